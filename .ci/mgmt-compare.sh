#!/usr/bin/env bash
# The management HTTP API compared field by field with RabbitMQ 3.10 (.ci/mgmt-compare.py):
# starts RabbitMQ (Debian's rabbitmq-server, installed when missing) with its management
# plugin on spare ports, and a Warren node from the release build on others, runs the same
# scripted calls against both, and stops both, also on failure. Fails on a difference that
# .ci/mgmt-compare-allowed.json does not name. The report and its condensed form (the
# table of docs/compatibility.md) go to .ci/work/mgmt-compare/.
#
#   bash .ci/mgmt-compare.sh [--replay]
#
# When RabbitMQ cannot be installed or started here (not root, no package mirror), or with
# --replay, Warren is compared with RabbitMQ 3.10.8's recorded answers instead
# (.ci/mgmt-compare-rabbitmq-3.10.8.json, written by `mgmt-compare.py --record`); the
# output says which it was. WARREN_BIN overrides the binary (target/release/warren).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="$ROOT/.ci/work/mgmt-compare"
RECORDING="$ROOT/.ci/mgmt-compare-rabbitmq-3.10.8.json"
BIN="${WARREN_BIN:-$ROOT/target/release/warren}"
REPLAY=""
case "${1:-}" in
    "") ;;
    --replay) REPLAY=1 ;;
    *) echo "usage: $0 [--replay]" >&2; exit 2 ;;
esac
mkdir -p "$WORK"

if [[ ! -x "$BIN" ]]; then
    echo "mgmt-compare: no Warren binary at $BIN (cargo build --release --bin warren)" >&2
    exit 1
fi

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

port_open() {
    python3 - "$1" <<'EOF' 2>/dev/null
import socket, sys
socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=1).close()
EOF
}

# wait_http URL SECONDS: until the URL answers 200 to guest (the broker is up).
wait_http() {
    python3 - "$1" "$2" <<'EOF'
import base64, sys, time, urllib.request
url, deadline = sys.argv[1], time.monotonic() + float(sys.argv[2])
req = urllib.request.Request(url, headers={"Authorization": "Basic " + base64.b64encode(b"guest:guest").decode()})
while True:
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            if r.status == 200:
                sys.exit(0)
    except Exception:
        pass
    if time.monotonic() > deadline:
        sys.exit(1)
    time.sleep(0.5)
EOF
}

RMQ_DIR=""
RMQ_NODE=""
RMQ_EPMD=""
RMQ_DIST=""
WARREN_PID=""
WARREN_DIR=""

# RabbitMQ's scripts with this run's node, ports and folders (the Debian wrapper in
# /usr/sbin would switch to the rabbitmq user and its own folders).
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
    if [[ -n "$WARREN_PID" ]] && kill -0 "$WARREN_PID" 2>/dev/null; then
        kill -TERM "$WARREN_PID" 2>/dev/null || true
        for _ in $(seq 1 50); do
            kill -0 "$WARREN_PID" 2>/dev/null || break
            sleep 0.2
        done
        kill -KILL "$WARREN_PID" 2>/dev/null || true
        wait "$WARREN_PID" 2>/dev/null || true
    fi
    if [[ -n "$RMQ_DIR" ]]; then
        # The node's OS pid, read before the stop removes the file.
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
        # The epmd this run started on its own port (-relaxed_command_check: it may be
        # killed even while a node is still registered).
        epmd -port "$RMQ_EPMD" -kill >/dev/null 2>&1
        rm -rf "$RMQ_DIR"
    fi
    [[ -z "$WARREN_DIR" ]] || rm -rf "$WARREN_DIR"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# --- RabbitMQ ------------------------------------------------------------------------------
start_rabbitmq() {
    if [[ ! -x /usr/lib/rabbitmq/bin/rabbitmq-server ]]; then
        echo "mgmt-compare: installing rabbitmq-server"
        if [[ $(id -u) -ne 0 ]]; then
            echo "mgmt-compare: not root: cannot install rabbitmq-server" >&2
            return 1
        fi
        # policy-rc.d 101: the package's own service must not start.
        local restore_policy=""
        if [[ ! -e /usr/sbin/policy-rc.d ]]; then
            printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
            chmod +x /usr/sbin/policy-rc.d
            restore_policy=1
        fi
        local st=0
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq rabbitmq-server) >&2 || st=$?
        [[ -z "$restore_policy" ]] || rm -f /usr/sbin/policy-rc.d
        [[ $st -eq 0 ]] || return 1
    fi
    RMQ_DIR="$(mktemp -d /tmp/warren-ci-rabbitmq.XXXXXX)"
    RMQ_NODE="mgmtcompare$$@localhost"
    RMQ_AMQP="$(free_port)"
    RMQ_MGMT="$(free_port)"
    RMQ_DIST="$(free_port)"
    RMQ_EPMD="$(free_port)"
    cat >"$RMQ_DIR/rabbitmq.conf" <<EOF
