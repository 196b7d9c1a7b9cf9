#!/usr/bin/env bash
# scripts/gpu_check.sh's own plumbing on a CPU host: with no GPU binaries it
# reports every GPU step "not available" (never a number), and its pp2_1f1b
# job, run from a release bundle built by scripts/package.sh with the job's
# workers on the CPU (--pp2_device cpu), trains and compares against the
# batonctl-local CPU run: the same bits, so both differences are exactly 0;
# likewise the same job in bf16 (pp2_1f1b_bf16), whose losses are not fp32's.
# result.json is valid JSON and the script exits 0.
set -euo pipefail

RUNFILES="${TEST_SRCDIR:?}/baton"
WORK="${TEST_TMPDIR:?}/gpu_check"
rm -rf "$WORK"
mkdir -p "$WORK/bins" "$WORK/dist" "$WORK/nobin"
fail() { echo "FAIL: $*" >&2; exit 1; }

ln -s "$RUNFILES/coordinator/baton-coordinator" "$WORK/bins/baton-coordinator"
ln -s "$RUNFILES/worker/baton-worker" "$WORK/bins/baton-worker"
ln -s "$RUNFILES/cli/batonctl" "$WORK/bins/batonctl"
bash "$RUNFILES/scripts/package.sh" --bin_dir "$WORK/bins" --out "$WORK/dist" >/dev/null
tarball=$(echo "$WORK"/dist/baton-*-linux-x86_64.tar.gz)
[ -f "$tarball" ] || fail "no release tarball"

rc=0
bash "$RUNFILES/scripts/gpu_check.sh" --bin "$WORK/nobin" --out "$WORK/out" --release "$tarball" \
  --pp2_device cpu --budget 120 >"$WORK/stdout" 2>&1 || rc=$?
result="$WORK/out/result.json"
[ -f "$result" ] || fail "no result.json; output: $(tail -n 20 "$WORK/stdout")"
cat "$result"
[ "$rc" -eq 0 ] || fail "gpu_check exited $rc: $(cat "$WORK/out/gpu_check.log")"
python3 -c 'import json, sys; json.load(open(sys.argv[1]))' "$result" || fail "result.json is not JSON"
grep -q '"name": "pp2_1f1b", "status": "pass"' "$result" ||
  fail "pp2_1f1b did not pass: $(tail -n 30 "$WORK/out/pp2_1f1b.out")"
grep -q '"pp2_loss_max_rel_diff": 0' "$result" || fail "CPU vs CPU losses differ"
grep -q '"pp2_weights_max_rel_diff": 0' "$result" || fail "CPU vs CPU weights differ"
grep -q '"name": "pp2_1f1b_bf16", "status": "pass"' "$result" ||
  fail "pp2_1f1b_bf16 did not pass: $(tail -n 30 "$WORK/out/pp2_1f1b_bf16.out")"
grep -q '"pp2_bf16_loss_max_rel_diff": 0' "$result" || fail "CPU vs CPU bf16 losses differ"
grep -q '"pp2_bf16_weights_max_rel_diff": 0' "$result" || fail "CPU vs CPU bf16 weights differ"
# The bf16 job really ran in bf16: its losses are not the fp32 job's.
cmp -s "$WORK/out/pp2/cpu.loss" "$WORK/out/pp2_bf16/cpu.loss" && fail "the bf16 job's losses equal the fp32 job's"
grep -q '"name": "cuda_ops", "status": "not available' "$result" || fail "cuda_ops not reported as not available"
if grep -E '"(gpt2_small|bf16_gemm)' "$result"; then fail "a GPU number without a GPU"; fi
echo "PASS"
