#!/usr/bin/env bash
# Runs baton's and PyTorch's one-thread GPT training step side by side
# (layers=4 d_model=256 heads=8 vocab=256 seq_len=128 micro_batch=8) and prints
# the throughput ratio (fastest step of each; the median is printed too).
# Extra arguments go to both (e.g. --steps=20).
# PyTorch: Debian's python3-torch or PyPI's torch; set PYTHON to choose.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1

bazel build //bench:model_bench >/dev/null 2>&1 || bazel build //bench:model_bench
baton_line=$(bazel-bin/bench/model_bench "$@")
echo "$baton_line"

python=${PYTHON:-}
if [[ -z "$python" ]]; then
  for candidate in python3 /usr/bin/python3; do
    if "$candidate" -c "import torch" >/dev/null 2>&1; then python=$candidate; break; fi
  done
fi
if [[ -z "$python" ]]; then
  echo "no Python with torch found (apt-get install python3-torch, or set PYTHON)" >&2
  exit 1
fi
torch_line=$("$python" bench/model_bench_torch.py "$@")
echo "$torch_line"

rate() { sed -n 's/.*tokens_per_s=\([0-9.]*\).*/\1/p' <<<"$1"; }
awk -v b="$(rate "$baton_line")" -v t="$(rate "$torch_line")" \
  'BEGIN { printf "ratio baton/torch tokens_per_s = %.2f\n", b / t }'
