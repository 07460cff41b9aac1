#!/usr/bin/env bash
# Backlog benchmark (not run in CI): a lazy queue grown to COUNT persistent messages of SIZE
# bytes, then drained, on one broker at a time (Warren or Debian's RabbitMQ 3.10):
#
#   - peak RSS of the broker process (target for Warren: under 1 GiB at 10 M x 1 KiB, i.e.
#     about 100 bytes of memory per message held on disk), sampled every second;
#   - publish rate while the backlog grows (one producer, confirms, 1000 in flight);
#   - disk used per message;
#   - restart time after a clean stop and after `kill -9`, until the AMQP port accepts and
#     until the node reports the whole backlog in the queue;
#   - drain rate (one consumer, prefetch 1000, multiple acks every 100).
#
#   bash .ci/bench-backlog.sh [--count N] [--size BYTES] [--no-build]
#                             [--broker warren|rabbitmq] [--install]
#
# Defaults: --count 10000000 --size 1024 --broker warren. --install runs
# `apt-get install -y rabbitmq-server` first. Environment knobs: RESTART_TIMEOUT (s, default
# 600) bounds each stop and restart wait; STALL_S (s, default 300) aborts the publish or drain
# when warren-perf reports no progress for that long (e.g. a publisher blocked for good by the
# memory alarm); CONFIG_TEMPLATE (default config/warren.toml, the text embedded in the binary)
# is the Warren config the run's config is derived from.
#
# Outputs under .ci/work/backlog/: summary-<broker>.md/.json, summary.md (side by side when
# both brokers have a summary for the same count and size), rss-<broker>-*.csv
# (elapsed_s,rss_kib,hwm_kib), publish-/drain-<broker>.json and .log (warren-perf), the node
# log (warren.log, or rabbitmq-log/ for RabbitMQ) and the data folder (warren-data/ or
# rabbitmq-mnesia/), kept for inspection. Progress goes to stderr, the summary to stdout.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$ROOT/.ci/work/backlog"
COUNT=10000000
SIZE=1024
BROKER=warren
INSTALL=0
NO_BUILD=0
RESTART_TIMEOUT="${RESTART_TIMEOUT:-600}"
STALL_S="${STALL_S:-300}"
CONFIG_TEMPLATE="${CONFIG_TEMPLATE:-config/warren.toml}"
QUEUE=backlog
USAGE="usage: $0 [--count N] [--size BYTES] [--no-build] [--broker warren|rabbitmq] [--install]"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --count) COUNT="${2:?$USAGE}"; shift ;;
        --size) SIZE="${2:?$USAGE}"; shift ;;
        --broker) BROKER="${2:?$USAGE}"; shift ;;
        --no-build) NO_BUILD=1 ;;
        --install) INSTALL=1 ;;
        -h|--help) echo "$USAGE"; exit 0 ;;
        *) echo "$USAGE" >&2; exit 2 ;;
    esac
    shift
done
[[ "$COUNT" =~ ^[1-9][0-9]*$ ]] || { echo "--count must be a positive integer" >&2; exit 2; }
[[ "$SIZE" =~ ^[0-9]+$ && "$SIZE" -ge 8 ]] || { echo "--size must be an integer >= 8" >&2; exit 2; }
[[ "$BROKER" == warren || "$BROKER" == rabbitmq ]] || { echo "--broker must be warren or rabbitmq" >&2; exit 2; }

log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "FAILED: $*"; exit 1; }
now() { echo "$EPOCHREALTIME"; }
# seconds elapsed since $1 (an EPOCHREALTIME value), 3 decimals
since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.3f", b - a }'; }
free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}
# true while PID exists and is not a zombie
alive() {
    local s
    s=$(awk '/^State:/ { print $2 }' "/proc/$1/status" 2>/dev/null) || return 1
    [[ -n "$s" && "$s" != Z ]]
}
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
# json_get FILE KEY: a top-level value of a warren-perf JSON summary ("null" when absent)
json_get() {
    python3 -c 'import json, sys; v = json.load(open(sys.argv[1])).get(sys.argv[2]); print("null" if v is None else v)' "$1" "$2"
}

