#!/usr/bin/env bash
# gpu_golden_check on the CPU device: the harness that scripts/gpu_check.sh
# runs on the GPU must itself agree with PyTorch where the kernels are known
# good, so a GPU failure points at the GPU path.
#   gpu_golden_check_test.sh CHECK GOLDEN...
set -u
check=$1
shift
failed=0
for golden in "$@"; do
  if ! "$check" --golden="$golden" --device=cpu | tail -1; then
    echo "FAILED: $golden"
    failed=1
  fi
done
# A device that does not parse is refused with exit 2, not a crash.
"$check" --golden="$1" --device=gpu0 >/dev/null 2>&1
[[ $? -eq 2 ]] || { echo "FAILED: --device=gpu0 was not refused with 2"; failed=1; }
exit $failed
