#!/usr/bin/env bash
# scripts/gpu_check.sh's own plumbing on a CPU host.
#
# 1. With no GPU binaries it reports every GPU step "not available" (never a
#    number), and its pp2_1f1b job, run from a release bundle built by
#    scripts/package.sh with the job's workers on the CPU (--pp2_device cpu),
#    trains and compares against the batonctl-local CPU run: the same bits,
#    so both differences are exactly 0; likewise the same job in bf16
#    (pp2_1f1b_bf16), whose losses are not fp32's. result.json is valid JSON
#    and the script exits 0.
# 2. --cuda (BUILD passes it where the CUDA toolkit is installed, with every
#    GPU binary of the check as data): `--collect` bundles them from the
#    runfiles tree (every binary, its libraries, the goldens, the script);
#    the packed bundle then runs under a cleared environment (env -i) with no
#    GPU visible (CUDA_VISIBLE_DEVICES=""): every binary's libraries resolve
#    (step libs passes), every GPU step runs its binary (none "not
#    available") and fails naming the missing GPU (not a loader error), the
#    script ends (no hang) and exits 1 with valid JSON; --report gets
#    result.json, gpu_check.log and outputs.tar.gz, nothing else.
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

if [ "${1:-}" = "--cuda" ]; then
  # Every GPU step of the check: its name in result.json.
  gpu_steps=(cuda_ops vector_ops stamp device_identity cudnn_attention cuda_backend golden_gpu_gpt_a golden_gpu_gpt_b
             golden_gpu_a_pp2 golden_gpu_a_tp2 golden_gpu_a_pp3 gemm_bench model_fp32 model_bf16
             golden_bf16_gpt_a golden_bf16_gpt_b nccl_communicator nccl_split device_staging nccl_watchdog)
  for s in "${gpu_steps[@]}"; do
    grep -q "\"name\": \"$s\", \"status\": \"not available" "$result" ||
      fail "$s is not reported 'not available' without its binary"
  done

  bash "$RUNFILES/scripts/gpu_check.sh" --collect "$WORK/bundle" --bin "$RUNFILES" >"$WORK/collect.out" 2>&1 ||
    fail "--collect failed: $(tail -n 20 "$WORK/collect.out")"
  [ -f "$WORK/bundle.tar.gz" ] || fail "--collect wrote no bundle.tar.gz"
  for b in kernels/cuda/stamp_test worker/comm/nccl_watchdog_test worker/comm/nccl_split_test \
           worker/comm/nccl_communicator_test worker/comm/device_staging_communicator_test; do
    [ -x "$WORK/bundle/bin/$b" ] || fail "bin/$b is not in the bundle"
  done
  [ -f "$WORK/bundle/data/gpt_a.safetensors" ] || fail "no goldens in the bundle"
  if ls "$WORK"/bundle/lib | grep -E '^lib(cuda|cudart|nccl|cudnn|cublas)'; then
    fail "the bundle carries the CUDA runtime"
  fi

  # The GPU host's view: only the packed bundle, the script and a clean
  # environment; here, no GPU either.
  rc=0
  env -i PATH=/usr/bin:/bin CUDA_VISIBLE_DEVICES= \
    bash "$WORK/bundle/gpu_check.sh" --bin "$WORK/bundle.tar.gz" --out "$WORK/nogpu" --report "$WORK/report" \
    >"$WORK/nogpu.stdout" 2>&1 || rc=$?
  result="$WORK/nogpu/result.json"
  [ -f "$result" ] || fail "no result.json without a GPU; output: $(tail -n 20 "$WORK/nogpu.stdout")"
  cat "$result"
  [ "$rc" -eq 1 ] || fail "gpu_check without a GPU exited $rc, not 1"
  python3 -c 'import json, sys; json.load(open(sys.argv[1]))' "$result" || fail "result.json is not JSON"
  # --report: three files, the last result among them.
  [ "$(ls "$WORK/report" | paste -sd' ' -)" = "gpu_check.log outputs.tar.gz result.json" ] ||
    fail "--report holds $(ls "$WORK/report")"
  cmp -s "$result" "$WORK/report/result.json" || fail "--report's result.json is not the last one"
  outputs=$(tar tzf "$WORK/report/outputs.tar.gz")
  grep -qx './nccl_watchdog.out' <<<"$outputs" || fail "no step outputs in outputs.tar.gz: $outputs"
  if grep -E '^\./(bundle|release)/' <<<"$outputs"; then fail "outputs.tar.gz carries the bundle"; fi
  grep -q '"name": "libs", "status": "pass"' "$result" ||
    fail "the bundle's libraries do not resolve: $(cat "$WORK/nogpu/libs.out")"
  for s in "${gpu_steps[@]}"; do
    status=$(python3 -c 'import json, sys
steps = [x for x in json.load(open(sys.argv[1]))["steps"] if x["name"] == sys.argv[2]]
print(steps[0]["status"] if steps else "missing")' "$result" "$s")
    case "$status" in
      "fail (exit "*) ;;
      *) fail "$s without a GPU: '$status', want 'fail (exit N): <cause>'" ;;
    esac
    # The cause is the GPU (or its driver), never the loader or a usage error.
    echo "$status" | grep -q -i -E 'gpu|cuda|device|driver' || fail "$s fails for another cause: $status"
    if grep -q 'error while loading shared libraries' "$WORK/nogpu/$s.out"; then
      fail "$s: $(grep 'error while loading' "$WORK/nogpu/$s.out")"
    fi
  done
fi
echo "PASS"
