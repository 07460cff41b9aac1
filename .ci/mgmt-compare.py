#!/usr/bin/env python3
"""The management HTTP API of Warren compared field by field with RabbitMQ 3.10's.

Runs the same scripted sequence of HTTP calls against two brokers (RabbitMQ with its
management plugin, and Warren), one after the other, then compares each answer: the status
code, the set of JSON field names (recursively; a list's items are compared as the union of
their fields), and the values of the fields that must match (names, types, flags,
arguments, routing keys, tags, ...). Prints a markdown report and exits 1 when a difference
is not in the allow-list (.ci/mgmt-compare-allowed.json, each entry with its reason), 2 on
a usage or connection error.

    python3 .ci/mgmt-compare.py \
        --rabbitmq http://127.0.0.1:25898 --rabbitmq-amqp 127.0.0.1:25899 \
        --warren http://127.0.0.1:25998 --warren-amqp 127.0.0.1:25999 \
        [--user guest --password guest] [--report report.md] [--summary summary.md] \
        [--record rabbitmq.json | --replay rabbitmq.json]

--record saves RabbitMQ's answers; --replay compares Warren with saved answers instead of
a running RabbitMQ. Python's standard library only (urllib, socket), so it runs anywhere.
The scenario creates vhosts `cmp` and `cmp-import` and users `cmp-mgmt` and `cmp-mon`,
deleting them first if a previous run left them, and deletes them at the end.

While the live-object endpoints are asked (/api/connections, /api/channels,
/api/consumers), the script holds an AMQP 0-9-1 connection of its own (a minimal client
over a raw socket: PLAIN login, one channel, basic.qos, basic.consume) to each broker.
"""

import argparse
import base64
import fnmatch
import json
import socket
import struct
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

VHOST = "cmp"
VHOST_IMPORT = "cmp-import"
MGMT_USER = ("cmp-mgmt", "cmp-pw")
MON_USER = ("cmp-mon", "cmp-pw")
CONNECTION_NAME = "mgmt-compare"
CONSUMER_TAG = "cmp-consumer"

# Fields whose value is data (a table of arguments, a client's properties, a map of
# nodes): compared as values where listed in MUST_MATCH, never descended into as fields.
DATA_KEYS = {
    "arguments", "definition", "effective_policy_definition", "client_properties",
    "capabilities", "headers", "cluster_state", "limits", "applied_to",
}

# Fields whose values must be the same on both brokers (on the objects the scenario made).
MUST_MATCH = [
    "name", "vhost", "type", "durable", "auto_delete", "internal", "exclusive",
    "arguments", "source", "destination", "destination_type", "routing_key",
    "properties_key", "tags", "description", "pattern", "apply-to", "definition",
    "priority", "configure", "write", "read", "user", "policy", "operator_policy",
    "effective_policy_definition", "routed", "payload", "payload_encoding", "redelivered",
    "exchange", "status", "error", "consumer_tag", "ack_required", "prefetch_count",
    "protocol", "number", "transactional", "confirm", "global_prefetch_count",
    "hashing_algorithm", "tracing", "rabbit_version", "rabbitmq_version",
]


def die(msg):
    print(f"mgmt-compare: {msg}", file=sys.stderr)
    sys.exit(2)


# --- a minimal AMQP 0-9-1 client ----------------------------------------------------------

def _shortstr(s):
    b = s.encode()
    return struct.pack("B", len(b)) + b


def _longstr(s):
    b = s.encode() if isinstance(s, str) else s
    return struct.pack(">I", len(b)) + b


def _table(d):
    out = b""
    for k, v in d.items():
        out += _shortstr(k)
        if isinstance(v, bool):
            out += b"t" + struct.pack("B", int(v))
        elif isinstance(v, int):
            out += b"I" + struct.pack(">i", v)
        elif isinstance(v, dict):
            out += b"F" + _table(v)
        else:
            out += b"S" + _longstr(str(v))
    return struct.pack(">I", len(out)) + out


class Amqp:
    """One AMQP connection with a consumer on one channel, held open while the live
    endpoints are listed. Deliveries are left unread in the socket's buffer."""

    def __init__(self, addr, user, password, vhost):
        host, port = addr.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.buf = b""
        self.sock.sendall(b"AMQP\x00\x00\x09\x01")
        self._expect(0, 10, 10)  # connection.start
        props = {
            "product": "mgmt-compare", "connection_name": CONNECTION_NAME,
            "capabilities": {"consumer_cancel_notify": True, "basic.nack": True},
        }
        self._method(0, 10, 11, _table(props) + _shortstr("PLAIN")
                     + _longstr(f"\0{user}\0{password}") + _shortstr("en_US"))
        tune = self._expect(0, 10, 30)
        channel_max, frame_max, _ = struct.unpack(">HIH", tune[:8])
        self._method(0, 10, 31, struct.pack(">HIH", channel_max, frame_max, 0))
        self._method(0, 10, 40, _shortstr(vhost) + _shortstr("") + b"\x00")
        self._expect(0, 10, 41)
        self._method(1, 20, 10, _shortstr(""))
        self._expect(1, 20, 11)

    def consume(self, queue, prefetch):
        self._method(1, 60, 10, struct.pack(">IHB", 0, prefetch, 0))
        self._expect(1, 60, 11)
        self._method(1, 60, 20, struct.pack(">H", 0) + _shortstr(queue)
                     + _shortstr(CONSUMER_TAG) + b"\x00" + _table({}))
        self._expect(1, 60, 21)

    def close(self):
        try:
            self._method(0, 10, 50, struct.pack(">H", 200) + _shortstr("bye")
                         + struct.pack(">HH", 0, 0))
            self.sock.settimeout(5)
            self._expect(0, 10, 51)
        except (OSError, RuntimeError):
            pass
        self.sock.close()

    def _method(self, channel, cls, mth, args):
        payload = struct.pack(">HH", cls, mth) + args
        self.sock.sendall(struct.pack(">BHI", 1, channel, len(payload)) + payload + b"\xce")

    def _frame(self):
        while True:
            if len(self.buf) >= 7:
                kind, channel, size = struct.unpack(">BHI", self.buf[:7])
                if len(self.buf) >= 8 + size:
                    payload = self.buf[7:7 + size]
                    self.buf = self.buf[8 + size:]
                    return kind, channel, payload
            chunk = self.sock.recv(65536)
            if not chunk:
                raise RuntimeError("AMQP connection closed by the broker")
            self.buf += chunk

    def _expect(self, channel, cls, mth):
        """Reads frames until method cls.mth on channel (deliveries are skipped)."""
        while True:
            kind, ch, payload = self._frame()
            if kind != 1:
                continue
            c, m = struct.unpack(">HH", payload[:4])
            if (c, m) in ((10, 50), (20, 40)):
                raise RuntimeError(f"broker closed: {payload[4:]!r}")
            if ch == channel and (c, m) == (cls, mth):
                return payload[4:]


