#!/usr/bin/env bash
# Runs golden_check on every golden at TP 1/2 × PP 1/2, and on the goldens
# listed after --vocab_parallel also at TP 2 × PP 1/2 with the vocabulary-
# parallel embedding and head; fails if any run differs from PyTorch by more
# than 1e-4.
#   golden_check_test.sh CHECK [--device=D] GOLDEN... [--vocab_parallel GOLDEN...]
set -u
check=$1
shift
device=--device=cpu
if [[ "${1:-}" == --device=* ]]; then
  device=$1
  shift
fi
failed=0
run() {
  if ! "$check" "$device" "$@" | tail -1; then
    echo "FAILED: $*"
    failed=1
  fi
}
vocab_parallel=0
for golden in "$@"; do
  if [[ "$golden" == --vocab_parallel ]]; then
    vocab_parallel=1
    continue
  fi
  if ((vocab_parallel)); then
    for pp in 1 2; do run --golden="$golden" --tp=2 --pp="$pp" --vocab_parallel; done
  else
    for tp in 1 2; do
      for pp in 1 2; do run --golden="$golden" --tp="$tp" --pp="$pp"; done
    done
  fi
done
exit "$failed"
