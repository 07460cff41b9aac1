#!/usr/bin/env bash
# The short fault campaign (issue 16): warren-chaos against the release build, a few seeds
# chosen for different fault mixes, within 14 minutes on a 2-core machine.
#
#   bash .ci/chaos.sh        builds warren, warrenctl and warren-chaos (release), then runs
#
# Prints each run's line and `chaos: N passed, M failed`; exits non-zero when any run
# failed (or the tool could not run). Needs root and nftables (`nft`), as warren-chaos
# checks at its start. A failing run's data dir and node logs are kept (the line says where).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"

cargo build --release --bin warren --bin warrenctl --bin warren-chaos

# Fault mixes at --duration 20 (see `warren-chaos --seeds A..B --plan-only --duration 20`):
#   16  SIGSTOP of ha.q0's master and of the leader, flapping cut of ha.q0's master
#   19  kill -9 of node2, of ha.q1's master and of the leader
#   20  minority partition of node2, SIGSTOP of node1, kill -9 of node3
#   10  SIGTERM restart of node3, minority partition of node3, policy changes
#   25  minority partition of node2, flapping cut of node2, policy changes
#   37  minority partitions of ha.q1's master and of node1
#   54  minority partition of node1, then a 10 s SIGSTOP of ha.q0's master (bug 9 in
#       docs/reliability.md: lost confirmed messages in 4 of 4 runs before its fix)
# and on five nodes:
#   3   kill -9 of node3, a whole-cluster kill -9, a one-node minority partition
# Seeds that found the bugs listed in docs/reliability.md are left out while their bug is
# open (3-node 7 and 24); 3-node 3, 5, 12, 18, 23 and 27 found bugs fixed since, and are
# not in the set yet. Run them by hand. A client call lapin never completes (bug 8) is
# bounded and reported as client_stalls=N, not failed.
# The extended mix (--extended: disk faults, a node joining and being forgotten), which
# draws other schedules from the same seeds:
#   7   kill -9 of node1, a node joining and forgotten (bug 15: 98,070 confirmed messages
#       gone with the queue it mastered, before its fix), SIGSTOP of ha.q0's master
#   9   node1's disk full (bug 14: the node stayed up unable to confirm), policy
#       changes, a whole-cluster SIGTERM
#   21  the leader's disk slow, a minority partition, a flapping cut of the leader
#   39  the disk of ha.q0's master full: it stops itself and its queues move (bug 16:
#       committed transactions lost in the promotion's window, once in four runs before
#       its fix)
status=0
for seed in 7 9 21 39; do
    "$TARGET/release/warren-chaos" --bin "$TARGET/release" --duration 20 --extended \
        --seed "$seed" | grep -E '^(seed=[0-9]+ nodes=|chaos:)' || status=1
done
# With the dead-letter stream (--dead-letters: confirmed messages expire from a source
# queue into a target queue):
#   19  kill -9 of the source's master while the target's master was on the same node
#       (its promoted mirror dead-lettered into a target recorded as its node's but not
#       adopted there yet: 180 confirmed messages lost before the fix)
#   5223 (extended) a whole-cluster SIGTERM voids rounds of the target's master, which took
#       letters from the source on the same node (bug 24: 10 confirmed messages lost)
"$TARGET/release/warren-chaos" --bin "$TARGET/release" --duration 20 --dead-letters --seed 19 \
    | grep -E '^(seed=[0-9]+ nodes=|chaos:)' || status=1
"$TARGET/release/warren-chaos" --bin "$TARGET/release" --duration 20 --dead-letters --extended \
    --seed 5223 | grep -E '^(seed=[0-9]+ nodes=|chaos:)' || status=1
for seed in 10 16 19 20 25 37 54; do
    "$TARGET/release/warren-chaos" --bin "$TARGET/release" --duration 20 --seed "$seed" \
        | grep -E '^(seed=[0-9]+ nodes=|chaos:)' || status=1
done
"$TARGET/release/warren-chaos" --bin "$TARGET/release" --duration 20 --nodes 5 --seed 3 \
    | grep -E '^(seed=[0-9]+ nodes=|chaos:)' || status=1
exit "$status"
