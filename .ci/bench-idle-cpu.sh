#!/bin/bash
# The CPU an idle 3-node cluster uses (no clients): utime + stime of each node, summed, over
# SECS seconds after 10 s of settling. Prints one line; exits non-zero if a node died.
#
#   bash .ci/bench-idle-cpu.sh [WARREN_BIN] [SECS]
#
# The nodes run config/cluster/node{1,2,3}.toml moved to 127.0.66.{1,2,3}, data in a
# temporary folder that is removed at the end.
set -euo pipefail
BIN="${1:-target/release/warren}"
SECS="${2:-60}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
D="$(mktemp -d /tmp/warren-idle-cpu.XXXXXX)"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$D"
}
trap cleanup EXIT
for i in 1 2 3; do
  python3 - "$ROOT/config/cluster/node$i.toml" "$D/node$i.toml" "$D/data$i" <<'PY'
import re, sys
src, dst, data = sys.argv[1:]
s = open(src).read()
s = re.sub(r'data_dir = ".*"', 'data_dir = "%s"' % data, s)
# Each node on its own address: 2567N is node N-1's link port.
s = re.sub(r'"127\.0\.0\.1:(2567(\d))"', lambda m: '"127.0.66.%d:%s"' % (int(m.group(2)) - 1, m.group(1)), s)
node = re.search(r'node_id = (\d+)', s).group(1)
s = s.replace('"127.0.0.1:', '"127.0.66.%s:' % node)
open(dst, "w").write(s)
PY
  "$BIN" --config "$D/node$i.toml" > "$D/node$i.log" 2>&1 &
  pids+=($!)
done
ticks() {
  local sum=0 p
  for p in "${pids[@]}"; do
    [ -r "/proc/$p/stat" ] || { echo "node $p died; logs in $D" >&2; trap - EXIT; exit 1; }
    read -r -a f < "/proc/$p/stat"
    sum=$((sum + f[13] + f[14]))
  done
  echo "$sum"
}
sleep 10
t0=$(ticks)
sleep "$SECS"
t1=$(ticks)
hz=$(getconf CLK_TCK)
python3 -c "t=$t1-$t0; print(f'idle 3-node cluster, {$SECS} s: {t} ticks of CPU summed over the nodes = {t/$hz/$SECS*100:.2f} % of one core ($BIN)')"
