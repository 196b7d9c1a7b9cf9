#!/usr/bin/env bash
# Mixture of Experts in one stage (bench/model_bench, CPU, one BLAS thread):
# GPT-2 layers=4 d_model=256 heads=8 seq_len=128, micro_batch 8 (1024 tokens
# a step), every block MoE with 8 experts, against the dense model measured
# in the same run, rounds interleaved (the machine is shared and noisy).
# Prints per configuration the best step time and its ratio to dense, and
# the GEMM share of the step: top-1 computes one expert MLP per token (the
# dense model's GEMM work, 8x its MLP parameters), top-2 two, so the ratio
# over the GEMM work left is the routing's cost (router, top-k, dispatch
# plan, permute, combine and the host synchronisation for the counts).
# One stage has no all-to-all: expert parallelism in jobs (parallel.ep) and
# its all-to-all share are measured by bench/ep_bench.sh.
# Usage: bash bench/moe_bench.sh   (ROUNDS=5 ...)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${ROUNDS:-3}
bazel build -c opt //bench:model_bench >/dev/null 2>&1
bench=$(bazel info -c opt bazel-bin 2>/dev/null)/bench/model_bench
common=(--layers=4 --d_model=256 --heads=8 --vocab=256 --seq_len=128 --micro_batch=8 --steps=8)
configs=("dense|" "top1_cap1.25|--moe_experts=8 --moe_top_k=1 --moe_capacity_factor=1.25"
         "top2_cap1.25|--moe_experts=8 --moe_top_k=2 --moe_capacity_factor=1.25"
         "top2_dropless|--moe_experts=8 --moe_top_k=2")
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
for ((r = 0; r < rounds; r++)); do
  for c in "${configs[@]}"; do
    name=${c%%|*}
    # shellcheck disable=SC2086
    line=$("$bench" "${common[@]}" ${c#*|})
    echo "$name $line" >> "$tmp"
  done
done
python3 - "$tmp" <<'PY'
import re, sys
best, share = {}, {}
for line in open(sys.argv[1]):
    name = line.split()[0]
    ms = float(re.search(r"best_step_ms=([\d.]+)", line).group(1))
    g = float(re.search(r"gemm_share=([\d.]+)", line).group(1))
    if name not in best or ms < best[name]:
        best[name], share[name] = ms, g
print(f"{'config':<16}{'best step ms':>14}{'vs dense':>10}{'gemm share':>12}")
for name in best:
    print(f"{name:<16}{best[name]:>14.1f}{best[name] / best['dense']:>10.2f}{share[name]:>12.3f}")
PY
