#!/usr/bin/env bash
# Issue 6's benchmarks, side by side: mirrored queues on a 3-node Warren cluster (three
# release `warren` processes on 127.0.88.{1,2,3}) and on a 3-node RabbitMQ 3.10 cluster
# (Debian's rabbitmq-server, rabbit{1,2,3}@localhost on 127.0.0.1:580{1,2,3}) on this machine,
# one broker at a time. Not part of CI. Figures go to stdout and to .ci/work/mirrored/.
#
#   bash .ci/bench-mirrored.sh [--no-build] [--duration S] [--sync-count N] STEP...
#
# STEPs (in the order given):
#   throughput-warren  throughput-rabbitmq    1 KiB persistent, confirms 100, 1p1c and 4p4c,
#                                             clients on the master's node, ha-mode all; then
#                                             1p1c as issue 18 measures it (confirms 200,
#                                             prefetch 100)
#   large-warren       large-rabbitmq         64 KiB, 1 MiB and 16 MiB persistent, confirms, 1p1c,
#                                             ha-mode all (GM messages sent in parts)
#   sync-warren        sync-rabbitmq          N (1,000,000) 64 B persistent messages on the
#                                             master alone, then ha-mode all + automatic sync:
#                                             time until every mirror is synchronised, and
#                                             warren-perf's rates while it runs (variants:
#                                             sync-B-publish, sync-B-pubsub, sync-B-idle: no load)
#   resync-warren                             issue 16's figure: a mirror of an N (1,000,000) x 1 KiB
#                                             queue is killed (kill -9) while 10,000 more arrive,
#                                             then started again: time from its start until it is
#                                             listed synchronised, with its copy kept (it catches
#                                             up what it missed) and with the copy's folder removed
#                                             while it was down (a full resync), side by side
#   failover-warren                           `cargo bench --bench mirrored` (default settings,
#                                             then peer_timeout_ms 1000 / heartbeat_ms 100)
#   failover-rabbitmq                         the same bench binary against RabbitMQ: kill -9
#                                             of the master's node, 3 times
#   failover-warren-stop failover-rabbitmq-stop   the same with a controlled stop (SIGTERM)
#                                             of the master's node instead of kill -9
#   failover-rabbitmq-reconnect               kill -9 with the publisher on the master's node
#                                             (it reconnects to the next one), 3 times
#   cpu-warren         cpu-rabbitmq           issue 18's CPU at everyday rates: 1 KiB persistent,
#                                             confirms (200 in flight), manual acks, 1p1c on node 1,
#                                             ha-mode all, at a fixed 100, 1,000 and 10,000 msg/s
#                                             and flat out: the brokers' CPU (utime + stime of the
#                                             three processes over the run) in cores and in µs per
#                                             confirmed message, beside confirm p50 / p99
#   manual-sync-warren manual-sync-rabbitmq   issue 18's sync without stalls: N (1,000,000) x 1 KiB
#                                             persistent on the master alone, then exactly 2 with
#                                             manual sync (an unsynchronised mirror), a probe
#                                             publisher (200 msg/s, 1 confirm in flight, 60 s or
#                                             MSYNC_PROBE_SECS) and `sync_queue` 3 s into it: time to
#                                             synchronised, the probe's confirm p50 / p99 / worst
#   many-warren        many-rabbitmq          issue 18's many queues: 1,000 mirrored queues
#                                             (ha-mode all) declared across the three nodes,
#                                             the brokers' RSS per idle queue, then 100
#                                             producers and 100 consumers over the three
#                                             nodes (1 KiB persistent, confirms 50 each)
#   all                                       throughput, sync and failover, both brokers
#                                             (bench-issue18.sh runs every issue 18 step)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$ROOT/.ci/work/mirrored"
DURATION=10
SYNC_COUNT=1000000
NO_BUILD=0
STEPS=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --no-build) NO_BUILD=1 ;;
        --duration) DURATION="$2"; shift ;;
        --sync-count) SYNC_COUNT="$2"; shift ;;
        all) STEPS+=(throughput-warren throughput-rabbitmq sync-warren sync-rabbitmq failover-warren failover-rabbitmq) ;;
        throughput-*|large-*|sync-*|manual-sync-*|resync-*|failover-*|cpu-*|many-*) STEPS+=("$1") ;; # sync-B-publish / sync-B-pubsub: one variant
        *) sed -n '2,53p' "$0" >&2; exit 2 ;;
    esac
    shift
