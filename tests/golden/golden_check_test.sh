#!/usr/bin/env bash
# Runs golden_check on every golden at TP 1/2 × PP 1/2; fails if any layout
# differs from PyTorch by more than 1e-4.
set -u
check=$1
shift
failed=0
for golden in "$@"; do
  for tp in 1 2; do
    for pp in 1 2; do
      if ! "$check" --golden="$golden" --tp="$tp" --pp="$pp" | tail -1; then
        echo "FAILED: $golden tp=$tp pp=$pp"
        failed=1
      fi
    done
  done
done
exit "$failed"
