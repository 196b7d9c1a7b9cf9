#!/bin/bash
# scripts/tokenize.py's shards are what baton reads: tokenize a small text
# (--encoding bytes: offline) into train and val llm.c shards, then train 2
# steps of examples/gpt2_tiny_tokens.textproto on them with batonctl local
# (real daemons). steps.jsonl must hold 2 step lines with a finite loss near
# ln(vocab) (the model read ids from the shard) and an eval line with a
# finite held-out loss.
#   tokenize_and_train_test.sh BATONCTL TOKENIZE_PY EXAMPLE_JOB
set -euo pipefail
batonctl=$1
tokenize=$2
example=$3
tmp=${TEST_TMPDIR:-$(mktemp -d)}
rm -rf "$tmp/data" "$tmp/run"
for _ in $(seq 40); do cat "$tokenize"; done >"$tmp/corpus.txt"
python3 "$tokenize" --input "$tmp/corpus.txt" --out_dir "$tmp/data" --name corpus --encoding bytes \
  --val_fraction 0.05 --warn_below 257

# The header llm.c writes and baton reads: magic 20240520, version 1, count.
python3 - "$tmp/data" <<'PY'
import glob, os, struct, sys
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.bin"))):
    data = open(path, "rb").read()
    magic, version, count = struct.unpack("<3i", data[:12])
    assert (magic, version) == (20240520, 1), (path, magic, version)
    assert len(data) == 1024 + 2 * count, (path, len(data), count)
    print(path, count, "ids")
PY

# The example as it is, but 2 steps with an evaluation after the last.
sed -e 's/^  steps: [0-9]*$/  steps: 2/' -e 's/^  eval_every_steps: [0-9]*$/  eval_every_steps: 2/' \
  "$example" >"$tmp/job.textproto"
if ! grep -q '^  steps: 2$' "$tmp/job.textproto" || ! grep -q '^  eval_every_steps: 2$' "$tmp/job.textproto"; then
  echo "FAIL: $example no longer has '  steps: N' and '  eval_every_steps: N' lines to shorten"
  exit 1
fi
"$batonctl" local --job="$tmp/job.textproto" --out="$tmp/run" --timeout_s=240 >"$tmp/local.log" 2>&1 || {
  cat "$tmp/local.log"
  echo "FAIL: 2 steps of $example on tokenize.py's shards did not finish"
  exit 1
}
cat "$tmp/run/steps.jsonl"
python3 - "$tmp/run/steps.jsonl" "$tmp/job.textproto" <<'PY'
import json, math, re, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
vocab = int(re.search(r"vocab: (\d+)", open(sys.argv[2]).read()).group(1))
steps = [l for l in lines if "step" in l]
evals = [l for l in lines if "eval" in l]
assert len(steps) == 2, "want 2 step lines, got %r" % steps
for l in steps:
    assert math.isfinite(l["loss"]), l
# Untrained weights score about ln(vocab) per target.
assert abs(steps[0]["loss"] - math.log(vocab)) < 2.0, (steps[0], math.log(vocab))
assert evals and evals[-1]["eval"] == 2, "want an eval line after step 2, got %r" % evals
assert math.isfinite(evals[-1]["loss"]) and evals[-1]["tokens"] > 0, evals[-1]
print("step losses", [l["loss"] for l in steps], "eval", evals[-1])
PY
echo PASS
