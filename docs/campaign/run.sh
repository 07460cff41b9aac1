#!/bin/bash
# The long campaign on one binary: seed s runs the extended mix when odd, the classic mix
# when even, 5 nodes when s % 10 == 0; one line per run appended to results.log.
cd /tmp/campaign
for s in $(seq $1 $(($2 - 1))); do
  [ -e /tmp/campaign/stop ] && break
  args="--seed $s --duration 20 --bin /tmp/chaos-bin"
  if [ $((s % 2)) -eq 1 ]; then args="$args --extended"; fi
  if [ $((s % 10)) -eq 0 ]; then args="$args --nodes 5"; fi
  start=$(date +%s)
  /tmp/chaos-bin/warren-chaos $args > run-$s.out 2>&1
  rc=$?
  line=$(grep "^seed=$s " run-$s.out | tail -1)
  echo "rc=$rc secs=$(( $(date +%s) - start )) args=[$args] $line" >> results.log
  [ $rc -eq 0 ] && rm -f run-$s.out
done
