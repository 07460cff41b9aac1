#!/usr/bin/env bash
# Forwarded publishes (issue 17: the relay's throughput before and after a change): a 3-node
# Warren cluster from BINDIR (warren, warrenctl, warren-perf) on 127.0.89.{1,2,3}, ha-mode all,
# the durable queue ha.fwd declared through node 1 (its master), one producer on node 2 (every
# publish forwarded by the relay; 1 KiB persistent, confirms 200) and one consumer on node 1
# (prefetch 100); prints confirmed msg/s and confirm p99 (µs). Not part of CI. Alternate two
# binaries for an A/B:
#
#   for r in 1 2; do for b in /tmp/old /tmp/new; do bash .ci/bench-forward.sh $b 15; done; done
set -u
[[ $# -ge 1 ]] || { sed -n "2,10p" "$0" >&2; exit 2; }
BIN=$1; SECS=${2:-15}
WIPS=(127.0.89.1 127.0.89.2 127.0.89.3)
T=$(mktemp -d /tmp/abfwd.XXXX)
members=""; for i in 1 2 3; do members+=$'[[cluster.initial_members]]\n'"id = $i"$'\n'"link = \"${WIPS[$((i-1))]}:25672\""$'\n\n'; done
PIDS=()
cleanup() { kill "${PIDS[@]}" 2>/dev/null; wait "${PIDS[@]}" 2>/dev/null; rm -rf "$T"; }
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
RUST_LOG=warn $BIN/warren --config $T/node$i.toml > $T/node$i.log 2>&1 & PIDS+=($!); done
for i in 1 2 3; do for _ in $(seq 1 200); do $BIN/warrenctl --node ${WIPS[$((i-1))]}:5679 list_vhosts 2>/dev/null | grep -qx / && break; sleep 0.1; done; done
for _ in $(seq 1 20); do $BIN/warrenctl --node ${WIPS[0]}:5679 set_policy ha '^ha\.' '{"ha-mode":"all","ha-sync-mode":"automatic"}' --apply-to queues >/dev/null && break; sleep 0.5; done
$BIN/warren-perf --uri amqp://guest:guest@${WIPS[0]}:5672/%2f --queue ha.fwd --persistent --publish-only --count 1 --confirm 1 >/dev/null 2>&1 || { echo "declare FAILED"; exit 1; }
$BIN/warren-perf --uri amqp://guest:guest@${WIPS[1]}:5672/%2f --consumer-uri amqp://guest:guest@${WIPS[0]}:5672/%2f --size 1024 --confirm 200 --prefetch 100 --persistent --duration $SECS --queue ha.fwd --json > $T/perf.json 2>$T/perf.err
rc=$?
[[ $rc == 0 ]] || { echo "warren-perf FAILED (exit $rc): $(tail -3 $T/perf.err)"; exit 1; }
python3 -c "import json; d=json.load(open('$T/perf.json')); l=d.get('confirm_latency_us'); print('confirmed_msg_per_s', d['confirmed_rate'], 'confirm_p99_us', l.get('p99') if isinstance(l, dict) else l)"
