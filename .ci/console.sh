#!/usr/bin/env bash
# The web console's browser test (tests/console_browser.rs): headless Chromium through
# chromedriver drives the console of a three-node cluster. Installs Debian's chromium and
# chromium-driver when either is missing, and fails when they are still missing after.
# Screenshots of each step go to a temporary folder the test names on stderr.
#
#   bash .ci/console.sh
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

CHROMIUM="${CHROMIUM:-/usr/bin/chromium}"
CHROMEDRIVER="${CHROMEDRIVER:-/usr/bin/chromedriver}"

if [[ ! -x "$CHROMIUM" || ! -x "$CHROMEDRIVER" ]]; then
    echo "console: installing chromium and chromium-driver"
    if [[ $(id -u) -ne 0 ]]; then
        echo "console: not root: cannot install chromium and chromium-driver" >&2
        exit 1
    fi
    (apt-get update -qq &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver) >&2 ||
        { echo "console: apt-get could not install chromium and chromium-driver" >&2; exit 1; }
fi
for tool in "$CHROMIUM" "$CHROMEDRIVER"; do
    if [[ ! -x "$tool" ]]; then
        echo "console: $tool is missing after the install: the browser test cannot run" >&2
        exit 1
    fi
done
echo "console: $("$CHROMIUM" --version 2>/dev/null | tail -n 1), $("$CHROMEDRIVER" --version)"

export CHROMIUM CHROMEDRIVER
cargo test --features browser-test --test console_browser -- --nocapture
