#!/usr/bin/env bash
# Sourced by .ci/fuzz.sh and .ci/fuzz-cpu.sh (from the fuzz/ folder): what they share.
#
# fuzz_settings NAME DEFAULT_WORK [TARGET...] checks for a nightly toolchain and cargo-fuzz
# (exit 2 without), then sets WORK ($FUZZ_WORK or DEFAULT_WORK), TARGET_DIR
# ($FUZZ_TARGET_DIR or fuzz/target), RSS_MB ($FUZZ_RSS_MB or 2048) and TARGETS (the named
# targets, or all of them).
fuzz_settings() {
    local name="$1" default_work="$2"
    shift 2
    WORK="${FUZZ_WORK:-$default_work}"
    TARGET_DIR="${FUZZ_TARGET_DIR:-$ROOT/fuzz/target}"
    RSS_MB="${FUZZ_RSS_MB:-2048}"
    if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
        echo "$name: needs a nightly toolchain and cargo-fuzz (cargo install cargo-fuzz)" >&2
        exit 2
    fi
    if [[ $# -gt 0 ]]; then
        TARGETS=("$@")
    else
        mapfile -t TARGETS < <(cargo +nightly fuzz list)
    fi
}