mkdir -p "$OUT"
cd "$ROOT"
if [[ $INSTALL == 1 ]]; then
    log "installing rabbitmq-server (apt-get)"
    apt-get update -qq && apt-get install -y -qq rabbitmq-server >/dev/null
fi
if [[ $NO_BUILD == 0 ]]; then
    log "building release binaries"
    if ! cargo build --release --bin warren --bin warren-perf --bin warrenctl > "$OUT/build.log" 2>&1; then
        grep -E '^error' "$OUT/build.log" | head -5 >&2
        die "cargo build failed (see $OUT/build.log); retry later, or run with --no-build"
    fi
    tail -1 "$OUT/build.log" >&2
fi
WARREN="$ROOT/target/release/warren"
PERF="$ROOT/target/release/warren-perf"
CTL="$ROOT/target/release/warrenctl"
[[ -x "$PERF" ]] || die "$PERF missing (build it, or drop --no-build)"
if [[ $BROKER == warren ]]; then
    [[ -x "$WARREN" && -x "$CTL" ]] || die "$WARREN or $CTL missing (build them, or drop --no-build)"
else
    command -v rabbitmq-server >/dev/null || die "rabbitmq-server not installed (use --install)"
fi

# VmRSS and VmHWM of PID as "rss_kib,hwm_kib" (nothing once it is gone or a zombie)
mem_of() {
    awk '/^VmRSS:/ { r = $2 } /^VmHWM:/ { h = $2 } END { if (r != "") print r "," h }' \
        "/proc/$1/status" 2>/dev/null || true
}
# sampler PID CSV T0: a line every second until PID exits (or stop_sampler)
sampler() {
    local pid="$1" csv="$2" t0="$3" line
    while line=$(mem_of "$pid") && [[ -n "$line" ]]; do
        echo "$(since "$t0"),$line" >> "$csv"
        sleep 1
    done
}
SAMPLER_CSV=""
SAMPLER_T0=""
start_sampler() {
    SAMPLER_CSV="$2"
    SAMPLER_T0="$EPOCHREALTIME"
    echo "elapsed_s,rss_kib,hwm_kib" > "$SAMPLER_CSV"
    sampler "$1" "$SAMPLER_CSV" "$SAMPLER_T0" &
    SAMPLER_PID=$!
}
# sample_now: one extra line in the current CSV right now (so a phase shorter than the
# sampling period still ends with its VmHWM); prints the RSS in KiB
sample_now() {
    local line
    line=$(mem_of "$NODE_PID")
    if [[ -n "$line" && -n "$SAMPLER_CSV" ]]; then
        echo "$(since "$SAMPLER_T0"),$line" >> "$SAMPLER_CSV"
        echo "${line%%,*}"
    else
        echo 0
    fi
}
stop_sampler() {
    if [[ -n "$SAMPLER_PID" ]]; then
        kill "$SAMPLER_PID" 2>/dev/null || true
        wait "$SAMPLER_PID" 2>/dev/null || true
        SAMPLER_PID=""
    fi
}
# csv_peaks CSV: "max_rss_kib max_hwm_kib last_rss_kib" (0 0 0 when empty)
csv_peaks() {
    awk -F, 'NR > 1 { if ($2 > r) r = $2; if ($3 > h) h = $3; l = $2 }
             END { printf "%d %d %d\n", r, h, l }' "$1"
}