done
[[ ${#STEPS[@]} -gt 0 ]] || { sed -n '2,53p' "$0" >&2; exit 2; }
mkdir -p "$OUT"
cd "$ROOT"
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
if [[ $NO_BUILD == 0 ]]; then
    # The bench profile's build (dev-dependency features) also builds the binaries in
    # target/release: building it first keeps cargo from rebuilding them in between.
    cargo bench --bench mirrored --no-run 2>&1 | tail -1
fi
PERF="$TARGET/release/warren-perf"
WARREN="$TARGET/release/warren"
CTL="$TARGET/release/warrenctl"
TMPD="$(mktemp -d /tmp/bench-mirrored.XXXXXX)"
chmod 755 "$TMPD"

log() { echo "[$(date -u +%H:%M:%S)] $* (load: $(cut -d' ' -f1-3 /proc/loadavg))"; }

# ---------------------------------------------------------------- Warren
WIPS=(127.0.88.1 127.0.88.2 127.0.88.3)
WPIDS=()
wuri() { echo "amqp://guest:guest@${WIPS[$(($1 - 1))]}:5672/%2f"; }
wctl() { local n="$1"; shift; "$CTL" --node "${WIPS[$((n - 1))]}:5679" "$@"; }
# set_policy, retried: under load a metadata command can meet a Raft leader change
# ("outcome unknown ... leadership lost"); setting the same policy again is harmless.
wpolicy() {
    for _ in $(seq 1 20); do wctl 1 set_policy "$@" && return 0; sleep 0.5; done
    return 1
}

warren_up() { # [peer_timeout_ms heartbeat_ms]
    local extra=""
    [[ $# -ge 2 ]] && extra="peer_timeout_ms = $1"$'\n'"heartbeat_ms = $2"$'\n'
    rm -rf "$TMPD/warren"; mkdir -p "$TMPD/warren"
    local members=""
    for i in 1 2 3; do members+=$'[[cluster.initial_members]]\n'"id = $i"$'\n'"link = \"${WIPS[$((i - 1))]}:25672\""$'\n\n'; done
    WPIDS=()
    for i in 1 2 3; do
        local ip="${WIPS[$((i - 1))]}"
        cat > "$TMPD/warren/node$i.toml" <<EOF
[node]
name = "warren$i@bench"
data_dir = "$TMPD/warren/data$i"

[amqp]
listen = "$ip:5672"

[admin]
listen = "$ip:5679"

[management]
listen = "$ip:15672"

[prometheus]
listen = "$ip:15692"

[cluster]
node_id = $i
cluster_id = "bench-mirrored"
listen = "$ip:25672"
$extra
$members
EOF
        RUST_LOG=info "$WARREN" --config "$TMPD/warren/node$i.toml" > "$OUT/warren-node$i.log" 2>&1 &
        WPIDS+=($!)
    done
    for i in 1 2 3; do
        for _ in $(seq 1 200); do
            wctl "$i" list_vhosts 2>/dev/null | grep -qx '/' && (exec 3<>"/dev/tcp/${WIPS[$((i - 1))]}/5672") 2>/dev/null && break
            sleep 0.1
        done
    done
    sleep 1
    log "warren cluster up: pids ${WPIDS[*]}"
}
warren_down() {
    for p in "${WPIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    for p in "${WPIDS[@]}"; do wait "$p" 2>/dev/null || true; done
    WPIDS=()
}
# "node=N synchronised=true" in node 1's (the master's) log, once per mirror.
warren_synced_count() {
    sed 's/\x1b\[[0-9;]*m//g' "$OUT/warren-node1.log" | grep -c "mirror state recorded.*synchronised=true" || true
}
# The queue's synchronised mirrors in `warrenctl list_queues` (empty if the call fails).
warren_synced_ctl() {
    wctl 1 list_queues name synchronised_slave_pids 2>/dev/null |
        awk -F'\t' -v q="$1" '$1 == q { n = gsub(/warren[0-9]@bench/, "&", $2); print n }'
}

# ---------------------------------------------------------------- RabbitMQ
RNODES=(rabbit1@localhost rabbit2@localhost rabbit3@localhost)
rport() { echo $((5800 + $1)); }
ruri() { echo "amqp://guest:guest@127.0.0.1:$(rport "$1")/%2f"; }
rctl() { local n="$1"; shift; rabbitmqctl -n "${RNODES[$((n - 1))]}" "$@"; }
rmq_env() { # node-number: the environment of that node
    local d="$TMPD/rmq/$1"
    echo RABBITMQ_NODENAME="${RNODES[$(($1 - 1))]}" RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 \
        RABBITMQ_NODE_PORT="$(rport "$1")" RABBITMQ_DIST_PORT=$((25800 + $1)) \
        RABBITMQ_MNESIA_BASE="$d/mnesia" RABBITMQ_LOG_BASE="$d/log" \
        RABBITMQ_ENABLED_PLUGINS_FILE="$TMPD/rmq/enabled_plugins" RABBITMQ_PID_FILE="$d/pid" \
        RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="'-kernel inet_dist_listen_min $((25800 + $1)) -kernel inet_dist_listen_max $((25800 + $1))'"
}
rmq_start_node() {
    mkdir -p "$TMPD/rmq/$1"
    chown -R rabbitmq:rabbitmq "$TMPD/rmq"
    (cd "$TMPD/rmq" && eval "env $(rmq_env "$1") rabbitmq-server -detached")
    for _ in $(seq 1 60); do rctl "$1" status >/dev/null 2>&1 && break; sleep 1; done
    rctl "$1" await_startup --timeout 90 >/dev/null
}
rmq_pid() { cat "$TMPD/rmq/$1/pid"; }
rmq_up() {
    rm -rf "$TMPD/rmq"; mkdir -p "$TMPD/rmq"
    echo "[]." > "$TMPD/rmq/enabled_plugins"
    for i in 1 2 3; do rmq_start_node "$i"; done
    for i in 2 3; do
        rctl "$i" stop_app >/dev/null
        rctl "$i" join_cluster rabbit1@localhost >/dev/null
        rctl "$i" start_app >/dev/null
    done
    rctl 1 cluster_status 2>/dev/null | sed -n '/Running Nodes/,/^$/p'
    log "rabbitmq cluster up: pids $(rmq_pid 1) $(rmq_pid 2) $(rmq_pid 3)"
}
rmq_down() {
    for i in 3 2 1; do
        if [[ -f "$TMPD/rmq/$i/pid" ]]; then
            rctl "$i" stop >/dev/null 2>&1 || kill -9 "$(rmq_pid "$i")" 2>/dev/null || true
        fi
    done
}
rmq_synced_count() {
    rctl 1 list_queues -q --no-table-headers name synchronised_slave_pids 2>/dev/null |
        awk -v q="$1" '$1 == q { n = gsub(/rabbit[0-9]@localhost/, "&"); print n; f = 1 } END { if (!f) print 0 }'
}

cleanup() {
    warren_down
    rmq_down
    rm -rf "$TMPD"
}
trap cleanup EXIT

# ---------------------------------------------------------------- steps
perf_json() { # broker label args...: warren-perf --json, one summary line
    local broker="$1" label="$2"; shift 2
    log "$broker $label: warren-perf $*"
    local rc=0
    "$PERF" "$@" --json 2> "$OUT/$broker-$label.stderr" > "$OUT/$broker-$label.json" || rc=$?
    if [[ $rc -ne 0 ]]; then
        FAILED_RUNS+=("$broker $label (exit $rc, $OUT/$broker-$label.stderr)")
        echo "| $label | $broker | FAILED: warren-perf exit $rc |"
        return
    fi
    python3 - "$OUT/$broker-$label.json" "$broker" "$label" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    print(f"| {sys.argv[3]} | {sys.argv[2]} | no result ({e}) |"); sys.exit()
lat = d.get("latency_us") or {}
cl = d.get("confirm_latency_us") or {}
print(f"| {sys.argv[3]} | {sys.argv[2]} | {d['sent_rate']:.0f} | {d['received_rate']:.0f} | {d['confirmed_rate']:.0f} | "
      f"{lat.get('p50', 0):.0f} | {lat.get('p99', 0):.0f} | {cl.get('p50', 0):.0f} | {cl.get('p99', 0):.0f} |")
PY
}

# broker: prints the table header, starts the cluster with ha-mode all (automatic sync) on
# ^ha\. queues, and sets URI to node 1's.
ha_all_up() {
    echo "| scenario | broker | sent msg/s | received msg/s | confirmed msg/s | latency p50 µs | p99 µs | confirm p50 µs | confirm p99 µs |"
    if [[ $1 == warren ]]; then
        warren_up
        wpolicy ha '^ha\.' '{"ha-mode":"all","ha-sync-mode":"automatic"}' --apply-to queues
        URI="$(wuri 1)"
    else
        rmq_up
        rctl 1 set_policy ha '^ha\.' '{"ha-mode":"all","ha-sync-mode":"automatic"}' --apply-to queues >/dev/null
        URI="$(ruri 1)"
    fi
}

throughput() { # broker
    local b="$1" u
    ha_all_up "$b"
    u="$URI"
    local common=(--uri "$u" --size 1024 --confirm 100 --persistent --duration "$DURATION")
    perf_json "$b" persistent-confirm-1KiB-1p1c "${common[@]}" --producers 1 --consumers 1 --queue ha.tp1
    sleep 2
    perf_json "$b" persistent-confirm-1KiB-4p4c "${common[@]}" --producers 4 --consumers 4 --queue ha.tp4
    # Issue 18's load client: 200 confirms in flight, prefetch 100.
    sleep 2
    perf_json "$b" persistent-confirm200-prefetch100-1KiB-1p1c --uri "$u" --size 1024 --confirm 200 \
        --prefetch 100 --persistent --duration "$DURATION" --producers 1 --consumers 1 --queue ha.tp200
    # Control: the same on an unmirrored durable queue of the same cluster (no policy matches).
    sleep 2
    perf_json "$b" unmirrored-confirm-1KiB-1p1c "${common[@]}" --producers 1 --consumers 1 --queue plain.tp1
    sleep 2
    perf_json "$b" unmirrored-confirm-1KiB-4p4c "${common[@]}" --producers 4 --consumers 4 --queue plain.tp4
    if [[ $b == warren ]]; then
        wctl 2 list_queues name pid slave_pids synchronised_slave_pids messages
        echo "mirror records on the master: $(warren_synced_count) synchronised=true"
        warren_down
    else
        rctl 1 list_queues name pid slave_pids synchronised_slave_pids messages
        rmq_down
    fi
}

large() { # broker: big persistent messages with confirms on a mirrored queue (MB/s = msg/s x size)
    local b="$1" u
    ha_all_up "$b"
    u="$URI"
    local common=(--uri "$u" --persistent --duration "$DURATION" --producers 1 --consumers 1)
    perf_json "$b" persistent-confirm-64KiB-1p1c "${common[@]}" --size $((64 << 10)) --confirm 200 --queue ha.large64
    sleep 2
    perf_json "$b" persistent-confirm-1MiB-1p1c "${common[@]}" --size $((1 << 20)) --confirm 16 --queue ha.large1
    sleep 2
    perf_json "$b" persistent-confirm-16MiB-1p1c "${common[@]}" --size $((16 << 20)) --confirm 4 --queue ha.large16
    if [[ $b == warren ]]; then warren_down; else rmq_down; fi
}

# Starts broker $1 with `^ha\.` queues kept on their master alone; sets URI (node 1).
master_alone_up() {
    if [[ $1 == warren ]]; then
        warren_up
        wpolicy ha '^ha\.' '{"ha-mode":"exactly","ha-params":1}' --apply-to queues
        URI="$(wuri 1)"
    else
        rmq_up
        rctl 1 set_policy ha '^ha\.' '{"ha-mode":"nodes","ha-params":["rabbit1@localhost"]}' --apply-to queues >/dev/null
        URI="$(ruri 1)"
    fi
}

sync_bench() { # broker variant: publish (1 producer during the sync, 3 s before the mirrors
    # are added) or pubsub (1 producer + 1 consumer started as the mirrors are added)
    local b="$1" v="$2" u q=ha.sync
    master_alone_up "$b"
    u="$URI"
    log "$b/$v: publishing $SYNC_COUNT x 64 B persistent messages to $q (master alone)"
    local t0=$SECONDS
    local rc=0
    "$PERF" --uri "$u" --publish-only --queue "$q" --persistent --size 64 --confirm 1000 \
        --count "$SYNC_COUNT" --json 2>/dev/null > "$OUT/$b-sync-$v-fill.json" || rc=$?
    if [[ $rc -ne 0 ]]; then
        FAILED_RUNS+=("$b sync-$v fill (exit $rc)")
        log "$b/$v: FAILED: the fill's warren-perf exited $rc"
        return
    fi
    log "$b/$v: filled in $((SECONDS - t0)) s: $(python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(f\"{d['sent_rate']:.0f} msg/s sent, {d['confirmed_rate']:.0f} confirmed\")" "$OUT/$b-sync-$v-fill.json")"
    if [[ $b == warren ]]; then wctl 1 list_queues name pid slave_pids synchronised_slave_pids messages; else rctl 1 list_queues name pid slave_pids synchronised_slave_pids messages; fi
    local before; before=$( [[ $b == warren ]] && warren_synced_count || echo 0)
    local load=(--producers 1 --consumers 0 --publish-only) lead=3 perf=""
    [[ $v == pubsub ]] && { load=(--producers 1 --consumers 1); lead=0; }
    [[ $v == idle ]] && lead=0
    if [[ $v != idle ]]; then
        "$PERF" --uri "$u" --queue "$q" --persistent --size 64 --confirm 100 "${load[@]}" \
            --duration 60 --json 2> "$OUT/$b-sync-$v-load.stderr" > "$OUT/$b-sync-$v-load.json" &
        perf=$!
    fi
    sleep "$lead"
    log "$b/$v: mirrors added (ha-mode all, automatic sync), $lead s into warren-perf"
    local start; start=$(date +%s.%N)
    if [[ $b == warren ]]; then
        wpolicy ha '^ha\.' '{"ha-mode":"all","ha-sync-mode":"automatic"}' --apply-to queues
    else
        rctl 1 set_policy ha '^ha\.' '{"ha-mode":"all","ha-sync-mode":"automatic"}' --apply-to queues >/dev/null
    fi
    local done_at=""
    while [[ -z "$done_at" ]]; do
        local n
        if [[ $b == warren ]]; then
            # warrenctl's synchronised_slave_pids; the master's log lines if the call fails.
            n=$(warren_synced_ctl "$q")
            [[ -n "$n" ]] || n=$(($(warren_synced_count) - before))
        else
            n=$(rmq_synced_count "$q")
        fi
        if [[ $n -ge 2 ]]; then done_at=$(date +%s.%N); break; fi
        if (( $(date +%s) - ${start%.*} > 600 )); then log "$b/$v: not synchronised after 600 s"; break; fi
        sleep 0.2
    done
    [[ -n "$done_at" ]] && log "$b/$v: both mirrors synchronised $(python3 -c "print(f'{$done_at - $start:.2f}')") s after the policy change"
    if [[ $b == warren ]]; then wctl 1 list_queues name pid slave_pids synchronised_slave_pids messages; else rctl 1 list_queues name pid slave_pids synchronised_slave_pids messages; fi
    if [[ -n "$perf" ]]; then
        local prc=0
        wait "$perf" || prc=$?
        [[ $prc == 0 ]] || FAILED_RUNS+=("$b sync-$v load (exit $prc, $OUT/$b-sync-$v-load.stderr)")
        echo "warren-perf per-second lines (mirrors added $lead s in):"
        cut -d, -f1-5 "$OUT/$b-sync-$v-load.stderr"
    fi
    if [[ $b == warren ]]; then
        sed 's/\x1b\[[0-9;]*m//g' "$OUT"/warren-node*.log | grep -E "mirror sync|mirror holds|mirror state recorded" || true
        wctl 1 list_queues name pid slave_pids synchronised_slave_pids messages
        warren_down
    else
        rctl 1 list_queues name pid slave_pids synchronised_slave_pids messages
        grep -h -i -E "synchronis" "$TMPD"/rmq/*/log/*.log | tail -20 || true
        rmq_down
    fi
}

# How many mirrors (synchronised or not) list_queues shows for queue $2 on broker $1.
mirror_count() {
    if [[ $1 == warren ]]; then
        wctl 1 list_queues name slave_pids 2>/dev/null |
            awk -F'\t' -v q="$2" '$1 == q { n = gsub(/warren[0-9]@bench/, "&", $2); print n; f = 1 } END { if (!f) print 0 }'
    else
        rctl 1 list_queues -q --no-table-headers name slave_pids 2>/dev/null |
            awk -v q="$2" '$1 == q { n = gsub(/rabbit[0-9]@localhost/, "&"); print n; f = 1 } END { if (!f) print 0 }'
    fi
}

manual_sync_bench() { # broker: issue 18's sync without stalls. A queue of SYNC_COUNT x 1 KiB
    # persistent messages on its master alone gets a second, unsynchronised mirror
    # (exactly 2, manual sync); a probe publisher sends 200 msg/s with one confirm in
    # flight; then `sync_queue`. Prints the time from the command to the mirror listed
    # synchronised, and the probe's confirm latency (p50 / p99 / worst) over its run.
    local b="$1" u q=ha.msync probe_secs=${MSYNC_PROBE_SECS:-60}
    master_alone_up "$b"
    u="$URI"
    log "$b/manual-sync: publishing $SYNC_COUNT x 1 KiB persistent messages to $q (master alone)"
    local t0=$SECONDS rc=0
    "$PERF" --uri "$u" --publish-only --queue "$q" --persistent --size 1024 --confirm 1000 \
        --count "$SYNC_COUNT" --json 2>/dev/null > "$OUT/$b-msync-fill.json" || rc=$?
    if [[ $rc -ne 0 ]]; then
        FAILED_RUNS+=("$b manual-sync fill (exit $rc)")
        log "$b/manual-sync: FAILED: the fill's warren-perf exited $rc"
        if [[ $b == warren ]]; then warren_down; else rmq_down; fi
        return
    fi
    log "$b/manual-sync: filled in $((SECONDS - t0)) s"
    if [[ $b == warren ]]; then
        wpolicy ha '^ha\.' '{"ha-mode":"exactly","ha-params":2,"ha-sync-mode":"manual"}' --apply-to queues
    else
        rctl 1 set_policy ha '^ha\.' '{"ha-mode":"exactly","ha-params":2,"ha-sync-mode":"manual"}' --apply-to queues >/dev/null
    fi
    local waited=0
    until [[ $(mirror_count "$b" "$q") -ge 1 ]]; do
        sleep 0.2; waited=$((waited + 1))
        if [[ $waited -gt 300 ]]; then
            FAILED_RUNS+=("$b manual-sync: no mirror listed 60 s after the policy change")
            if [[ $b == warren ]]; then warren_down; else rmq_down; fi
            return
        fi
    done
    if [[ $b == warren ]]; then wctl 1 list_queues name pid slave_pids synchronised_slave_pids messages; else rctl 1 list_queues name pid slave_pids synchronised_slave_pids messages; fi
    "$PERF" --uri "$u" --queue "$q" --persistent --size 1024 --confirm 1 --rate 200 --publish-only \
        --producers 1 --duration "$probe_secs" --json 2> "$OUT/$b-msync-probe.stderr" > "$OUT/$b-msync-probe.json" &
    local probe=$!
    sleep 3
    log "$b/manual-sync: sync_queue $q, 3 s into the probe"
    local start; start=$(date +%s.%N)
    if [[ $b == warren ]]; then wctl 1 sync_queue "$q" & else rctl 1 sync_queue "$q" & fi
    local syncer=$! done_at=""
    while [[ -z "$done_at" ]]; do
        local n
        if [[ $b == warren ]]; then n=$(warren_synced_ctl "$q"); else n=$(rmq_synced_count "$q"); fi
        if [[ ${n:-0} -ge 1 ]]; then done_at=$(date +%s.%N); break; fi
        if (( $(date +%s) - ${start%.*} > 600 )); then log "$b/manual-sync: not synchronised after 600 s"; break; fi
        sleep 0.2
    done
    local src=0
    wait "$syncer" || src=$?
    [[ $src == 0 ]] || FAILED_RUNS+=("$b manual-sync: sync_queue exited $src")
    if [[ -n "$done_at" ]]; then
        log "$b/manual-sync: mirror synchronised $(python3 -c "print(f'{$done_at - $start:.2f}')") s after sync_queue"
        python3 -c "print(f'{$done_at - $start:.3f}')" > "$OUT/$b-msync.seconds"
    else
        FAILED_RUNS+=("$b manual-sync: the mirror was not synchronised")
    fi
    local prc=0
    wait "$probe" || prc=$?
    if [[ $prc != 0 ]]; then
        FAILED_RUNS+=("$b manual-sync probe (exit $prc, $OUT/$b-msync-probe.stderr)")
    else
        python3 - "$OUT/$b-msync-probe.json" "$b" "$probe_secs" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
c = d.get("confirm_latency_us") or {}
print(f"{sys.argv[2]}/manual-sync probe ({sys.argv[3]} s at 200 msg/s, 1 in flight): "
      f"{d['confirmed_rate']:.0f} confirmed msg/s, confirm p50 {c.get('p50', 0) / 1000:.1f} ms, "
      f"p99 {c.get('p99', 0) / 1000:.1f} ms, worst {c.get('max', 0) / 1000:.1f} ms")
PY
        echo "probe per-second lines (sync_queue 3 s in):"
        cut -d, -f1-5 "$OUT/$b-msync-probe.stderr"
    fi
    if [[ $b == warren ]]; then wctl 1 list_queues name pid slave_pids synchronised_slave_pids messages; warren_down
    else rctl 1 list_queues name pid slave_pids synchronised_slave_pids messages; rmq_down; fi
}

# Starts node N of the running Warren cluster again (after warren_up; its log appended).
warren_start_node() {
    RUST_LOG=info "$WARREN" --config "$TMPD/warren/node$1.toml" >> "$OUT/warren-node$1.log" 2>&1 &
    WPIDS[$(($1 - 1))]=$!
}

resync_bench() { # issue 16: a restarted mirror with its copy kept, then with it removed
    local q=ha.resync fails=0
    warren_up
    wpolicy ha '^ha\.' '{"ha-mode":"all","ha-sync-mode":"automatic"}' --apply-to queues
    log "resync: publishing $SYNC_COUNT x 1 KiB persistent messages to $q (mirrored on all three)"
    if ! "$PERF" --uri "$(wuri 1)" --publish-only --queue "$q" --persistent --size 1024 --confirm 1000 \
        --count "$SYNC_COUNT" --json 2>/dev/null > "$OUT/warren-resync-fill.json"; then
        log "resync: FAILED: the fill did not complete"; warren_down; return 1
    fi
    wctl 1 list_queues name pid synchronised_slave_pids messages
    echo "| mirror's copy | missed while down | start to serving s | start to synchronised s | master sent (messages) |"
    echo "|---|---|---|---|---|"
    for mode in kept removed; do
        kill -9 "${WPIDS[2]}"; wait "${WPIDS[2]}" 2>/dev/null || true
        if ! "$PERF" --uri "$(wuri 1)" --publish-only --queue "$q" --persistent --size 1024 --confirm 1000 \
            --count 10000 --json 2>/dev/null > "$OUT/warren-resync-$mode-missed.json"; then
            log "resync/$mode: FAILED: publishing while the mirror was down"; fails=$((fails + 1)); continue
        fi
        if [[ $mode == removed ]]; then
            local dir
            dir=$(dirname "$(grep -l "$q" "$TMPD"/warren/data3/queues/*/queue.name)")
            rm -rf "$dir"
        fi
        local before; before=$(grep -c "mirror sync copied the backlog" "$OUT/warren-node1.log" || true)
        local start; start=$(date +%s.%N)
        warren_start_node 3
        local serving="" synced=""
        while [[ -z "$synced" ]]; do
            if [[ -z "$serving" ]] && (exec 3<>"/dev/tcp/${WIPS[2]}/5672") 2>/dev/null; then serving=$(date +%s.%N); fi
            [[ "$(warren_synced_ctl "$q")" == 2 ]] && synced=$(date +%s.%N)
            if (( $(date +%s) - ${start%.*} > 600 )); then break; fi
            sleep 0.05
        done
        if [[ -z "$synced" ]]; then
            log "resync/$mode: FAILED: not synchronised 600 s after the start"; fails=$((fails + 1)); continue
        fi
        # The master's log line of this sync (its count of messages sent with bodies).
        local copied=""
        for _ in $(seq 1 50); do
            copied=$(sed 's/\x1b\[[0-9;]*m//g' "$OUT/warren-node1.log" | grep "mirror sync copied the backlog" | tail -n +"$((before + 1))" | grep -o 'copied=[0-9]*' | tail -1)
            [[ -n "$copied" ]] && break; sleep 0.1
        done
        echo "| $mode | 10000 | $(python3 -c "print(f'{${serving:-$start} - $start:.2f}')") | $(python3 -c "print(f'{$synced - $start:.2f}')") | ${copied#copied=} |"
    done
    sed 's/\x1b\[[0-9;]*m//g' "$OUT/warren-node3.log" | grep -E "kept|mirror sync|mirror holds" || true
    wctl 1 list_queues name pid synchronised_slave_pids messages
    warren_down
    [[ $fails == 0 ]]
}

failover_rabbitmq() { # [--stop | --reconnect]: SIGTERM instead of SIGKILL, or the publisher
    # on the master's node (its connection drops: it reconnects to the next node)
    local stop=() reconnect=0
    case "${1:-}" in --stop) stop=(--stop) ;; --reconnect) reconnect=1 ;; esac
    rmq_up
    rctl 1 set_policy ha '^ha\.' '{"ha-mode":"all","ha-sync-mode":"automatic"}' --apply-to queues >/dev/null
    local bench
    bench=$(cargo bench --bench mirrored --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json,sys
for l in sys.stdin:
    d = json.loads(l)
    if d.get("reason") == "compiler-artifact" and d.get("target", {}).get("name") == "mirrored" and d.get("executable"):
        print(d["executable"])')
    for run in 1 2 3; do
        # Where the master is: the node in the queue's pid (declared on node 1 the first time).
        local master=1
        if rctl 1 list_queues -q --no-table-headers name pid 2>/dev/null | grep -q '^ha.failover'; then
            master=$(rctl 1 list_queues -q --no-table-headers name pid | awk '$1 == "ha.failover" { print $2 }' | sed -E 's/.*rabbit([0-9])@.*/\1/')
        fi
        local other=$(( master % 3 + 1 )) old
        old=$(rmq_pid "$master")
        local uris
        uris="$(ruri "$other")"
        if [[ $reconnect == 1 ]]; then
            uris="$(ruri "$master"),$(ruri "$other")"
            log "rabbitmq failover run $run: master on rabbit$master (os pid $old), publisher on it, reconnecting to rabbit$other"
        else
            log "rabbitmq failover run $run: master on rabbit$master (os pid $old), publisher on rabbit$other"
        fi
        "$bench" --external --declare-uri "$(ruri "$master")" --uri "$uris" \
            --queue ha.failover --kill-pid "$old" "${stop[@]}"
        rctl "$other" list_queues name pid slave_pids synchronised_slave_pids messages
        # Bring the killed node back (it rejoins as a mirror) for the next run.
        # (A controlled stop removes the pid file; wait for the process itself.)
        for _ in $(seq 1 100); do kill -0 "$old" 2>/dev/null || break; sleep 0.2; done
        rm -f "$TMPD/rmq/$master/pid"
        rmq_start_node "$master"
        sleep 5
    done
    rmq_down
}

# CPU ticks (utime + stime, every thread) of the given pids, summed.
cpu_ticks() {
    local t=0 p f
    for p in "$@"; do
        f=$(sed 's/^.*) //' "/proc/$p/stat") || { echo "no /proc/$p/stat" >&2; return 1; }
        # Fields after the command: state is 1, utime 12, stime 13.
        t=$((t + $(echo "$f" | awk '{print $12 + $13}')))
    done
    echo "$t"
}

cpu_bench() { # broker: CPU at fixed rates, then flat out
    local b="$1" pids rate t0 t1 s0 s1
    ha_all_up "$b" > /dev/null
    if [[ $b == warren ]]; then pids=("${WPIDS[@]}"); else pids=($(rmq_pid 1) $(rmq_pid 2) $(rmq_pid 3)); fi
    local hz; hz=$(getconf CLK_TCK)
    echo "| broker | rate msg/s | confirmed msg/s | broker CPU, cores (3 nodes) | CPU µs per message | confirm p50 µs | confirm p99 µs |"
    echo "|---|---:|---:|---:|---:|---:|---:|"
    for rate in 100 1000 10000 0; do
        local json="$OUT/$b-cpu-$rate.json"
        s0=$(cpu_ticks "${pids[@]}"); t0=$(date +%s.%N)
        local rc=0
        "$PERF" --uri "$URI" --size 1024 --confirm 200 --persistent --duration "$DURATION" \
            --producers 1 --consumers 1 --queue "ha.cpu$rate" --rate "$rate" --json \
            > "$json" 2> "$OUT/$b-cpu-$rate.stderr" || rc=$?
        if [[ $rc != 0 ]]; then
            echo "| $b | $rate | FAILED: warren-perf exited $rc (see $OUT/$b-cpu-$rate.stderr) |"
            continue
        fi
        s1=$(cpu_ticks "${pids[@]}"); t1=$(date +%s.%N)
        python3 - "$json" "$b" "$rate" "$((s1 - s0))" "$hz" "$t0" "$t1" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
b, rate, ticks, hz, t0, t1 = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6]), float(sys.argv[7])
cpu_s = ticks / hz
wall = t1 - t0
confirmed = d["confirmed_rate"] * d.get("duration_s", wall)
cl = d.get("confirm_latency_us") or {}
per = cpu_s / confirmed * 1e6 if confirmed else float("nan")
print(f"| {b} | {rate or 'flat out'} | {d['confirmed_rate']:.0f} | {cpu_s / wall:.3f} | {per:.0f} | {cl.get('p50', 0):.0f} | {cl.get('p99', 0):.0f} |")
json.dump({"rate": rate, "confirmed_rate": d["confirmed_rate"], "cores": cpu_s / wall, "us_per_msg": per,
           "confirm_p50_us": cl.get("p50", 0), "confirm_p99_us": cl.get("p99", 0)},
          open(sys.argv[1][:-5] + ".result.json", "w"))
PY
        sleep 2
    done
    if [[ $b == warren ]]; then warren_down; else rmq_down; fi
}

