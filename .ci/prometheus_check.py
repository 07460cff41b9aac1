"""Scrapes a running Warren node's Prometheus endpoint after a little AMQP traffic and
parses the text with the Prometheus project's own Python parsers (format 0.0.4, and
OpenMetrics when asked for): every family must parse, RabbitMQ's names must be there with
their types, and the values must be what the traffic made.

    python .ci/prometheus_check.py --amqp-port P --metrics-port M
"""

import argparse
import sys
import urllib.request

import amqp
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as parse_openmetrics,
)
from prometheus_client.parser import text_string_to_metric_families as parse_text

FAILED = []
PASSED = []


def check(what, ok):
    print(("ok   " if ok else "FAIL ") + what)
    (PASSED if ok else FAILED).append(what)


def scrape(port, path, accept=None):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
    if accept:
        req.add_header("Accept", accept)
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.headers.get("Content-Type", ""), r.read().decode()


def families(parse, text):
    return {f.name: f for f in parse(text)}


def value(fams, name, suffix="", **labels):
    f = fams.get(name)
    if f is None:
        return None
    for s in f.samples:
        if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--amqp-port", type=int, required=True)
    ap.add_argument("--metrics-port", type=int, required=True)
    a = ap.parse_args()

    conn = amqp.Connection(f"127.0.0.1:{a.amqp_port}", userid="guest", password="guest",
                           confirm_publish=True)
    conn.connect()
    ch = conn.channel()
    ch.queue_declare("prom.check", durable=True, auto_delete=False)
    for i in range(5):
        ch.basic_publish(amqp.Message(b"m%d" % i, delivery_mode=2), routing_key="prom.check")
    got = ch.basic_get("prom.check")
    ch.basic_ack(got.delivery_tag)
    # A round trip on the same channel: the broker has taken the ack once this answers.
    ch.queue_declare("prom.check", passive=True)

    ctype, text = scrape(a.metrics_port, "/metrics")
    check("/metrics is text format 0.0.4", ctype.startswith("text/plain; version=0.0.4"))
    fams = families(parse_text, text)
    check(f"/metrics parses ({len(fams)} families)", len(fams) > 40)
    for name, kind in [
        ("rabbitmq_connections", "gauge"),
        ("rabbitmq_queue_messages_ready", "gauge"),
        ("rabbitmq_global_messages_received", "counter"),
        ("rabbitmq_global_messages_confirmed", "counter"),
        ("rabbitmq_connections_opened", "counter"),
        ("warren_confirm_latency_seconds", "histogram"),
        ("warren_fsync_latency_seconds", "histogram"),
        ("rabbitmq_io_write_ops", "counter"),
        ("rabbitmq_io_sync_time_seconds", "counter"),
        ("rabbitmq_msg_store_write", "counter"),
    ]:
        f = fams.get(name)
        check(f"{name} is a {kind}", f is not None and f.type == kind)
    amqp091 = {"protocol": "amqp091"}
    check("5 messages received",
          value(fams, "rabbitmq_global_messages_received", "_total", **amqp091) == 5)
    check("5 confirmed",
          value(fams, "rabbitmq_global_messages_confirmed", "_total", **amqp091) == 5)
    check("1 acknowledged",
          value(fams, "rabbitmq_global_messages_acknowledged", "_total", **amqp091) == 1)
    check("4 ready", value(fams, "rabbitmq_queue_messages_ready") == 4)
    check("1 connection open", value(fams, "rabbitmq_connections") == 1)
    check("confirm latency observed 5 times",
          value(fams, "warren_confirm_latency_seconds", "_count") == 5)

    ctype, text = scrape(a.metrics_port, "/metrics/per-object",
                         accept="application/openmetrics-text; version=1.0.0")
    check("OpenMetrics when asked for", ctype.startswith("application/openmetrics-text"))
    fams = families(parse_openmetrics, text)
    check(f"/metrics/per-object parses as OpenMetrics ({len(fams)} families)", len(fams) > 40)
    check("the queue's own ready count",
          value(fams, "rabbitmq_queue_messages_ready", vhost="/", queue="prom.check") == 4)

    ch.queue_delete("prom.check")
    conn.close()
    print(f"prometheus: {len(PASSED)} passed, {len(FAILED)} failed")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
