#!/usr/bin/env bash
# Side-by-side benchmark: the same warren-perf runs against Warren and against Debian's
# RabbitMQ 3.10 on this machine, one broker at a time (the other is not running), and a
# Markdown table of the figures. Not part of CI (it takes a few minutes and needs RabbitMQ).
#
#   bash .ci/bench-compare.sh [--install] [--no-build] [--duration S] [--only warren|rabbitmq]
#                             [--scenarios REGEX]
#
# --install runs `apt-get install -y rabbitmq-server` first. Results: .ci/work/bench/*.json
# and .ci/work/bench/table.md.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$ROOT/.ci/work/bench"
DURATION=10
ONLY=""
PICK=""
INSTALL=0
NO_BUILD=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --install) INSTALL=1 ;;
        --duration) DURATION="$2"; shift ;;
        --only) ONLY="$2"; shift ;;
        --scenarios) PICK="$2"; shift ;;
        --no-build) NO_BUILD=1 ;;
        *) echo "usage: $0 [--install] [--duration S] [--only warren|rabbitmq] [--scenarios REGEX]" >&2; exit 2 ;;
    esac
    shift
done
mkdir -p "$OUT"
cd "$ROOT"
if [[ $INSTALL == 1 ]]; then
    apt-get update -qq && apt-get install -y -qq rabbitmq-server >/dev/null
fi
if [[ $NO_BUILD == 0 ]]; then
    cargo build --release --bin warren --bin warren-perf 2>&1 | tail -1
fi
# CARGO_TARGET_DIR picks other builds (an A/B of two commits).
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
PERF="$TARGET/release/warren-perf"

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

# name | warren-perf arguments (queue names are fixed so persistent runs use durable queues)
SCENARIOS=(
    "transient-autoack-16B|--producers 1 --consumers 1 --size 16 --autoack"
    "transient-confirm-ack-16B|--producers 1 --consumers 1 --size 16 --confirm 100"
    "latency-at-20k-autoack-16B|--producers 1 --consumers 1 --size 16 --autoack --rate 20000"
    "latency-at-20k-confirm-ack-16B|--producers 1 --consumers 1 --size 16 --confirm 100 --rate 20000"
    "latency-at-50k-confirm-ack-16B|--producers 1 --consumers 1 --size 16 --confirm 100 --rate 50000"
    "persistent-confirm-1KiB-1p1c|--producers 1 --consumers 1 --size 1024 --confirm 100 --persistent --queue bench-p1"
    "persistent-confirm-1KiB-4p4c|--producers 4 --consumers 4 --size 1024 --confirm 100 --persistent --queue bench-p4"
    "persistent-confirm-64KiB-1p1c|--producers 1 --consumers 1 --size 65536 --confirm 200 --persistent --queue bench-p64"
)

# Runs of the load tool that failed: reported at the end, and the script exits 1.
FAILED_RUNS=()
run_all() {
    local broker="$1" uri="$2"
    for s in "${SCENARIOS[@]}"; do
        local name="${s%%|*}" args="${s#*|}"
        [[ -z $PICK || $name =~ $PICK ]] || continue
        echo "--- $broker: $name: warren-perf $args --duration $DURATION"
        # shellcheck disable=SC2086
        local rc=0
        "$PERF" --uri "$uri" $args --duration "$DURATION" --json 2>/dev/null > "$OUT/$broker-$name.json" || rc=$?
        if [[ $rc -ne 0 ]]; then
            echo "--- $broker: $name FAILED: warren-perf exit $rc" >&2
            FAILED_RUNS+=("$broker $name (exit $rc)")
            rm -f "$OUT/$broker-$name.json"
        fi
        sleep 2
    done
}

WPID=""
RMQ_NODE=""
cleanup() {
    if [[ -n "$WPID" ]]; then kill -TERM "$WPID" 2>/dev/null || true; wait "$WPID" 2>/dev/null || true; fi
    if [[ -n "$RMQ_NODE" ]]; then rabbitmqctl -n "$RMQ_NODE" stop >/dev/null 2>&1 || true; fi
    rm -rf "${TMPD:-/nonexistent}"
}
trap cleanup EXIT
TMPD="$(mktemp -d)"