# ---------------------------------------------------------------------------------------------
# Process bookkeeping and cleanup: everything this script starts is stopped on exit.
NODE_PID=""      # the broker process (warren, or RabbitMQ's beam.smp)
SAMPLER_PID=""
PERF_PID=""
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    [[ -n "$PERF_PID" ]] && { kill -TERM "$PERF_PID" 2>/dev/null || true; wait "$PERF_PID" 2>/dev/null || true; }
    stop_sampler
    if [[ -n "$NODE_PID" ]] && alive "$NODE_PID"; then
        log "cleanup: stopping the $BROKER node (pid $NODE_PID)"
        if [[ $BROKER == rabbitmq ]]; then
            timeout 60 rabbitmqctl -n "$RMQ_NODE" stop >/dev/null 2>&1 || true
        else
            kill -TERM "$NODE_PID" 2>/dev/null || true
        fi
        for _ in $(seq 1 300); do alive "$NODE_PID" || break; sleep 0.1; done
        alive "$NODE_PID" && kill -KILL "$NODE_PID" 2>/dev/null || true
        [[ $BROKER == warren ]] && wait "$NODE_PID" 2>/dev/null || true
    fi
    if [[ $BROKER == rabbitmq && "${EPMD_WAS_RUNNING:-1}" == 0 ]] && command -v epmd >/dev/null; then
        epmd -kill >/dev/null 2>&1 || true
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ---------------------------------------------------------------------------------------------
# Broker-specific start / stop / queue depth.
if [[ $BROKER == warren ]]; then
    PORT=$(free_port)
    ADMIN_PORT=$(free_port)
    DATA="$OUT/warren-data"
    CFG="$OUT/warren.toml"
    NODE_LOG="$OUT/warren.log"
    rm -rf "$DATA"
    : > "$NODE_LOG"
    # The embedded default config with the listeners, data folder and memory budget replaced;
    # each key must already exist in its section (warren refuses unknown keys anyway).
    python3 - "$CONFIG_TEMPLATE" "$CFG" \
        "amqp.listen=\"127.0.0.1:$PORT\"" \
        "admin.listen=\"127.0.0.1:$ADMIN_PORT\"" \
        "node.data_dir=\"$DATA\"" \
        "limits.memory_high_watermark_bytes=536870912" <<'PY'
import re, sys
src, dst, *edits = sys.argv[1:]
want = {}
for e in edits:
    k, v = e.split("=", 1)
    sec, key = k.split(".", 1)
    want[(sec, key)] = v
done = set()
section = None
out = []
for line in open(src):
    m = re.match(r"^\[\[?([^\]]+)\]\]?\s*$", line)
    if m:
        section = m.group(1)
    m = re.match(r"^([A-Za-z0-9_]+)\s*=", line)
    if m and (section, m.group(1)) in want:
        line = f"{m.group(1)} = {want[(section, m.group(1))]}\n"
        done.add((section, m.group(1)))
    out.append(line)
missing = [f"[{s}] {k}" for (s, k) in want if (s, k) not in done]
if missing:
    sys.exit(f"{src} has no key " + ", ".join(missing))
open(dst, "w").write("".join(out))
PY
    DISK_DIR="$DATA"

    start_node() {
        echo "===== $(date -Is) start: $1 =====" >> "$NODE_LOG"
        NO_COLOR=1 "$WARREN" --config "$CFG" >> "$NODE_LOG" 2>&1 &
        NODE_PID=$!
    }
    queue_depth() {
        timeout 30 "$CTL" --node "127.0.0.1:$ADMIN_PORT" -q list_queues name messages 2>/dev/null \
            | awk -F'\t' -v q="$QUEUE" '$1 == q { print $2 }'
    }
    clean_stop() {
        kill -TERM "$NODE_PID"
    }
    reap() { wait "$NODE_PID" 2>/dev/null || true; }
