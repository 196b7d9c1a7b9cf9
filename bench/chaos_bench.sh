#!/usr/bin/env bash
# chaos_bench: random fault schedules against real daemons on loopback.
#
#   bash bench/chaos_bench.sh [RUNS=100] [SEED=1]
#
# Each run trains a small GPT with `batonctl local --spares=1` in a layout
# drawn from {PP=3, PP=2xTP=2, PP=2xTP=2xDP=2, PP=2xTP=2 interleaved v=2} and
# injects one fault at a random step: SIGKILL (70%) or SIGSTOP past the lease
# (30%) into a worker of a random pipeline stage. It checks that the job
# completes within the time limit and that its final weights are bitwise
# equal to the fault-free run of the same layout (batonctl checkpoint diff),
# and reports, over all runs: recovery time (fault detected -> first step
# completed after the recovery, from steps.jsonl "recovered" lines) median,
# p95 and max, steps replayed, and every failure or hang. The baseline in the
# same run is the fault-free run's time per step.
set -u
runs=${1:-100}
seed=${2:-1}
root=$(cd "$(dirname "$0")/.." && pwd)
bazel build //cli:batonctl //coordinator:baton-coordinator //worker:baton-worker >/dev/null 2>&1 ||
  { echo "build failed"; exit 1; }
bin=$root/bazel-bin
work=$(mktemp -d /tmp/chaos_bench.XXXXXX)
RANDOM=$seed

layouts=("pp: 3 tp: 1 dp: 1 virtual_stages: 1|1f1b|3" "pp: 2 tp: 2 dp: 1 virtual_stages: 1|1f1b|2"
         "pp: 2 tp: 2 dp: 2 virtual_stages: 1|1f1b|2" "pp: 2 tp: 2 dp: 1 virtual_stages: 2|interleaved|2")
steps=120

job() {  # job PARALLEL KIND
  cat <<EOF
name: "chaos"
model { layers: 4 d_model: 32 heads: 4 vocab: 16 seq_len: 20 }
parallel { $1 }
schedule { kind: "$2" microbatches: 4 }
train { steps: $steps micro_batch_size: 2 lr: 0.003 weight_decay: 0.01 grad_clip: 1.0 seed: 5 }
data { synthetic { task: "addition" } }
EOF
}

# Fault-free reference per layout.
for i in "${!layouts[@]}"; do
  IFS='|' read -r parallel kind pp <<<"${layouts[$i]}"
  job "$parallel" "$kind" >"$work/job$i.textproto"
  start=$(date +%s.%N)
  "$bin/cli/batonctl" local --job="$work/job$i.textproto" --out="$work/ref$i" --bin_dir="$bin" \
    --timeout_s=300 >"$work/ref$i.log" 2>&1 || { echo "reference $i failed"; cat "$work/ref$i.log"; exit 1; }
  end=$(date +%s.%N)
  echo "reference ${layouts[$i]}: $(echo "($end - $start) / $steps * 1000" | bc -l | xargs printf '%.1f') ms/step (wall, incl. start-up)"
done

failures=0
: >"$work/recovery_seconds"
: >"$work/replayed"
for ((r = 0; r < runs; r++)); do
  i=$((RANDOM % ${#layouts[@]}))
  IFS='|' read -r parallel kind pp <<<"${layouts[$i]}"
  stage=$((RANDOM % pp))
  at=$((5 + RANDOM % (steps - 20)))
  sig=kill
  ((RANDOM % 10 < 3)) && sig=stop
  out="$work/run$r"
  if ! timeout 600 "$bin/cli/batonctl" local --job="$work/job$i.textproto" --out="$out" --bin_dir="$bin" \
      --spares=1 --inject="$sig:stage=$stage@step=$at" --timeout_s=300 >"$out.log" 2>&1; then
    echo "run $r FAILED: layout $i $sig stage $stage step $at (log: $out.log)"
    failures=$((failures + 1))
    continue
  fi
  if ! python3 - "$work/ref$i/final" "$out/final" "$bin/cli/batonctl" <<'PY'
import json, subprocess, sys
r = subprocess.run([sys.argv[3], "checkpoint", "diff", sys.argv[1], sys.argv[2], "--json"],
                   capture_output=True, text=True)
sys.exit(0 if r.returncode == 0 and json.loads(r.stdout)["max_abs_diff"] == 0 else 1)
PY
  then
    echo "run $r FAILED: final weights differ (layout $i $sig stage $stage step $at)"
    failures=$((failures + 1))
  fi
  grep -h '"recovered"' "$out/steps.jsonl" | python3 -c '
import json, sys
for line in sys.stdin: print(json.loads(line)["seconds"])' >>"$work/recovery_seconds"
  grep -h '"recovery"' "$out/steps.jsonl" | python3 -c '
import json, sys
for line in sys.stdin: print(json.loads(line)["replayed_steps"])' >>"$work/replayed"
  rm -rf "$out"
done

python3 - "$work/recovery_seconds" "$work/replayed" "$runs" "$failures" <<'PY'
import statistics, sys
secs = sorted(float(x) for x in open(sys.argv[1]) if x.strip())
replayed = [int(x) for x in open(sys.argv[2]) if x.strip()]
runs, failures = int(sys.argv[3]), int(sys.argv[4])
print(f"runs {runs}, failures {failures}, recoveries {len(secs)}")
if secs:
    p95 = secs[min(len(secs) - 1, int(0.95 * len(secs)))]
    print(f"recovery seconds: median {statistics.median(secs):.2f}  p95 {p95:.2f}  max {secs[-1]:.2f}")
print(f"steps replayed: total {sum(replayed)}, max per recovery {max(replayed) if replayed else 0}")
PY
echo "work dir: $work"
exit $((failures > 0))
