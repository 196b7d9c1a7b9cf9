#!/usr/bin/env bash
# What the control plane adds to every step, where nothing else hides it: a
# synthetic job whose ops cost 0 ms (1f1b, m = 4, 4 KiB activations) at
# pp = 1, 2 and 4, run by `batonctl local` on loopback; the median of steps
# 2..200 (`wall_seconds` of steps.jsonl: a step's share of the job's time).
#
# With one build it prints the medians. Given several builds it runs them
# alternately, ROUNDS times, and prints each one's ratio to the first's in
# the same round (the machine is shared and noisy):
#   bash bench/step_latency.sh                      # this tree, -c opt
#   ROUNDS=3 bash bench/step_latency.sh /tmp/flat-base /tmp/flat-new
# REPORT_GROUPS=1 compares this tree without and with report groups
# (docs/protocol.md; batonctl local --report_groups_min_ranks=2), the same
# way:
#   REPORT_GROUPS=1 ROUNDS=3 bash bench/step_latency.sh
# A build is a directory holding batonctl, baton-coordinator and
# baton-worker (batonctl local takes its daemons from beside itself), e.g.
#   mkdir /tmp/flat-new && cp bazel-bin/cli/batonctl \
#     bazel-bin/coordinator/baton-coordinator bazel-bin/worker/baton-worker /tmp/flat-new
# after `bazel build -c opt //cli:batonctl //coordinator:baton-coordinator
# //worker:baton-worker` in each checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${ROUNDS:-1}
[[ "$rounds" =~ ^[1-9][0-9]*$ ]] || { echo "ROUNDS=$rounds: want a positive integer" >&2; exit 2; }
builds=("$@")
labels=("$@")
flags=()
for b in "${builds[@]}"; do flags+=(""); done
if [[ ${#builds[@]} -eq 0 ]]; then
  bazel build -c opt //cli:batonctl //coordinator:baton-coordinator //worker:baton-worker >/dev/null 2>&1
  # batonctl finds the daemons in bazel-bin's package directories too.
  builds=("$(bazel info -c opt bazel-bin 2>/dev/null)/cli")
  labels=("this tree")
  flags=("")
  if [[ "${REPORT_GROUPS:-0}" == 1 ]]; then
    builds+=("${builds[0]}")
    labels+=("report groups")
    flags+=("--report_groups_min_ranks=2")
  fi
fi
for b in "${builds[@]}"; do
  [[ -x "$b/batonctl" ]] || { echo "$b: no batonctl there (want a directory with batonctl, baton-coordinator, baton-worker)" >&2; exit 2; }
done
tmp=$(mktemp -d /tmp/baton-step-latency.XXXXXX)
trap 'rm -rf "$tmp"' EXIT

median_ms() {  # median_ms BUILD PP [FLAG] -> the median step in ms
  local dir="$tmp/run"
  rm -rf "$dir" && mkdir -p "$dir"
  cat > "$dir/job.textproto" <<EOF
name: "step-latency"
model { layers: $2 synthetic { forward_ms: 0 backward_input_ms: 0 backward_weight_ms: 0 activation_bytes: 4096 } }
parallel { pp: $2 }
schedule { kind: "1f1b" microbatches: 4 }
train { steps: 200 micro_batch_size: 1 lr: 0.001 }
EOF
  "$1/batonctl" local --job="$dir/job.textproto" --out="$dir/out" ${3:+"$3"} > "$dir/log" 2>&1 || { cat "$dir/log" >&2; exit 1; }
  python3 - "$dir/out/steps.jsonl" <<'PY'
import json, statistics, sys
walls = [json.loads(l)["wall_seconds"] for l in open(sys.argv[1]) if '"loss"' in l][1:]  # drop the warm-up step
print(f"{statistics.median(walls) * 1e3:.3f}")
PY
}

for round in $(seq 1 "$rounds"); do
  for pp in 1 2 4; do
    line="round $round pp $pp (load $(cut -d' ' -f1 /proc/loadavg)):"
    first=""
    for i in "${!builds[@]}"; do
      ms=$(median_ms "${builds[$i]}" "$pp" "${flags[$i]}")
      if [[ -z "$first" ]]; then
        first=$ms
        line+=" ${labels[$i]} $ms ms"
      else
        line+=" | ${labels[$i]} $ms ms, ratio $(python3 -c "print(f'{$ms / $first:.3f}')")"
      fi
    done
    echo "$line"
  done
done
