#!/usr/bin/env bash
# What in-memory recovery snapshots cost a CPU worker's host RAM: the real
# system (coordinator + two worker daemons on loopback, batonctl local) runs a
# GPT of layers=4 d_model=256 (3.16 M parameters, one stage, dp 2: each
# worker is the other's buddy) with fault_tolerance.snapshot_every_steps 1
# and 0, alternated, ROUNDS rounds. Each run's figure is the larger of the two
# workers' peak resident memory (VmHWM) once step 30 of 40 is in steps.jsonl
# (before the final save). Prints the medians and the difference in shard
# states (values + both AdamW moments: 12 bytes a parameter), the number the
# coordinator's memory estimate uses (coordinator/memory_estimate.cc,
# kSnapshotStates).
# Usage: bash bench/snapshot_memory_bench.sh    (ROUNDS=5 bash bench/snapshot_memory_bench.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${ROUNDS:-3}
bazel build -c opt //cli:batonctl //coordinator:baton-coordinator //worker:baton-worker >/dev/null 2>&1
ctl=$(bazel info -c opt bazel-bin 2>/dev/null)/cli/batonctl
tmp=$(mktemp -d /tmp/baton-snapshot-memory.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
params=3167744  # 4 blocks of 12 d^2 + 13 d, wte and wpe 16 x d each, the final norm 2 d (d = 256; the head is the tied wte)

job() {  # job EVERY -> a job file
  cat > "$tmp/job$1.textproto" <<EOF
name: "snapmem$1"
model { layers: 4 d_model: 256 heads: 4 vocab: 16 seq_len: 16 }
parallel { pp: 1 tp: 1 dp: 2 }
schedule { kind: "1f1b" microbatches: 2 }
train { steps: 40 micro_batch_size: 1 lr: 0.003 weight_decay: 0.01 grad_clip: 1.0 seed: 11 }
data { synthetic { task: "addition" } }
fault_tolerance { snapshot_every_steps: $1 }
EOF
  echo "$tmp/job$1.textproto"
}

peak() {  # peak JOB -> the workers' largest VmHWM in kB at step 30
  local out="$tmp/out$RANDOM" max=0 h
  "$ctl" local --job="$1" --out="$out" --workers=2 > "$out.log" 2>&1 &
  local ctl_pid=$!
  while kill -0 "$ctl_pid" 2>/dev/null; do
    if [[ -f $out/steps.jsonl ]] && grep -q '"step": *30[,}]' "$out/steps.jsonl"; then
      for p in $(pgrep -P "$ctl_pid"); do
        if grep -q baton-worker "/proc/$p/cmdline" 2>/dev/null; then
          h=$(awk '/VmHWM/ {print $2}' "/proc/$p/status")
          ((h > max)) && max=$h
        fi
      done
      break
    fi
    sleep 0.1
  done
  wait "$ctl_pid" || { echo "run failed: $(tail -3 "$out.log")" >&2; exit 1; }
  echo "$max"
}

median() { tr ' ' '\n' | sed '/^$/d' | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

on_job=$(job 1)
off_job=$(job 0)
on="" off=""
for ((r = 1; r <= rounds; ++r)); do
  on="$on $(peak "$on_job")"
  off="$off $(peak "$off_job")"
done
on_median=$(median <<< "$on")
off_median=$(median <<< "$off")
echo "peak RSS per worker (kB), snapshots every step:$on (median $on_median)"
echo "peak RSS per worker (kB), no snapshots:        $off (median $off_median)"
awk -v on="$on_median" -v off="$off_median" -v p="$params" 'BEGIN {
  state = 12 * p / 1024
  printf "snapshots cost %.0f kB = %.1f shard states of %.0f kB\n", on - off, (on - off) / state, state
}'
