#!/usr/bin/env bash
# What bounds one node's persistent large-message throughput (issue 18, docs/performance.md
# "One node, 64 KiB: where it stops"). Starts one Warren node (release binaries in BINDIR:
# warren, warren-perf) from config/warren.toml with its own data folder, and runs
# warren-perf with SIZE-byte messages (bench-compare.sh's 64 KiB scenario: 1 producer,
# 1 consumer, confirms, manual acks) in four ways: persistent; persistent with 1,000 in
# flight instead of 200; persistent with no consumer; transient (no disk at all). For each
# it prints the confirmed rate and, from `perf sched` over 3 s in the middle, the CPU each
# thread ran and how idle the two cores were; for the persistent run also where the
# syncer thread's time went (`perf trace -s`, 2 s). Not part of CI; needs perf and root.
# A warren-perf run that fails is reported, and the script exits 1.
#
#   bash .ci/probe-one-node.sh target/release 65536 10
set -u
[[ $# == 3 ]] || { sed -n '2,13p' "$0" >&2; exit 2; }
BIN=$1; SIZE=$2; SECS=$3
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
command -v perf >/dev/null || { echo "probe-one-node: needs perf" >&2; exit 2; }
T=$(mktemp -d /tmp/probe-one-node.XXXX)
WPID=""
cleanup() { [[ -n "$WPID" ]] && { kill "$WPID" 2>/dev/null; wait "$WPID" 2>/dev/null; }; rm -rf "$T"; }
trap cleanup EXIT
PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()')
sed -e "0,/^listen = /{s|^listen = .*|listen = \"127.0.0.1:$PORT\"|}" \
    -e "/^\[admin\]/,/^listen = /{s|^listen = .*|listen = \"127.0.0.1:0\"|}" \
    -e "/^\[management\]/,/^listen = /{s|^listen = .*|listen = \"127.0.0.1:0\"|}" \
    -e "s|^data_dir = .*|data_dir = \"$T/data\"|" "$ROOT/config/warren.toml" > "$T/warren.toml"
"$BIN/warren" --config "$T/warren.toml" > "$T/node.log" 2>&1 &
WPID=$!
for _ in $(seq 1 100); do (exec 3<>/dev/tcp/127.0.0.1/$PORT) 2>/dev/null && break; sleep 0.1; done
URI="amqp://guest:guest@127.0.0.1:$PORT/%2f"
SYNCER=$(for t in /proc/$WPID/task/*; do [[ $(cat "$t/comm") == warren-syncer ]] && basename "$t"; done | head -1)
FAILED=0

# Per-thread CPU (ms per second) and idle cores, from a perf sched file.
sched_summary() {
    perf sched timehist -i "$1" -s 2>/dev/null | awk -v secs="$2" '
        /warren-perf\[/ { c += $4 }
        /tokio-rt-worker\[/ { w += $4 }
        /warren-syncer\[/ { s += $4 }
        /idle for/ { v = $NF; gsub(/[()%]/, "", v); idle += v }
        END { printf "client %.0f, workers %.0f, syncer %.0f ms/s; cores idle %.0f%% (mean of 2)",
                     c/secs, w/secs, s/secs, idle/2 }'
}

run() {
    local name=$1; shift
    "$BIN/warren-perf" --uri "$URI" --producers 1 --size "$SIZE" --duration "$SECS" --json "$@" \
        > "$T/$name.json" 2> "$T/$name.err" &
    local pp=$! rc=0
    sleep $((SECS / 3))
    perf sched record -o "$T/$name.sched" -- sleep 3 >/dev/null 2>&1
    local sched; sched=$(sched_summary "$T/$name.sched" 3)
    local trace=""
    if [[ $name == persistent && -n "$SYNCER" ]]; then
        timeout -s INT 2 perf trace -s -t "$SYNCER" -o "$T/trace.txt" >/dev/null 2>&1
        trace=$(awk '$1 ~ /^(pwrite64|fdatasync|write|futex)$/ { printf "%s %d calls %.0f ms (avg %.3f ms); ", $1, $2, $4, $6 }' "$T/trace.txt")
    fi
    wait $pp || rc=$?
    if [[ $rc != 0 ]]; then
        echo "$name: warren-perf FAILED (exit $rc): $(tail -2 "$T/$name.err")"
        FAILED=1
        return
    fi
    python3 - "$T/$name.json" "$name" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
c = d.get("confirm_latency_us") or {}
print(f"{sys.argv[2]}: confirmed {d['confirmed_rate']:.0f} msg/s, received {d['received_rate']:.0f} msg/s, "
      f"confirm p50 {c.get('p50', 0)/1000:.1f} ms p99 {c.get('p99', 0)/1000:.1f} ms")
PY
    echo "  perf sched: $sched"
    [[ -n "$trace" ]] && echo "  syncer (perf trace -s, 2 s): $trace"
    sleep 2
}

echo "one node, $SIZE-byte messages, $SECS s each, release binaries in $BIN"
run persistent --consumers 1 --confirm 200 --persistent --queue probe-p
run persistent-1000-in-flight --consumers 1 --confirm 1000 --persistent --queue probe-p1000
run persistent-no-consumer --publish-only --confirm 200 --persistent --queue probe-po
run transient --consumers 1 --confirm 200 --queue probe-t
exit $FAILED