# Resident memory (KiB) of the given pids, summed.
rss_kib() {
    local t=0 p
    for p in "$@"; do t=$((t + $(awk '/^VmRSS/ {print $2}' "/proc/$p/status"))); done
    echo "$t"
}

many_bench() { # broker: 1,000 mirrored queues, idle and then under 100 producers and 100 consumers
    local b="$1" pids u1 u2 u3 rc=0
    ha_all_up "$b"
    if [[ $b == warren ]]; then
        pids=("${WPIDS[@]}"); u1="$(wuri 1)"; u2="$(wuri 2)"; u3="$(wuri 3)"
    else
        pids=($(rmq_pid 1) $(rmq_pid 2) $(rmq_pid 3)); u1="$(ruri 1)"; u2="$(ruri 2)"; u3="$(ruri 3)"
    fi
    local before; before=$(rss_kib "${pids[@]}")
    local t0=$SECONDS
    # Declares ha.many-1..ha.many-1000 through the three nodes in turn (one message to the first).
    "$PERF" --uri "$u1" --uri "$u2" --uri "$u3" --queue ha.many --queues 1000 --persistent \
        --publish-only --producers 1 --count 1 --json > "$OUT/$b-many-declare.json" 2> "$OUT/$b-many-declare.stderr" || rc=$?
    if [[ $rc != 0 ]]; then
        echo "many-$b: FAILED: declaring 1,000 queues: warren-perf exited $rc (see $OUT/$b-many-declare.stderr)"
        if [[ $b == warren ]]; then warren_down; else rmq_down; fi
        return
    fi
    log "$b: 1,000 queues declared in $((SECONDS - t0)) s"
    local synced=0
    for _ in $(seq 1 120); do
        if [[ $b == warren ]]; then
            synced=$(wctl 1 list_queues name synchronised_slave_pids 2>/dev/null | awk -F'\t' '$1 ~ /^ha\.many-/ && gsub(/warren[0-9]@bench/, "&", $2) == 2' | wc -l)
        else
            synced=$(rctl 1 list_queues -q --no-table-headers name synchronised_slave_pids 2>/dev/null | awk '$1 ~ /^ha\.many-/ && gsub(/rabbit[0-9]@localhost/, "&") == 2' | wc -l)
        fi
        [[ $synced -ge 1000 ]] && break
        sleep 1
    done
    local after; after=$(rss_kib "${pids[@]}")
    echo "many-$b: $synced of 1,000 queues with both mirrors synchronised after $((SECONDS - t0)) s; RSS of the 3 nodes $((before / 1024)) MiB before, $((after / 1024)) MiB after: $(( (after - before) / 1000 )) KiB per idle mirrored queue (master and 2 mirrors)"
    echo "{\"synced\": $synced, \"rss_before_kib\": $before, \"rss_after_kib\": $after}" > "$OUT/$b-many-idle.result.json"
    # The nodes' RSS every 5 s under the load: a growth that settles is a cache, one that
    # does not is a leak.
    ( while sleep 5; do echo -n "$(( $(rss_kib "${pids[@]}" 2>/dev/null || echo 0) / 1024 )) "; done ) > "$OUT/$b-many-rss" &
    local sampler=$!
    perf_json "$b" many-1000q-100p100c --uri "$u1" --uri "$u2" --uri "$u3" --queue ha.many --queues 1000 \
        --producers 100 --consumers 100 --size 1024 --confirm 50 --persistent --duration "$DURATION" --threads 2
    # The sampler ends by this kill: its exit status says nothing about the run.
    kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null || :
    echo "many-$b: RSS of the 3 nodes every 5 s from the load's start, MiB: $(cat "$OUT/$b-many-rss")"
    echo "many-$b: RSS of the 3 nodes at the end of the load: $(( $(rss_kib "${pids[@]}") / 1024 )) MiB"
    if [[ $b == warren ]]; then warren_down; else rmq_down; fi
}

