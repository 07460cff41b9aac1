#!/usr/bin/env bash
# Run the third-party AMQP client suites (py-amqp, kombu), and our own py-amqp check of
# direct reply-to (tests/interop/test_direct_reply_to.py), against a broker that is
# already listening. Used by .ci/run against a Warren node, and by hand against
# RabbitMQ for the baseline (see tests/interop/README.md).
#
#   .ci/interop.sh [--host H] [--port P] [--tls-port P --certs DIR]
#                  [--suite py-amqp|kombu|direct-reply-to]... [--no-deselect] [--reruns N]
#                  [-- PYTEST_ARGS...]
#
# Defaults: host $RABBITMQ_HOST or 127.0.0.1, port $RABBITMQ_5672_TCP or 5672, all three
# suites, the tests listed in tests/interop/deselected.txt deselected, every test
# rerun at most once (INTEROP_RERUNS) whatever its @flaky marker says, each test
# bounded to INTEROP_TEST_TIMEOUT seconds (60). With --tls-port (the broker's AMQPS port)
# and --certs (a folder made by .ci/make-certs.sh, the broker trusting its CA), py-amqp's
# TLS tests run too; without them the `tls-listener:` entries are deselected.
# Ends with the line `interop: N passed, M failed`; exits non-zero when M > 0.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="$ROOT/.ci/work"
DESELECT_FILE="$ROOT/tests/interop/deselected.txt"

HOST="${RABBITMQ_HOST:-127.0.0.1}"
PORT="${RABBITMQ_5672_TCP:-5672}"
RERUNS="${INTEROP_RERUNS:-1}"
TEST_TIMEOUT="${INTEROP_TEST_TIMEOUT:-60}"
SUITE_TIMEOUT="${INTEROP_SUITE_TIMEOUT:-1500}"
DESELECT=1
TLS_PORT=""
CERTS=""
SELECTED=()
EXTRA=()

while [[ $# -gt 0 ]]; do
    case "$1" in
        --host) HOST="$2"; shift 2 ;;
        --port) PORT="$2"; shift 2 ;;
        --tls-port) TLS_PORT="$2"; shift 2 ;;
        --certs) CERTS="$2"; shift 2 ;;
        --suite) SELECTED+=("$2"); shift 2 ;;
        --no-deselect) DESELECT=0; shift ;;
        --reruns) RERUNS="$2"; shift 2 ;;
        --) shift; EXTRA=("$@"); break ;;
        -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
        *) echo "interop.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done

if [[ -n "$TLS_PORT" && ! -f "$CERTS/client_certificate.pem" ]]; then
    echo "interop.sh: --tls-port needs --certs DIR with .ci/make-certs.sh's files" >&2
    exit 2
fi

# name | folder (under .ci/work/suites unless absolute) | test file
SUITES=(
    "py-amqp|amqp-5.4.2|t/integration/test_rmq.py"
    "kombu|kombu-5.7.0|t/integration/test_py_amqp.py"
    "direct-reply-to|$ROOT/tests/interop|test_direct_reply_to.py"
)
[[ ${#SELECTED[@]} -gt 0 ]] || SELECTED=(py-amqp kombu direct-reply-to)
for name in "${SELECTED[@]}"; do
    case "$name" in
        py-amqp | kombu | direct-reply-to) ;;
        *) echo "interop.sh: unknown suite $name (py-amqp, kombu, direct-reply-to)" >&2; exit 2 ;;
    esac
done
suite_dir() {
    case "$1" in
        /*) echo "$1" ;;
        *) echo "$WORK/suites/$1" ;;
    esac
}

# deselected.txt: `NODE_ID  # TAG: explanation`, TAG one of the later-work features.
ALLOWED_TAGS='^(TLS|tls-listener|message-ttl|queue-expires|priority|dead-letter|failover):'
DESELECTED=()
if [[ $DESELECT -eq 1 && -f "$DESELECT_FILE" ]]; then
    n=0
    while IFS= read -r line || [[ -n "$line" ]]; do
        n=$((n + 1))
        [[ "$line" =~ ^[[:space:]]*(#.*)?$ ]] && continue
        id="$(sed -E 's/[[:space:]]*#.*$//; s/^[[:space:]]+//' <<<"$line")"
        reason="$(sed -nE 's/^[^#]*#[[:space:]]*//p' <<<"$line")"
        if ! [[ "$reason" =~ $ALLOWED_TAGS ]]; then
            echo "interop.sh: $DESELECT_FILE:$n: reason must start with one of" \
                 "TLS: tls-listener: message-ttl: queue-expires: priority: dead-letter:" \
                 "failover:" >&2
            exit 2
        fi
        case "$id" in
            t/integration/test_rmq.py::* | t/integration/test_py_amqp.py::*) ;;
            *)
                echo "interop.sh: $DESELECT_FILE:$n: not a node id of either suite: $id" >&2
                exit 2
                ;;
        esac
        # With an AMQPS listener to test, its tests run (the id was still checked above).
        [[ -n "$TLS_PORT" && "$reason" == tls-listener:* ]] && continue
        DESELECTED+=("$id")
    done <"$DESELECT_FILE"
