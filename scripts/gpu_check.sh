#!/usr/bin/env bash
# The GPU check: every CUDA op against the CPU op, the CUDA backend through
# the ops, the PyTorch goldens on the GPU (pp = tp = 1), the bf16 GEMM
# ceiling and a GPT-2-small-shaped training step, on one GPU, in at most
# 6 minutes. Each step has its own timeout; every step appends to
# OUT/gpu_check.log and rewrites OUT/result.json, so a run cut short still
# reports what it did. A step whose binary or feature is missing reports
# "not available", never a number.
#
# It runs prebuilt binaries, not Bazel (the GPU machine has no Bazel and no
# network). Two ways to bring them:
#
#   1. On the build machine:
#        bazel build //kernels/cuda:all //bench:gpu_gemm_bench //bench:gpu_model_bench \
#          //bench:gpu_golden_check //tests/golden:golden_check
#        scripts/gpu_check.sh --collect gpu_check_bundle
#      copies those binaries, every shared library they need that is not
#      glibc or the CUDA/NCCL/cuDNN runtime, and the golden files into
#      gpu_check_bundle/{bin,lib,data}; carry that directory to the GPU host
#      (it runs with LD_LIBRARY_PATH=bundle/lib and CUDA from the host), then
#        scripts/gpu_check.sh --bin gpu_check_bundle --out /tmp/gpu_check
#   2. On a GPU host with the source tree and Bazel:
#        scripts/gpu_check.sh --bin bazel-bin --out /tmp/gpu_check
#
# The release bundle (dist/baton-*.tar.gz, scripts/package.sh: the daemons
# and batonctl) runs the pipeline job: `--release TARBALL|DIR` (a --collect
# bundle carries dist/'s tarball as release/ when scripts/package.sh ran
# first). Step pp2_1f1b trains a small GPT with 1F1B over two baton-worker
# processes on cuda:0 (one coordinator, real gRPC and Gloo on loopback) and
# compares it with the same job on the CPU (batonctl local): every step's
# loss within 1e-4 relative and the final weights within 1e-3 relative L2
# per tensor (batonctl checkpoint diff). Step pp2_1f1b_bf16 runs the same
# job in train.precision = bf16 against the CPU's bf16 reference kernels:
# losses within 1e-2 relative, weights within 5e-2. Without a release bundle
# they report "not available". `--pp2_device cpu` runs those jobs' workers
# on the CPU instead (how CI tests this script: //tests/package:gpu_check_test).
# bf16 also runs the PyTorch goldens (golden_bf16_*: loss within 1e-2,
# gradients within 5e-2 of the float64 golden) and the GPT-2-small step.
#
# Exit status: 0 when every available step passed, 1 otherwise.
set -uo pipefail

BIN=""
OUT="${TMPDIR:-/tmp}/baton_gpu_check"
COLLECT=""
RELEASE=""
PP2_DEVICE="cuda:0"  # --pp2_device cpu: the job's plumbing on a CPU host (tests/package:gpu_check_test)
# Seconds for the whole check. The steps' own limits add up to 360 s
# (gpu 10, cuda_ops 45, cudnn_attention 10, cuda_backend 30, goldens
# 2 x 12, golden layouts 3 x 10, pp2_1f1b 45, gemm 30, model fp32 40, model
# bf16 35, golden bf16 2 x 8, pp2_1f1b_bf16 45; the last four are the bf16
# ones), so the
# check ends within 6 minutes by construction; a step is also cut to what
# is left (the budget), and the most wanted numbers come first.
BUDGET=360

usage() {
  sed -n '2,40p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
}

while [[ $# -gt 0 ]]; do
  case "$1" in
    --bin) BIN="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --collect) COLLECT="$2"; shift 2 ;;
    --release) RELEASE="$2"; shift 2 ;;
    --pp2_device) PP2_DEVICE="$2"; shift 2 ;;
    --budget) BUDGET="$2"; shift 2 ;;
    -h|--help) usage ;;
    *) echo "gpu_check: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
