#!/usr/bin/env bash
# The Go client's own integration tests (github.com/rabbitmq/amqp091-go 1.5.0, Debian's
# golang-github-rabbitmq-amqp091-go-dev) against a Warren node this script starts, or
# against any broker that is already listening (--url, e.g. RabbitMQ for the baseline).
#
#   .ci/go-client.sh [--url amqp://guest:guest@HOST:PORT/] [--no-deselect]
#                    [--run REGEX] [-- TEST_BINARY_ARGS...]
#
# Installs Debian's golang-go and golang-github-rabbitmq-amqp091-go-dev (which pulls in
# golang-uber-goleak-dev, the tests' only dependency) with apt-get when either is missing,
# copies both source trees into a GOPATH under .ci/work/go (GO111MODULE=off: nothing is
# fetched) and compiles the package's tests with the `integration` build tag. Without --url
# it then starts target/release/warren (or $WARREN_BIN) with a copy of config/warren.toml
# whose listeners are on free ports and whose data_dir is a temporary folder, runs the tests
# with AMQP_URL pointing at it, and stops the node (SIGTERM, also when the tests fail; a
# node that is gone or that does not stop within 30 s fails the run). Node log:
# .ci/work/go-client-node.log.
#
# Selected: every test of the files built only with the `integration` tag
# (integration_test.go, connection_test.go) and ExampleConnection_reconnect (which dials
# AMQP_URL); the package's other tests talk to in-process fakes, not to a broker. The
# DESELECTED list below names the exceptions, each with its reason; --no-deselect runs them
# too. --run REGEX narrows the selection further (Go's -test.run syntax, matched against
# the selected names).
#
# Ends with the line `go-client: N passed, M failed, K skipped` (K: deselected plus any
# test that skipped itself); exits non-zero when M > 0. A run whose test binary fails
# outside any test (goleak's check for leaked goroutines after the last test, a panic, the
# GO_CLIENT_TIMEOUT of 300 s) counts as one more failure, as does a selected test that
# never reported a result.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="$ROOT/.ci/work"
GOWORK="$WORK/go"
PKG=github.com/rabbitmq/amqp091-go
DEBIAN_SRC=/usr/share/gocode/src
TIMEOUT="${GO_CLIENT_TIMEOUT:-300}"

# name | reason. Each name must be one of the selected tests (checked: a stale entry
# fails the run).
DESELECTED=(
    # These three run their body only when connection.start's server property `product`
    # is "RabbitMQ" (Warren says "Warren"). Otherwise they pass without testing anything,
    # and leave the connection they opened to look at the product unclosed, so goleak's
    # check after the last test finds its reader and heartbeat goroutines and fails the
    # whole run.
    "TestRabbitMQQueueTTLGet|body runs only on product RabbitMQ; elsewhere its open connection fails goleak"
    "TestRabbitMQQueueNackMultipleRequeue|body runs only on product RabbitMQ; elsewhere its open connection fails goleak"
    "TestIntegrationRecoverNotImplemented|body runs only on product RabbitMQ; elsewhere its open connection fails goleak"
)

URL=""
DESELECT=1
RUN=""
EXTRA=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --url) URL="$2"; shift 2 ;;
        --no-deselect) DESELECT=0; shift ;;
        --run) RUN="$2"; shift 2 ;;
        --) shift; EXTRA=("$@"); break ;;
        -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
        *) echo "go-client: unknown argument $1" >&2; exit 2 ;;
    esac
done

# --- the Go toolchain and the client's source, from Debian ---------------------------------
if ! command -v go >/dev/null 2>&1 || [[ ! -f "$DEBIAN_SRC/$PKG/integration_test.go" ]] ||
    [[ ! -d "$DEBIAN_SRC/go.uber.org/goleak" ]]; then
    echo "go-client: installing golang-go and golang-github-rabbitmq-amqp091-go-dev"
    if [[ $(id -u) -ne 0 ]]; then
        echo "go-client: not root: cannot install golang-go and golang-github-rabbitmq-amqp091-go-dev" >&2
        echo "go-client: 0 passed, 1 failed, 0 skipped"
        exit 1
    fi
    if ! (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        golang-go golang-github-rabbitmq-amqp091-go-dev) >&2; then
        echo "go-client: apt-get could not install golang-go and golang-github-rabbitmq-amqp091-go-dev" >&2
        echo "go-client: 0 passed, 1 failed, 0 skipped"
        exit 1
    fi