else
    PORT=$(free_port)
    RMQ_NODE="backlog@localhost"
    RMQ_HOME="$OUT/rabbitmq-home"
    RMQ_MNESIA="$OUT/rabbitmq-mnesia"
    RMQ_LOGDIR="$OUT/rabbitmq-log"
    rm -rf "$RMQ_HOME" "$RMQ_MNESIA" "$RMQ_LOGDIR"
    mkdir -p "$RMQ_HOME" "$RMQ_MNESIA" "$RMQ_LOGDIR"
    echo "[]." > "$RMQ_HOME/enabled_plugins"
    # Debian's rabbitmq-server drops to the rabbitmq user: it must own its folders.
    chown -R rabbitmq:rabbitmq "$RMQ_HOME" "$RMQ_MNESIA" "$RMQ_LOGDIR"
    export RABBITMQ_NODENAME="$RMQ_NODE" RABBITMQ_NODE_PORT="$PORT" RABBITMQ_DIST_PORT="$(free_port)" \
        RABBITMQ_MNESIA_BASE="$RMQ_MNESIA" RABBITMQ_LOG_BASE="$RMQ_LOGDIR" \
        RABBITMQ_ENABLED_PLUGINS_FILE="$RMQ_HOME/enabled_plugins" RABBITMQ_PID_FILE="$RMQ_HOME/pid"
    NODE_LOG="$RMQ_LOGDIR"
    DISK_DIR="$RMQ_MNESIA"
    # RabbitMQ (and rabbitmqctl) start Erlang's epmd daemon when none runs; stop it at the
    # end in that case.
    EPMD_WAS_RUNNING=0
    port_open 4369 && EPMD_WAS_RUNNING=1
    if timeout 10 rabbitmqctl -n "$RMQ_NODE" status >/dev/null 2>&1; then
        die "a RabbitMQ node $RMQ_NODE is already running; stop it first"
    fi

    start_node() {
        rm -f "$RMQ_HOME/pid"
        (cd "$RMQ_HOME" && rabbitmq-server -detached) >/dev/null
        # -detached returns at once; the pid file names beam.smp once the node is booting.
        NODE_PID=""
        local pid
        for _ in $(seq 1 600); do
            pid=$(cat "$RMQ_HOME/pid" 2>/dev/null || true)
            if [[ "$pid" =~ ^[0-9]+$ ]] && alive "$pid"; then NODE_PID="$pid"; break; fi
            sleep 0.1
        done
        [[ -n "$NODE_PID" ]] || die "RabbitMQ wrote no pid file in 60 s (see $RMQ_LOGDIR)"
        [[ "$(cat "/proc/$NODE_PID/comm" 2>/dev/null)" == beam.smp ]] ||
            log "WARNING: pid $NODE_PID from $RMQ_HOME/pid is $(cat "/proc/$NODE_PID/comm" 2>/dev/null), not beam.smp"
    }
    queue_depth() {
        timeout 60 rabbitmqctl -n "$RMQ_NODE" -q list_queues name messages 2>/dev/null \
            | awk -F'\t' -v q="$QUEUE" '$1 == q { print $2 }'
    }
    clean_stop() {
        timeout "$RESTART_TIMEOUT" rabbitmqctl -n "$RMQ_NODE" stop >/dev/null 2>&1 || true
    }
    reap() { :; }
fi
URI="amqp://guest:guest@127.0.0.1:$PORT/%2f"

# wait_port TIMEOUT: until the AMQP port accepts; fails if the node exits first
wait_port() {
    local deadline=$((SECONDS + $1))
    until port_open "$PORT"; do
        alive "$NODE_PID" || return 1
        ((SECONDS < deadline)) || return 1
        sleep 0.05
    done
}

# wait_depth T0 DEADLINE: until the node reports $COUNT messages in the queue. Sets DEPTH_S
# (seconds from T0) and DEPTH (last count seen). Gives up at DEADLINE (a $SECONDS value), when
# the node exits, or when the reported count has stayed at another value for 60 s.
wait_depth() {
    local t0="$1" deadline="$2" last="" stable_since=$SECONDS next_log=$((SECONDS + 10)) d
    DEPTH_S=""
    DEPTH=""
    while :; do
        d=$(queue_depth || true)
        if [[ -n "$d" ]]; then
            DEPTH="$d"
            if [[ "$d" == "$COUNT" ]]; then DEPTH_S=$(since "$t0"); return 0; fi
            if [[ "$d" != "$last" ]]; then last="$d"; stable_since=$SECONDS; fi
            if ((SECONDS - stable_since >= 60)); then
                log "queue '$QUEUE' has reported $d messages (not $COUNT) for 60 s; giving up"
                return 1
            fi
        fi
        alive "$NODE_PID" || { log "the node exited while recovering"; return 1; }
        ((SECONDS < deadline)) || { log "timed out after ${RESTART_TIMEOUT}s (last count: ${DEPTH:-none})"; return 1; }
        if ((SECONDS >= next_log)); then
            log "  ... still recovering: queue '$QUEUE' reports ${DEPTH:-nothing yet}"
            next_log=$((SECONDS + 10))
        fi
        sleep 0.2
    done
}