# Binaries by their bazel-bin path; collected bundles keep the same paths under bin/.
BINARIES=(
  kernels/cuda/cuda_ops_test
  kernels/cuda/cudnn_attention_test
  kernels/cuda/cuda_backend_test
  tests/golden/golden_check
  bench/gpu_golden_check
  bench/gpu_gemm_bench
  bench/gpu_model_bench
)

# ------------------------------------------------------------------ collect
if [[ -n "$COLLECT" ]]; then
  src="$ROOT/bazel-bin"
  mkdir -p "$COLLECT/bin" "$COLLECT/lib" "$COLLECT/data"
  for b in "${BINARIES[@]}"; do
    if [[ ! -x "$src/$b" ]]; then
      echo "gpu_check: $src/$b is not built; it will report 'not available'" >&2
      continue
    fi
    mkdir -p "$COLLECT/bin/$(dirname "$b")"
    cp -L "$src/$b" "$COLLECT/bin/$b"
    # Shared libraries except glibc's and the CUDA/NCCL/cuDNN runtime, which
    # the GPU host provides.
    ldd "$src/$b" | awk '/=> \// {print $3}' | while read -r lib; do
      case "$(basename "$lib")" in
        libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libresolv.so*) ;;
        libcuda.so*|libcudart.so*|libcublas*|libnccl.so*|libcudnn*|libnvrtc*|libnvJitLink*) ;;
        *) cp -Ln "$lib" "$COLLECT/lib/" 2>/dev/null ;;
      esac
    done
  done
  cp "$ROOT"/tests/golden/*.safetensors "$COLLECT/data/" 2>/dev/null
  # The release bundle, when scripts/package.sh has built it.
  for t in "$ROOT"/dist/baton-*-linux-x86_64.tar.gz; do
    [[ -f "$t" ]] && mkdir -p "$COLLECT/release" && cp "$t" "$COLLECT/release/"
  done
  # A compressed copy too (about 25 MB; the directory itself is ~66 MB,
  # mostly OpenBLAS): unpack with tar xzf on the GPU host.
  tar czf "$COLLECT.tar.gz" -C "$(dirname "$COLLECT")" "$(basename "$COLLECT")"
  du -sh "$COLLECT" "$COLLECT.tar.gz"
  exit 0
fi

# ---------------------------------------------------------------------- run
if [[ -z "$BIN" ]]; then
  echo "gpu_check: --bin DIR is required (bazel-bin or a --collect bundle; see --help)" >&2
  exit 2
fi
BIN="$(cd "$BIN" && pwd)"
if [[ -d "$BIN/bin" ]]; then  # a collected bundle
  DATA="$BIN/data"
  if [[ -z "$RELEASE" ]]; then
    for t in "$BIN"/release/baton-*-linux-x86_64.tar.gz; do [[ -f "$t" ]] && RELEASE="$t"; done
  fi
  export LD_LIBRARY_PATH="$BIN/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  BIN="$BIN/bin"
else
  DATA="$ROOT/tests/golden"
fi
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
RESULT="$OUT/result.json"
START=$(date +%s)
STARTED="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
NAMES=()
STATUSES=()
SECONDS_TAKEN=()
METRICS=()  # "key": <json value> pairs
FAILED=0

log() { echo "[$(date -u +%H:%M:%S)] $*" >>"$LOG"; }

json_escape() { printf '%s' "$1" | sed -e 's/\\/\\\\/g' -e 's/"/\\"/g' | tr -d '\n\r\t'; }

write_result() {
  {
    echo "{"
    echo "  \"started\": \"$STARTED\","
    echo "  \"elapsed_s\": $(( $(date +%s) - START )),"
    echo "  \"host\": \"$(json_escape "$(hostname)")\","
    echo "  \"steps\": ["
    local i sep=""
    for i in "${!NAMES[@]}"; do
      printf '%s    {"name": "%s", "status": "%s", "seconds": %s}' "$sep" "${NAMES[$i]}" \
        "$(json_escape "${STATUSES[$i]}")" "${SECONDS_TAKEN[$i]}"
      sep=$',\n'
    done
    echo ""
    echo "  ],"
    echo "  \"metrics\": {"
    sep=""
    for i in "${!METRICS[@]}"; do
      printf '%s    %s' "$sep" "${METRICS[$i]}"
      sep=$',\n'
    done
    echo ""
    echo "  }"
    echo "}"
  } >"$RESULT.tmp" && mv "$RESULT.tmp" "$RESULT"
}

record() {  # name status seconds
  NAMES+=("$1"); STATUSES+=("$2"); SECONDS_TAKEN+=("$3")
  log "$1: $2 (${3}s)"
  write_result
}

# step NAME TIMEOUT BINARY ARGS...: runs BINARY (relative to BIN, or an
# absolute path) with its own timeout, output into OUT/NAME.out and the log.
step() {
  local name="$1" limit="$2" bin="$3"; shift 3
  local left=$(( BUDGET - ($(date +%s) - START) ))
  [[ "$bin" == /* ]] || bin="$BIN/$bin"
  if [[ ! -x "$bin" ]]; then
    record "$name" "not available: ${bin#$BIN/} not built/collected" 0
    return 1
  fi
  if (( left < 5 )); then
    record "$name" "not run: the ${BUDGET}s budget is spent" 0
    FAILED=1
    return 1
  fi
  (( limit > left )) && limit=$left
  log "$name: $bin $* (timeout ${limit}s)"
  local t0=$(date +%s) rc
  timeout --kill-after=5 "$limit" "$bin" "$@" >"$OUT/$name.out" 2>&1
  rc=$?
  local took=$(( $(date +%s) - t0 ))
  tail -n 40 "$OUT/$name.out" >>"$LOG"
  if (( rc == 0 )); then
    record "$name" "pass" "$took"
  elif (( rc == 124 || rc == 137 )); then
    record "$name" "timeout after ${limit}s" "$took"; FAILED=1
  else
    # Why, in a line: the failed gtest cases, else the output's last line.
    local why
    why=$(grep -m 4 '^\[  FAILED  \] [A-Za-z]' "$OUT/$name.out" | sed 's/^\[  FAILED  \] //' |
          sed 's/ (.*//' | paste -sd, -)
    [[ -z "$why" ]] && why=$(grep -v '^[[:space:]]*$' "$OUT/$name.out" | tail -n 1)
    record "$name" "fail (exit $rc): ${why:0:300}" "$took"; FAILED=1
  fi
  return $rc
}

