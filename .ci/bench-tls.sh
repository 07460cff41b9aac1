#!/usr/bin/env bash
# TLS against plaintext on one Warren node: the same warren-perf run (1 KiB bodies,
# publisher confirms with 100 in flight, 1 producer, 1 consumer with manual acks) against
# the plaintext listener and the AMQPS listener, alternating, ROUNDS times each, for a
# transient and a persistent (durable queue, delivery_mode 2) scenario. Not part of CI.
#
#   bash .ci/bench-tls.sh [--no-build] [--duration S] [--rounds N]
#
# Certificates come from .ci/make-certs.sh (EC P-256; the client verifies the server,
# no client certificate). Any failed run, a run that confirmed nothing, or a node that
# died stops the script with an error: no table is printed from partial results.
# Results: .ci/work/bench-tls/*.json and table.md.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$ROOT/.ci/work/bench-tls"
DURATION=10
ROUNDS=2
NO_BUILD=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --duration) DURATION="$2"; shift ;;
        --rounds) ROUNDS="$2"; shift ;;
        --no-build) NO_BUILD=1 ;;
        *) sed -n '2,13p' "$0" >&2; exit 2 ;;
    esac
    shift
done
cd "$ROOT"
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
if [[ $NO_BUILD == 0 ]]; then
    cargo build --release --bin warren --bin warren-perf
fi
PERF="$TARGET/release/warren-perf"
WARREN="$TARGET/release/warren"
rm -rf "$OUT"
mkdir -p "$OUT"

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

WPID=""
cleanup() {
    if [[ -n "$WPID" ]]; then kill -TERM "$WPID" 2>/dev/null || true; wait "$WPID" 2>/dev/null || true; fi
    rm -rf "${TMPD:-/nonexistent}"
}
trap cleanup EXIT
TMPD="$(mktemp -d)"

bash "$ROOT/.ci/make-certs.sh" "$TMPD/certs" >/dev/null
PORT=$(free_port)
TLS_PORT=$(free_port)
sed -e "0,/^listen = /{s|^listen = .*|listen = \"127.0.0.1:$PORT\"|}" \
    -e "/^\[admin\]/,/^listen = /{s|^listen = .*|listen = \"127.0.0.1:0\"|}" \
    -e "/^\[management\]/,/^listen = /{s|^listen = .*|listen = \"127.0.0.1:0\"|}" \
    -e "/^\[prometheus\]/,/^listen = /{s|^listen = .*|listen = \"\"|}" \
    -e "s|^data_dir = .*|data_dir = \"$TMPD/warren\"|" \
    config/warren.toml > "$TMPD/warren.toml"
cat >> "$TMPD/warren.toml" <<TOML

[amqp.tls]
listen = "127.0.0.1:$TLS_PORT"
certfile = "$TMPD/certs/server_certificate.pem"
keyfile = "$TMPD/certs/server_key.pem"
TOML
"$WARREN" --config "$TMPD/warren.toml" > "$OUT/warren-node.log" 2>&1 &
WPID=$!
for port in "$PORT" "$TLS_PORT"; do
    for _ in $(seq 1 100); do (exec 3<>/dev/tcp/127.0.0.1/$port) 2>/dev/null && break; sleep 0.1; done
    (exec 3<>/dev/tcp/127.0.0.1/$port) 2>/dev/null || { echo "bench-tls: the node does not listen on $port" >&2; tail -20 "$OUT/warren-node.log" >&2; exit 1; }
done

# name | warren-perf arguments
SCENARIOS=(
    "transient|--producers 1 --consumers 1 --size 1024 --confirm 100"
    "persistent|--producers 1 --consumers 1 --size 1024 --confirm 100 --persistent --queue bench-tls-p"
)
for round in $(seq 1 "$ROUNDS"); do
    for s in "${SCENARIOS[@]}"; do
        name="${s%%|*}" args="${s#*|}"
        for listener in plain tls; do
            if [[ $listener == plain ]]; then
                uri="amqp://guest:guest@127.0.0.1:$PORT/%2f"; extra=()
            else
                uri="amqps://guest:guest@127.0.0.1:$TLS_PORT/%2f"; extra=(--cacert "$TMPD/certs/ca_certificate.pem")
            fi
            file="$OUT/$name-$listener-$round.json"
            echo "--- round $round, $name, $listener: warren-perf --uri $uri $args ${extra[*]} --duration $DURATION"
            # shellcheck disable=SC2086
            if ! "$PERF" --uri "$uri" $args "${extra[@]}" --duration "$DURATION" --json > "$file" 2> "$OUT/$name-$listener-$round.err"; then
                echo "bench-tls: the run failed:" >&2
                tail -5 "$OUT/$name-$listener-$round.err" >&2
                exit 1
            fi
            kill -0 "$WPID" 2>/dev/null || { echo "bench-tls: the node died" >&2; tail -20 "$OUT/warren-node.log" >&2; exit 1; }
            sleep 2
        done
    done
done

python3 - "$OUT" "$ROUNDS" <<'PY'
import json, os, sys
out, rounds = sys.argv[1], int(sys.argv[2])
lines = ["| scenario | listener | round | sent msg/s | received msg/s | confirmed msg/s | latency p50 µs | p99 µs | confirm p99 µs |",
         "|---|---|---|---|---|---|---|---|---|"]
means = {}
for name in ("transient", "persistent"):
    for listener in ("plain", "tls"):
        for r in range(1, rounds + 1):
            d = json.load(open(os.path.join(out, f"{name}-{listener}-{r}.json")))
            if not d.get("confirmed_rate"):
                sys.exit(f"bench-tls: {name} {listener} round {r} confirmed nothing")
            lat, cl = d.get("latency_us") or {}, d.get("confirm_latency_us") or {}
            lines.append(f"| {name} | {listener} | {r} | {d['sent_rate']:.0f} | {d['received_rate']:.0f} | "
                         f"{d['confirmed_rate']:.0f} | {lat.get('p50', 0):.0f} | {lat.get('p99', 0):.0f} | {cl.get('p99', 0):.0f} |")
            means.setdefault((name, listener), []).append(d["confirmed_rate"])
lines += ["", "| scenario | plain confirmed msg/s (mean) | TLS confirmed msg/s (mean) | TLS / plain |", "|---|---|---|---|"]
for name in ("transient", "persistent"):
    p = sum(means[(name, "plain")]) / rounds
    t = sum(means[(name, "tls")]) / rounds
    lines.append(f"| {name} | {p:.0f} | {t:.0f} | {t / p:.2f} |")
open(os.path.join(out, "table.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