fi
for f in "$DEBIAN_SRC/$PKG/integration_test.go" "$DEBIAN_SRC/go.uber.org/goleak/testmain.go"; do
    if [[ ! -f "$f" ]]; then
        echo "go-client: $f is missing after the install" >&2
        echo "go-client: 0 passed, 1 failed, 0 skipped"
        exit 1
    fi
done
VERSION="$(dpkg-query -W -f '${Version}' golang-github-rabbitmq-amqp091-go-dev 2>/dev/null || echo '?')"
echo "go-client: $(go version), amqp091-go $VERSION (Debian)"

# GOPATH mode with fresh copies of the two source trees: no module download, no proxy, and
# nothing written under /usr/share/gocode. The build cache is kept between runs.
export GO111MODULE=off GOTOOLCHAIN=local GOPROXY=off GOFLAGS="" CGO_ENABLED=0 \
    GOPATH="$GOWORK/gopath" GOCACHE="$GOWORK/cache"
rm -rf "$GOPATH"
mkdir -p "$GOPATH/src/github.com/rabbitmq" "$GOPATH/src/go.uber.org" "$GOCACHE"
cp -r "$DEBIAN_SRC/$PKG" "$GOPATH/src/github.com/rabbitmq/"
cp -r "$DEBIAN_SRC/go.uber.org/goleak" "$GOPATH/src/go.uber.org/"
SRC="$GOPATH/src/$PKG"
TESTBIN="$GOWORK/amqp091-go.test"
echo "go-client: compiling the tests (go test -tags integration -c)"
if ! (cd "$SRC" && go test -tags integration -vet=off -c -o "$TESTBIN" .); then
    echo "go-client: the tests did not compile" >&2
    echo "go-client: 0 passed, 1 failed, 0 skipped"
    exit 1
fi

# --- the selection -------------------------------------------------------------------------
mapfile -t TAGGED < <(cd "$SRC" && grep -l '^//go:build integration' -- *_test.go)
mapfile -t SELECTED < <(
    cd "$SRC" &&
        grep -hoE '^func Test[A-Za-z0-9_]+\(t \*testing\.T\)' -- "${TAGGED[@]}" |
        sed -E 's/^func (Test[A-Za-z0-9_]+)\(.*/\1/'
    echo ExampleConnection_reconnect
)
LISTED="$(cd "$SRC" && "$TESTBIN" -test.list '.*' 2>/dev/null)"
for name in "${SELECTED[@]}"; do
    if ! grep -qxF -- "$name" <<<"$LISTED"; then
        echo "go-client: selected test $name is not in the test binary's list" >&2
        exit 2
    fi
done
declare -A REASON=()
for entry in "${DESELECTED[@]}"; do
    name="${entry%%|*}"
    if ! printf '%s\n' "${SELECTED[@]}" | grep -qxF -- "$name"; then
        echo "go-client: deselected test not selected any more (stale?): $name" >&2
        exit 2
    fi
    REASON[$name]="${entry#*|}"
done
RUNNING=()
SKIPPED=()
for name in "${SELECTED[@]}"; do
    if [[ $DESELECT -eq 1 && -n "${REASON[$name]:-}" ]]; then
        SKIPPED+=("$name")
    else
        RUNNING+=("$name")
    fi
done
if [[ -n "$RUN" ]]; then
    MATCHED="$(cd "$SRC" && "$TESTBIN" -test.list "$RUN" 2>/dev/null)"
    mapfile -t RUNNING < <(grep -xF -f <(printf '%s\n' "${RUNNING[@]}") <<<"$MATCHED" || true)
