#!/usr/bin/env bash
# Prepare the third-party AMQP client suites in .ci/work/ (gitignored):
#   .ci/work/venv             python venv with the test runner and the client libraries
#   .ci/work/suites/amqp-X    py-amqp sdist, unpacked (t/integration/test_rmq.py)
#   .ci/work/suites/kombu-Y   kombu sdist, unpacked (t/integration/test_py_amqp.py)
# Idempotent: a finished setup (stamp file) is reused. Needs only PyPI.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="$ROOT/.ci/work"

# Suite versions, and the sha256 of their sdists as served by PyPI.
AMQP_VERSION=5.4.2
AMQP_SHA256=9362660c4a31150cf18e78cae2ce8aa1e929fc6c6739e69f6dd5dbea9c3edc82
KOMBU_VERSION=5.7.0
KOMBU_SHA256=31e62fdfd2381caa3422f8e02b84a491d9a2180ddda74507b57f4cb1e1c2c2c9

REQS="$ROOT/tests/interop/requirements.txt"
VENV="$WORK/venv"
SUITES="$WORK/suites"
STAMP="$WORK/interop-setup.stamp"
WANT="amqp=$AMQP_VERSION kombu=$KOMBU_VERSION reqs=$(sha256sum "$REQS" | cut -c1-16)"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" && -x "$VENV/bin/pytest" ]]; then
    echo "interop-setup: up to date ($WANT)"
    exit 0
fi

PYTHON="${PYTHON:-}"
if [[ -z "$PYTHON" ]]; then
    for p in python3.11 python3; do
        if command -v "$p" >/dev/null 2>&1; then PYTHON="$p"; break; fi
    done
fi
[[ -n "$PYTHON" ]] || { echo "interop-setup: no python3 found" >&2; exit 1; }

export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
rm -rf "$VENV" "$SUITES" "$STAMP"
mkdir -p "$WORK" "$SUITES/dl"
echo "interop-setup: venv with $("$PYTHON" --version 2>&1) at $VENV"
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip -q)

"${PIP[@]}" download --no-deps --no-binary :all: -d "$SUITES/dl" \
    "amqp==$AMQP_VERSION" "kombu==$KOMBU_VERSION"
( cd "$SUITES/dl" && sha256sum -c - ) <<SUMS
$AMQP_SHA256  amqp-$AMQP_VERSION.tar.gz
$KOMBU_SHA256  kombu-$KOMBU_VERSION.tar.gz
SUMS
tar -xzf "$SUITES/dl/amqp-$AMQP_VERSION.tar.gz" -C "$SUITES"
tar -xzf "$SUITES/dl/kombu-$KOMBU_VERSION.tar.gz" -C "$SUITES"

"${PIP[@]}" install -r "$REQS"
# The libraries under test come from the very sdists whose tests we run.
"${PIP[@]}" install --no-deps \
    "$SUITES/dl/amqp-$AMQP_VERSION.tar.gz" "$SUITES/dl/kombu-$KOMBU_VERSION.tar.gz"
"$VENV/bin/python" -m pip check
"$VENV/bin/python" -c 'import amqp, kombu; print("interop-setup: amqp", amqp.__version__, "kombu", kombu.__version__)'

echo "$WANT" > "$STAMP"
