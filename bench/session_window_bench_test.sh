#!/usr/bin/env bash
# session_window_bench at toy size, so the benchmark of docs/BENCHMARKS.md
# ("Big session messages across a round trip") keeps working: 6 MiB each way
# through the delaying proxy under both settings, every message across.
#   session_window_bench_test.sh BENCH
set -u
out=$("$1" --mib=6 --delay_ms=1 --rounds=1 2>&1)
rc=$?
echo "$out"
[[ $rc == 0 ]] || { echo "FAILED: exit $rc"; exit 1; }
for row in "gRPC default (BDP probe)" "baton (no BDP probe)" "ratio baton / gRPC default"; do
  grep -qF "$row" <<< "$out" || { echo "FAILED: no line '$row'"; exit 1; }
done
echo PASSED
