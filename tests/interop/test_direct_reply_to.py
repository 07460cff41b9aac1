"""Direct reply-to (`amq.rabbitmq.reply-to`) through py-amqp, Warren's own interop check.

.ci/interop.sh runs this file as the `direct-reply-to` suite, after the py-amqp and kombu
suites, against the same broker (RABBITMQ_HOST, RABBITMQ_5672_TCP). It passes against
RabbitMQ 3.10.8 as well. An RPC round trip over two connections, the capability, and the
two 406s a client meets first.
"""
import os
import socket
import time
import uuid

import amqp
import pytest

HOST = os.environ.get("RABBITMQ_HOST", "127.0.0.1")
PORT = os.environ.get("RABBITMQ_5672_TCP", "5672")
REPLY_QUEUE = "amq.rabbitmq.reply-to"
TIMEOUT_S = 10


@pytest.fixture
def connect():
    opened = []

    def make():
        conn = amqp.Connection(host=f"{HOST}:{PORT}", userid="guest", password="guest")
        conn.connect()
        opened.append(conn)
        return conn

    yield make
    for conn in opened:
        try:
            conn.close()
        except Exception:
            pass


def drain_until(conn, done):
    """Handles the connection's events until done() holds; fails after TIMEOUT_S."""
    deadline = time.monotonic() + TIMEOUT_S
    while not done():
        left = deadline - time.monotonic()
        if left <= 0:
            pytest.fail(f"nothing arrived within {TIMEOUT_S} s")
        try:
            conn.drain_events(timeout=left)
        except socket.timeout:
            pass


def test_direct_reply_to_is_advertised(connect):
    assert connect().server_capabilities.get("direct_reply_to") is True


def test_rpc_round_trip_over_direct_reply_to(connect):
    client, server = connect(), connect()
    rpc = f"interop-rpc-{uuid.uuid4().hex}"
    server_ch = server.channel()
    server_ch.queue_declare(rpc, auto_delete=True)
    requests = []
    server_ch.basic_consume(rpc, callback=requests.append, no_ack=True)

    client_ch = client.channel()
    replies = []
    client_ch.basic_consume(REPLY_QUEUE, callback=replies.append, no_ack=True)
    correlation_id = uuid.uuid4().hex
    client_ch.basic_publish(
        amqp.Message(b"ping", reply_to=REPLY_QUEUE, correlation_id=correlation_id),
        exchange="",
        routing_key=rpc,
    )

    drain_until(server, lambda: requests)
    request = requests[0]
    reply_to = request.properties["reply_to"]
    assert reply_to.startswith(REPLY_QUEUE + ".") and len(reply_to) > len(REPLY_QUEUE) + 1
    server_ch.basic_publish(
        amqp.Message(b"pong", correlation_id=request.properties["correlation_id"]),
        exchange="",
        routing_key=reply_to,
    )

    drain_until(client, lambda: replies)
    reply = replies[0]
    assert reply.body == b"pong"
    assert reply.properties["correlation_id"] == correlation_id
    assert reply.delivery_info["routing_key"] == reply_to


def test_a_reply_consumer_with_acks_is_refused(connect):
    ch = connect().channel()
    with pytest.raises(amqp.exceptions.PreconditionFailed, match="cannot acknowledge"):
        ch.basic_consume(REPLY_QUEUE, callback=lambda m: None, no_ack=False)


def test_reply_to_without_a_reply_consumer_is_refused(connect):
    ch = connect().channel()
    ch.basic_publish(
        amqp.Message(b"ping", reply_to=REPLY_QUEUE), exchange="", routing_key="nowhere"
    )
    # The channel.close comes while the next synchronous method waits for its answer.
    with pytest.raises(amqp.exceptions.PreconditionFailed, match="fast reply consumer"):
        ch.queue_declare("", exclusive=True)