# Runs of the load tool that failed: reported at the end, and the script exits 1.
FAILED_RUNS=()
for step in "${STEPS[@]}"; do
    log "=== $step"
    case "$step" in
        throughput-warren) throughput warren ;;
        throughput-rabbitmq) throughput rabbitmq ;;
        large-warren) large warren ;;
        large-rabbitmq) large rabbitmq ;;
        sync-warren) sync_bench warren publish; sync_bench warren pubsub ;;
        sync-rabbitmq) sync_bench rabbitmq publish; sync_bench rabbitmq pubsub ;;
        sync-*-publish|sync-*-pubsub|sync-*-idle) b="${step#sync-}"; sync_bench "${b%-*}" "${b##*-}" ;;
        manual-sync-warren) manual_sync_bench warren ;;
        manual-sync-rabbitmq) manual_sync_bench rabbitmq ;;
        failover-warren)
            # Master on node 1 (also the Raft leader), then on node 2 (a Raft follower).
            for m in 1 2; do
                cargo bench --bench mirrored -- --runs 3 --master "$m"
                cargo bench --bench mirrored -- --runs 3 --master "$m" --peer-timeout-ms 1000 --heartbeat-ms 100
            done ;;
        failover-rabbitmq) failover_rabbitmq ;;
        resync-warren) resync_bench ;;
        failover-warren-stop)
            for m in 1 2; do cargo bench --bench mirrored -- --runs 3 --master "$m" --stop; done ;;
        failover-rabbitmq-stop) failover_rabbitmq --stop ;;
        failover-rabbitmq-reconnect) failover_rabbitmq --reconnect ;;
        cpu-warren) cpu_bench warren ;;
        cpu-rabbitmq) cpu_bench rabbitmq ;;
        many-warren) many_bench warren ;;
        many-rabbitmq) many_bench rabbitmq ;;
    esac
done
if [[ ${#FAILED_RUNS[@]} -gt 0 ]]; then
    log "FAILED runs: ${#FAILED_RUNS[@]}"
    printf '  %s\n' "${FAILED_RUNS[@]}" >&2
    exit 1
fi
