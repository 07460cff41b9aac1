#!/usr/bin/env bash
# The cost of [cluster.tls]: a mirrored queue (ha-mode all, automatic sync) on a 3-node
# cluster of release `warren` processes (127.0.89.{1,2,3}), with plaintext node links and
# with mutual-TLS node links, alternating, ROUNDS times each. warren-perf runs 1 producer
# and 1 consumer (manual acks) on node 1, the queue's master, with 1 KiB bodies and
# publisher confirms (100 in flight): everything the mirrors get crosses the node links.
# Scenarios: transient messages, and persistent ones (durable queue, delivery_mode 2).
# Not part of CI.
#
#   bash .ci/bench-node-tls.sh [--no-build] [--duration S] [--rounds N]
#
# Certificates come from .ci/make-certs.sh --nodes (EC P-256). Every run must succeed and
# confirm something, and every node must still run after it; otherwise the script stops
# with an error and prints no table. Results: .ci/work/bench-node-tls/*.json, table.md.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$ROOT/.ci/work/bench-node-tls"
DURATION=10
ROUNDS=2
NO_BUILD=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --duration) DURATION="$2"; shift ;;
        --rounds) ROUNDS="$2"; shift ;;
        --no-build) NO_BUILD=1 ;;
        *) sed -n '2,14p' "$0" >&2; exit 2 ;;
    esac
    shift
done
cd "$ROOT"
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
if [[ $NO_BUILD == 0 ]]; then
    cargo build --release --bin warren --bin warren-perf --bin warrenctl
fi
PERF="$TARGET/release/warren-perf"
WARREN="$TARGET/release/warren"
CTL="$TARGET/release/warrenctl"
rm -rf "$OUT"
mkdir -p "$OUT"
TMPD="$(mktemp -d /tmp/bench-node-tls.XXXXXX)"
IPS=(127.0.89.1 127.0.89.2 127.0.89.3)
PIDS=()

log() { echo "[$(date -u +%H:%M:%S)] $* (load: $(cut -d' ' -f1-3 /proc/loadavg))"; }
die() { echo "bench-node-tls: $*" >&2; exit 1; }
cluster_down() {
    for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
    PIDS=()
}
cleanup() { cluster_down; rm -rf "$TMPD"; }
trap cleanup EXIT

bash "$ROOT/.ci/make-certs.sh" "$TMPD/certs" --nodes "$(IFS=,; echo "${IPS[*]}")" >/dev/null
ctl() { local n="$1"; shift; "$CTL" --node "${IPS[$((n - 1))]}:5679" "$@"; }

cluster_up() { # plain|tls
    local mode="$1" members="" i ip
    rm -rf "$TMPD/nodes"; mkdir -p "$TMPD/nodes"
    for i in 1 2 3; do members+=$'[[cluster.initial_members]]\n'"id = $i"$'\n'"link = \"${IPS[$((i - 1))]}:25672\""$'\n\n'; done
    for i in 1 2 3; do
        ip="${IPS[$((i - 1))]}"
        cat > "$TMPD/nodes/node$i.toml" <<EOF
[node]
name = "warren$i@bench"
data_dir = "$TMPD/nodes/data$i"

[amqp]
listen = "$ip:5672"

[admin]
listen = "$ip:5679"

[management]
listen = ""

[prometheus]
listen = ""

[cluster]
node_id = $i
cluster_id = "bench-node-tls"
listen = "$ip:25672"

$members
EOF
        if [[ $mode == tls ]]; then
            cat >> "$TMPD/nodes/node$i.toml" <<EOF
[cluster.tls]
certfile = "$TMPD/certs/node-${ip}_certificate.pem"
keyfile = "$TMPD/certs/node-${ip}_key.pem"
cacertfile = "$TMPD/certs/ca_certificate.pem"
EOF
        fi
        RUST_LOG=info "$WARREN" --config "$TMPD/nodes/node$i.toml" > "$OUT/$mode-node$i.log" 2>&1 &
        PIDS+=($!)
    done
    # Serving: its AMQP port is open (it opens once the node has caught up) and the admin
    # endpoint lists the vhost. (Not `grep -q`: with pipefail, warrenctl's SIGPIPE after an
    # early match would count as a failure.)
    for i in 1 2 3; do
        ip="${IPS[$((i - 1))]}" up=0
        for _ in $(seq 1 300); do
            if (exec 3<>"/dev/tcp/$ip/5672") 2>/dev/null && ctl "$i" list_vhosts 2>/dev/null | grep -x '/' >/dev/null; then
                up=1; break
            fi
            sleep 0.1
        done
        [[ $up == 1 ]] || { tail -20 "$OUT/$mode-node$i.log" >&2; die "$mode node $i did not start"; }
    done
    # A metadata command can meet a leader change under load; setting it again is harmless.
    local ok=0
    for _ in $(seq 1 20); do
        ctl 1 set_policy ha '^ha\.' '{"ha-mode":"all","ha-sync-mode":"automatic"}' --apply-to queues >/dev/null 2>>"$OUT/ctl.err" && { ok=1; break; }
        sleep 0.5
    done
    [[ $ok == 1 ]] || die "set_policy failed on the $mode cluster"
    if [[ $mode == tls ]]; then
        sed 's/\x1b\[[0-9;]*m//g' "$OUT/tls-node1.log" | grep 'link up.*tls=true' >/dev/null || die "the TLS cluster's node 1 logged no TLS link"
    fi
    log "$mode cluster up: pids ${PIDS[*]}"
}