if [[ "$ONLY" != "rabbitmq" ]]; then
    PORT=$(free_port)
    sed -e "0,/^listen = /{s|^listen = .*|listen = \"127.0.0.1:$PORT\"|}" \
        -e "/^\[admin\]/,/^listen = /{s|^listen = .*|listen = \"127.0.0.1:0\"|}" \
        -e "/^\[management\]/,/^listen = /{s|^listen = .*|listen = \"127.0.0.1:0\"|}" -e "s|^data_dir = .*|data_dir = \"$TMPD/warren\"|" \
        config/warren.toml > "$TMPD/warren.toml"
    "$TARGET/release/warren" --config "$TMPD/warren.toml" > "$OUT/warren-node.log" 2>&1 &
    WPID=$!
    for _ in $(seq 1 100); do (exec 3<>/dev/tcp/127.0.0.1/$PORT) 2>/dev/null && break; sleep 0.1; done
    run_all warren "amqp://guest:guest@127.0.0.1:$PORT/%2f"
    kill -TERM "$WPID"; wait "$WPID" || true; WPID=""
fi

if [[ "$ONLY" != "warren" ]]; then
    command -v rabbitmq-server >/dev/null || { echo "rabbitmq-server not installed (use --install)" >&2; exit 1; }
    PORT=$(free_port)
    RMQ_NODE="wbench@localhost"
    mkdir -p "$TMPD/rmq"
    echo "[]." > "$TMPD/rmq/enabled_plugins"
    # Debian's rabbitmq-server drops to the rabbitmq user: it must own its folders.
    chmod 755 "$TMPD"
    chown -R rabbitmq:rabbitmq "$TMPD/rmq" 2>/dev/null || true
    export RABBITMQ_NODENAME="$RMQ_NODE" RABBITMQ_NODE_PORT="$PORT" RABBITMQ_DIST_PORT="$(free_port)" \
        RABBITMQ_MNESIA_BASE="$TMPD/rmq/mnesia" RABBITMQ_LOG_BASE="$TMPD/rmq/log" \
        RABBITMQ_ENABLED_PLUGINS_FILE="$TMPD/rmq/enabled_plugins" RABBITMQ_PID_FILE="$TMPD/rmq/pid"
    (cd "$TMPD/rmq" && rabbitmq-server -detached)
    # The node registers with epmd a few seconds after -detached returns.
    for _ in $(seq 1 60); do
        rabbitmqctl -n "$RMQ_NODE" status >/dev/null 2>&1 && break
        sleep 1
    done
    rabbitmqctl -n "$RMQ_NODE" await_startup --timeout 90 >/dev/null
    run_all rabbitmq "amqp://guest:guest@127.0.0.1:$PORT/%2f"
fi

python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
rows = {}
for f in sorted(os.listdir(out)):
    if not f.endswith(".json"):
        continue
    broker, name = f[:-5].split("-", 1)
    try:
        d = json.load(open(os.path.join(out, f)))
    except Exception:
        continue
    rows.setdefault(name, {})[broker] = d
lines = ["| scenario | broker | sent msg/s | received msg/s | confirmed msg/s | latency p50 µs | p99 µs | confirm p99 µs |",
         "|---|---|---|---|---|---|---|---|"]
for name, brokers in rows.items():
    for broker in ("warren", "rabbitmq"):
        d = brokers.get(broker)
        if not d:
            continue
        lat = d.get("latency_us") or {}
        cl = d.get("confirm_latency_us") or {}
        lines.append(f"| {name} | {broker} | {d['sent_rate']:.0f} | {d['received_rate']:.0f} | {d['confirmed_rate']:.0f} | "
                     f"{lat.get('p50', 0):.0f} | {lat.get('p99', 0):.0f} | {cl.get('p99', 0) if cl else '-'} |")
open(os.path.join(out, "table.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
if [[ ${#FAILED_RUNS[@]} -gt 0 ]]; then
    echo "FAILED runs: ${FAILED_RUNS[*]}" >&2
    exit 1
fi
