"""cudnn_cc_library: a C++ library that uses cuDNN through the frontend headers.

Absent where the CUDA toolkit or cuDNN's headers are missing (CUDNN_AVAILABLE
from @local_cuda), like the macros of //third_party/cuda:cuda.bzl.
"""

load("@local_cuda//:defs.bzl", "CUDNN_AVAILABLE")

def cudnn_cc_library(name, **kwargs):
    if not CUDNN_AVAILABLE:
        return
    native.cc_library(name = name, **kwargs)
