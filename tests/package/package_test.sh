#!/usr/bin/env bash
# Builds the release tarball with scripts/package.sh from the binaries under
# test, then proves it self-contained: unpacked into an empty directory, every
# shared library outside glibc and the CUDA/NCCL runtime resolves inside the
# bundle under a cleared environment, `baton-worker --help` runs there, and
# `batonctl local` trains a one-worker CPU job to the end with env -i.
set -euo pipefail

RUNFILES="${TEST_SRCDIR:?}/baton"
WORK="${TEST_TMPDIR:?}/package"
rm -rf "$WORK"
mkdir -p "$WORK/bins" "$WORK/unpacked" "$WORK/dist"
fail() { echo "FAIL: $*" >&2; exit 1; }
# --cuda_linked: the build has the CUDA toolkit, so the worker links the CUDA
# backend (BUILD passes it where CUDA_AVAILABLE).

ln -s "$RUNFILES/coordinator/baton-coordinator" "$WORK/bins/baton-coordinator"
ln -s "$RUNFILES/worker/baton-worker" "$WORK/bins/baton-worker"
ln -s "$RUNFILES/cli/batonctl" "$WORK/bins/batonctl"

# package.sh reads the version from common/version.h beside it.
bash "$RUNFILES/scripts/package.sh" --bin_dir "$WORK/bins" --out "$WORK/dist"
tarballs=("$WORK"/dist/baton-*-linux-x86_64.tar.gz)
[ ${#tarballs[@]} -eq 1 ] && [ -f "${tarballs[0]}" ] || fail "no single tarball in $WORK/dist"
tarball=${tarballs[0]}
version=$(sed -n 's/.*kVersion\[\] = "\(.*\)";.*/\1/p' "$RUNFILES/common/version.h")
[ "$(basename "$tarball")" = "baton-$version-linux-x86_64.tar.gz" ] || fail "tarball named $(basename "$tarball")"
bytes=$(stat -c %s "$tarball")
echo "tarball: $bytes bytes"
[ "$bytes" -le $((48 * 1024 * 1024)) ] || fail "tarball is $bytes bytes, over 48 MiB"

tar -C "$WORK/unpacked" -xzf "$tarball"
root="$WORK/unpacked/baton-$version-linux-x86_64"
for b in baton-coordinator baton-worker batonctl; do
  [ -x "$root/bin/$b" ] || fail "bin/$b missing from the bundle"
  # Everything but glibc and the GPU runtime comes from the bundle.
  outside=$(env -i /usr/bin/ldd "$root/bin/$b" | awk '/=>/ {print $1, $3}' |
            grep -v -E "^(libc|libm|libpthread|libdl|librt|libcuda|libcudart|libnccl|libcudnn|libcublas[A-Za-z]*)\.so" |
            grep -v " $root/bin/../lib/" || true)
  [ -z "$outside" ] || fail "$b loads libraries from outside the bundle: $outside"
  if env -i /usr/bin/ldd "$root/bin/$b" | grep "not found" >/dev/null; then fail "$b has unresolved libraries"; fi
  # The driver (libcuda) is opened by cudart only when a CUDA call is made,
  # so a binary never needs it to start (CPU hosts, CI).
  if readelf -d "$root/bin/$b" | grep "NEEDED.*libcuda\.so" >/dev/null; then fail "$b needs libcuda.so at load time"; fi
done
# (grep reads all its input in these pipelines: `grep -q` would exit at the
# first match and, under pipefail, readelf's SIGPIPE would turn a match into
# a failure.)
# Where the toolkit is installed the worker carries the CUDA backend, which
# opens cuBLASLt on its first GEMM, never at start (loading it costs ~150 MB
# resident in every worker process, GPU or not).
if [ "${1:-}" = "--cuda_linked" ]; then
  grep -a "cublasLtMatmulAlgoGetHeuristic" "$root/bin/baton-worker" >/dev/null ||
    fail "baton-worker is not linked with the CUDA backend (no cuBLASLt loader)"
  if readelf -d "$root/bin/baton-worker" | grep "NEEDED.*libcublas" >/dev/null; then
    fail "baton-worker loads cuBLAS at start; it must open it on first use (kernels/cuda/cublaslt_loader.h)"
  fi
fi

# The bundle runs with a cleared environment, all but the sanitizer options
# of a --config=tsan run (scripts/tsan.sh: suppressions and where reports go).
clean_env=(env -i)
[ -z "${TSAN_OPTIONS:-}" ] || clean_env+=("TSAN_OPTIONS=$TSAN_OPTIONS")

# --help exits 1 (absl's convention) after printing the usage and the flags.
help=$(cd "$WORK/unpacked" && "${clean_env[@]}" "$root/bin/baton-worker" --help 2>&1 || true)
echo "$help" | grep -q "baton-worker --coordinator=HOST:PORT" || fail "--help printed: $help"
echo "$help" | grep -q -- "--device" || fail "--help lists no --device flag: $help"

cat > "$WORK/job.textproto" <<'JOB'
name: "bundle"
model { layers: 2 d_model: 16 heads: 2 vocab: 16 seq_len: 20 }
parallel { pp: 1 tp: 1 dp: 1 }
schedule { kind: "1f1b" microbatches: 2 }
train { steps: 3 micro_batch_size: 1 lr: 0.001 seed: 1 }
data { synthetic { task: "addition" } }
JOB
if ! (cd "$WORK/unpacked" && "${clean_env[@]}" "$root/bin/batonctl" local --job="$WORK/job.textproto" \
        --out="$WORK/out" --timeout_s=120 > "$WORK/local.log" 2>&1); then
  cat "$WORK/local.log" >&2
  for f in "$WORK"/out/logs/*; do echo "== $f" >&2; cat "$f" >&2; done
  fail "batonctl local from the bundle failed"
fi
[ -f "$WORK/out/summary.json" ] || fail "no summary.json"
steps=$(wc -l < "$WORK/out/steps.jsonl")
[ "$steps" -eq 3 ] || fail "steps.jsonl has $steps lines, want 3"
grep -q '"state": "done"' "$WORK/out/summary.json" || fail "job not done: $(cat "$WORK/out/summary.json")"
echo "PASS: bundle of $bytes bytes runs with env -i"
