#!/usr/bin/env bash
# Builds the release bundle dist/baton-<version>-linux-x86_64.tar.gz:
#
#   baton-<version>-linux-x86_64/
#     bin/   baton-coordinator baton-worker batonctl   (debug info stripped)
#     lib/   every shared library they need except glibc and the CUDA / NCCL /
#            cuDNN runtime (those come with the host's NVIDIA driver and CUDA
#            installation)
#     VERSION
#
# The binaries' RUNPATH is $ORIGIN/../lib (then the CUDA runtime's own
# directory, /usr/local/cuda/lib64, as linked); each bundled library's is
# $ORIGIN, so the bundle runs from any directory with a cleared environment.
# Fails if a needed library is missing or the tarball exceeds 48 MiB.
#
# Usage: scripts/package.sh [--bin_dir DIR] [--out DIR]
#   --bin_dir DIR  take the three binaries from DIR (default: bazel build them)
#   --out DIR      where the tarball goes (default: dist/ in the repository)
# Needs: bazel (without --bin_dir), ldd, patchelf, strip, tar, gzip.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BIN_DIR=""
OUT="$ROOT/dist"
while [ $# -gt 0 ]; do
  case "$1" in
    --bin_dir) BIN_DIR=$2; shift 2 ;;
    --bin_dir=*) BIN_DIR=${1#*=}; shift ;;
    --out) OUT=$2; shift 2 ;;
    --out=*) OUT=${1#*=}; shift ;;
    *) echo "package.sh: unknown argument '$1' (want --bin_dir DIR, --out DIR)" >&2; exit 2 ;;
  esac
done
MAX_BYTES=$((48 * 1024 * 1024))

for tool in ldd patchelf strip tar gzip; do
  if ! command -v "$tool" >/dev/null; then
    echo "package.sh: '$tool' is missing (scripts/setup.sh installs patchelf)" >&2
    exit 1
  fi
done

VERSION=$(sed -n 's/.*kVersion\[\] = "\(.*\)";.*/\1/p' "$ROOT/common/version.h")
[ -n "$VERSION" ] || { echo "package.sh: no kVersion in common/version.h" >&2; exit 1; }
NAME="baton-$VERSION-linux-x86_64"

declare -A BINARIES=(
  [baton-coordinator]=coordinator/baton-coordinator
  [baton-worker]=worker/baton-worker
  [batonctl]=cli/batonctl
)
if [ -z "$BIN_DIR" ]; then
  # Release binaries: -c opt (NDEBUG: no debug assertions, and the daemons
  # skip Abseil's per-lock deadlock graph).
  (cd "$ROOT" && bazel build -c opt //coordinator:baton-coordinator //worker:baton-worker //cli:batonctl)
  BAZEL_BIN=$(cd "$ROOT" && bazel info -c opt bazel-bin 2>/dev/null)
fi

STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
DIR="$STAGE/$NAME"
mkdir -p "$DIR/bin" "$DIR/lib"
echo "$VERSION" > "$DIR/VERSION"

for name in "${!BINARIES[@]}"; do
  if [ -n "$BIN_DIR" ]; then src="$BIN_DIR/$name"; else src="$BAZEL_BIN/${BINARIES[$name]}"; fi
  [ -f "$src" ] || { echo "package.sh: binary $src not found" >&2; exit 1; }
  cp -L "$src" "$DIR/bin/$name"
  chmod u+w "$DIR/bin/$name"
  strip --strip-debug "$DIR/bin/$name"
done

# glibc's libraries and the GPU runtime stay on the host.
host_lib() {
  case "$1" in
    linux-vdso.so.*|ld-linux*|libc.so.*|libm.so.*|libpthread.so.*|libdl.so.*|librt.so.*|libutil.so.*|\
    libresolv.so.*|libanl.so.*|libnsl.so.*|libmvec.so.*|libBrokenLocale.so.*|\
    libcuda.so*|libcudart.so*|libnccl.so*|libcudnn*|libcublas*|libcufft*|libcurand*|libcusparse*|\
    libcusolver*|libnvrtc*|libnvJitLink*|libnvidia-*|libnvToolsExt*)
      return 0 ;;
  esac
  return 1
}

for bin in "$DIR"/bin/*; do
  # ldd lists the whole dependency closure: "soname => /path (addr)".
  while read -r soname arrow path _; do
    [ "$arrow" = "=>" ] || continue
    host_lib "$soname" && continue
    if [ "$path" = "not" ]; then
      echo "package.sh: $(basename "$bin") needs $soname, which is not installed" >&2
      exit 1
    fi
    if [ ! -e "$DIR/lib/$soname" ]; then
      cp -L "$path" "$DIR/lib/$soname"
      chmod u+w "$DIR/lib/$soname"
    fi
  done < <(ldd "$bin")
done

for lib in "$DIR"/lib/*; do
  patchelf --set-rpath '$ORIGIN' "$lib"
done
for bin in "$DIR"/bin/*; do
  # Keep absolute entries the link added for the CUDA runtime, after ours.
  old=$(patchelf --print-rpath "$bin")
  rpath='$ORIGIN/../lib'
  IFS=: read -ra entries <<< "$old"
  for e in "${entries[@]}"; do
    case "$e" in /*cuda*) rpath="$rpath:$e" ;; esac
  done
  patchelf --set-rpath "$rpath" "$bin"
done

mkdir -p "$OUT"
TARBALL="$OUT/$NAME.tar.gz"
tar -C "$STAGE" -czf "$TARBALL" "$NAME"
bytes=$(stat -c %s "$TARBALL")
if [ "$bytes" -gt "$MAX_BYTES" ]; then
  echo "package.sh: $TARBALL is $bytes bytes, over the 48 MiB limit ($MAX_BYTES)" >&2
  exit 1
fi
echo "package.sh: $TARBALL ($bytes bytes, $(ls "$DIR/lib" | wc -l) libraries)"