# stop_node clean|kill: sets STOP_S
stop_node() {
    local how="$1" t0
    sample_now > /dev/null
    t0=$(now)
    if [[ $how == kill ]]; then
        kill -KILL "$NODE_PID"
    else
        clean_stop
    fi
    local deadline=$((SECONDS + RESTART_TIMEOUT))
    while alive "$NODE_PID"; do
        if ((SECONDS >= deadline)); then
            log "the node did not stop within ${RESTART_TIMEOUT}s; killing it"
            kill -KILL "$NODE_PID" 2>/dev/null || true
            sleep 1
        fi
        sleep 0.05
    done
    STOP_S=$(since "$t0")
    reap
    stop_sampler
    NODE_PID=""
}

# restart LABEL: start the node, time port and full backlog; sets PORT_S, READY_S, DEPTH
restart() {
    local label="$1" t0 deadline
    t0=$(now)
    deadline=$((SECONDS + RESTART_TIMEOUT))
    start_node "$label"
    start_sampler "$NODE_PID" "$OUT/rss-$BROKER-$label.csv"
    wait_port "$RESTART_TIMEOUT" || die "$label: the AMQP port did not open (node log: $NODE_LOG)"
    PORT_S=$(since "$t0")
    log "  AMQP port accepts after ${PORT_S}s"
    if wait_depth "$t0" "$deadline"; then
        READY_S="$DEPTH_S"
        log "  queue '$QUEUE' reports all $COUNT messages after ${READY_S}s"
    else
        READY_S="n/a"
    fi
    READY_RSS=$(sample_now)
    log "  RSS with the backlog recovered: $((READY_RSS / 1024)) MiB"
}

# perf NAME ARGS...: run warren-perf with --json, print progress, abort on a stall of STALL_S s
perf() {
    local name="$1"
    shift
    local json="$OUT/$name-$BROKER.json" plog="$OUT/$name-$BROKER.log" rc=0 next_log=$((SECONDS + 30))
    local why=""
    log "warren-perf $*"
    "$PERF" --uri "$URI" "$@" --json > "$json" 2> "$plog" &
    PERF_PID=$!
    while alive "$PERF_PID"; do
        sleep 1
        if [[ -z "$why" ]] && ! alive "$NODE_PID"; then
            why="the node (pid $NODE_PID) exited"
            kill -TERM "$PERF_PID" 2>/dev/null || true
        fi
        if ((SECONDS >= next_log)); then
            log "  $(awk '/^time:/ { l = $0 } END { print substr(l, 1, 160) }' "$plog")"
            next_log=$((SECONDS + 30))
        fi
        # a stall: the last STALL_S per-second lines all report no traffic at all
        if [[ -z "$why" ]] && awk -v n="$STALL_S" '/^time:/ { t[c++ % n] = $0 }
                END { if (c < n) exit 1; for (i in t) if (t[i] ~ /(sent|confirmed|received): [1-9]/) exit 1 }' "$plog"; then
            why="no progress for ${STALL_S}s"
            kill -TERM "$PERF_PID" 2>/dev/null || true
        fi
    done
    wait "$PERF_PID" || rc=$?
    PERF_PID=""
    if [[ -n "$why" || $rc != 0 || ! -s "$json" ]]; then
        tail -5 "$plog" >&2 || true
        die "warren-perf $name: ${why:-exited with $rc} (see $plog and the node log $NODE_LOG)"
    fi
    [[ "$(json_get "$json" error)" == null ]] || log "WARNING: warren-perf reported: $(json_get "$json" error)"
}

# =============================================================================================
log "backlog benchmark: broker $BROKER, $COUNT messages of $SIZE bytes, queue '$QUEUE' (lazy), AMQP port $PORT"
[[ $BROKER == warren ]] && log "config $CFG (admin port $ADMIN_PORT, data $DATA, memory_high_watermark_bytes 536870912)"
rm -f "$OUT"/rss-"$BROKER"-*.csv "$OUT"/publish-"$BROKER".* "$OUT"/drain-"$BROKER".*