# name | warren-perf arguments (each run gets a fresh queue name)
SCENARIOS=(
    "transient|--producers 1 --consumers 1 --size 1024 --confirm 100"
    "persistent|--producers 1 --consumers 1 --size 1024 --confirm 100 --persistent"
)
for round in $(seq 1 "$ROUNDS"); do
    for mode in plain tls; do
        cluster_up "$mode"
        for s in "${SCENARIOS[@]}"; do
            name="${s%%|*}" args="${s#*|}"
            file="$OUT/$name-$mode-$round.json"
            uri="amqp://guest:guest@${IPS[0]}:5672/%2f"
            log "round $round, $name, $mode links: warren-perf --uri $uri $args --queue ha.$name.$round --duration $DURATION"
            # shellcheck disable=SC2086
            if ! "$PERF" --uri "$uri" $args --queue "ha.$name.$round" --duration "$DURATION" --json > "$file" 2> "$OUT/$name-$mode-$round.err"; then
                tail -5 "$OUT/$name-$mode-$round.err" >&2
                die "the run failed ($name, $mode, round $round)"
            fi
            for p in "${PIDS[@]}"; do kill -0 "$p" 2>/dev/null || die "a node died during $name, $mode, round $round"; done
            # The mirrors really were there: two synchronised mirrors of the queue.
            synced=$(ctl 1 list_queues name synchronised_slave_pids 2>/dev/null |
                awk -F'\t' -v q="ha.$name.$round" '$1 == q { print gsub(/warren[0-9]@bench/, "&", $2) }')
            [[ "$synced" == 2 ]] || die "ha.$name.$round has ${synced:-no} synchronised mirrors ($mode)"
            sleep 1
        done
        cluster_down
    done
done

python3 - "$OUT" "$ROUNDS" <<'PY'
import json, os, sys
out, rounds = sys.argv[1], int(sys.argv[2])
lines = ["| scenario | node links | round | sent msg/s | received msg/s | confirmed msg/s | latency p50 µs | p99 µs | confirm p99 µs |",
         "|---|---|---|---|---|---|---|---|---|"]
means = {}
for name in ("transient", "persistent"):
    for mode in ("plain", "tls"):
        for r in range(1, rounds + 1):
            d = json.load(open(os.path.join(out, f"{name}-{mode}-{r}.json")))
            if not d.get("confirmed_rate"):
                sys.exit(f"bench-node-tls: {name} {mode} round {r} confirmed nothing")
            lat, cl = d.get("latency_us") or {}, d.get("confirm_latency_us") or {}
            lines.append(f"| {name} | {mode} | {r} | {d['sent_rate']:.0f} | {d['received_rate']:.0f} | "
                         f"{d['confirmed_rate']:.0f} | {lat.get('p50', 0):.0f} | {lat.get('p99', 0):.0f} | {cl.get('p99', 0):.0f} |")
            means.setdefault((name, mode), []).append(d["confirmed_rate"])
lines += ["", "| scenario | plain links, confirmed msg/s (mean) | TLS links, confirmed msg/s (mean) | TLS / plain |", "|---|---|---|---|"]
for name in ("transient", "persistent"):
    p = sum(means[(name, "plain")]) / rounds
    t = sum(means[(name, "tls")]) / rounds
    lines.append(f"| {name} | {p:.0f} | {t:.0f} | {t / p:.2f} |")
open(os.path.join(out, "table.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
