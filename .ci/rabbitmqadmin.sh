#!/usr/bin/env bash
# RabbitMQ's own HTTP API client, rabbitmqadmin, against a running Warren node's management
# listener: lists, declares, deletes, exports and imports definitions, and checks what it
# prints. Installs Debian's rabbitmq-server (which ships /usr/bin/rabbitmqadmin; RabbitMQ
# itself is not started) when rabbitmqadmin is missing.
#
#   bash .ci/rabbitmqadmin.sh --port MGMT_PORT [--host 127.0.0.1]
set -euo pipefail

HOST=127.0.0.1
PORT=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --host) HOST="$2"; shift 2 ;;
        --port) PORT="$2"; shift 2 ;;
        *) echo "usage: $0 --port MGMT_PORT [--host HOST]" >&2; exit 2 ;;
    esac
done
[[ -n "$PORT" ]] || { echo "usage: $0 --port MGMT_PORT [--host HOST]" >&2; exit 2; }

if ! command -v rabbitmqadmin >/dev/null 2>&1; then
    echo "rabbitmqadmin: installing rabbitmq-server (for /usr/bin/rabbitmqadmin)"
    if [[ $(id -u) -ne 0 ]]; then
        echo "rabbitmqadmin: not root: cannot install rabbitmq-server" >&2
        exit 1
    fi
    # policy-rc.d 101: the package's service must not start (only its client is wanted).
    restore_policy=""
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod +x /usr/sbin/policy-rc.d
        restore_policy=1
    fi
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq rabbitmq-server) >&2
    [[ -n "$restore_policy" ]] && rm -f /usr/sbin/policy-rc.d
fi

ADMIN=(rabbitmqadmin -H "$HOST" -P "$PORT" -u guest -p guest)
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
PASSED=0
FAILED=0

# check NAME EXPECTED_REGEX COMMAND...: the command succeeds and prints a match.
check() {
    local name="$1" want="$2" out
    shift 2
    if out="$("$@" 2>&1)" && grep -Eq -- "$want" <<<"$out"; then
        PASSED=$((PASSED + 1))
        echo "ok   $name"
    else
        FAILED=$((FAILED + 1))
        echo "FAIL $name: wanted /$want/, got:"
        sed 's/^/     /' <<<"$out"
    fi
}

# refused NAME COMMAND...: the command fails.
refused() {
    local name="$1" out
    shift
    if out="$("$@" 2>&1)"; then
        FAILED=$((FAILED + 1))
        echo "FAIL $name: succeeded, expected a refusal:"
        sed 's/^/     /' <<<"$out"
    else
        PASSED=$((PASSED + 1))
        echo "ok   $name"
    fi
}

check "show overview" "Warren|3\.10" "${ADMIN[@]}" -f long show overview
check "list nodes" "disc" "${ADMIN[@]}" list nodes name type
check "list vhosts" "^\| / " "${ADMIN[@]}" list vhosts name
check "list users" "guest.*administrator" "${ADMIN[@]}" list users name tags
check "declare vhost" "vhost declared" "${ADMIN[@]}" declare vhost name=ci
check "declare user" "user declared" "${ADMIN[@]}" declare user name=ci_user password=s3cret tags=management
check "declare permission" "permission declared" "${ADMIN[@]}" declare permission vhost=ci user=guest configure=.* write=.* read=.*
check "declare exchange" "exchange declared" "${ADMIN[@]}" -V ci declare exchange name=ci.x type=topic durable=true
check "declare queue" "queue declared" "${ADMIN[@]}" -V ci declare queue name=ci.q durable=true arguments='{"x-max-length": 100}'
check "declare binding" "binding declared" "${ADMIN[@]}" -V ci declare binding source=ci.x destination=ci.q routing_key='a.#'
check "declare policy" "policy declared" "${ADMIN[@]}" -V ci declare policy name=cap pattern='^ci\.' definition='{"max-length": 10}' apply-to=queues
check "list queues" "ci\.q +\| 0 +\| cap" "${ADMIN[@]}" -V ci list queues name messages policy
check "list exchanges" "ci\.x +\| topic" "${ADMIN[@]}" -V ci list exchanges name type
check "list bindings" "ci\.x +\| ci\.q +\| a\.#" "${ADMIN[@]}" -V ci list bindings source destination routing_key
check "list policies" "cap" "${ADMIN[@]}" -V ci list policies name pattern
check "list permissions" "ci +\| guest" "${ADMIN[@]}" list permissions vhost user
refused "bad credentials" rabbitmqadmin -H "$HOST" -P "$PORT" -u guest -p wrong list queues
refused "a non-management user" rabbitmqadmin -H "$HOST" -P "$PORT" -u ci_nobody -p x list queues
check "export" "Exported definitions" "${ADMIN[@]}" export "$TMP/defs.json"
check "export holds the queue" '"ci\.q"' cat "$TMP/defs.json"
check "delete binding" "binding deleted" "${ADMIN[@]}" -V ci delete binding source=ci.x destination=ci.q destination_type=queue properties_key=a.%23
check "delete queue" "queue deleted" "${ADMIN[@]}" -V ci delete queue name=ci.q
check "delete exchange" "exchange deleted" "${ADMIN[@]}" -V ci delete exchange name=ci.x
check "delete policy" "policy deleted" "${ADMIN[@]}" -V ci delete policy name=cap
check "queue gone" "No items" "${ADMIN[@]}" -V ci list queues name
check "import" "Uploaded definitions" "${ADMIN[@]}" import "$TMP/defs.json"
check "import restored the queue" "ci\.q" "${ADMIN[@]}" -V ci list queues name
check "import restored the binding" "a\.#" "${ADMIN[@]}" -V ci list bindings source destination routing_key
check "delete user" "user deleted" "${ADMIN[@]}" delete user name=ci_user
check "delete vhost" "vhost deleted" "${ADMIN[@]}" delete vhost name=ci

echo "rabbitmqadmin: $PASSED passed, $FAILED failed"
[[ $FAILED -eq 0 ]]