# --- 1. start the node with an empty data folder
log "starting the $BROKER node"
T0=$(now)
start_node "fresh"
start_sampler "$NODE_PID" "$OUT/rss-$BROKER-1-publish.csv"
if ! wait_port 120; then
    [[ $BROKER == warren ]] && grep -v '^ ' "$NODE_LOG" | tail -n 5 >&2
    die "the AMQP port did not open (node log: $NODE_LOG)"
fi
[[ $BROKER == rabbitmq ]] && { timeout 120 rabbitmqctl -n "$RMQ_NODE" await_startup --timeout 110 >/dev/null || die "RabbitMQ did not finish booting"; }
log "node up (pid $NODE_PID) after $(since "$T0")s"
DISK0=$(du -sb "$DISK_DIR" | cut -f1)

# --- 2. publish the backlog
log "publishing $COUNT x $SIZE B persistent messages to lazy queue '$QUEUE'"
T0=$(now)
perf publish --publish-only --queue "$QUEUE" --queue-args x-queue-mode=lazy --persistent \
    --size "$SIZE" --count "$COUNT" --confirm 1000 --producers 1
PUB_WALL=$(since "$T0")
PJ="$OUT/publish-$BROKER.json"
PUB_RATE=$(json_get "$PJ" confirmed_rate)
PUB_CONFIRMED=$(json_get "$PJ" confirmed)
PUB_NACKED=$(json_get "$PJ" nacked)
PUB_DEPTH=$(json_get "$PJ" queue_depth_end)
log "published: confirmed $PUB_CONFIRMED, nacked $PUB_NACKED, queue depth $PUB_DEPTH, ${PUB_RATE} msg/s (wall ${PUB_WALL}s)"
[[ "$PUB_CONFIRMED" == "$COUNT" ]] || log "WARNING: $PUB_CONFIRMED of $COUNT messages confirmed"
PUB_RSS_END=$(sample_now)
read -r _ PUB_HWM _ < <(csv_peaks "$OUT/rss-$BROKER-1-publish.csv")
log "RSS at end of publish $((PUB_RSS_END / 1024)) MiB, peak so far $((PUB_HWM / 1024)) MiB"
sync
DISK1=$(du -sb "$DISK_DIR" | cut -f1)
log "disk: $DISK1 bytes in $DISK_DIR ($DISK0 before publishing)"

# --- 3. clean stop, restart
log "clean stop"
stop_node clean
CLEAN_STOP_S="$STOP_S"
log "  stopped in ${CLEAN_STOP_S}s; restarting"
restart 2-clean-restart
CLEAN_PORT_S="$PORT_S"
CLEAN_READY_S="$READY_S"
CLEAN_DEPTH="$DEPTH"
CLEAN_READY_RSS="$READY_RSS"

# --- 4. kill -9, restart
log "kill -9 (pid $NODE_PID)"
stop_node kill
log "  killed; restarting"
restart 3-kill9-restart
KILL_PORT_S="$PORT_S"
KILL_READY_S="$READY_S"
KILL_DEPTH="$DEPTH"
KILL_READY_RSS="$READY_RSS"

# --- 5. drain
stop_sampler
start_sampler "$NODE_PID" "$OUT/rss-$BROKER-4-drain.csv"
log "draining queue '$QUEUE'"
perf drain --consume-only --queue "$QUEUE" --prefetch 1000 --multi-ack-every 100
DJ="$OUT/drain-$BROKER.json"
DRAIN_RATE=$(json_get "$DJ" received_rate)
DRAIN_RECEIVED=$(json_get "$DJ" received)
DRAIN_DEPTH=$(json_get "$DJ" queue_depth_end)
log "drained: received $DRAIN_RECEIVED, ${DRAIN_RATE} msg/s, queue depth at end $DRAIN_DEPTH"
[[ "$DRAIN_RECEIVED" == "$COUNT" ]] ||
    log "WARNING: drained $DRAIN_RECEIVED of $COUNT (warren-perf stops after 1 s without a delivery)"
sleep 2
DISK2=$(du -sb "$DISK_DIR" | cut -f1)

# --- 6. stop
log "final clean stop"
stop_node clean
FINAL_STOP_S="$STOP_S"
DISK3=$(du -sb "$DISK_DIR" | cut -f1)

