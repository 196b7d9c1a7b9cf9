#!/bin/bash
# An imported Hugging Face checkpoint is what a job resumes from: import
# tests/hf/testdata/MODEL (default gpt2_tiny), run one step of a job of that
# model at pp 2 × tp 2 with lr 0 (AdamW moves nothing), and out/final must
# hold the imported weights bit for bit (`checkpoint diff` max_abs_diff 0). A
# job that ignored the checkpoint would hold its seed's initial weights
# instead.
#   hf_resume_test.sh BATONCTL TESTDATA [MODEL 'MODEL_BLOCK']
set -euo pipefail
batonctl=$1
testdata=$2
model=${3:-gpt2_tiny}
model_block=${4:-'model { layers: 2 d_model: 32 heads: 4 vocab: 64 seq_len: 16 }'}
tmp=${TEST_TMPDIR:-$(mktemp -d)}
rm -rf "$tmp/ckpt" "$tmp/run"
"$batonctl" checkpoint import-hf "$testdata/$model" --out="$tmp/ckpt"
cat >"$tmp/job.textproto" <<JOB
name: "hf-resume"
$model_block
parallel { pp: 2 tp: 2 dp: 1 }
schedule { kind: "1f1b" microbatches: 2 }
train { steps: 1 micro_batch_size: 2 lr: 0.0 weight_decay: 0.0 grad_clip: 0.0 seed: 1 }
data { synthetic { task: "addition" } }
JOB
"$batonctl" local --job="$tmp/job.textproto" --out="$tmp/run" --resume="$tmp/ckpt" --timeout_s=120 >"$tmp/local.log" 2>&1 || {
  cat "$tmp/local.log"
  echo "FAIL: the job resumed from the imported checkpoint did not finish"
  exit 1
}
diff=$("$batonctl" checkpoint diff "$tmp/run/final" "$tmp/ckpt" --json)
echo "$diff"
if ! grep -q '"max_abs_diff": 0,' <<<"$diff"; then
  echo "FAIL: out/final does not hold the imported weights: the job did not resume from the checkpoint"
  exit 1
fi
echo PASS