fi

bash "$ROOT/.ci/interop-setup.sh"
PY="$WORK/venv/bin/python"

# The broker must already be up: fail at once rather than through every fixture.
if ! "$PY" - "$HOST" "$PORT" <<'PYEOF'
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5).close()
except OSError as exc:
    sys.exit(f"interop.sh: nothing accepts connections on {sys.argv[1]}:{sys.argv[2]}: {exc}")
PYEOF
then
    echo "interop: 0 passed, 1 failed"
    exit 1
fi

mkdir -p "$WORK/results"
export RABBITMQ_HOST="$HOST" RABBITMQ_5672_TCP="$PORT"
if [[ -n "$TLS_PORT" ]]; then
    # py-amqp's TLS tests read t/certs/ (the names RabbitMQ's tls-gen gives) and port 5671
    # or RABBITMQ_5671_TCP. test_tls_connect_fails wants a certificate and a key that do
    # not belong together, so that the client's own TLS setup fails.
    certs="$WORK/suites/amqp-5.4.2/t/certs"
    mkdir -p "$certs"
    cp "$CERTS/ca_certificate.pem" "$CERTS/client_certificate.pem" "$CERTS/client_key.pem" "$certs/"
    cp "$CERTS/client_certificate.pem" "$certs/client_certificate_broken.pem"
    cp "$CERTS/server_key.pem" "$certs/client_key_broken.pem"
    export RABBITMQ_5671_TCP="$TLS_PORT"
fi
export PYTHONPATH="$ROOT/.ci${PYTHONPATH:+:$PYTHONPATH}" PYTHONDONTWRITEBYTECODE=1
PYTEST=("$PY" -m pytest -p interop_plugin -p no:cacheprovider)
REPORT_ARGS=()
rc=0

# Deselect each suite's listed ids. Every listed id must name a collected test: a stale
# list would silently deselect nothing. Checked for all suites before any runs.
declare -A DESELECT_ARGS=()
for spec in "${SUITES[@]}"; do
    IFS='|' read -r name dir file <<<"$spec"
    [[ " ${SELECTED[*]} " == *" $name "* ]] || continue
    collected="$(cd "$(suite_dir "$dir")" && "${PYTEST[@]}" --collect-only -q "$file" | grep '::' || true)"
    args=""
    for id in ${DESELECTED[@]+"${DESELECTED[@]}"}; do
        [[ "$id" == "$file::"* ]] || continue
        if ! grep -qxF -- "$id" <<<"$collected"; then
            echo "interop.sh: deselected id not collected (stale?): $id" >&2
            exit 2
        fi
        args+="$id"$'\n'
    done
    DESELECT_ARGS[$name]="$args"
done

for spec in "${SUITES[@]}"; do
    IFS='|' read -r name dir file <<<"$spec"
    [[ " ${SELECTED[*]} " == *" $name "* ]] || continue
    cd "$(suite_dir "$dir")"
    args=()
    while IFS= read -r id; do
        [[ -n "$id" ]] && args+=(--deselect "$id")
    done <<<"${DESELECT_ARGS[$name]}"

    results="$WORK/results/$name.json"
    rm -f "$results"
    echo "=== interop suite $name ($dir, $file) against $HOST:$PORT," \
         "$(( ${#args[@]} / 2 )) deselected, reruns $RERUNS ==="
    set +e
    INTEROP_RESULTS="$results" timeout -k 10 "$SUITE_TIMEOUT" "${PYTEST[@]}" "$file" \
        -v -rfE --tb=short --timeout "$TEST_TIMEOUT" \
        --force-reruns "$RERUNS" --reruns-delay 1 \
        ${args[@]+"${args[@]}"} ${EXTRA[@]+"${EXTRA[@]}"}
    st=$?
    set -e
    echo "=== interop suite $name: pytest exit $st ==="
    # 0 = all passed, 1 = some failed (counted by the report); anything else
    # (5 = no tests ran, 124 = timed out, ...) fails the run by itself.
    if [[ $st -ne 0 && $st -ne 1 ]]; then rc=1; fi
    REPORT_ARGS+=("$name=$results")
done

cd "$ROOT"
echo "=== interop summary ==="
"$PY" "$ROOT/.ci/interop_report.py" "${REPORT_ARGS[@]}" || rc=1
exit $rc