fi
if [[ ${#RUNNING[@]} -eq 0 ]]; then
    echo "go-client: no test selected" >&2
    echo "go-client: 0 passed, 1 failed, ${#SKIPPED[@]} skipped"
    exit 1
fi
RUN_REGEX="^($(IFS='|'; echo "${RUNNING[*]}"))\$"

# --- the broker ------------------------------------------------------------------------------
NODE_PID=""
NODE_TMP=""
NODE_LOG="$WORK/go-client-node.log"

kill_node() {
    if [[ -n "$NODE_PID" ]] && kill -0 "$NODE_PID" 2>/dev/null; then
        kill -TERM "$NODE_PID" 2>/dev/null || true
        for _ in $(seq 1 150); do
            kill -0 "$NODE_PID" 2>/dev/null || break
            sleep 0.2
        done
        kill -KILL "$NODE_PID" 2>/dev/null || true
        wait "$NODE_PID" 2>/dev/null || true
    fi
    NODE_PID=""
    if [[ -n "$NODE_TMP" ]]; then
        rm -rf "$NODE_TMP"
        NODE_TMP=""
    fi
}
trap kill_node EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

port_open() {
    python3 - "$1" <<'EOF' 2>/dev/null
import socket, sys
socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=1).close()
EOF
}

# start_node BIN: as .ci/run's start_node, without the TLS listener.
start_node() {
    local bin="$1" port mport pport conf deadline
    port="$(free_port)" && mport="$(free_port)" && pport="$(free_port)" || return 1
    NODE_TMP="$(mktemp -d /tmp/warren-go-client.XXXXXX)" || return 1
    conf="$NODE_TMP/warren.toml"
    # The shipped config, with only the listen addresses and the data folder changed.
    sed -E \
        -e "0,/^listen = /{s|^listen = .*|listen = \"127.0.0.1:$port\"|}" \
        -e "/^\[admin\]/,/^listen = /{s|^listen = .*|listen = \"127.0.0.1:0\"|}" \
        -e "/^\[management\]/,/^listen = /{s|^listen = .*|listen = \"127.0.0.1:$mport\"|}" \
        -e "/^\[prometheus\]/,/^listen = /{s|^listen = .*|listen = \"127.0.0.1:$pport\"|}" \
        -e "s|^data_dir = .*|data_dir = \"$NODE_TMP/data\"|" \
        "$ROOT/config/warren.toml" >"$conf" || return 1
    if ! grep -qx "listen = \"127.0.0.1:$port\"" "$conf" ||
        ! grep -qx "listen = \"127.0.0.1:$mport\"" "$conf" ||
        ! grep -qx "listen = \"127.0.0.1:$pport\"" "$conf" ||
        ! grep -qx "data_dir = \"$NODE_TMP/data\"" "$conf"; then
        echo "go-client: could not set listen/data_dir in a copy of config/warren.toml" >&2
        return 1
    fi
    echo "go-client: starting $bin --config $conf (127.0.0.1:$port), log $NODE_LOG"
    (cd "$NODE_TMP" && NO_COLOR=1 exec "$bin" --config "$conf") >"$NODE_LOG" 2>&1 </dev/null &
    NODE_PID=$!
    deadline=$((SECONDS + 60))
    until port_open "$port"; do
        if ! kill -0 "$NODE_PID" 2>/dev/null; then
            local st=0
            wait "$NODE_PID" || st=$?
            NODE_PID=""
            echo "go-client: the node exited (status $st) before listening on $port; its log:" >&2
            tail -n 50 "$NODE_LOG" >&2
            return 1
        fi
        if ((SECONDS >= deadline)); then
            echo "go-client: the node is not listening on $port after 60s; its log:" >&2
            tail -n 50 "$NODE_LOG" >&2
            return 1
        fi
        sleep 0.2
    done
    URL="amqp://guest:guest@127.0.0.1:$port/"
    echo "go-client: node pid $NODE_PID listening on 127.0.0.1:$port"
}

# stop_node: SIGTERM; fails when the node had exited by itself, does not stop within 30 s,
# or exits with a status other than 0 or 143.
stop_node() {
    local st=0 deadline
    [[ -n "$NODE_PID" ]] || return 0
    if ! kill -0 "$NODE_PID" 2>/dev/null; then
        wait "$NODE_PID" || st=$?
        NODE_PID=""
        echo "go-client: the node had already exited (status $st) before the end of the tests" >&2
        tail -n 50 "$NODE_LOG" >&2
        return 1
    fi
    echo "go-client: stopping the node (SIGTERM)"
    kill -TERM "$NODE_PID"
    deadline=$((SECONDS + 30))
    while kill -0 "$NODE_PID" 2>/dev/null; do
        if ((SECONDS >= deadline)); then
            echo "go-client: the node did not exit within 30s of SIGTERM; killing it" >&2
            kill -KILL "$NODE_PID" 2>/dev/null || true
            wait "$NODE_PID" 2>/dev/null || true
            NODE_PID=""
            return 1
        fi
        sleep 0.2
    done
    wait "$NODE_PID" || st=$?
    NODE_PID=""
    if [[ $st -ne 0 && $st -ne 143 ]]; then
        echo "go-client: the node exited with status $st after SIGTERM; its log:" >&2
        tail -n 50 "$NODE_LOG" >&2
        return 1
    fi
    echo "go-client: node stopped (status $st)"
}

if [[ -z "$URL" ]]; then
    BIN="${WARREN_BIN:-$ROOT/target/release/warren}"
    if [[ ! -x "$BIN" ]]; then
        echo "go-client: no Warren binary at $BIN (cargo build --release --bin warren)" >&2
        echo "go-client: 0 passed, 1 failed, ${#SKIPPED[@]} skipped"
        exit 1
    fi
    # A free port can be taken between the probe and the node's bind: try three ports.
    for try in 1 2 3; do
        start_node "$BIN" && break
        kill_node
        if [[ $try -eq 3 ]]; then
            echo "go-client: 0 passed, 1 failed, ${#SKIPPED[@]} skipped"
            exit 1
        fi
        echo "go-client: retrying the node start on another port" >&2
    done
fi

# --- the run ---------------------------------------------------------------------------------
RAW="$GOWORK/output.txt"
EVENTS="$GOWORK/events.json"
echo "=== go-client: ${#RUNNING[@]} tests against $URL, ${#SKIPPED[@]} deselected ==="
for name in ${SKIPPED[@]+"${SKIPPED[@]}"}; do
    echo "deselected: $name - ${REASON[$name]}"
done
set +e
(cd "$SRC" && AMQP_URL="$URL" timeout -k 10 $((TIMEOUT + 60)) "$TESTBIN" -test.v \
    -test.count=1 -test.timeout "${TIMEOUT}s" -test.run "$RUN_REGEX" \
    ${EXTRA[@]+"${EXTRA[@]}"} 2>&1) | tee "$RAW"
TEST_ST="${PIPESTATUS[0]}"
set -e
RC=0
# The verbose output as events, one per test result (what `go test -json` prints).
go tool test2json -p "$PKG" <"$RAW" >"$EVENTS" || { echo "go-client: test2json failed" >&2; RC=1; }

NODE_OK=1
if [[ -n "$NODE_PID" ]]; then
    stop_node || NODE_OK=0
    kill_node
fi

# --- the summary -----------------------------------------------------------------------------
python3 - "$EVENTS" "$TEST_ST" "$NODE_OK" "${#SKIPPED[@]}" "${RUNNING[@]}" <<'PYEOF' || RC=1
import json, re, sys

events_file, test_st, node_ok, deselected = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
running = sys.argv[5:]
final, started, output, panic = {}, set(), {}, None
with open(events_file) as f:
    for line in f:
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        test = ev.get("Test")
        action = ev.get("Action")
        if action == "output":
            text = ev.get("Output", "")
            if text.startswith("panic: ") and panic is None:
                panic = text.strip()
            if test:
                output.setdefault(test.split("/")[0], []).append(text)
            continue
        if not test or "/" in test:
            continue
        if action == "run":
            started.add(test)
        elif action in ("pass", "fail", "skip"):
            final[test] = action

print("=== go-client summary ===")
passed = sum(1 for t in running if final.get(t) == "pass")
skipped = deselected + sum(1 for t in running if final.get(t) == "skip")
failed = 0
for t in running:
    outcome = final.get(t)
    if outcome == "fail":
        failed += 1
        # The last `file.go:N: text` line: t.Fatalf's, after any t.Log lines.
        lines = [l.strip() for l in output.get(t, []) if re.match(r"\s+\w+\.go:\d+: ", l)]
        print(f"FAILED {t} - {lines[-1] if lines else 'no message'}")
    elif outcome is None:
        failed += 1
        why = f"started, no result ({panic or 'panic or timeout'})" if t in started else "did not run"
        print(f"FAILED {t} - {why}")
if test_st != 0 and failed == 0:
    failed += 1
    print(f"FAILED (test binary) - exit status {test_st} with every test passed: "
          f"{panic or 'goleak found leaked goroutines, or the timeout; see above'}")
if not node_ok:
    failed += 1
    print("FAILED (broker) - the Warren node did not stop cleanly (see above)")
print(f"go-client: {passed} passed, {failed} failed, {skipped} skipped")
sys.exit(1 if failed else 0)
PYEOF
exit $RC
