#!/usr/bin/env bash
# Sequence parallelism (parallel.sequence_parallel) on the real system:
# coordinator + worker daemons on loopback, driven by batonctl local, GPT
# layers=4 d_model=256 heads=8 vocab=256 seq_len=128, micro_batch_size 4
# (512 tokens a microbatch), pp=1, Gloo. For tp 2 and 4, with and without
# SP, it prints per rank (the largest, from steps.jsonl):
#   - the step's activation high-water (max_activation_bytes) and its ratio
#     to TP alone (SP keeps the residual stream, the norms and their outputs
#     at 1/tp; the gathered output gradients the weight gradients read stay
#     whole);
#   - bytes the TP collectives sent per step and the ratio to TP alone: TP's
#     4 all-reduces per block become 4 reduce-scatters + 4 all-gathers (the
#     same ring volume) plus 2 all-gathers of the norm outputs in the weight
#     pass (Megatron's re-gather): 1.25 x per block, plus the gathers at the
#     stage's ends;
#   - median step time (first step skipped) and its ratio to TP alone;
#   - the last step's loss (the same model either way, to rounding).
# Usage: bash bench/sp_bench.sh    (STEPS=12 bash bench/sp_bench.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${STEPS:-8}
bazel build -c opt //cli:batonctl //coordinator:baton-coordinator //worker:baton-worker >/dev/null 2>&1
ctl=$(bazel info -c opt bazel-bin 2>/dev/null)/cli/batonctl
tmp=$(mktemp -d /tmp/baton-sp-bench.XXXXXX)
trap 'rm -rf "$tmp"' EXIT

job() {  # job TP SP -> job text
  cat <<EOF
name: "sp-tp$1-$2"
model { layers: 4 d_model: 256 heads: 8 vocab: 256 seq_len: 128 }
parallel { tp: $1 sequence_parallel: $2 }
schedule { kind: "1f1b" microbatches: 2 }
train { steps: $steps micro_batch_size: 4 lr: 0.0003 seed: 1 }
data { synthetic { task: "addition" } }
EOF
}

results="$tmp/results.jsonl"
for tp in 2 4; do
  for sp in false true; do
    name="tp${tp}-${sp}"
    job "$tp" "$sp" > "$tmp/$name.textproto"
    "$ctl" local --job="$tmp/$name.textproto" --out="$tmp/$name" > "$tmp/$name.log" 2>&1 ||
      { echo "tp $tp sequence_parallel $sp failed:"; tail -20 "$tmp/$name.log"; exit 1; }
    python3 - "$tp" "$sp" "$tmp/$name/steps.jsonl" >> "$results" <<'PY'
import json, sys
tp, sp, path = int(sys.argv[1]), sys.argv[2] == "true", sys.argv[3]
steps = [json.loads(l) for l in open(path) if '"step"' in l][1:]  # the first step warms up
med = lambda k: sorted(s[k] for s in steps)[len(steps) // 2]
print(json.dumps({"tp": tp, "sp": sp, "step_s": med("wall_seconds"), "act": med("max_activation_bytes"),
                  "tp_bytes": med("max_tp_bytes"), "loss": steps[-1]["loss"]}))
PY
  done
done

python3 - "$results" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
base = {r["tp"]: r for r in rows if not r["sp"]}
mib = lambda b: b / 1048576
print("tp  SP    | activations MiB (x TP) | TP bytes/step MiB (x TP) | step s (x TP) | last loss")
for r in rows:
    b = base[r["tp"]]
    print(f"{r['tp']:>2}  {str(r['sp']):5} | {mib(r['act']):15.2f} ({r['act'] / b['act']:.3f}) | "
          f"{mib(r['tp_bytes']):17.2f} ({r['tp_bytes'] / b['tp_bytes']:.3f}) | {r['step_s']:.3f} "
          f"({r['step_s'] / b['step_s']:.2f}) | {r['loss']:.6f}")
PY
