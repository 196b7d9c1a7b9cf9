#!/usr/bin/env bash
# The GPU check: every CUDA op against the CPU op, the CUDA backend through
# the ops, the PyTorch goldens on the GPU, a 1F1B pp=2 job on one GPU against
# the CPU, the bf16 GEMM ceiling and a GPT-2-small-shaped training step, then
# the one-GPU NCCL tests and the watchdog test, on one GPU, in at most
# 6 minutes. Each step has its own timeout; every step appends to
# OUT/gpu_check.log and rewrites OUT/result.json, so a run cut short still
# reports what it did. A step whose binary or feature is missing reports
# "not available", never a number; a step whose binary is there but fails
# (no GPU, no driver, a missing library) reports "fail (exit N): " and the
# first failure's message.
#
# It runs prebuilt binaries, not Bazel (the GPU machine has no Bazel and no
# network). Two ways to bring them:
#
#   1. On the build machine (Bazel, the CUDA toolkit):
#        scripts/gpu_check.sh --collect gpu_check_bundle
#      builds the binaries below (bazel build) and the release bundle
#      (scripts/package.sh, into release/), and copies the binaries, every
#      shared library they need that is not glibc or the CUDA/NCCL/cuDNN
#      runtime, and the golden files into gpu_check_bundle/{bin,lib,data,
#      release}, then packs it as gpu_check_bundle.tar.gz. It fails if any
#      of them is missing or a binary does not resolve its libraries from the
#      bundle. `--collect DIR --bin SRC [--release TARBALL]` copies from SRC
#      (a bazel-bin-shaped tree) without building. Carry the tarball (or the
#      directory) to the GPU host; there, with no other setup,
#        scripts/gpu_check.sh --bin gpu_check_bundle.tar.gz --out /tmp/gpu_check [--report DIR]
#      (--report DIR: only result.json, gpu_check.log and, at the end,
#      outputs.tar.gz go there, updated after every step: for a tool that
#      returns a few files, e.g. the device machine's $OUT)
#      (the bundle's lib/ first on LD_LIBRARY_PATH, then the host's CUDA
#      library directories: CUDA_HOME, /usr/local/cuda; the host provides
#      libcudart.so.13, libcublasLt.so.13, libnccl.so.2, libcudnn.so.9 and a
#      driver for CUDA 13).
#   2. On a GPU host with the source tree and Bazel:
#        scripts/gpu_check.sh --bin bazel-bin --out /tmp/gpu_check
#
# Steps and their limits in seconds, in order (they add up to 358 of the 360 s
# budget, and each step is also cut to what is left of the budget less the
# 5 s it may take to die, so the check ends within 6 minutes by construction,
# plus its own bookkeeping: 5 s for 24 steps on a loaded 2-core machine):
#   gpu 8 (nvidia-smi), libs 5 (every binary's libraries resolve; cuBLASLt
#   and cuDNN found), cuda_ops 40, vector_ops 5, stamp 5, device_identity 2,
#   cudnn_attention 15,
#   cuda_backend 30, golden_gpu_{a,b} 2 x 10, golden_gpu_a_{pp2,tp2,pp3}
#   3 x 8, pp2_1f1b 35, gemm_bench 20, model_fp32 30, model_bf16 30,
#   golden_bf16_{a,b} 2 x 8, pp2_1f1b_bf16 35, nccl_communicator 10,
#   nccl_split 8, device_staging 8, nccl_watchdog 12.
# The most wanted numbers come first; the NCCL tests come last (the watchdog
# test holds the GPU with a spin kernel and aborts NCCL behind it: if that
# goes wrong, it must not cost the numbers). The NCCL tests run their
# one-GPU cases only (--gtest_filter=-*TwoGpus*; the multi_gpu targets and
# //worker:nccl_executor_test need two GPUs and are not run here).
#
# The release bundle (dist/baton-*.tar.gz, scripts/package.sh: the daemons
# and batonctl) runs the pipeline job: `--release TARBALL|DIR` (a --collect
# bundle carries it as release/). Step pp2_1f1b trains a small GPT with 1F1B
# over two baton-worker processes on cuda:0 (one coordinator, real gRPC and
# Gloo on loopback) and compares it with the same job on the CPU (batonctl
# local): every step's loss within 1e-4 relative and the final weights within
# 1e-3 relative L2 per tensor (batonctl checkpoint diff). Step pp2_1f1b_bf16
# runs the same job in train.precision = bf16 against the CPU's bf16
# reference kernels: losses within 1e-2 relative, weights within 5e-2.
# Without a release bundle they report "not available". `--pp2_device cpu`
# runs those jobs' workers on the CPU instead (how CI tests this script:
# //tests/package:gpu_check_test). bf16 also runs the PyTorch goldens
# (golden_bf16_*: loss within 1e-2, gradients within 5e-2 of the float64
# golden) and the GPT-2-small step.
#
# Exit status: 0 when every available step passed, 1 otherwise (2: usage).
set -uo pipefail

