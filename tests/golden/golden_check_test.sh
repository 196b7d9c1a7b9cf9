#!/usr/bin/env bash
# Runs golden_check on every golden at TP 1/2 × PP 1/2 (in fp32 also at CP 2,
# CP 2 with TP 2 × PP 2, and CP 4, except for the goldens listed after
# --no_cp: MoE models, which context parallelism does not take), and on the
# goldens listed after --vocab_parallel also at TP 2 × PP 1/2 with the
# vocabulary-parallel embedding and head; fails if any run differs from
# PyTorch by more than golden_check's tolerance (fp32: 1e-4; bf16: 1e-2
# losses, 5e-2 gradients). With --precision=bf16 a run also fails when its
# worst error is below 1e-5: then the model did not round to bf16 at all
# (fp32 runs stay near 1e-6).
#   golden_check_test.sh CHECK [--device=D] [--precision=P] GOLDEN...
#       [--no_cp GOLDEN...] [--vocab_parallel GOLDEN...]
set -u
check=$1
shift
device=--device=cpu
precision=--precision=fp32
while [[ "${1:-}" == --device=* || "${1:-}" == --precision=* ]]; do
  case "$1" in
    --device=*) device=$1 ;;
    *) precision=$1 ;;
  esac
  shift
done
failed=0
run() {
  local out
  out=$("$check" "$device" "$precision" "$@")
  local rc=$?
  echo "$out" | tail -1
  if ((rc != 0)); then
    echo "$out"
    echo "FAILED: $*"
    failed=1
  elif [[ "$precision" == --precision=bf16 ]] &&
       ! echo "$out" | tail -1 | awk '{ for (i = 1; i < NF; i++) if ($i == "worst") exit !($(i + 1) + 0 > 1e-5); exit 1 }'; then
    echo "FAILED: $* in bf16 is as close to the golden as fp32: no bf16 rounding took place"
    failed=1
  fi
}
mode=all  # then no_cp or vocab_parallel, as the markers say
for golden in "$@"; do
  case "$golden" in
    --no_cp) mode=no_cp; continue ;;
    --vocab_parallel) mode=vocab_parallel; continue ;;
  esac
  if [[ "$mode" == vocab_parallel ]]; then
    for pp in 1 2; do run --golden="$golden" --tp=2 --pp="$pp" --vocab_parallel; done
  else
    for tp in 1 2; do
      for pp in 1 2; do run --golden="$golden" --tp="$tp" --pp="$pp"; done
    done
    # Context parallelism (ring attention; fp32 only).
    if [[ "$mode" == all && "$precision" == --precision=fp32 ]]; then
      run --golden="$golden" --cp=2
      run --golden="$golden" --tp=2 --pp=2 --cp=2
      run --golden="$golden" --cp=4
    fi
  fi
done
exit "$failed"
