#!/bin/bash
# The long campaign on one binary: seed s runs the extended mix when odd, the classic mix
# when even, 5 nodes when s % 10 == 0; one line per run appended to results.log.
#
#   CHAOS_BIN=/tmp/chaos-bin CAMPAIGN_DIR=/tmp/campaign bash docs/campaign/run.sh A B
#
# CHAOS_BIN holds release builds of warren, warrenctl and warren-chaos (one commit);
# CAMPAIGN_DIR gets results.log and the output of every failed run. `touch
# $CAMPAIGN_DIR/stop` ends the campaign after the run going on. From session 31, seeds
# with s % 4 == 2 add the dead-letter stream (--dead-letters); CHAOS_EXTRA adds flags to
# every run.
BIN="${CHAOS_BIN:-/tmp/chaos-bin}"
DIR="${CAMPAIGN_DIR:-/tmp/campaign}"
mkdir -p "$DIR" && cd "$DIR" || exit 1
for s in $(seq $1 $(($2 - 1))); do
  [ -e "$DIR/stop" ] && break
  args="--seed $s --duration 20 --bin $BIN"
  if [ $((s % 2)) -eq 1 ]; then args="$args --extended"; fi
  if [ $((s % 10)) -eq 0 ]; then args="$args --nodes 5"; fi
  if [ $((s % 4)) -eq 2 ] && [[ "${CHAOS_EXTRA:-}" != *--dead-letters* ]]; then
    args="$args --dead-letters"
  fi
  if [ -n "${CHAOS_EXTRA:-}" ]; then args="$args $CHAOS_EXTRA"; fi
  start=$(date +%s)
  "$BIN/warren-chaos" $args > run-$s.out 2>&1
  rc=$?
  line=$(grep "^seed=$s " run-$s.out | tail -1)
  echo "rc=$rc secs=$(( $(date +%s) - start )) args=[$args] $line" >> results.log
  [ $rc -eq 0 ] && rm -f run-$s.out
done
