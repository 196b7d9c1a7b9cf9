#!/usr/bin/env bash
# Installs the Debian 12 packages baton builds and tests with. Idempotent: a
# fast no-op when everything is present. Needs root (or sudo) only to install.
set -euo pipefail
# clang-14 + libclang-rt-14-dev: the clang -Wthread-safety build, ASan/UBSan/
# TSan and libFuzzer (scripts/test.sh stages clang, asan, fuzz); llvm-14 has
# llvm-symbolizer for readable sanitizer stacks.

PACKAGES=(
  bazel-bootstrap g++ git python3 curl
  protobuf-compiler protobuf-compiler-grpc libprotobuf-dev libgrpc++-dev
  libabsl-dev prometheus-cpp-dev libmicrohttpd-dev
  libgtest-dev libgmock-dev libgloo-dev libopenblas-dev zlib1g-dev
  prometheus openssl
  patchelf  # scripts/package.sh: RUNPATH of the release bundle
  clang-14 libclang-rt-14-dev llvm-14
  cmake ninja-build dpkg-dev  # scripts/tsan.sh: apt-get source + build of an instrumented Abseil
)
# Test-only tools (not needed to build, e.g. in deploy/docker/Dockerfile):
#  python3-yaml, python3-venv: tests/ops (PyYAML; a venv for kubernetes-validate)
#  systemd: systemd-analyze verify/security for deploy/systemd (tests/ops:systemd_test)
#  kubernetes-client: `kubectl kustomize` for deploy/k8s (only when no kubectl/kustomize is installed)
#  python3-torch: PyTorch 1.13 (CPU) for the Hugging Face venv below (tests/hf)
if [ -z "${BATON_SETUP_BUILD_ONLY:-}" ]; then
  PACKAGES+=(python3-yaml python3-venv systemd python3-torch)
  if ! command -v kubectl >/dev/null && ! command -v kustomize >/dev/null; then
    PACKAGES+=(kubernetes-client)
  fi
fi

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

if [ -z "${BATON_SETUP_BUILD_ONLY:-}" ]; then
  # //tests/ops:docker_test looks packages up in Debian 12's lists.
  if ! grep -q 'bookworm' <<<"$(apt-cache policy libc6 2>/dev/null)"; then
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
    $SUDO apt-get update -q
  fi
  # kubernetes-validate (PyPI, pinned; schemas bundled, so the test runs offline)
  # for //tests/ops:k8s_test, in a venv of Debian's python3.
  BATON_VENV=${BATON_VENV:-$HOME/.cache/baton/venv}
  KUBERNETES_VALIDATE=1.37.0
  if ! "$BATON_VENV/bin/kubernetes-validate" --version 2>/dev/null | grep -qF "$KUBERNETES_VALIDATE"; then
    echo "setup: installing kubernetes-validate==$KUBERNETES_VALIDATE into $BATON_VENV"
    /usr/bin/python3 -m venv "$BATON_VENV"
    "$BATON_VENV/bin/pip" install -q --disable-pip-version-check "kubernetes-validate==$KUBERNETES_VALIDATE"
  fi
  # transformers (PyPI, pinned with its dependencies: 4.40 still runs on
  # Debian's torch 1.13) for //tests/hf:hf_export_check_test, in a venv that
  # sees Debian's python3-torch and numpy (--system-site-packages).
  BATON_HF_VENV=${BATON_HF_VENV:-$HOME/.cache/baton/hf-venv}
  TRANSFORMERS=4.40.2
  if ! "$BATON_HF_VENV/bin/python" -c "import torch, transformers; assert transformers.__version__ == '$TRANSFORMERS'" \
      2>/dev/null; then
    echo "setup: installing transformers==$TRANSFORMERS into $BATON_HF_VENV"
    /usr/bin/python3 -m venv --system-site-packages "$BATON_HF_VENV"
    "$BATON_HF_VENV/bin/pip" install -q --disable-pip-version-check "transformers==$TRANSFORMERS" \
      "huggingface_hub==0.36.2" "tokenizers==0.19.1" "safetensors==0.8.0"
  fi
fi

if [ ! -x /usr/local/cuda/bin/nvcc ] && [ -z "${BATON_CUDA_PATH:-}" ]; then
  echo "setup: no CUDA toolkit at /usr/local/cuda: GPU targets will be left out of the build"
fi
