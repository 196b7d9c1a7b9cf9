#!/usr/bin/env bash
# control_plane_bench at toy size, so the benchmark of docs/BENCHMARKS.md
# ("Control plane at scale") keeps working: a real coordinator and simulated
# workers over real gRPC finish the job with no protocol error, with and
# without spares (--job_ranks) and in report groups, and bad sizes are
# refused with exit 1.
#   control_plane_bench_test.sh BENCH COORDINATOR
set -u
bench=$1
coordinator=$2
failed=0
fail() { echo "FAILED: $*"; failed=1; }
field() {  # field JSON KEY: the value of "KEY": in the bench's one-line JSON
  sed -n "s/.*\"$2\": \"\{0,1\}\([^,\"}]*\).*/\1/p" <<< "$1"
}

run() {  # run NAME FLAGS...: the JSON line, or "" (and a failure) when it did not print one
  local name=$1
  shift
  local dir=$TEST_TMPDIR/$name
  mkdir -p "$dir"
  local out
  out=$("$bench" --coordinator="$coordinator" --dir="$dir" --idle_s=1 "$@" 2> "$dir/stderr")
  [[ $out == "{"* ]] || { fail "$name printed no JSON: $(tail -5 "$dir/stderr")"; return; }
  echo "$out"
}

expect() {  # expect NAME JSON KEY=VALUE...
  local name=$1 json=$2 pair got
  shift 2
  for pair in "$@"; do
    got=$(field "$json" "${pair%%=*}")
    [[ $got == "${pair#*=}" ]] || fail "$name: ${pair%%=*} is '$got', want '${pair#*=}' in $json"
  done
}

# Every worker steps (a connection per worker, as deployed).
json=$(run all --workers=6 --steps=10 --workers_per_connection=1)
if [[ -n $json ]]; then
  expect all "$json" job_state=done errors=0 ready=6 configured=6
  (( $(field "$json" steps_measured) >= 8 )) || fail "all: fewer than 8 steps measured: $json"
fi

# Spares: 8 sessions, a job of 4 ranks; the other 4 only heartbeat.
json=$(run spares --workers=8 --job_ranks=4 --steps=40)
if [[ -n $json ]]; then
  expect spares "$json" job_state=done errors=0 job_ranks=4 ready=8 configured=4 configure_seconds=-1.0000
  (( $(field "$json" heartbeats_measured) > 0 )) || fail "spares: no idle heartbeat measured: $json"
fi

# Report groups: RunStep to the group's leader only, which passes it on
# and reports for its members (the coordinator's log says it used them).
json=$(run groups --workers=8 --steps=20 --report_groups --workers_per_connection=1)
if [[ -n $json ]]; then
  expect groups "$json" job_state=done errors=0 report_groups=true ready=8 configured=8
  grep -q "steps reported by 1 group leaders (1 column each)" "$TEST_TMPDIR/groups/coordinator.log" ||
    fail "groups: the coordinator did not run the job in report groups: $(grep generation "$TEST_TMPDIR/groups/coordinator.log")"
fi
# pp 1 (--mesh): groups of several single-rank columns, 16 ranks each.
json=$(run columns --workers=40 --mesh=1x2x20 --steps=20 --report_groups --workers_per_connection=4)
if [[ -n $json ]]; then
  expect columns "$json" job_state=done errors=0 report_groups=true ready=40 configured=40
  grep -q "steps reported by 3 group leaders (16 columns each)" "$TEST_TMPDIR/columns/coordinator.log" ||
    fail "columns: not in 3 groups of 16 columns: $(grep generation "$TEST_TMPDIR/columns/coordinator.log")"
fi

# Bad sizes: a clear error and exit 1 (before any process is started).
for bad in "--workers=8 --job_ranks=9" "--workers=0" "--workers=100 --job_ranks=100" "--workers=5000" \
  "--workers=8 --mesh=2x2x3" "--workers=8 --mesh=2x4" "--workers=8 --mesh=0x8x1"; do
  # shellcheck disable=SC2086
  msg=$("$bench" --coordinator="$coordinator" --dir="$TEST_TMPDIR" $bad 2>&1 >/dev/null)
  rc=$?
  [[ $rc -eq 1 && $msg == *"--"* ]] || fail "$bad: exit $rc, message '$msg'"
done
exit $failed