# --- targets: a live broker, or a recording of one -------------------------------------------

class Target:
    """A broker's management API; `answers` collects each step's (status, body) by id."""

    def __init__(self, label, base, amqp, user, password):
        self.label, self.base, self.amqp = label, base.rstrip("/"), amqp
        self.user, self.password = user, password
        self.answers = {}
        self.live = True

    def http(self, method, path, body=None, auth="admin"):
        url = self.base + path
        data = None if body is None else (body if isinstance(body, bytes) else
                                          json.dumps(body).encode())
        req = urllib.request.Request(url, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        creds = {"admin": (self.user, self.password), "mgmt": MGMT_USER, "mon": MON_USER,
                 "wrong": (self.user, "not-the-password"), "none": None}[auth]
        if creds:
            token = base64.b64encode(f"{creds[0]}:{creds[1]}".encode()).decode()
            req.add_header("Authorization", f"Basic {token}")
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                status, text = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, text = e.code, e.read()
        except (urllib.error.URLError, OSError) as e:
            die(f"{self.label}: {method} {url}: {e}")
        try:
            parsed = json.loads(text) if text.strip() else None
        except ValueError:
            parsed = {"(not JSON)": text.decode(errors="replace")[:200]}
        return status, parsed

    def step(self, sid, method, path, body=None, auth="admin"):
        """One compared call: `sid` names it in the report (and in a recording)."""
        answer = self.http(method, path, body, auth)
        self.answers[sid] = {"method": method, "path": path, "status": answer[0],
                             "body": answer[1]}
        return answer

    def until(self, method, path, ready, seconds=20.0):
        """Polls a GET until `ready(body)` (RabbitMQ's statistics arrive every few seconds)."""
        deadline = time.monotonic() + seconds
        while True:
            status, body = self.http(method, path)
            if status == 200 and ready(body):
                return body
            if time.monotonic() > deadline:
                print(f"mgmt-compare: {self.label}: {path} not ready after {seconds}s; "
                      "comparing what it answers", file=sys.stderr)
                return body
            time.sleep(0.5)


class Replay(Target):
    """Answers recorded from a broker (--record), in place of calling it."""

    def __init__(self, label, recording):
        super().__init__(label, "replay:", None, "", "")
        self.recorded = recording["steps"]
        self.live = False

    def http(self, method, path, body=None, auth="admin"):
        return 200, None

    def step(self, sid, method, path, body=None, auth="admin"):
        if sid not in self.recorded:
            die(f"the recording has no step {sid!r}: record it again (--record)")
        r = self.recorded[sid]
        self.answers[sid] = r
        return r["status"], r["body"]

    def until(self, method, path, ready, seconds=20.0):
        return None


# --- the scenario -----------------------------------------------------------------------------

def q(s):
    return urllib.parse.quote(s, safe="")


def sampled(queue):
    """Whether RabbitMQ's statistics database has filled in a queue object (a new queue
    shows its fields in several steps)."""
    return all(k in queue for k in ("messages", "consumers", "state", "policy",
                                    "effective_policy_definition"))


def scenario(t):
    """The calls, in order. Setup calls are steps too: their status codes are compared."""
    v, vi = q(VHOST), q(VHOST_IMPORT)
    # Leftovers of an interrupted run (not compared).
    for path in (f"/api/vhosts/{v}", f"/api/vhosts/{vi}", f"/api/users/{MGMT_USER[0]}",
                 f"/api/users/{MON_USER[0]}", "/api/users/cmp-nopw"):
        t.http("DELETE", path)

    # Errors before anything exists.
    t.step("GET /api/overview (no credentials)", "GET", "/api/overview", auth="none")
    t.step("GET /api/overview (wrong password)", "GET", "/api/overview", auth="wrong")
    t.step("GET /api/vhosts/{missing}", "GET", "/api/vhosts/cmp-missing")
    t.step("GET /api/queues/{missing vhost}", "GET", "/api/queues/cmp-missing")
    t.step("DELETE /api/overview", "DELETE", "/api/overview")
    t.step("POST /api/queues", "POST", "/api/queues", body={})

    # Vhosts, users, permissions.
    t.step("PUT /api/vhosts/{v} (create)", "PUT", f"/api/vhosts/{v}",
           body={"description": "field-by-field comparison", "tags": "cmp,test"})
    t.step("PUT /api/vhosts/{v} (again)", "PUT", f"/api/vhosts/{v}",
           body={"description": "field-by-field comparison", "tags": "cmp,test"})
    t.step("PUT /api/users/{u} (create)", "PUT", f"/api/users/{MGMT_USER[0]}",
           body={"password": MGMT_USER[1], "tags": "management"})
    t.step("PUT /api/users/{u} (tags as a list)", "PUT", f"/api/users/{MON_USER[0]}",
           body={"password": MON_USER[1], "tags": ["monitoring", "policymaker"]})
    t.step("PUT /api/users/{u} (no password)", "PUT", "/api/users/cmp-nopw",
           body={"tags": "management"})
    t.step("PUT /api/users/{u} (bad JSON)", "PUT", "/api/users/cmp-badjson", body=b"{not json")
    for user, perms in ((t.user, [".*", ".*", ".*"]), (MGMT_USER[0], [".*", ".*", ".*"]),
                        (MON_USER[0], ["^cmp\\.", "", "^cmp\\."])):
        t.step(f"PUT /api/permissions/{{v}}/{{u}} ({user if user.startswith('cmp') else 'admin'})",
               "PUT", f"/api/permissions/{v}/{q(user)}",
               body=dict(zip(("configure", "write", "read"), perms)))
    t.step("PUT /api/permissions/{v}/{u} (missing keys)", "PUT",
           f"/api/permissions/{v}/{MON_USER[0]}", body={"configure": ".*"})
    t.step("PUT /api/permissions/{v}/{missing user}", "PUT",
           f"/api/permissions/{v}/cmp-nobody", body={"configure": "", "write": "", "read": ""})

    # Exchanges of every type, with arguments.
    exchanges = {
        "cmp.direct": {"type": "direct", "durable": True},
        "cmp.topic": {"type": "topic", "durable": True,
                      "arguments": {"alternate-exchange": "cmp.fanout"}},
        "cmp.fanout": {"type": "fanout", "durable": False, "auto_delete": False},
        "cmp.headers": {"type": "headers", "durable": True, "internal": True,
                        "arguments": {"x-cmp": "yes"}},
    }
    for name, body in exchanges.items():
        t.step(f"PUT /api/exchanges/{{v}}/{body['type']}", "PUT",
               f"/api/exchanges/{v}/{q(name)}", body=body)
    t.step("PUT /api/exchanges/{v}/{x} (again, equivalent)", "PUT",
           f"/api/exchanges/{v}/cmp.direct", body={"type": "direct", "durable": True})
    t.step("PUT /api/exchanges/{v}/{x} (inequivalent)", "PUT",
           f"/api/exchanges/{v}/cmp.direct", body={"type": "fanout", "durable": True})
    t.step("PUT /api/exchanges/{v}/{x} (no type)", "PUT", f"/api/exchanges/{v}/cmp.notype",
           body={"durable": True})
    t.step("PUT /api/exchanges/{v}/{x} (unknown type)", "PUT",
           f"/api/exchanges/{v}/cmp.badtype", body={"type": "no-such-type"})

    # Queues with x-arguments.
    queues = {
        "cmp.q1": {"durable": True, "arguments": {"x-max-length": 100,
                                                  "x-message-ttl": 60000}},
        "cmp.q2": {"durable": True, "arguments": {"x-queue-mode": "lazy"}},
        "cmp.q3": {"durable": False, "auto_delete": True},
        "cmp.q4": {"durable": True, "arguments": {"x-dead-letter-exchange": "cmp.fanout",
                                                  "x-dead-letter-routing-key": "dead",
                                                  "x-max-priority": 5}},
    }
    for name, body in queues.items():
        t.step(f"PUT /api/queues/{{v}}/{name}", "PUT", f"/api/queues/{v}/{q(name)}", body=body)
    t.step("PUT /api/queues/{v}/{q} (again, equivalent)", "PUT", f"/api/queues/{v}/cmp.q2",
           body={"durable": True, "arguments": {"x-queue-mode": "lazy"}})
    t.step("PUT /api/queues/{v}/{q} (inequivalent)", "PUT", f"/api/queues/{v}/cmp.q2",
           body={"durable": False})
    t.step("PUT /api/queues/{v}/{q} (bad JSON)", "PUT", f"/api/queues/{v}/cmp.bad",
           body=b"not json")
    t.step("PUT /api/queues/{v}/{q} (bad argument type)", "PUT", f"/api/queues/{v}/cmp.bad",
           body={"arguments": {"x-max-length": "many"}})

    # Bindings: exchange to queue, with arguments, exchange to exchange.
    bindings = [
        ("cmp.direct", "q", "cmp.q1", {"routing_key": "k1"}),
        ("cmp.topic", "q", "cmp.q2", {"routing_key": "a.#"}),
        ("cmp.fanout", "q", "cmp.q3", {"routing_key": ""}),
        ("cmp.headers", "q", "cmp.q4", {"routing_key": "",
                                        "arguments": {"x-match": "all", "h": "v"}}),
        ("cmp.topic", "e", "cmp.fanout", {"routing_key": "b.*"}),
    ]
    for src, kind, dst, body in bindings:
        t.step(f"POST /api/bindings/{{v}}/e/{{x}}/{kind}/{{d}} ({src})", "POST",
               f"/api/bindings/{v}/e/{q(src)}/{kind}/{q(dst)}", body=body)
    t.step("POST /api/bindings/{v}/e/{x}/q/{missing}", "POST",
           f"/api/bindings/{v}/e/cmp.direct/q/cmp.missing", body={"routing_key": "k"})

    # Policies.
    t.step("PUT /api/policies/{v}/{p}", "PUT", f"/api/policies/{v}/cmp-pol",
           body={"pattern": "^cmp\\.q1$", "definition": {"max-length": 50},
                 "apply-to": "queues", "priority": 1})
    t.step("PUT /api/policies/{v}/{p} (no definition)", "PUT", f"/api/policies/{v}/cmp-bad",
           body={"pattern": "^x"})
    t.step("PUT /api/policies/{v}/{p} (unknown key)", "PUT", f"/api/policies/{v}/cmp-bad",
           body={"pattern": "^x", "definition": {"no-such-key": 1}})
    t.step("PUT /api/operator-policies/{v}/{p}", "PUT", f"/api/operator-policies/{v}/cmp-op",
           body={"pattern": "^cmp\\.", "definition": {"max-length": 1000},
                 "apply-to": "queues", "priority": 0})

    # Messages through the API.
    for i in range(3):
        t.step(f"POST /api/exchanges/{{v}}/{{x}}/publish ({i})", "POST",
               f"/api/exchanges/{v}/cmp.direct/publish",
               body={"properties": {"delivery_mode": 2, "headers": {"n": i}},
                     "routing_key": "k1", "payload": f"hello {i}",
                     "payload_encoding": "string"})
    t.step("POST /api/exchanges/{v}/{x}/publish (unroutable)", "POST",
           f"/api/exchanges/{v}/cmp.direct/publish",
           body={"properties": {}, "routing_key": "nowhere", "payload": "x",
                 "payload_encoding": "string"})
    t.step("POST /api/exchanges/{v}/amq.default/publish", "POST",
           f"/api/exchanges/{v}/amq.default/publish",
           body={"properties": {}, "routing_key": "cmp.q2", "payload": "aGk=",
                 "payload_encoding": "base64"})
    t.step("POST /api/exchanges/{v}/{x}/publish (no payload_encoding)", "POST",
           f"/api/exchanges/{v}/cmp.direct/publish",
           body={"properties": {}, "routing_key": "k1", "payload": "x"})
    t.step("POST /api/queues/{v}/{q}/get", "POST", f"/api/queues/{v}/cmp.q1/get",
           body={"count": 2, "ackmode": "ack_requeue_true", "encoding": "auto"})
    t.step("POST /api/queues/{v}/{q}/get (bad ackmode)", "POST", f"/api/queues/{v}/cmp.q1/get",
           body={"count": 1, "ackmode": "nope", "encoding": "auto"})
    # RabbitMQ's queue statistics arrive every 5 s: wait for the messages to show, and for
    # the operator policy set after cmp.q2 and cmp.q3 were declared to show on them (a CI
    # run compared a RabbitMQ listing that did not show it yet on cmp.q2).
    t.until("GET", f"/api/queues/{v}/cmp.q1", lambda b: b.get("messages") == 3)
    t.until("GET", f"/api/queues/{v}",
            lambda b: len(b) == 4 and all(map(sampled, b))
            and all(x.get("operator_policy") == "cmp-op" for x in b
                    if x.get("name") in ("cmp.q1", "cmp.q2", "cmp.q3")))

    # Listings and single objects.
    t.step("GET /api/overview", "GET", "/api/overview")
    t.step("GET /api/cluster-name", "GET", "/api/cluster-name")
    t.step("GET /api/whoami", "GET", "/api/whoami")
    t.step("GET /api/whoami (management user)", "GET", "/api/whoami", auth="mgmt")
    status, nodes = t.step("GET /api/nodes", "GET", "/api/nodes")
    node = nodes[0]["name"] if t.live and status == 200 and nodes else "unknown"
    t.step("GET /api/nodes/{node}", "GET", f"/api/nodes/{q(node)}")
    t.step("GET /api/nodes/{missing}", "GET", "/api/nodes/nobody%40nowhere")
    t.step("GET /api/extensions", "GET", "/api/extensions")
    t.step("GET /api/vhosts", "GET", "/api/vhosts")
    t.step("GET /api/vhosts/{v}", "GET", f"/api/vhosts/{v}")
    t.step("GET /api/vhosts/{v}/permissions", "GET", f"/api/vhosts/{v}/permissions")
    t.step("GET /api/users", "GET", "/api/users")
    t.step("GET /api/users/{u}", "GET", f"/api/users/{MGMT_USER[0]}")
    t.step("GET /api/users/{missing}", "GET", "/api/users/cmp-missing")
    t.step("GET /api/users/{u}/permissions", "GET", f"/api/users/{MGMT_USER[0]}/permissions")
    t.step("GET /api/users/without-permissions", "GET", "/api/users/without-permissions")
    t.step("GET /api/permissions", "GET", "/api/permissions")
    t.step("GET /api/permissions/{v}/{u}", "GET", f"/api/permissions/{v}/{MGMT_USER[0]}")
    t.step("GET /api/topic-permissions", "GET", "/api/topic-permissions")
    t.step("GET /api/exchanges", "GET", "/api/exchanges")
    t.step("GET /api/exchanges/{v}", "GET", f"/api/exchanges/{v}")
    t.step("GET /api/exchanges/{v}/{x}", "GET", f"/api/exchanges/{v}/cmp.topic")
    t.step("GET /api/exchanges/{v}/amq.default", "GET", f"/api/exchanges/{v}/amq.default")
    t.step("GET /api/exchanges/{v}/{missing}", "GET", f"/api/exchanges/{v}/cmp.missing")
    t.step("GET /api/exchanges/{v}/{x}/bindings/source", "GET",
           f"/api/exchanges/{v}/cmp.topic/bindings/source")
    t.step("GET /api/exchanges/{v}/{x}/bindings/destination", "GET",
           f"/api/exchanges/{v}/cmp.fanout/bindings/destination")
    t.step("GET /api/queues", "GET", "/api/queues")
    t.step("GET /api/queues/{v}", "GET", f"/api/queues/{v}")
    t.step("GET /api/queues/{v}/{q}", "GET", f"/api/queues/{v}/cmp.q1")
    t.step("GET /api/queues/{v}/{missing}", "GET", f"/api/queues/{v}/cmp.missing")
    t.step("GET /api/queues/{v}/{q}/bindings", "GET", f"/api/queues/{v}/cmp.q1/bindings")
    t.step("GET /api/queues/{v}?columns=name,durable", "GET",
           f"/api/queues/{v}?columns=name,durable")
    t.step("GET /api/queues/{v}?page=1&page_size=2&sort=name", "GET",
           f"/api/queues/{v}?page=1&page_size=2&sort=name")
    t.step("GET /api/queues/{v}?page=9&page_size=2", "GET", f"/api/queues/{v}?page=9&page_size=2")
    t.step("GET /api/bindings", "GET", "/api/bindings")
    t.step("GET /api/bindings/{v}", "GET", f"/api/bindings/{v}")
    t.step("GET /api/bindings/{v}/e/{x}/q/{q}", "GET",
           f"/api/bindings/{v}/e/cmp.direct/q/cmp.q1")
    t.step("GET /api/bindings/{v}/e/{x}/q/{q}/{props}", "GET",
           f"/api/bindings/{v}/e/cmp.direct/q/cmp.q1/k1")
    t.step("GET /api/bindings/{v}/e/{x}/e/{x}", "GET",
           f"/api/bindings/{v}/e/cmp.topic/e/cmp.fanout")
    t.step("GET /api/bindings/{v}/e/{x}/e/{x}/{props}", "GET",
           f"/api/bindings/{v}/e/cmp.topic/e/cmp.fanout/b.%2A")
    t.step("GET /api/policies", "GET", "/api/policies")
    t.step("GET /api/policies/{v}", "GET", f"/api/policies/{v}")
    t.step("GET /api/policies/{v}/{p}", "GET", f"/api/policies/{v}/cmp-pol")
    t.step("GET /api/policies/{v}/{missing}", "GET", f"/api/policies/{v}/cmp-missing")
    t.step("GET /api/operator-policies", "GET", "/api/operator-policies")
    t.step("GET /api/operator-policies/{v}/{p}", "GET", f"/api/operator-policies/{v}/cmp-op")
    t.step("GET /api/parameters", "GET", "/api/parameters")
    t.step("GET /api/global-parameters", "GET", "/api/global-parameters")
    t.step("GET /api/vhost-limits", "GET", "/api/vhost-limits")
    t.step("GET /api/feature-flags", "GET", "/api/feature-flags")

    # What a user short of a tag, or of a vhost, gets.
    t.step("GET /api/users (management user)", "GET", "/api/users", auth="mgmt")
    t.step("GET /api/nodes (management user)", "GET", "/api/nodes", auth="mgmt")
    t.step("GET /api/definitions (management user)", "GET", "/api/definitions", auth="mgmt")
    t.step("PUT /api/vhosts/{v} (management user)", "PUT", "/api/vhosts/cmp-denied",
           auth="mgmt")
    t.step("GET /api/policies/{v} (management user)", "GET", f"/api/policies/{v}", auth="mgmt")
    t.step("GET /api/queues/%2F (management user)", "GET", "/api/queues/%2F", auth="mgmt")
    t.step("GET /api/queues (management user)", "GET", "/api/queues", auth="mgmt")
    t.step("GET /api/policies/{v} (policymaker)", "GET", f"/api/policies/{v}", auth="mon")
    t.step("GET /api/nodes (monitoring user)", "GET", "/api/nodes", auth="mon")
    t.step("PUT /api/queues/{v}/{q} (denied by permissions)", "PUT",
           f"/api/queues/{v}/other.q", body={"durable": True}, auth="mon")

    # Live objects, with an AMQP connection of the script's own and a consumer.
    conn = None
    if t.live:
        try:
            conn = Amqp(t.amqp, MGMT_USER[0], MGMT_USER[1], VHOST)
            conn.consume("cmp.q2", 7)
        except (OSError, RuntimeError) as e:
            die(f"{t.label}: AMQP connection to {t.amqp}: {e}")
    mine = (lambda items: [c for c in items or []
                           if isinstance(c, dict) and c.get("user") == MGMT_USER[0]])
    conns = t.until("GET", "/api/connections",
                    lambda b: any(c.get("channels") == 1 for c in mine(b)))
    t.until("GET", "/api/channels",
            lambda b: any(c.get("consumer_count") == 1 for c in mine(b)))
    t.until("GET", "/api/consumers", lambda b: bool(b))
    cname = mine(conns)[0]["name"] if t.live and mine(conns) else "none"
    t.step("GET /api/connections", "GET", "/api/connections")
    t.step("GET /api/connections/{name}", "GET", f"/api/connections/{q(cname)}")
    t.step("GET /api/connections/{name}/channels", "GET",
           f"/api/connections/{q(cname)}/channels")
    t.step("GET /api/vhosts/{v}/connections", "GET", f"/api/vhosts/{v}/connections")
    t.step("GET /api/connections (management user)", "GET", "/api/connections", auth="mgmt")
    t.step("GET /api/channels", "GET", "/api/channels")
    t.step("GET /api/channels/{name}", "GET", f"/api/channels/{q(cname + ' (1)')}")
    t.step("GET /api/vhosts/{v}/channels", "GET", f"/api/vhosts/{v}/channels")
    t.step("GET /api/consumers", "GET", "/api/consumers")
    t.step("GET /api/consumers/{v}", "GET", f"/api/consumers/{v}")
    t.step("GET /api/connections/{missing}", "GET", "/api/connections/no%20such")
    if conn:
        conn.close()

    # Definitions: the whole broker's, one vhost's, and an import of it into another vhost.
    t.step("GET /api/definitions", "GET", "/api/definitions")
    status, defs = t.step("GET /api/definitions/{v}", "GET", f"/api/definitions/{v}")
    t.step("GET /api/definitions/{missing}", "GET", "/api/definitions/cmp-missing")
    t.step("PUT /api/vhosts/{v2}", "PUT", f"/api/vhosts/{vi}")
    t.step("POST /api/definitions/{v2}", "POST", f"/api/definitions/{vi}",
           body=defs if t.live and status == 200 else {})
    t.until("GET", f"/api/queues/{vi}", lambda b: len(b) == 4 and all(map(sampled, b)))
    t.step("GET /api/queues/{v2}", "GET", f"/api/queues/{vi}")
    t.step("GET /api/bindings/{v2}", "GET", f"/api/bindings/{vi}")
    t.step("GET /api/exchanges/{v2}", "GET", f"/api/exchanges/{vi}")
    t.step("GET /api/policies/{v2}", "GET", f"/api/policies/{vi}")
    t.step("POST /api/definitions (bad JSON)", "POST", "/api/definitions", body=b"{nope")

    # Health checks and the aliveness test.
    port = t.amqp.rsplit(":", 1)[1] if t.live else "0"
    for check in ("alarms", "local-alarms", "virtual-hosts", "node-is-quorum-critical",
                  "node-is-mirror-sync-critical", "protocol-listener/amqp",
                  "protocol-listener/nosuch", "certificate-expiration/1/months"):
        t.step(f"GET /api/health/checks/{check}", "GET", f"/api/health/checks/{check}")
    t.step("GET /api/health/checks/port-listener/{amqp port}", "GET",
           f"/api/health/checks/port-listener/{port}")
    t.step("GET /api/health/checks/port-listener/{closed port}", "GET",
           "/api/health/checks/port-listener/1")
    t.step("GET /api/aliveness-test/{v}", "GET", f"/api/aliveness-test/{v}")

    # Changes and deletions.
    t.step("POST /api/queues/{v}/{q}/actions (unknown)", "POST",
           f"/api/queues/{v}/cmp.q1/actions", body={"action": "bogus"})
    t.step("DELETE /api/queues/{v}/{q}/contents", "DELETE", f"/api/queues/{v}/cmp.q1/contents")
    t.step("DELETE /api/permissions/{v}/{u}", "DELETE", f"/api/permissions/{v}/{MON_USER[0]}")
    t.step("GET /api/permissions/{v}/{u} (deleted)", "GET",
           f"/api/permissions/{v}/{MON_USER[0]}")
    t.step("DELETE /api/permissions/{v}/{u} (again)", "DELETE",
           f"/api/permissions/{v}/{MON_USER[0]}")
    t.step("DELETE /api/bindings/{v}/e/{x}/q/{q}/{props}", "DELETE",
           f"/api/bindings/{v}/e/cmp.direct/q/cmp.q1/k1")
    t.step("DELETE /api/bindings/{v}/e/{x}/e/{x}/{props}", "DELETE",
           f"/api/bindings/{v}/e/cmp.topic/e/cmp.fanout/b.%2A")
    t.step("DELETE /api/exchanges/{v}/{x}?if-unused=true (in use)", "DELETE",
           f"/api/exchanges/{v}/cmp.topic?if-unused=true")
    t.step("DELETE /api/exchanges/{v}/{x}", "DELETE", f"/api/exchanges/{v}/cmp.direct")
    t.step("DELETE /api/exchanges/{v}/{missing}", "DELETE", f"/api/exchanges/{v}/cmp.missing")
    t.step("DELETE /api/queues/{v}/{q}", "DELETE", f"/api/queues/{v}/cmp.q1")
    t.step("DELETE /api/queues/{v}/{missing}", "DELETE", f"/api/queues/{v}/cmp.missing")
    t.step("DELETE /api/policies/{v}/{p}", "DELETE", f"/api/policies/{v}/cmp-pol")
    t.step("DELETE /api/operator-policies/{v}/{p}", "DELETE",
           f"/api/operator-policies/{v}/cmp-op")
    t.step("DELETE /api/users/{u}", "DELETE", f"/api/users/{MGMT_USER[0]}")
    t.step("DELETE /api/users/{u} (again)", "DELETE", f"/api/users/{MGMT_USER[0]}")
    t.step("DELETE /api/users/{u} (monitoring)", "DELETE", f"/api/users/{MON_USER[0]}")
    t.step("DELETE /api/users/{u} (no password)", "DELETE", "/api/users/cmp-nopw")
    t.step("DELETE /api/vhosts/{v2}", "DELETE", f"/api/vhosts/{vi}")
    t.step("DELETE /api/vhosts/{v}", "DELETE", f"/api/vhosts/{v}")
    t.step("DELETE /api/vhosts/{v} (again)", "DELETE", f"/api/vhosts/{v}")


# --- comparison -------------------------------------------------------------------------------

def fields(value, prefix=""):
    """The field paths of a JSON value: `a`, `a.b`, `list[].c`; a list's items as a union."""
    out = set()
    if isinstance(value, dict):
        for k, x in value.items():
            path = f"{prefix}{k}"
            out.add(path)
            if k not in DATA_KEYS:
                out |= fields(x, path + ".")
    elif isinstance(value, list):
        for item in value:
            out |= fields(item, prefix.rstrip(".") + "[]." if prefix else "[].")
    return out


def prune(paths):
    """Drops paths under another path of the same set: a missing object is one difference."""
    def parents(p):
        parts = p.replace("[].", ".").split(".")
        return {".".join(parts[:i]) for i in range(1, len(parts))}
    flat = {p.replace("[].", "."): p for p in paths}
    return sorted(p for p in paths if not (parents(p) & set(flat)))


def in_scope(item):
    """Objects the scenario made (the brokers have others): compared by value."""
    if not isinstance(item, dict):
        return False
    vhost = item.get("vhost")
    if isinstance(vhost, str):
        return vhost in (VHOST, VHOST_IMPORT)
    if isinstance(item.get("queue"), dict):
        return item["queue"].get("vhost") == VHOST
    name = item.get("name")
    return isinstance(name, str) and name.startswith("cmp")


def key_of(item):
    if "consumer_tag" in item:
        return ("consumer", item["consumer_tag"])
    if "source" in item and "destination" in item:
        return (item.get("vhost"), item["source"], item["destination"],
                item.get("destination_type"), item.get("routing_key"))
    if "configure" in item:
        return (item.get("vhost"), item.get("user"))
    if "number" in item and "connection_details" in item:
        return ("channel", item["number"])
    if "peer_port" in item:
        return ("connection", item.get("user"))
    return (item.get("vhost"), item.get("name"))


# The lists of a definitions export, compared item by item.
DEFINITION_LISTS = ["users", "vhosts", "permissions", "topic_permissions", "parameters",
                    "global_parameters", "policies", "queues", "exchanges", "bindings"]


def value_diffs(r, w, scope=None):
    """Differences of MUST_MATCH values between two answers (objects, or listings matched
    by key among the scenario's objects)."""
    out = []

    def fmt(x):
        return json.dumps(x, sort_keys=True)

    def compare(a, b, where):
        for k in MUST_MATCH:
            # A connection's or channel's name holds its client's port.
            if k == "name" and " -> " in str(a.get(k)):
                continue
            if k in a and k in b and a[k] != b[k]:
                if isinstance(a[k], list) and isinstance(b[k], list) and k == "tags" and \
                        sorted(map(str, a[k])) == sorted(map(str, b[k])):
                    continue
                out.append(f"{where}{k}: {fmt(a[k])} / {fmt(b[k])}")

    if isinstance(r, dict) and isinstance(w, dict):
        if "items" in r and "items" in w:
            return value_diffs(r["items"], w["items"], scope)
        compare(r, w, "")
        # Definitions: their lists of objects, matched by key.
        for k in DEFINITION_LISTS:
            if isinstance(r.get(k), list) and isinstance(w.get(k), list):
                out += [f"{k}: {d}" for d in value_diffs(r[k], w[k], scope or k)]
    elif isinstance(r, list) and isinstance(w, list):
        # A per-vhost export has no `vhost` fields: all of it is the scenario's.
        keep = (lambda x: isinstance(x, dict)) if scope and not any(
            isinstance(x, dict) and "vhost" in x for x in r + w) and scope not in (
                "users", "vhosts") else in_scope
        scoped_r = {key_of(x): x for x in r if keep(x)}
        scoped_w = {key_of(x): x for x in w if keep(x)}
        for k in sorted(set(scoped_r) | set(scoped_w), key=str):
            label = "/".join(str(p) for p in k if p is not None)
            if k not in scoped_w:
                out.append(f"item {label}: only in RabbitMQ")
            elif k not in scoped_r:
                out.append(f"item {label}: only in Warren")
            else:
                compare(scoped_r[k], scoped_w[k], f"{label}: ")
    return out


def load_allowed(path):
    try:
        with open(path) as f:
            entries = json.load(f)["allowed"]
    except (OSError, ValueError, KeyError) as e:
        die(f"cannot read the allow-list {path}: {e}")
    for e in entries:
        missing = {"endpoint", "kind", "what", "reason", "class"} - set(e)
        if missing:
            die(f"allow-list entry {e} lacks {sorted(missing)}")
        if e["kind"] not in ("status", "only_rabbitmq", "only_warren", "value"):
            die(f"allow-list entry {e}: unknown kind {e['kind']!r}")
        if e["class"] not in ("deliberate", "not built"):
            die(f"allow-list entry {e}: class must be `deliberate` or `not built`")
    return entries


def patterns(x):
    return x if isinstance(x, list) else [x]


def allowed_by(entries, endpoint, kind, what):
    """The index of the first entry allowing this difference, or None. Field patterns are
    written without a listing's `[].` or `items[].` in front, and also cover the fields
    under what they match."""
    bare = what
    for prefix in ("items[].", "[]."):
        if bare.startswith(prefix):
            bare = bare[len(prefix):]
            break
    for i, e in enumerate(entries):
        if e["kind"] != kind or not any(fnmatch.fnmatchcase(endpoint, p)
                                        for p in patterns(e["endpoint"])):
            continue
        for p in patterns(e["what"]):
            for w in {what, bare}:
                if fnmatch.fnmatchcase(w, p) or w.startswith(p + ".") or \
                        w.startswith(p + "[]."):
                    return i
    return None


def compare(rabbit, warren, allowed):
    """Rows of the report, and whether any difference is not allowed."""
    rows, used, failed = [], set(), False
    for sid in rabbit.answers:
        ra, wa = rabbit.answers[sid], warren.answers.get(sid)
        if wa is None:
            continue
        diffs = {"status": [], "only_rabbitmq": [], "only_warren": [], "value": []}
        if ra["status"] != wa["status"]:
            diffs["status"].append(f"{ra['status']} / {wa['status']}")
        rb, wb = ra["body"], wa["body"]
        if isinstance(rb, list) and isinstance(wb, list):
            rs = [x for x in rb if in_scope(x)] or rb
            ws = [x for x in wb if in_scope(x)] or wb
            rf, wf = fields(rs), fields(ws)
        else:
            rf, wf = fields(rb), fields(wb)
        if ra["status"] == wa["status"]:
            diffs["only_rabbitmq"] = prune(rf - wf)
            diffs["only_warren"] = prune(wf - rf)
            diffs["value"] = value_diffs(rb, wb)
        marked = {}
        for kind, items in diffs.items():
            marked[kind] = []
            for what in items:
                i = allowed_by(allowed, sid, kind, what)
                if i is None:
                    failed = True
                    marked[kind].append(f"**{what}** (NEW)")
                else:
                    used.add(i)
                    marked[kind].append(f"{what} [{i + 1}]")
        rows.append((sid, ra["status"], wa["status"], marked))
    return rows, used, failed


def cell(items):
    return "<br>".join(s.replace("|", "\\|") for s in items) if items else ""


def report(rows, allowed, used, rabbit_version, warren_version):
    out = [f"RabbitMQ {rabbit_version} compared with Warren {warren_version}.", "",
           "| endpoint | status RabbitMQ / Warren | fields only in RabbitMQ | "
           "fields only in Warren | value differences (RabbitMQ / Warren) |",
           "|---|---|---|---|---|"]
    for sid, rs, ws, m in rows:
        status = m["status"][0] if m["status"] else f"{rs} / {ws}"
        out.append(f"| `{sid}` | {status} | {cell(m['only_rabbitmq'])} | "
                   f"{cell(m['only_warren'])} | {cell(m['value'])} |")
    out += ["", "Allowed differences (`[n]` above; `.ci/mgmt-compare-allowed.json`):", "",
            "| n | endpoint | kind | what | class | reason |", "|---|---|---|---|---|---|"]
    for i, e in enumerate(allowed):
        mark = "" if i in used else " (not seen in this run)"
        endpoints = "<br>".join(f"`{p}`" for p in patterns(e["endpoint"]))
        what = ", ".join(f"`{p}`" for p in patterns(e["what"])).replace("|", "\\|")
        out.append(f"| {i + 1} | {endpoints} | {e['kind']} | {what}{mark} | "
                   f"{e['class']} | {e['reason'].replace('|', '/')} |")
    return "\n".join(out) + "\n"


def summary(rows, allowed, used, rabbit_version, warren_version):
    """The report condensed for docs/compatibility.md: calls with the same differences
    share a row (a listing's `[].` dropped), and the calls that agree are named once."""
    def bare(items):
        out = []
        for x in items:
            for prefix in ("items[].", "[]."):
                x = x.replace(prefix, "") if x.startswith(prefix) else x
            out.append(x)
        return tuple(out)

    groups, agree = {}, []
    for sid, rs, ws, m in rows:
        if not any(m.values()):
            agree.append(f"`{sid}` ({rs})")
            continue
        key = (m["status"][0] if m["status"] else f"{rs} / {ws}",
               bare(m["only_rabbitmq"]), bare(m["only_warren"]), tuple(m["value"]))
        groups.setdefault(key, []).append(sid)
    out = [f"RabbitMQ {rabbit_version} compared with Warren {warren_version}: "
           f"{len(rows)} calls, {len(agree)} with the same status, fields and values, "
           f"{len(rows) - len(agree)} with the differences below (`[n]`: the allowed "
           "difference that explains it).", "",
           "| calls | status RabbitMQ / Warren | fields only in RabbitMQ | "
           "fields only in Warren | value differences (RabbitMQ / Warren) |",
           "|---|---|---|---|---|"]
    for (status, only_r, only_w, values), sids in groups.items():
        calls = "<br>".join(f"`{x}`" for x in sids)
        out.append(f"| {calls} | {status} | {cell(list(only_r))} | {cell(list(only_w))} | "
                   f"{cell(list(values))} |")
    out += ["", "The same in both (status code, field names and values): "
            + ", ".join(agree) + ".", "",
            "| n | calls | kind | what | class | reason |", "|---|---|---|---|---|---|"]
    for i, e in enumerate(allowed):
        endpoints = "<br>".join(f"`{p}`" for p in patterns(e["endpoint"]))
        what = ", ".join(f"`{p}`" for p in patterns(e["what"])).replace("|", "\\|")
        mark = "" if i in used else " (not seen in this run)"
        out.append(f"| {i + 1} | {endpoints} | {e['kind']} | {what}{mark} | "
                   f"{e['class']} | {e['reason'].replace('|', '/')} |")
    return "\n".join(out) + "\n"


def version_of(t):
    if not t.live:
        return t.recorded_version
    status, body = t.http("GET", "/api/overview")
    if status != 200 or not isinstance(body, dict):
        return "unknown"
    if body.get("product_name") == "Warren":
        return body.get("product_version", "unknown")
    return body.get("rabbitmq_version", "unknown")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rabbitmq", help="RabbitMQ's management base URL")
    p.add_argument("--rabbitmq-amqp", help="RabbitMQ's AMQP host:port")
    p.add_argument("--warren", required=True, help="Warren's management base URL")
    p.add_argument("--warren-amqp", required=True, help="Warren's AMQP host:port")
    p.add_argument("--user", default="guest", help="an administrator on both")
    p.add_argument("--password", default="guest")
    p.add_argument("--allowed", default=str(__file__).rsplit("/", 1)[0]
                   + "/mgmt-compare-allowed.json")
    p.add_argument("--report", help="also write the markdown report to this file")
    p.add_argument("--summary", help="write the condensed report (for the docs) to this file")
    p.add_argument("--record", help="save RabbitMQ's answers to this file")
    p.add_argument("--replay", help="compare with saved answers instead of a RabbitMQ")
    a = p.parse_args()
    if bool(a.rabbitmq) == bool(a.replay):
        die("give --rabbitmq (with --rabbitmq-amqp) or --replay")
    allowed = load_allowed(a.allowed)

    if a.replay:
        with open(a.replay) as f:
            recording = json.load(f)
        rabbit = Replay("RabbitMQ (replayed)", recording)
        rabbit.recorded_version = recording.get("version", "unknown")
    else:
        if not a.rabbitmq_amqp:
            die("--rabbitmq needs --rabbitmq-amqp")
        rabbit = Target("RabbitMQ", a.rabbitmq, a.rabbitmq_amqp, a.user, a.password)
    warren = Target("Warren", a.warren, a.warren_amqp, a.user, a.password)
    rabbit_version, warren_version = version_of(rabbit), version_of(warren)
    if rabbit.live:
        print(f"mgmt-compare: running the scenario against RabbitMQ {rabbit_version}",
              file=sys.stderr)
    scenario(rabbit)
    print(f"mgmt-compare: running the scenario against Warren {warren_version}",
          file=sys.stderr)
    scenario(warren)
    if a.record:
        with open(a.record, "w") as f:
            json.dump({"version": rabbit_version, "steps": rabbit.answers}, f, indent=1,
                      sort_keys=True)
            f.write("\n")

    rows, used, failed = compare(rabbit, warren, allowed)
    text = report(rows, allowed, used, rabbit_version, warren_version)
    print(text)
    if a.report:
        with open(a.report, "w") as f:
            f.write(text)
    if a.summary:
        with open(a.summary, "w") as f:
            f.write(summary(rows, allowed, used, rabbit_version, warren_version))
    new = sum(cell(m[k]).count("(NEW)") for _, _, _, m in rows for k in m)
    print(f"mgmt-compare: {len(rows)} calls compared, {new} undocumented difference(s), "
          f"{len(used)} of {len(allowed)} allowed differences seen", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