BIN=""
OUT="${TMPDIR:-/tmp}/baton_gpu_check"
COLLECT=""
RELEASE=""
REPORT=""            # --report DIR: result.json, gpu_check.log, outputs.tar.gz only (the device tool's $OUT)
PP2_DEVICE="cuda:0"  # --pp2_device cpu: the job's plumbing on a CPU host (tests/package:gpu_check_test)
BUDGET=360           # seconds for the whole check (the limits above add up to 358)
KILL_GRACE=5         # a step that ignores SIGTERM at its limit is killed this much later

usage() {
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
  exit 2
}

while [[ $# -gt 0 ]]; do
  case "$1" in
    --bin) BIN="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --collect) COLLECT="$2"; shift 2 ;;
    --release) RELEASE="$2"; shift 2 ;;
    --report) REPORT="$2"; shift 2 ;;
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
  kernels/cuda/vector_ops_test
  kernels/cuda/stamp_test
  kernels/device_gpu_test
  kernels/cuda/cudnn_attention_test
  kernels/cuda/cuda_backend_test
  tests/golden/golden_check
  bench/gpu_golden_check
  bench/gpu_gemm_bench
  bench/gpu_model_bench
  worker/comm/nccl_communicator_test
  worker/comm/nccl_split_test
  worker/comm/device_staging_communicator_test
  worker/comm/nccl_watchdog_test
)
GOLDENS=(gpt_a.safetensors gpt_b.safetensors)

# The host's CUDA library directories (libcudart, libcublasLt, libnccl,
# libcudnn), after the bundle's own: CUDA_HOME, then /usr/local/cuda.
cuda_lib_dirs() {
  local d seen=":"
  for d in ${CUDA_HOME:+"$CUDA_HOME/lib64" "$CUDA_HOME/lib" "$CUDA_HOME/targets/x86_64-linux/lib"} \
           /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib; do
    [[ -d "$d" ]] || continue
    d="$(cd "$d" && pwd -P)"
    [[ "$seen" == *":$d:"* ]] && continue
    seen+="$d:"
    printf '%s\n' "$d"
  done
}
CUDA_LIB_PATH="$(cuda_lib_dirs | paste -sd: -)"

