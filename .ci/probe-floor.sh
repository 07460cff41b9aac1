#!/usr/bin/env bash
# The CPU floor of a confirmed 1 KiB message with three copies on disk (issue 18,
# docs/performance.md "CPU at everyday rates"): compiles .ci/fsync-floor.rs (std only) with
# rustc and runs it in a scratch folder under /tmp (the disk Warren's benchmarks use) at
# RATE msg/s for SECS, with each message's ack as a second round: none, synced or unsynced.
# Prints the three nodes' CPU per message and in cores, and the confirm latency. Not part
# of CI.
#
#   bash .ci/probe-floor.sh 1000 10 synced
set -eu
[[ $# == 3 ]] || { sed -n '2,9p' "$0" >&2; exit 2; }
T=$(mktemp -d /tmp/fsync-floor.XXXX)
trap 'rm -rf "$T"' EXIT
rustc --edition 2021 -O "$(dirname "$0")/fsync-floor.rs" -o "$T/fsync-floor"
mkdir "$T/data"
"$T/fsync-floor" "$T/data" "$1" "$2" "$3"