if [[ $BROKER == warren ]]; then
    ERRORS=$(sed 's/\x1b\[[0-9;]*m//g' "$NODE_LOG" | grep -cE ' (ERROR|WARN) |panicked' || true)
else
    ERRORS=$(cat "$RMQ_LOGDIR"/*.log | grep -cE '\[(error|warning)\]' || true)
fi

# --- 7. summary
read -r P1R P1H _ < <(csv_peaks "$OUT/rss-$BROKER-1-publish.csv")
read -r P2R P2H _ < <(csv_peaks "$OUT/rss-$BROKER-2-clean-restart.csv")
read -r P3R P3H _ < <(csv_peaks "$OUT/rss-$BROKER-3-kill9-restart.csv")
read -r P4R P4H _ < <(csv_peaks "$OUT/rss-$BROKER-4-drain.csv")
python3 - "$OUT" "$BROKER" <<PY
import json, os, sys
out, broker = sys.argv[1], sys.argv[2]
def num(s):
    try:
        return float(s)
    except (TypeError, ValueError):
        return None
count, size = $COUNT, $SIZE
kib = lambda a, b: max(a, b)
m = {
    "broker": broker, "count": count, "size": size,
    # peaks per node lifetime: the max of VmHWM and the sampled VmRSS (KiB)
    "peak_rss_publish_kib": kib($P1R, $P1H),
    "rss_end_publish_kib": $PUB_RSS_END,
    "peak_rss_clean_restart_kib": kib($P2R, $P2H),
    "rss_clean_restart_ready_kib": $CLEAN_READY_RSS,
    "rss_kill9_restart_ready_kib": $KILL_READY_RSS,
    # the third lifetime: recovery after kill -9 (its HWM) and the drain (sampled RSS)
    "peak_rss_kill9_restart_kib": kib($P3R, $P3H),
    "peak_rss_drain_kib": $P4R,
    "hwm_kill9_restart_and_drain_kib": max($P3H, $P4H),
    "publish_rate": num("$PUB_RATE"), "publish_wall_s": num("$PUB_WALL"),
    "publish_confirmed": num("$PUB_CONFIRMED"), "publish_nacked": num("$PUB_NACKED"),
    "disk_before_bytes": $DISK0, "disk_after_publish_bytes": $DISK1, "disk_after_drain_bytes": $DISK2, "disk_after_stop_bytes": $DISK3,
    "clean_stop_s": num("$CLEAN_STOP_S"),
    "clean_restart_port_s": num("$CLEAN_PORT_S"), "clean_restart_ready_s": num("$CLEAN_READY_S"),
    "clean_restart_depth": num("$CLEAN_DEPTH"),
    "kill9_restart_port_s": num("$KILL_PORT_S"), "kill9_restart_ready_s": num("$KILL_READY_S"),
    "kill9_restart_depth": num("$KILL_DEPTH"),
    "drain_rate": num("$DRAIN_RATE"), "drain_received": num("$DRAIN_RECEIVED"),
    "drain_depth_end": num("$DRAIN_DEPTH"),
    "final_stop_s": num("$FINAL_STOP_S"),
    "node_log_errors": $ERRORS,
}
m["peak_rss_kib"] = max(m["peak_rss_publish_kib"], m["peak_rss_clean_restart_kib"],
                        m["hwm_kill9_restart_and_drain_kib"])
m["rss_bytes_per_msg"] = m["peak_rss_kib"] * 1024 / count
m["disk_bytes_per_msg"] = (m["disk_after_publish_bytes"] - m["disk_before_bytes"]) / count
json.dump(m, open(os.path.join(out, f"summary-{broker}.json"), "w"), indent=1)

def f(v, fmt="{:.0f}"):
    return "n/a" if v is None else fmt.format(v)
mib = lambda k: f(k / 1024 if k is not None else None, "{:.1f}")
ROWS = [
    ("**peak RSS, MiB** (max VmHWM over all phases)", lambda m: mib(m["peak_rss_kib"])),
    ("**RSS bytes per message at peak**", lambda m: f(m["rss_bytes_per_msg"], "{:.0f}")),
    ("**publish msg/s** (confirmed, 1 producer, 1000 in flight)", lambda m: f(m["publish_rate"])),
    ("**disk bytes per message** (after publish, less the empty node)", lambda m: f(m["disk_bytes_per_msg"], "{:.0f}")),
    ("**clean restart s** (until the queue reports the backlog)", lambda m: f(m["clean_restart_ready_s"], "{:.2f}")),
    ("**kill -9 restart s** (until the queue reports the backlog)", lambda m: f(m["kill9_restart_ready_s"], "{:.2f}")),
    ("**drain msg/s** (1 consumer, prefetch 1000, ack every 100)", lambda m: f(m["drain_rate"])),
    ("peak RSS while publishing, MiB", lambda m: mib(m["peak_rss_publish_kib"])),
    ("RSS at end of publish, MiB", lambda m: mib(m["rss_end_publish_kib"])),
    ("peak RSS, clean restart (recovery until stopped), MiB", lambda m: mib(m["peak_rss_clean_restart_kib"])),
    ("RSS once the clean restart reports the backlog, MiB", lambda m: mib(m["rss_clean_restart_ready_kib"])),
    ("peak RSS, kill -9 restart (recovery), MiB", lambda m: mib(m["peak_rss_kill9_restart_kib"])),
    ("RSS once the kill -9 restart reports the backlog, MiB", lambda m: mib(m["rss_kill9_restart_ready_kib"])),
    ("peak RSS sampled while draining, MiB", lambda m: mib(m["peak_rss_drain_kib"])),
    ("publish wall time s (incl. connection setup)", lambda m: f(m["publish_wall_s"], "{:.1f}")),
    ("messages confirmed / nacked", lambda m: f"{f(m['publish_confirmed'])} / {f(m['publish_nacked'])}"),
    ("disk after publish, MiB", lambda m: f(m["disk_after_publish_bytes"] / 2**20, "{:.1f}")),
    ("disk 2 s after the drain (node running), MiB", lambda m: f(m["disk_after_drain_bytes"] / 2**20, "{:.1f}")),
    ("disk after the final stop, MiB", lambda m: f(m["disk_after_stop_bytes"] / 2**20, "{:.1f}")),
    ("clean stop s", lambda m: f(m["clean_stop_s"], "{:.2f}")),
    ("clean restart: AMQP port accepts s", lambda m: f(m["clean_restart_port_s"], "{:.2f}")),
    ("clean restart: messages reported", lambda m: f(m["clean_restart_depth"])),
    ("kill -9 restart: AMQP port accepts s", lambda m: f(m["kill9_restart_port_s"], "{:.2f}")),
    ("kill -9 restart: messages reported", lambda m: f(m["kill9_restart_depth"])),
    ("drain: messages received / left in queue", lambda m: f"{f(m['drain_received'])} / {f(m['drain_depth_end'])}"),
    # RabbitMQ logs warren-perf's passive queue.declare of a missing queue (404) as 2 errors
    ("error/warning lines in the node log", lambda m: f(m["node_log_errors"])),
]
def table(ms):
    head = f"Backlog: {count:,} messages of {size} B, lazy durable queue, persistent, publisher confirms"
    lines = [head, "", "| metric | " + " | ".join(x["broker"] for x in ms) + " |",
             "|---|" + "---|" * len(ms)]
    for name, get in ROWS:
        lines.append(f"| {name} | " + " | ".join(get(x) for x in ms) + " |")
    return "\n".join(lines) + "\n"
open(os.path.join(out, f"summary-{broker}.md"), "w").write(table([m]))
print(table([m]))
# side by side when both brokers have a summary for the same count and size
both = []
for b in ("warren", "rabbitmq"):
    try:
        x = json.load(open(os.path.join(out, f"summary-{b}.json")))
    except (OSError, ValueError):
        continue
    if x.get("count") == count and x.get("size") == size:
        both.append(x)
if len(both) == 2:
    open(os.path.join(out, "summary.md"), "w").write(table(both))
    print(table(both))
PY
log "done; raw data in $OUT"