# ------------------------------------------------------------------ collect
# Libraries a bundle never carries: glibc's and the CUDA/NCCL/cuDNN runtime,
# which the GPU host provides.
host_library() {
  case "$1" in
    libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libresolv.so*|libutil.so*) return 0 ;;
    libcuda.so*|libcudart.so*|libcublas*|libnccl.so*|libcudnn*|libnvrtc*|libnvJitLink*) return 0 ;;
  esac
  return 1
}
if [[ -n "$COLLECT" ]]; then
  die() { echo "gpu_check --collect: $*" >&2; exit 1; }
  # Only a new directory or an earlier bundle (it has the marker) is emptied.
  if [[ -d "$COLLECT" && -n "$(ls -A "$COLLECT")" && ! -f "$COLLECT/.gpu_check_bundle" ]]; then
    die "$COLLECT exists and is not a gpu_check bundle: name a new directory"
  fi
  mkdir -p "$COLLECT" && touch "$COLLECT/.gpu_check_bundle" || die "cannot create $COLLECT"
  COLLECT="$(cd "$COLLECT" && pwd)"
  if [[ -n "$BIN" ]]; then
    src="$(cd "$BIN" && pwd)" || die "no directory $BIN"
  else
    command -v bazel >/dev/null || die "no bazel here: build elsewhere and pass --bin BAZEL_BIN"
    targets=()
    for b in "${BINARIES[@]}"; do targets+=("//$(dirname "$b"):$(basename "$b")"); done
    (cd "$ROOT" && bazel build "${targets[@]}") || die "bazel build failed"
    # Not the bazel-bin symlink: a later `bazel build -c opt` (scripts/package.sh)
    # points it at the opt tree, which has none of these binaries.
    src="$(cd "$ROOT" && bazel info bazel-bin 2>/dev/null)" || die "bazel info bazel-bin failed"
    if [[ -z "$RELEASE" ]]; then
      rm -rf "${COLLECT:?}/release"
      bash "$ROOT/scripts/package.sh" --out "$COLLECT/release" || die "scripts/package.sh failed"
    fi
  fi
  rm -rf "${COLLECT:?}/bin" "${COLLECT:?}/lib" "${COLLECT:?}/data"
  mkdir -p "$COLLECT/bin" "$COLLECT/lib" "$COLLECT/data"
  for b in "${BINARIES[@]}"; do
    [[ -x "$src/$b" ]] || die "$src/$b is not built (bazel build //$(dirname "$b"):$(basename "$b"))"
    mkdir -p "$COLLECT/bin/$(dirname "$b")"
    cp -L "$src/$b" "$COLLECT/bin/$b" && chmod u+w "$COLLECT/bin/$b"
    # ldd lists every library the binary loads, its libraries' included.
    missing=$(ldd "$src/$b" | awk '/not found/ {print $1}' | paste -sd' ' -)
    [[ -z "$missing" ]] || die "$src/$b: ldd finds no $missing here"
    while read -r lib; do
      host_library "$(basename "$lib")" && continue
      [[ -e "$COLLECT/lib/$(basename "$lib")" ]] && continue
      cp -L "$lib" "$COLLECT/lib/" && chmod u+w "$COLLECT/lib/$(basename "$lib")" || die "cannot copy $lib"
    done < <(ldd "$src/$b" | awk '/=> \// {print $3}')
  done
  # Debug info is not needed to run (symbols stay, for stack traces), and the
  # bundle must travel: stripped, it is a fraction of the size.
  find "$COLLECT/bin" "$COLLECT/lib" -type f -exec strip --strip-debug {} + 2>/dev/null
  cp "$0" "$COLLECT/gpu_check.sh"  # the bundle runs without the source tree too
  for g in "${GOLDENS[@]}"; do
    cp "$ROOT/tests/golden/$g" "$COLLECT/data/" || die "no golden file tests/golden/$g"
  done
  if [[ -n "$RELEASE" ]]; then
    [[ "$RELEASE" == */baton-*-linux-x86_64.tar.gz && -f "$RELEASE" ]] ||
      die "--release wants a tarball dist/baton-VERSION-linux-x86_64.tar.gz, not $RELEASE"
    rm -rf "${COLLECT:?}/release"; mkdir -p "$COLLECT/release"
    cp "$RELEASE" "$COLLECT/release/" || die "cannot copy the release bundle $RELEASE"
  fi
  # The bundle alone must resolve every library, with the CUDA runtime from
  # the host's CUDA directories (as on the GPU host: see cuda_lib_dirs).
  for b in "${BINARIES[@]}"; do
    missing=$(env -i PATH=/usr/bin:/bin LD_LIBRARY_PATH="$COLLECT/lib${CUDA_LIB_PATH:+:$CUDA_LIB_PATH}" \
                ldd "$COLLECT/bin/$b" | awk '/not found/ {print $1}' | paste -sd' ' -)
    [[ -z "$missing" ]] || die "bin/$b does not find $missing in the bundle"
  done
  ls "$COLLECT"/release/baton-*-linux-x86_64.tar.gz >/dev/null 2>&1 ||
    echo "gpu_check --collect: no release bundle in $COLLECT/release: pp2_1f1b and pp2_1f1b_bf16 will report 'not available'" >&2
  tar czf "$COLLECT.tar.gz" -C "$(dirname "$COLLECT")" "$(basename "$COLLECT")" || die "tar failed"
  du -sh "$COLLECT" "$COLLECT.tar.gz"
  # The device tool carries at most 64 MiB: the working tree's files plus
  # what `carry` names (this tarball). Say so here, before device time is spent.
  bundle_bytes=$(stat -c %s "$COLLECT.tar.gz")
  tree_bytes=$(cd "$ROOT" && git ls-files -z 2>/dev/null | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
  if (( bundle_bytes + tree_bytes > 64 * 1024 * 1024 )); then
    echo "gpu_check --collect: WARNING: the bundle ($((bundle_bytes >> 20)) MiB) and the tracked tree" \
         "($((tree_bytes >> 20)) MiB) exceed the device tool's 64 MiB carry limit: the run will not get there" >&2
  fi
  echo "gpu_check --collect: on the GPU host run: scripts/gpu_check.sh --bin $(basename "$COLLECT").tar.gz --out OUT"
  exit 0
fi

# ---------------------------------------------------------------------- run
if [[ -z "$BIN" ]]; then
  echo "gpu_check: --bin DIR|BUNDLE.tar.gz is required (bazel-bin or a --collect bundle; see --help)" >&2
  exit 2
fi
START=$(date +%s)  # the budget counts from here, unpacking included
STARTED="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
mkdir -p "$OUT" || exit 2
OUT="$(cd "$OUT" && pwd)"
if [[ -f "$BIN" && "$BIN" == *.tar.gz ]]; then  # a packed --collect bundle
  rm -rf "$OUT/bundle"; mkdir -p "$OUT/bundle"
  tar -C "$OUT/bundle" -xzf "$BIN" || { echo "gpu_check: cannot unpack $BIN" >&2; exit 2; }
  BIN=$(echo "$OUT"/bundle/*)
fi
BIN="$(cd "$BIN" && pwd)" || { echo "gpu_check: no directory $BIN" >&2; exit 2; }
if [[ -d "$BIN/bin" ]]; then  # a collected bundle
  DATA="$BIN/data"
  if [[ -z "$RELEASE" ]]; then
    for t in "$BIN"/release/baton-*-linux-x86_64.tar.gz; do [[ -f "$t" ]] && RELEASE="$t"; done
  fi
  LIBS="$BIN/lib"
  BIN="$BIN/bin"
else
  DATA="$ROOT/tests/golden"
  LIBS=""
fi
export LD_LIBRARY_PATH="${LIBS}${LIBS:+:}${LD_LIBRARY_PATH:-}${LD_LIBRARY_PATH:+:}${CUDA_LIB_PATH}"
LD_LIBRARY_PATH="${LD_LIBRARY_PATH%:}"
LOG="$OUT/gpu_check.log"
RESULT="$OUT/result.json"
if [[ -n "$REPORT" ]]; then
  mkdir -p "$REPORT" && REPORT="$(cd "$REPORT" && pwd)" || exit 2
  [[ "$REPORT" != "$OUT" ]] || { echo "gpu_check: --report must not be --out" >&2; exit 2; }
fi
NAMES=()
STATUSES=()
SECONDS_TAKEN=()
METRICS=()  # "key": <json value> pairs
FAILED=0

log() { echo "[$(date -u +%H:%M:%S)] $*" >>"$LOG"; }

json_escape() {
  printf '%s' "$1" | tr '\n\r\t' '   ' | tr -d '\000-\037' | sed -e 's/\\/\\\\/g' -e 's/"/\\"/g'
}

write_result() {
  {
    echo "{"
    echo "  \"started\": \"$STARTED\","
    echo "  \"elapsed_s\": $(( $(date +%s) - START )),"
    echo "  \"host\": \"$(json_escape "${HOSTNAME:-$(uname -n)}")\","
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
  report
}

# With --report DIR: result.json and gpu_check.log copied there after every
# step (a run cut short still reports), and at the end outputs.tar.gz, every
# step's output and the pp2 jobs' logs (not the bundle, the release or the
# checkpoints): three files, however many steps.
report() {  # [final]
  [[ -n "$REPORT" ]] || return 0
  cp "$RESULT" "$LOG" "$REPORT/" 2>/dev/null
  if [[ "${1:-}" == final ]]; then
    (cd "$OUT" && find . -path ./bundle -prune -o -path ./release -prune -o -type f -size -4M \
       \( -name '*.out' -o -name '*.log' -o -name '*.xml' -o -name '*.json' -o -name '*.jsonl' \
          -o -name '*.metrics' -o -name '*.cmp' -o -name '*.loss' -o -name '*.textproto' \) -print |
       tar czf "$REPORT/outputs.tar.gz" -T -)
  fi
}

# Why a step failed, in a line: the gtest failures' own messages (e.g.
# "this test needs a GPU: UNAVAILABLE: ...", the first three distinct ones)
# and the failed cases, else the output's last line.
failure_cause() {  # OUTPUT_FILE
  local cases n messages
  cases=$(grep '^\[  FAILED  \] [A-Za-z]' "$1" | sed 's/^\[  FAILED  \] //; s/ (.*//' | sort -u)
  if [[ -z "$cases" ]]; then
    grep -v '^[[:space:]]*$' "$1" | tail -n 1
    return
  fi
  n=$(printf '%s\n' "$cases" | wc -l)
  # A gtest failure is "file:line: Failure", the expression's lines, then the
  # streamed message, last before the next failure or "[ ... ]" line.
  messages=$(awk 'function flush() { if (on && msg != "" && !(msg in seen)) { seen[msg] = 1; print msg } }
                  /: Failure$/ { flush(); on = 1; msg = ""; next }
                  on && /^\[/ { flush(); on = 0; next }
                  on && NF { msg = $0 }
                  END { flush() }' "$1" | head -n 3 | paste -sd'|' - | sed 's/|/ | /g')
  echo "${messages:-no message} [$n failed: $(printf '%s\n' "$cases" | head -n 3 | paste -sd, - | sed 's/,/, /g')$( ((n > 3)) && echo ", ...")]"
}

# step NAME TIMEOUT BINARY ARGS...: runs BINARY (relative to BIN, or an
# absolute path) with its own timeout, output into OUT/NAME.out and the log.
step() {
  local name="$1" limit="$2" bin="$3"; shift 3
  local left=$(( BUDGET - ($(date +%s) - START) - KILL_GRACE ))
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
  local t0 rc
  t0=$(date +%s)
  timeout --kill-after="$KILL_GRACE" "$limit" "$bin" "$@" >"$OUT/$name.out" 2>&1 </dev/null
  rc=$?
  local took=$(( $(date +%s) - t0 ))
  tail -n 40 "$OUT/$name.out" >>"$LOG"
  if (( rc == 0 )); then
    record "$name" "pass" "$took"
  elif (( rc == 124 || rc == 137 )); then
    record "$name" "timeout after ${limit}s" "$took"; FAILED=1
  else
    local why
    why=$(failure_cause "$OUT/$name.out")
    record "$name" "fail (exit $rc): ${why:0:500}" "$took"; FAILED=1
  fi
  return $rc
}

# Every binary's libraries resolve (a missing libnccl.so.2 or libcudart.so.13
# would fail every step the same way: say it once, first), and the libraries
# opened at run time (cuBLASLt, cuDNN) are on the loader's path; says where
# each CUDA library comes from.
check_libs() {
  local b out missing bad=0 lib d found ldconfig resolved=""
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  for b in "${BINARIES[@]}"; do
    [[ -x "$BIN/$b" ]] || continue
    out=$(ldd "$BIN/$b" 2>&1)
    resolved+="$out"$'\n'
    missing=$(awk '/not found/ {print $1}' <<<"$out" | paste -sd' ' -)
    if [[ -n "$missing" ]]; then echo "$b: not found: $missing"; bad=1; fi
  done
  ldconfig=$(command -v ldconfig || ls /sbin/ldconfig /usr/sbin/ldconfig 2>/dev/null | head -n 1)
  for lib in libcudart.so.13 libnccl.so.2 libcublasLt.so.13 libcudnn.so.9; do
    # Linked ones as ldd resolved them; opened ones (dlopen) by the loader's
    # search: LD_LIBRARY_PATH, the cache, the default directories.
    found=$(awk -v l="$lib" '$1 == l && $3 ~ /^\// {print $3; exit}' <<<"$resolved")
    if [[ -z "$found" ]]; then
      for d in ${LD_LIBRARY_PATH//:/ }; do [[ -e "$d/$lib" ]] && { found="$d/$lib"; break; }; done
    fi
    if [[ -z "$found" && -n "$ldconfig" ]]; then
      found=$("$ldconfig" -p 2>/dev/null | awk -v l="$lib" '$1 == l {print $NF; exit}')
    fi
    if [[ -z "$found" ]]; then
      for d in /lib/x86_64-linux-gnu /usr/lib/x86_64-linux-gnu /lib64 /usr/lib64 /lib /usr/lib; do
        [[ -e "$d/$lib" ]] && { found="$d/$lib"; break; }
      done
    fi
    if [[ -n "$found" ]]; then echo "$lib: $found"; else echo "$lib: not found"; bad=1; fi
  done
  return "$bad"
}

log "gpu_check started: bin=$BIN out=$OUT budget=${BUDGET}s LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
write_result
report

# 0. The GPU itself, and the libraries.
if command -v nvidia-smi >/dev/null; then
  t0=$(date +%s)
  if timeout --kill-after=2 8 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm \
       --format=csv,noheader >"$OUT/gpu.out" 2>&1; then
    METRICS+=("\"gpu\": \"$(json_escape "$(head -n 1 "$OUT/gpu.out")")\"")
    # CUDA 13's runtime (libcudart.so.13) needs a driver of branch 580 or later.
    driver=$(head -n 1 "$OUT/gpu.out" | awk -F', *' '{print $2}')
    if [[ "${driver%%.*}" =~ ^[0-9]+$ ]] && (( ${driver%%.*} < 580 )); then
      record gpu "fail: driver $driver is older than CUDA 13 needs (580 or later): every CUDA step will fail" \
        $(( $(date +%s) - t0 ))
      FAILED=1
    else
      record gpu "pass" $(( $(date +%s) - t0 ))
    fi
  else
    record gpu "fail: nvidia-smi: $(head -c 200 "$OUT/gpu.out")" $(( $(date +%s) - t0 )); FAILED=1
  fi
else
  record gpu "not available: no nvidia-smi" 0
fi
have_binaries=0
for b in "${BINARIES[@]}"; do [[ -x "$BIN/$b" ]] && have_binaries=1; done
if (( have_binaries )); then
  # `step` runs a binary: run this shell function through bash.
  export -f check_libs
  export BIN BINARIES_LIST="${BINARIES[*]}"
  step libs 5 "$(command -v bash)" -c 'BINARIES=($BINARIES_LIST); check_libs'
else
  record libs "not available: no GPU binaries in $BIN" 0
fi

# 1. Every CUDA op against the CPU op (fp32 <= 1e-5 relative, bf16 bounds in
#    the test, bitwise run to run), and the first kernels' fill/axpy.
step cuda_ops 40 kernels/cuda/cuda_ops_test --gtest_output="xml:$OUT/cuda_ops.xml"
step vector_ops 5 kernels/cuda/vector_ops_test --gtest_output="xml:$OUT/vector_ops.xml"
# 1a. StampTime on CUDA: %globaltimer mapped onto the host clock within the
#     measured uncertainty, stamps in stream order (the pipeline's post-time
#     stamps on NCCL).
step stamp 5 kernels/cuda/stamp_test --gtest_output="xml:$OUT/stamp.xml"
# 1b'. What a cuda:0 worker registers of its GPU: nvidia-smi's UUID, memory.
step device_identity 2 kernels/device_gpu_test --gtest_output="xml:$OUT/device_identity.xml"
# 1b. bf16 attention through cuDNN's fused SDPA against the CPU's bf16
#     reference (<= 3e-2, bitwise run to run; prints its errors and the
#     GPT-2-small workspace; the limit includes building 4 cuDNN graphs).
#     Needs libcudnn.so.9 on the host.
step cudnn_attention 15 kernels/cuda/cudnn_attention_test \
  --gtest_output="xml:$OUT/cudnn_attention.xml"
# 2. The CUDA backend through kernels/ops.h against the CPU backend.
step cuda_backend 30 kernels/cuda/cuda_backend_test --gtest_output="xml:$OUT/cuda_backend.xml"

# 3. The PyTorch goldens on the GPU, fp32 loss and gradients within 1e-4:
#    one stage (pp = tp = 1) with everything on cuda:0 (gpu_golden_check),
#    then golden_check's multi-stage and TP layouts in one process.
for golden in "${GOLDENS[@]}"; do
  step "golden_gpu_$(basename "$golden" .safetensors)" 10 bench/gpu_golden_check \
    --golden="$DATA/$golden" --device=cuda:0
done
for layout in pp=2 tp=2 pp=3; do
  step "golden_gpu_a_${layout/=/}" 8 tests/golden/golden_check \
    --golden="$DATA/gpt_a.safetensors" --device=cuda:0 "--$layout"
done

# 3b. A 1F1B pp=2 job on one GPU (two workers on cuda:0) against the same job
#     on the CPU, from the release bundle.
# PRECISION fp32: losses within 1e-4 relative, weights 1e-3; bf16 (GPU bf16
# against the CPU's bf16 reference, whose GEMMs sum in another order and
# round their outputs to bf16): 1e-2 and 5e-2.
# LIMIT is the step's limit: the CPU job gets half of it, the device job what
# is left less 5 s for the comparison, so a slow job says which one it was.
pp2_job() {  # REL_DIR OUT_DIR DEVICE PRECISION LIMIT: exit 0 when the DEVICE job equals the CPU job within tolerance
  local rel="$1" out="$2" device="$3" precision="$4" limit="$5" job="$2/job.textproto"
  local t0 deadline
  t0=$(date +%s); deadline=$(( t0 + limit - 5 ))
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
    --timeout_s=$(( limit / 2 )) >"$out/cpu.out" 2>&1 || { echo "cpu job failed:"; tail -n 20 "$out/cpu.out"; return 1; }
  echo "cpu job: $(( $(date +%s) - t0 ))s"
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
  while [[ ! -f "$out/gpu/summary.json" ]] && (( $(date +%s) < deadline )); do sleep 0.1; done
  # The workers' device metrics (memory, host waits), when curl is there.
  local http
  http=$(sed -n 's/.*"http": *\([0-9]*\).*/\1/p' "$out/w1.json" 2>/dev/null)
  if [[ -n "$http" ]] && command -v curl >/dev/null; then
    curl -s --max-time 3 "http://127.0.0.1:$http/metrics" | grep -E '^baton_(device_memory_bytes|host_syncs_total|step_wall_seconds_total)' \
      >"$out/worker1.metrics" || true
    cat "$out/worker1.metrics"
  fi
  kill "${pids[@]}" 2>/dev/null; wait "${pids[@]}" 2>/dev/null
  [[ -f "$out/gpu/summary.json" ]] ||
    { tail -n 20 "$out"/*.log; echo "the $device job did not end within the step's ${limit}s"; return 1; }
  echo "cpu and $device jobs: $(( $(date +%s) - t0 ))s"
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
    step pp2_1f1b 35 "$(command -v bash)" -c "pp2_job '$REL_DIR' '$OUT/pp2' '$PP2_DEVICE' fp32 35"
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
if step gemm_bench 20 bench/gpu_gemm_bench; then
  v=$(sed -n 's/.*"summary": "bf16_ceiling_tflops", "value": \([0-9.]*\).*/\1/p' "$OUT/gemm_bench.out")
  [[ -n "$v" ]] && METRICS+=("\"bf16_gemm_ceiling_tflops\": $v")
  METRICS+=("\"gemm_bench\": [$(grep '^{"gemm"' "$OUT/gemm_bench.out" | paste -sd, -)]")
  write_result
fi

# 5. A GPT-2-small-shaped training step, fp32 and bf16.
if step model_fp32 30 bench/gpu_model_bench --device=cuda:0 --precision=fp32; then
  line=$(grep '^{"device"' "$OUT/model_fp32.out" | tail -n 1)
  [[ -n "$line" ]] && METRICS+=("\"gpt2_small_fp32\": $line")
  write_result
fi
if step model_bf16 30 bench/gpu_model_bench --device=cuda:0 --precision=bf16; then
  line=$(grep '^{"device"' "$OUT/model_bf16.out" | tail -n 1)
  [[ -n "$line" ]] && METRICS+=("\"gpt2_small_bf16\": $line")
  write_result
fi

# 6. bf16 against PyTorch's float64 goldens (one stage on cuda:0) and the
#    bf16 pipeline job against the CPU's bf16 reference.
for golden in "${GOLDENS[@]}"; do
  step "golden_bf16_$(basename "$golden" .safetensors)" 8 tests/golden/golden_check \
    --golden="$DATA/$golden" --device=cuda:0 --precision=bf16
done
if [[ -n "$RELEASE" && -x "$REL_DIR/bin/baton-worker" ]]; then
  step pp2_1f1b_bf16 35 "$(command -v bash)" -c "pp2_job '$REL_DIR' '$OUT/pp2_bf16' '$PP2_DEVICE' bf16 35"
  v=$(sed -n 's/.*"loss_max_rel_diff": \([^}]*\)}.*/\1/p' "$OUT/pp2_1f1b_bf16.out" | tail -n 1)
  [[ -n "$v" ]] && METRICS+=("\"pp2_bf16_loss_max_rel_diff\": $v")
  v=$(sed -n 's/.*"pp2_weights_max_rel_diff": \([^}]*\)}.*/\1/p' "$OUT/pp2_1f1b_bf16.out" | tail -n 1)
  [[ -n "$v" ]] && METRICS+=("\"pp2_bf16_weights_max_rel_diff\": $v")
  write_result
else
  record pp2_1f1b_bf16 "not available: no release bundle with bin/baton-worker" 0
fi

# 7. NCCL on one GPU, their one-GPU cases only (the TwoGpus cases need two
#    GPUs: the multi_gpu targets). A one-rank communicator's collectives on
#    device memory, host buffers rejected, Abort; a parent split into a group
#    and "no group"; Gloo carrying device buffers through pinned memory (two
#    ranks as threads on cuda:0, as the pp2 jobs' workers do).
step nccl_communicator 10 worker/comm/nccl_communicator_test --gtest_filter='-*TwoGpus*' \
  --gtest_output="xml:$OUT/nccl_communicator.xml"
step nccl_split 8 worker/comm/nccl_split_test --gtest_filter='-*TwoGpus*' \
  --gtest_output="xml:$OUT/nccl_split.xml"
step device_staging 8 worker/comm/device_staging_communicator_test \
  --gtest_output="xml:$OUT/device_staging.xml"
# 8. The watchdog: a collective queued behind a spin kernel on the
#    communicator's stream fails after its 0.5 s op timeout, and Wait, Abort
#    and destroying the communicator return while the kernel still spins
#    (no hang). Last: it holds the GPU on purpose.
step nccl_watchdog 12 worker/comm/nccl_watchdog_test --gtest_filter='-*TwoGpus*' \
  --gtest_output="xml:$OUT/nccl_watchdog.xml"

log "gpu_check finished in $(( $(date +%s) - START ))s, failed=$FAILED"
write_result
report final
echo "gpu_check: $RESULT"
cat "$RESULT"
exit "$FAILED"
