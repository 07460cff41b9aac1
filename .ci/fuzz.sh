#!/usr/bin/env bash
# Runs Warren's libFuzzer targets (fuzz/, cargo-fuzz) for a while each: `bash .ci/fuzz.sh
# [SECONDS] [TARGET...]`. SECONDS defaults to 30 per target; no TARGET means all of them.
#
# Not part of .ci/run: CI replays the committed corpora with `cargo test --test fuzz_corpus`
# (stable, no cargo-fuzz). This script is for longer runs by hand (docs/security.md,
# *Fuzzing*). Needs a nightly toolchain (`rustup toolchain install nightly`) and
# cargo-fuzz (`cargo install cargo-fuzz`).
#
# Each target starts from its committed corpus (fuzz/corpus/<target>/, read only) and
# writes what it finds to a scratch corpus ($FUZZ_WORK, default /tmp/warren-fuzz/<target>);
# `cargo fuzz cmin` folds that into the committed one when wanted. A crash, panic, leak,
# out-of-memory or timeout makes the script print libFuzzer's report and the artefact,
# and exit non-zero after the remaining targets ran.
#
# Environment: FUZZ_WORK (scratch folder), FUZZ_TARGET_DIR (cargo's target folder, default
# fuzz/target), FUZZ_RSS_MB (memory limit per input run, default 2048), FUZZ_NICE (default
# 19: the fuzzer takes only idle CPU).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT/fuzz"

SECONDS_PER_TARGET="${1:-30}"
if [[ $# -gt 0 ]]; then shift; fi
if ! [[ "$SECONDS_PER_TARGET" =~ ^[0-9]+$ ]]; then
    echo "usage: .ci/fuzz.sh [SECONDS] [TARGET...]" >&2
    exit 2
fi
NICE="${FUZZ_NICE:-19}"
# shellcheck source=fuzz-lib.sh
source "$ROOT/.ci/fuzz-lib.sh"
# WORK, TARGET_DIR, RSS_MB, and TARGETS: all unless some are named.
fuzz_settings fuzz /tmp/warren-fuzz "$@"

# No sanitizer: the fuzzed code has no unsafe (Warren's few unsafe blocks are libc calls
# in the runtime), and without AddressSanitizer the
# targets build and run several times faster; panics, aborts, OOMs and hangs are still
# caught. Debug assertions on: integer overflow panics.
FLAGS=(-s none -a --target-dir "$TARGET_DIR")
echo "fuzz: building ${TARGETS[*]}"
nice -n "$NICE" cargo +nightly fuzz build "${FLAGS[@]}"

FAILED=()
for t in "${TARGETS[@]}"; do
    mkdir -p "$WORK/$t" "$ROOT/fuzz/corpus/$t"
    log="$WORK/$t.log"
    echo
    echo "=== fuzz $t: ${SECONDS_PER_TARGET}s, log $log ==="
    rc=0
    touch "$WORK/.start-$t"
    # -jobs=1: one fuzzing process, its output in fuzz-0.log (copied to $log below).
    (cd "$WORK" && nice -n "$NICE" cargo +nightly fuzz run "${FLAGS[@]}" \
        --fuzz-dir "$ROOT/fuzz" "$t" "$WORK/$t" "$ROOT/fuzz/corpus/$t" -- \
        -max_total_time="$SECONDS_PER_TARGET" -jobs=1 -rss_limit_mb="$RSS_MB" -timeout=10 \
        -artifact_prefix="$WORK/$t-") >"$WORK/$t.driver.log" 2>&1 || rc=$?
    cp "$WORK/$t.driver.log" "$log"
    if [[ -f "$WORK/fuzz-0.log" ]]; then
        cat "$WORK/fuzz-0.log" >>"$log"
        rm "$WORK/fuzz-0.log"
    fi
    # libFuzzer's last words: the final stats line and `Done N runs in S second(s)`.
    grep -E '^(#[0-9]+|Done [0-9]+ runs)' "$log" | tail -n 2 >&2 || echo "(no libFuzzer stats)" >&2
    if [[ $rc -ne 0 ]] || grep -qE 'ERROR: libFuzzer|SUMMARY: libFuzzer|panicked at' "$log"; then
        echo "!!! fuzz $t FAILED (exit $rc); the report:" >&2
        grep -E -A 30 'panicked at|ERROR: libFuzzer' "$log" | head -n 60 >&2 || tail -n 40 "$log" >&2
        find "$WORK" -maxdepth 1 -name "$t-*" -newer "$WORK/.start-$t" >&2
        FAILED+=("$t")
    fi
done

echo
if [[ ${#FAILED[@]} -gt 0 ]]; then
    echo "fuzz: FAILED: ${FAILED[*]} (inputs: $WORK/<target>-crash-*, -oom-*, -timeout-*)" >&2
    exit 1
fi
echo "fuzz: ok (${TARGETS[*]}, ${SECONDS_PER_TARGET}s each)"
