"""cuda_cc_test: a test of CUDA-linked code that needs no GPU (runs in CI).

Absent where no CUDA toolkit is installed, like the macros of
//third_party/cuda:cuda.bzl.
"""

load("@local_cuda//:defs.bzl", "CUDA_AVAILABLE")

def cuda_cc_test(name, **kwargs):
    if not CUDA_AVAILABLE:
        return
    native.cc_test(name = name, **kwargs)