log "gpu_check started: bin=$BIN out=$OUT budget=${BUDGET}s"
write_result

# 0. The GPU itself.
if command -v nvidia-smi >/dev/null; then
  t0=$(date +%s)
  if timeout 10 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm \
       --format=csv,noheader >"$OUT/gpu.out" 2>&1; then
    record gpu "pass" $(( $(date +%s) - t0 ))
    METRICS+=("\"gpu\": \"$(json_escape "$(head -n 1 "$OUT/gpu.out")")\"")
  else
    record gpu "fail: nvidia-smi: $(head -c 200 "$OUT/gpu.out")" $(( $(date +%s) - t0 )); FAILED=1
  fi
else
  record gpu "not available: no nvidia-smi" 0
fi

# 1. Every CUDA op against the CPU op (fp32 <= 1e-5 relative, bf16 bounds in
#    the test, bitwise run to run).
step cuda_ops 45 kernels/cuda/cuda_ops_test --gtest_output="xml:$OUT/cuda_ops.xml"
# 1b. bf16 attention through cuDNN's fused SDPA against the CPU's bf16
#     reference (<= 3e-2, bitwise run to run; prints its errors and the
#     GPT-2-small workspace; the 10 s include building 4 cuDNN graphs).
#     Needs libcudnn.so.9 on the host.
step cudnn_attention 10 kernels/cuda/cudnn_attention_test \
  --gtest_output="xml:$OUT/cudnn_attention.xml"