listeners.tcp.default = $RMQ_AMQP
management.tcp.port = $RMQ_MGMT
loopback_users = none
EOF
    echo '[rabbitmq_management].' >"$RMQ_DIR/enabled_plugins"
    echo "mgmt-compare: starting RabbitMQ $RMQ_NODE (AMQP $RMQ_AMQP, management $RMQ_MGMT), log in $RMQ_DIR/log"
    epmd -port "$RMQ_EPMD" -daemon -relaxed_command_check || return 1
    rmq rabbitmq-server -detached || return 1
    if ! wait_http "http://127.0.0.1:$RMQ_MGMT/api/overview" 120; then
        echo "mgmt-compare: RabbitMQ's management listener did not answer within 120s; its log:" >&2
        tail -n 30 "$RMQ_DIR"/log/*.log >&2 2>/dev/null || true
        return 1
    fi
    echo "mgmt-compare: RabbitMQ $(rmq rabbitmqctl -n "$RMQ_NODE" version 2>/dev/null || echo '?') is up"
}

# --- Warren --------------------------------------------------------------------------------
start_warren() {
    local conf
    WARREN_DIR="$(mktemp -d /tmp/warren-ci-mgmt.XXXXXX)"
    W_AMQP="$(free_port)"
    W_MGMT="$(free_port)"
    W_PROM="$(free_port)"
    conf="$WARREN_DIR/warren.toml"
    # The shipped config, with only the listen addresses and the data folder changed.
    sed -E \
        -e "0,/^listen = /{s|^listen = .*|listen = \"127.0.0.1:$W_AMQP\"|}" \
        -e "/^\[admin\]/,/^listen = /{s|^listen = .*|listen = \"127.0.0.1:0\"|}" \
        -e "/^\[management\]/,/^listen = /{s|^listen = .*|listen = \"127.0.0.1:$W_MGMT\"|}" \
        -e "/^\[prometheus\]/,/^listen = /{s|^listen = .*|listen = \"127.0.0.1:$W_PROM\"|}" \
        -e "s|^data_dir = .*|data_dir = \"$WARREN_DIR/data\"|" \
        "$ROOT/config/warren.toml" >"$conf"
    echo "mgmt-compare: starting $BIN (AMQP $W_AMQP, management $W_MGMT), log $WORK/warren.log"
    (cd "$WARREN_DIR" && NO_COLOR=1 exec "$BIN" --config "$conf") >"$WORK/warren.log" 2>&1 </dev/null &
    WARREN_PID=$!
    if ! wait_http "http://127.0.0.1:$W_MGMT/api/overview" 60 || ! port_open "$W_AMQP"; then
        echo "mgmt-compare: the Warren node did not come up; its log:" >&2
        tail -n 30 "$WORK/warren.log" >&2
        return 1
    fi
}

if [[ -z "$REPLAY" ]] && ! start_rabbitmq; then
    echo "mgmt-compare: RabbitMQ could not be started here: comparing with its recorded answers ($RECORDING)" >&2
    REPLAY=1
fi
start_warren

ARGS=(--warren "http://127.0.0.1:$W_MGMT" --warren-amqp "127.0.0.1:$W_AMQP"
    --report "$WORK/report.md" --summary "$WORK/summary.md")
if [[ -n "$REPLAY" ]]; then
    ARGS+=(--replay "$RECORDING")
else
    ARGS+=(--rabbitmq "http://127.0.0.1:$RMQ_MGMT" --rabbitmq-amqp "127.0.0.1:$RMQ_AMQP"
        --record "$WORK/rabbitmq.json")
fi
rc=0
python3 "$ROOT/.ci/mgmt-compare.py" "${ARGS[@]}" >"$WORK/stdout.md" || rc=$?
# The rows with a difference nobody documented, then the totals (stderr, above).
grep -F '(NEW)' "$WORK/stdout.md" || true
if [[ $rc -eq 0 ]]; then
    echo "mgmt-compare: ok${REPLAY:+ (against the recorded answers)}; report in $WORK/report.md"
else
    echo "mgmt-compare: FAILED${REPLAY:+ (against the recorded answers)}: differences marked NEW are not in .ci/mgmt-compare-allowed.json; report in $WORK/report.md" >&2
fi
exit $rc
