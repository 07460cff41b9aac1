#!/usr/bin/env bash
# Records RabbitMQ 3.10's answers to the differential suite's scenarios
# (tests/differential.rs) into tests/differential/rabbitmq-3.10.8.json: starts a fresh
# RabbitMQ (Debian's rabbitmq-server, installed when missing) with its management plugin
# (the policy scenarios use its HTTP API) on its own ports and folders, runs every
# scenario once against it, and stops it, also on failure. The scenarios name their
# queues from their ids, so the broker must start empty: this script always starts a new
# one.
#
#   bash .ci/differential-record.sh
#
# The replay against Warren is part of `cargo test` (warren_answers_as_rabbitmq_3_10_does).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RMQ_DIR="$(mktemp -d /tmp/warren-diff-rmq.XXXXXX)"
RMQ_NODE="diffrecord$$@localhost"

# Ports below the kernel's ephemeral range, so no client's source port holds them.
pick_port() {
    python3 - "$1" <<'EOF'
import socket, sys
for p in range(int(sys.argv[1]), int(sys.argv[1]) + 500):
    s = socket.socket()
    try:
        s.bind(("0.0.0.0", p))
    except OSError:
        continue
    s.close()
    print(p)
    break
EOF
}
RMQ_AMQP="$(pick_port 21000)"
RMQ_DIST="$(pick_port $((RMQ_AMQP + 1)))"
RMQ_EPMD="$(pick_port $((RMQ_DIST + 1)))"
RMQ_HTTP="$(pick_port $((RMQ_EPMD + 1)))"

rmq() {
    local tool="$1"
    shift
    HOME="$RMQ_DIR" RABBITMQ_NODENAME="$RMQ_NODE" \
        RABBITMQ_CONFIG_FILE="$RMQ_DIR/rabbitmq" \
        RABBITMQ_ENABLED_PLUGINS_FILE="$RMQ_DIR/enabled_plugins" \
        RABBITMQ_MNESIA_BASE="$RMQ_DIR/mnesia" RABBITMQ_LOG_BASE="$RMQ_DIR/log" \
        RABBITMQ_PID_FILE="$RMQ_DIR/pid" RABBITMQ_DIST_PORT="$RMQ_DIST" \
        ERL_EPMD_PORT="$RMQ_EPMD" "/usr/lib/rabbitmq/bin/$tool" "$@"
}

cleanup() {
    set +e
    local pid
    pid="$(cat "$RMQ_DIR/pid" 2>/dev/null)"
    rmq rabbitmqctl -n "$RMQ_NODE" stop >/dev/null 2>&1
    if [[ -n "$pid" ]]; then
        for _ in $(seq 1 150); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.2
        done
        kill -KILL "$pid" 2>/dev/null
    fi
    epmd -port "$RMQ_EPMD" -kill >/dev/null 2>&1
    rm -rf "$RMQ_DIR"
}
trap cleanup EXIT

if [[ ! -x /usr/lib/rabbitmq/bin/rabbitmq-server ]]; then
    echo "differential-record: installing rabbitmq-server"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq rabbitmq-server
fi
cat >"$RMQ_DIR/rabbitmq.conf" <<EOF
listeners.tcp.default = $RMQ_AMQP
management.tcp.ip = 127.0.0.1
management.tcp.port = $RMQ_HTTP
EOF
echo '[rabbitmq_management].' >"$RMQ_DIR/enabled_plugins"
epmd -port "$RMQ_EPMD" -daemon -relaxed_command_check
rmq rabbitmq-server -detached
for _ in $(seq 1 120); do
    if (echo >"/dev/tcp/127.0.0.1/$RMQ_AMQP") 2>/dev/null &&
        (echo >"/dev/tcp/127.0.0.1/$RMQ_HTTP") 2>/dev/null; then
        break
    fi
    sleep 1
done
echo "differential-record: RabbitMQ $(rmq rabbitmqctl -n "$RMQ_NODE" version) on port $RMQ_AMQP, management on $RMQ_HTTP"
cd "$ROOT"
DIFF_RECORD="127.0.0.1:$RMQ_AMQP" DIFF_RECORD_HTTP="127.0.0.1:$RMQ_HTTP" cargo test --test differential -- --ignored record --nocapture