# 2. The CUDA backend through kernels/ops.h against the CPU backend.
step cuda_backend 30 kernels/cuda/cuda_backend_test --gtest_output="xml:$OUT/cuda_backend.xml"

# 3. The PyTorch goldens on the GPU: one stage (pp = tp = 1) with everything
#    on cuda:0, fp32 loss and gradients within 1e-4. Multi-stage and TP layouts
#    in one process need golden_check to take --device (run when it does).
for golden in "$DATA"/gpt_a.safetensors "$DATA"/gpt_b.safetensors; do
  step "golden_gpu_$(basename "$golden" .safetensors)" 12 bench/gpu_golden_check \
    --golden="$golden" --device=cuda:0
done
if [[ -x "$BIN/tests/golden/golden_check" ]] &&
   [[ "$("$BIN/tests/golden/golden_check" --helpfull 2>&1)" == *--device* ]]; then
  for layout in "--pp=2" "--tp=2" "--pp=3"; do
    step "golden_gpu_a_${layout#--}" 10 tests/golden/golden_check \
      --golden="$DATA/gpt_a.safetensors" --device=cuda:0 "$layout"
  done
else
  record golden_gpu_layouts "not available: golden_check has no --device flag in this build" 0
fi

# 3b. A 1F1B pp=2 job on one GPU (two workers on cuda:0) against the same job
#     on the CPU, from the release bundle.
# PRECISION fp32: losses within 1e-4 relative, weights 1e-3; bf16 (GPU bf16
# against the CPU's bf16 reference, whose GEMMs sum in another order and
# round their outputs to bf16): 1e-2 and 5e-2.
pp2_job() {  # REL_DIR OUT_DIR DEVICE [PRECISION]: exit 0 when the DEVICE job equals the CPU job within tolerance
  local rel="$1" out="$2" device="${3:-cuda:0}" precision="${4:-fp32}" job="$2/job.textproto"
  local loss_tol=1e-4 weights_tol=1e-3
  [[ "$precision" == bf16 ]] && { loss_tol=1e-2; weights_tol=5e-2; }
  rm -rf "$out"; mkdir -p "$out"
  cat >"$job" <<JOB
name: "pp2"
model { layers: 4 d_model: 64 heads: 4 vocab: 16 seq_len: 20 }
parallel { pp: 2 tp: 1 dp: 1 }
schedule { kind: "1f1b" microbatches: 4 }
train { steps: 4 micro_batch_size: 4 lr: 0.001 weight_decay: 0.0 seed: 1 precision: "$precision" }
data { synthetic { task: "addition" } }
JOB
  echo "== cpu: batonctl local (2 workers)"
  "$rel/bin/batonctl" local --job="$job" --out="$out/cpu" --workers=2 --bin_dir="$rel/bin" \
    --timeout_s=40 >"$out/cpu.out" 2>&1 || { echo "cpu job failed:"; tail -n 20 "$out/cpu.out"; return 1; }
  echo "== $device: coordinator + 2 workers on $device"
  "$rel/bin/baton-coordinator" --listen=127.0.0.1:0 --http_listen=127.0.0.1:0 --port_file="$out/c.json" \
    --job="$job" --out="$out/gpu" >"$out/coordinator.log" 2>&1 &
  local pids=($!) port="" i
  for i in $(seq 1 100); do
    port=$(sed -n 's/.*"grpc": *\([0-9]*\).*/\1/p' "$out/c.json" 2>/dev/null); [[ -n "$port" ]] && break; sleep 0.1
  done
  [[ -n "$port" ]] || { echo "coordinator did not start"; tail "$out/coordinator.log"; kill "${pids[@]}"; return 1; }
  for i in 0 1; do
    "$rel/bin/baton-worker" --coordinator=127.0.0.1:"$port" --name="g$i" --device="$device" \
      --listen=127.0.0.1:0 --http_listen=127.0.0.1:0 --port_file="$out/w$i.json" --output_dir="$out/gpu" \
      >"$out/worker$i.log" 2>&1 &
    pids+=($!)
  done
  for i in $(seq 1 400); do [[ -f "$out/gpu/summary.json" ]] && break; sleep 0.1; done
  # The workers' device metrics (memory, host waits), when curl is there.
  local http
  http=$(sed -n 's/.*"http": *\([0-9]*\).*/\1/p' "$out/w1.json" 2>/dev/null)
  if [[ -n "$http" ]] && command -v curl >/dev/null; then
    curl -s "http://127.0.0.1:$http/metrics" | grep -E '^baton_(device_memory_bytes|host_syncs_total|step_wall_seconds_total)' \
      >"$out/worker1.metrics" || true
    cat "$out/worker1.metrics"
  fi
  kill "${pids[@]}" 2>/dev/null; wait "${pids[@]}" 2>/dev/null
  [[ -f "$out/gpu/summary.json" ]] || { tail -n 20 "$out"/*.log; echo "the $device job did not end in 40 s"; return 1; }
  cat "$out/cpu/summary.json" "$out/gpu/summary.json"
  if ! grep -q '"state": "done"' "$out/gpu/summary.json"; then
    tail -n 20 "$out"/*.log
    echo "the $device job did not finish: $(sed -n 's/.*"error": \(".*"\)}.*/\1/p' "$out/gpu/summary.json")"
    return 1
  fi
  # Every committed step's loss, CPU vs GPU.
  grep '"committed": true' "$out/cpu/steps.jsonl" | sed 's/.*"loss": \([^,}]*\).*/\1/' >"$out/cpu.loss"
  grep '"committed": true' "$out/gpu/steps.jsonl" | sed 's/.*"loss": \([^,}]*\).*/\1/' >"$out/gpu.loss"
  paste "$out/cpu.loss" "$out/gpu.loss" | awk -v tol="$loss_tol" '
    { n++; d = $1 - $2; if (d < 0) d = -d; r = d / ($1 < 0 ? -$1 : $1); if (r > worst) worst = r;
      printf "step %d loss cpu %s gpu %s rel %.3g\n", n, $1, $2, r }
    END { printf "{\"steps\": %d, \"loss_max_rel_diff\": %.3g}\n", n, worst;
          exit (n != 4 || worst > tol) }' >"$out/loss.cmp"
  local loss_ok=$?
  cat "$out/loss.cmp"
  "$rel/bin/batonctl" checkpoint diff "$out/gpu/final" "$out/cpu/final" --json >"$out/weights.json" 2>&1
  cat "$out/weights.json"
  local rel_diff
  rel_diff=$(sed -n 's/.*"max_rel_diff": *\([^,}]*\).*/\1/p' "$out/weights.json" | head -n 1)
  [[ -n "$rel_diff" ]] || { echo "no weights diff"; return 1; }
  echo "{\"pp2_weights_max_rel_diff\": $rel_diff}"
  awk -v r="$rel_diff" -v tol="$weights_tol" 'BEGIN { exit !(r <= tol) }' ||
    { echo "weights differ beyond $weights_tol"; return 1; }
  return "$loss_ok"
}
if [[ -n "$RELEASE" ]]; then
  REL_DIR="$RELEASE"
  if [[ -f "$RELEASE" ]]; then
    mkdir -p "$OUT/release" && tar -C "$OUT/release" -xzf "$RELEASE" && REL_DIR=$(echo "$OUT"/release/baton-*)
  fi
  if [[ -x "$REL_DIR/bin/baton-worker" ]]; then
    # `step` runs a binary under BIN: run this shell function through bash.
    export -f pp2_job
    step pp2_1f1b 45 "$(command -v bash)" -c "pp2_job '$REL_DIR' '$OUT/pp2' '$PP2_DEVICE' fp32"
    v=$(sed -n 's/.*"loss_max_rel_diff": \([^}]*\)}.*/\1/p' "$OUT/pp2_1f1b.out" | tail -n 1)
    [[ -n "$v" ]] && METRICS+=("\"pp2_loss_max_rel_diff\": $v")
    v=$(sed -n 's/.*"pp2_weights_max_rel_diff": \([^}]*\)}.*/\1/p' "$OUT/pp2_1f1b.out" | tail -n 1)
    [[ -n "$v" ]] && METRICS+=("\"pp2_weights_max_rel_diff\": $v")
    write_result
  else
    record pp2_1f1b "not available: no bin/baton-worker in the release bundle $RELEASE" 0
  fi
else
  record pp2_1f1b "not available: no release bundle (--release, or scripts/package.sh before --collect)" 0
fi

# 4. The bf16 GEMM ceiling and GPT-2-small layer GEMMs.
if step gemm_bench 30 bench/gpu_gemm_bench; then
  v=$(sed -n 's/.*"summary": "bf16_ceiling_tflops", "value": \([0-9.]*\).*/\1/p' "$OUT/gemm_bench.out")
  [[ -n "$v" ]] && METRICS+=("\"bf16_gemm_ceiling_tflops\": $v")
  METRICS+=("\"gemm_bench\": [$(grep '^{"gemm"' "$OUT/gemm_bench.out" | paste -sd, -)]")
  write_result
fi

# 5. A GPT-2-small-shaped training step, fp32 and bf16.
if step model_fp32 40 bench/gpu_model_bench --device=cuda:0 --precision=fp32; then
  line=$(grep '^{"device"' "$OUT/model_fp32.out" | tail -n 1)
  [[ -n "$line" ]] && METRICS+=("\"gpt2_small_fp32\": $line")
  write_result
fi
if step model_bf16 35 bench/gpu_model_bench --device=cuda:0 --precision=bf16; then
  line=$(grep '^{"device"' "$OUT/model_bf16.out" | tail -n 1)
  [[ -n "$line" ]] && METRICS+=("\"gpt2_small_bf16\": $line")
  write_result
fi

# 6. bf16 against PyTorch's float64 goldens (one stage on cuda:0) and the
#    bf16 pipeline job against the CPU's bf16 reference.
for golden in "$DATA"/gpt_a.safetensors "$DATA"/gpt_b.safetensors; do
  step "golden_bf16_$(basename "$golden" .safetensors)" 8 tests/golden/golden_check \
    --golden="$golden" --device=cuda:0 --precision=bf16
done
if [[ -n "$RELEASE" && -x "$REL_DIR/bin/baton-worker" ]]; then
  step pp2_1f1b_bf16 45 "$(command -v bash)" -c "pp2_job '$REL_DIR' '$OUT/pp2_bf16' '$PP2_DEVICE' bf16"
  v=$(sed -n 's/.*"loss_max_rel_diff": \([^}]*\)}.*/\1/p' "$OUT/pp2_1f1b_bf16.out" | tail -n 1)
  [[ -n "$v" ]] && METRICS+=("\"pp2_bf16_loss_max_rel_diff\": $v")
  v=$(sed -n 's/.*"pp2_weights_max_rel_diff": \([^}]*\)}.*/\1/p' "$OUT/pp2_1f1b_bf16.out" | tail -n 1)
  [[ -n "$v" ]] && METRICS+=("\"pp2_bf16_weights_max_rel_diff\": $v")
  write_result
else
  record pp2_1f1b_bf16 "not available: no release bundle with bin/baton-worker" 0
fi

log "gpu_check finished in $(( $(date +%s) - START ))s, failed=$FAILED"
write_result
echo "gpu_check: $RESULT"
cat "$RESULT"
exit "$FAILED"
