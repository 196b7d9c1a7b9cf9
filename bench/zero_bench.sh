#!/usr/bin/env bash
# ZeRO (parallel.zero_stage) on the real system: coordinator + worker daemons
# on loopback, driven by batonctl local, GPT layers=4 d_model=256 heads=8
# vocab=256 seq_len=64 (3.2 M parameters), pp=1, Gloo. For dp 2 and 4 and
# each zero_stage the workers accept, it prints per rank (the largest rank,
# from the StepDone fields in steps.jsonl):
#   - model state bytes: weights, grads, optimizer (AdamW moments), and the
#     ratio to zero_stage 0 at the same dp (ZeRO-1 predicts moments / dp);
#   - bytes the DP collectives sent per step, against the ring formula
#     2 (dp-1)/dp x the gradient buffer's bytes (ZeRO paper: stage 1 moves the same volume
#     as the all-reduce: a reduce-scatter plus an all-gather);
#   - median step time (first step skipped) and its ratio to zero_stage 0.
# zero_stage 2 and 3 are refused by the coordinator (not implemented yet);
# the bench runs them to show the refusal is still what a user gets.
# Usage: bash bench/zero_bench.sh    (STEPS=12 bash bench/zero_bench.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${STEPS:-8}
bazel build -c opt //cli:batonctl //coordinator:baton-coordinator //worker:baton-worker >/dev/null 2>&1
ctl=$(bazel info -c opt bazel-bin 2>/dev/null)/cli/batonctl
tmp=$(mktemp -d /tmp/baton-zero-bench.XXXXXX)
trap 'rm -rf "$tmp"' EXIT

job() {  # job DP ZERO -> job text
  cat <<EOF
name: "zero-dp$1-z$2"
model { layers: 4 d_model: 256 heads: 8 vocab: 256 seq_len: 64 }
parallel { dp: $1 zero_stage: $2 }
schedule { kind: "1f1b" microbatches: 2 }
train { steps: $steps micro_batch_size: 2 lr: 0.0003 seed: 1 }
data { synthetic { task: "addition" } }
EOF
}

results="$tmp/results.jsonl"
for dp in 2 4; do
  for zero in 0 1 2 3; do
    name="dp${dp}-z${zero}"
    job "$dp" "$zero" > "$tmp/$name.textproto"
    if "$ctl" local --job="$tmp/$name.textproto" --out="$tmp/$name" > "$tmp/$name.log" 2>&1; then
      python3 - "$dp" "$zero" "$tmp/$name/steps.jsonl" >> "$results" <<'PY'
import json, sys
dp, zero, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
steps = [json.loads(l) for l in open(path) if '"step"' in l]
steps = steps[1:]  # the first step warms up
walls = sorted(s["wall_seconds"] for s in steps)
last = steps[-1]
dp_bytes = sorted(s["max_dp_bytes"] for s in steps)
print(json.dumps({"dp": dp, "zero": zero, "median_step_s": walls[len(walls) // 2],
                  "weights": last["max_weights_bytes"], "grads": last["max_grads_bytes"],
                  "optimizer": last["max_optimizer_bytes"], "dp_bytes": dp_bytes[len(dp_bytes) // 2]}))
PY
    else
      why=$(grep -m1 -o 'zero_stage[^"]*' "$tmp/$name.log" || true)
      printf '{"dp": %d, "zero": %d, "refused": %s}\n' "$dp" "$zero" \
        "$(python3 -c 'import json,sys; print(json.dumps(sys.argv[1]))' "${why:-see the log}")" >> "$results"
    fi
  done
done

python3 - "$results" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
base = {r["dp"]: r for r in rows if r["zero"] == 0 and "refused" not in r}
mib = lambda b: b / 1048576
print("dp zero | weights MiB  grads MiB  optimizer MiB (x stage 0) | DP bytes/step MiB  formula MiB  ratio | step s (x stage 0)")
for r in rows:
    if "refused" in r:
        print(f"{r['dp']:>2} {r['zero']:>4} | refused: {r['refused'][:110]}")
        continue
    b = base[r["dp"]]
    n = r["dp"]
    formula = 2 * (n - 1) / n * b["grads"]  # the whole gradient buffer (stage 0's)
    print(f"{n:>2} {r['zero']:>4} | {mib(r['weights']):11.2f} {mib(r['grads']):10.2f} {mib(r['optimizer']):9.2f} "
          f"({r['optimizer'] / b['optimizer']:.3f}) | {mib(r['dp_bytes']):17.2f} {mib(formula):12.2f} "
          f"{r['dp_bytes'] / formula:6.3f} | {r['median_step_s']:.3f} ({r['median_step_s'] / b['median_step_s']:.2f})")
PY
