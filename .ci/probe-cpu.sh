#!/usr/bin/env bash
# Where a mirrored queue's CPU goes at a fixed rate (issue 18, docs/performance.md "CPU at
# everyday rates"): starts a 3-node Warren cluster (release binaries in BINDIR: warren,
# warrenctl, warren-perf) on 127.0.89.{1,2,3} with ha-mode all, runs warren-perf (1 KiB
# persistent, confirms 200, 1p1c on node 1) at RATE msg/s (0: flat out) for SECONDS, and
# prints each node's CPU ticks, syscalls and context switches (perf stat) over 5 s in the
# middle. Not part of CI; needs perf and root. KEEP=1 keeps the run's folder.
#
#   bash .ci/probe-cpu.sh target/release 1000 21
set -u
[[ $# == 3 ]] || { sed -n '2,9p' "$0" >&2; exit 2; }
BIN=$1; RATE=$2; SECS=$3
WIPS=(127.0.89.1 127.0.89.2 127.0.89.3)
T=$(mktemp -d /tmp/cpulab-run.XXXX)
members=""; for i in 1 2 3; do members+=$'[[cluster.initial_members]]\n'"id = $i"$'\n'"link = \"${WIPS[$((i-1))]}:25672\""$'\n\n'; done
PIDS=()
cleanup() { kill "${PIDS[@]}" 2>/dev/null; wait "${PIDS[@]}" 2>/dev/null; [[ -n "${KEEP:-}" ]] || rm -rf "$T"; }
trap cleanup EXIT
for i in 1 2 3; do ip=${WIPS[$((i-1))]}; cat > $T/node$i.toml <<EOT
[node]
name = "warren$i@lab"
data_dir = "$T/data$i"
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
cluster_id = "lab"
listen = "$ip:25672"
$members
EOT
RUST_LOG=info $BIN/warren --config $T/node$i.toml > $T/node$i.log 2>&1 & PIDS+=($!); done
for i in 1 2 3; do for _ in $(seq 1 200); do $BIN/warrenctl --node ${WIPS[$((i-1))]}:5679 list_vhosts 2>/dev/null | grep -qx / && break; sleep 0.1; done; done
sleep 1
for _ in $(seq 1 20); do $BIN/warrenctl --node ${WIPS[0]}:5679 set_policy ha '^ha\.' '{"ha-mode":"all","ha-sync-mode":"automatic"}' --apply-to queues >/dev/null && break; sleep 0.5; done
$BIN/warren-perf --uri amqp://guest:guest@${WIPS[0]}:5672/%2f --size 1024 --confirm 200 --persistent --duration $SECS --producers 1 --consumers 1 --queue ha.lab --rate $RATE --json > $T/perf.json 2>$T/perf.err &
PP=$!
sleep $((SECS/3))
ticks() { for p in "${PIDS[@]}"; do awk '{printf "%d ", $14+$15}' /proc/$p/stat; done; }
a=$(ticks)
SP=()
for p in "${PIDS[@]}"; do perf stat -e 'syscalls:sys_enter_fdatasync,syscalls:sys_enter_futex,syscalls:sys_enter_epoll_wait,syscalls:sys_enter_write,syscalls:sys_enter_sendto,syscalls:sys_enter_recvfrom,context-switches' -p $p -o $T/stat$p -- sleep 5 & SP+=($!); done
wait "${SP[@]}"
b=$(ticks)
echo "ticks over ~5 s: before $a after $b"
for p in "${PIDS[@]}"; do echo "pid $p:"; grep -E "syscalls|context" $T/stat$p | awk '{printf "  %s %.0f/s\n", $2, $1/5}'; done
rc=0; wait $PP || rc=$?
[[ $rc == 0 ]] || { echo "warren-perf FAILED (exit $rc): $(tail -3 $T/perf.err)"; exit 1; }
python3 -c "import json; d=json.load(open('$T/perf.json')); print('confirmed', d['confirmed_rate'], 'confirm lat', d.get('confirm_latency_us'))"
[[ -n "${KEEP:-}" ]] && echo "kept: $T"
