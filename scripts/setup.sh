#!/usr/bin/env bash
# Installs the Debian 12 packages baton builds and tests with. Idempotent: a
# fast no-op when everything is present. Needs root (or sudo) only to install.
set -euo pipefail

PACKAGES=(
  bazel-bootstrap g++ git python3 curl
  protobuf-compiler protobuf-compiler-grpc libprotobuf-dev libgrpc++-dev
  libabsl-dev prometheus-cpp-dev libmicrohttpd-dev
  libgtest-dev libgmock-dev libgloo-dev libopenblas-dev zlib1g-dev
  prometheus openssl
  patchelf  # scripts/package.sh: RUNPATH of the release bundle
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

if [ ! -x /usr/local/cuda/bin/nvcc ] && [ -z "${BATON_CUDA_PATH:-}" ]; then
  echo "setup: no CUDA toolkit at /usr/local/cuda: GPU targets will be left out of the build"
fi
