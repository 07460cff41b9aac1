#!/usr/bin/env bash
# Runs Warren's libFuzzer targets side by side, each until it has used CPU_SECONDS of CPU
# time (user + system, read from /proc), not of wall-clock time: on a shared machine a
# wall-clock budget gives each target only its share of the cores.
#
#   bash .ci/fuzz-cpu.sh CPU_SECONDS [TARGET...]       # no TARGET: all of them
#
# Not part of .ci/run (docs/security.md, *Fuzzing*). Needs what .ci/fuzz.sh needs: a
# nightly toolchain and cargo-fuzz. Each target starts from its committed corpus and its
# regression inputs (read only) and writes new inputs to a scratch corpus
# ($FUZZ_WORK/<target>, default /tmp/warren-fuzz-cpu). When a target reaches its budget it
# gets SIGINT, and libFuzzer prints its final stats (-print_final_stats=1) and exits 72.
# Any other exit (a crash, panic, out-of-memory or timeout) is a failure: the script prints
# libFuzzer's report and the artefact and exits non-zero after every target has finished.
# At the end it prints one line per target: CPU seconds, wall seconds, executions.
#
# Environment: FUZZ_WORK, FUZZ_TARGET_DIR (default fuzz/target), FUZZ_RSS_MB (default
# 2048), FUZZ_TIMEOUT (libFuzzer's -timeout, wall-clock seconds per input, default 10:
# raise it when the targets run niced beside other work, where an input starved of CPU
# is not a hang), FUZZ_NO_BUILD=1 (use the binaries already built).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT/fuzz"

BUDGET="${1:-}"
if ! [[ "$BUDGET" =~ ^[0-9]+$ ]]; then
    echo "usage: .ci/fuzz-cpu.sh CPU_SECONDS [TARGET...]" >&2
    exit 2
fi
shift
TIMEOUT="${FUZZ_TIMEOUT:-10}"
# shellcheck source=fuzz-lib.sh
source "$ROOT/.ci/fuzz-lib.sh"
# WORK, TARGET_DIR, RSS_MB, and TARGETS: all unless some are named.
fuzz_settings fuzz-cpu /tmp/warren-fuzz-cpu "$@"
BIN_DIR="$TARGET_DIR/x86_64-unknown-linux-gnu/release"
TICKS="$(getconf CLK_TCK)"
# Same build as .ci/fuzz.sh: no sanitizer, debug assertions on.
if [[ "${FUZZ_NO_BUILD:-0}" != 1 ]]; then
    cargo +nightly fuzz build -s none -a --target-dir "$TARGET_DIR"
fi

mkdir -p "$WORK"
declare -A PID START CPU
for t in "${TARGETS[@]}"; do
    [[ -x "$BIN_DIR/$t" ]] || { echo "fuzz-cpu: no binary $BIN_DIR/$t" >&2; exit 2; }
    mkdir -p "$WORK/$t"
    seeds=("$ROOT/fuzz/corpus/$t")
    [[ -d "$ROOT/fuzz/regressions/$t" ]] && seeds+=("$ROOT/fuzz/regressions/$t")
    "$BIN_DIR/$t" "$WORK/$t" "${seeds[@]}" -print_final_stats=1 -rss_limit_mb="$RSS_MB" \
        -timeout="$TIMEOUT" -artifact_prefix="$WORK/$t-" >"$WORK/$t.log" 2>&1 &
    PID[$t]=$!
    START[$t]=$(date +%s)
    CPU[$t]=0
done
# Stop whatever is still running if the script itself is stopped.
trap 'for p in "${PID[@]}"; do kill -INT "$p" 2>/dev/null || true; done' EXIT

cpu_seconds() { # utime + stime of a live process, whole seconds
    awk -v hz="$TICKS" '{ sub(/.*\) /, ""); print int(($12 + $13) / hz) }' "/proc/$1/stat"
}

declare -A RC WALL
running=${#TARGETS[@]}
while [[ $running -gt 0 ]]; do
    sleep 5
    running=0
    for t in "${TARGETS[@]}"; do
        [[ -n "${RC[$t]:-}" ]] && continue
        p=${PID[$t]}
        if [[ -r /proc/$p/stat ]] && [[ "$(awk '{ sub(/.*\) /, ""); print $1 }' /proc/$p/stat)" != Z ]]; then
            CPU[$t]=$(cpu_seconds "$p")
            if [[ ${CPU[$t]} -ge $BUDGET ]]; then
                kill -INT "$p" 2>/dev/null || true
            fi
            running=$((running + 1))
        else
            rc=0
            wait "$p" || rc=$?
            RC[$t]=$rc
            WALL[$t]=$(( $(date +%s) - START[$t] ))
            echo "fuzz-cpu: $t ended (exit $rc) after ${CPU[$t]} s CPU, ${WALL[$t]} s wall" >&2
        fi
    done
done
trap - EXIT

FAILED=()
echo
printf '%-16s %8s %8s %14s %9s  %s\n' target cpu_s wall_s executions slowest_s \
    "libFuzzer's last stats line"
for t in "${TARGETS[@]}"; do
    log="$WORK/$t.log"
    execs=$(grep -oE '^stat::number_of_executed_units: +[0-9]+' "$log" | awk '{ print $2 }' || true)
    slowest=$(grep -oE '^stat::slowest_unit_time_sec: +[0-9]+' "$log" | awk '{ print $2 }' || true)
    last=$(grep -E '^#[0-9]+' "$log" | tail -n 1 || true)
    printf '%-16s %8s %8s %14s %9s  %s\n' "$t" "${CPU[$t]}" "${WALL[$t]}" "${execs:-?}" \
        "${slowest:-?}" "$last"
    # 72: libFuzzer's exit after SIGINT (-interrupted_exit_code), i.e. our budget.
    if [[ ${RC[$t]} -ne 72 ]] || [[ ${CPU[$t]} -lt $BUDGET ]] || [[ -z "$execs" ]]; then
        FAILED+=("$t")
    fi
done
for t in "${FAILED[@]}"; do
    echo >&2
    echo "!!! fuzz $t FAILED (exit ${RC[$t]}, ${CPU[$t]} s CPU of $BUDGET); the report:" >&2
    grep -E -A 30 'panicked at|ERROR: libFuzzer' "$WORK/$t.log" | head -n 60 >&2 \
        || tail -n 40 "$WORK/$t.log" >&2
    ls "$WORK/$t-"* 2>/dev/null >&2 || true
done
if [[ ${#FAILED[@]} -gt 0 ]]; then
    echo "fuzz-cpu: FAILED: ${FAILED[*]}" >&2
    exit 1
fi
echo "fuzz-cpu: ok (${TARGETS[*]}, $BUDGET s CPU each)"
