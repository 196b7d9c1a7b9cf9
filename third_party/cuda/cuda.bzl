"""cuda_library / cuda_test: compile .cu files with the system nvcc.

nvcc builds for sm_80 and sm_90 plus sm_90 PTX (so newer GPUs JIT). Where no
CUDA toolkit is installed these macros create nothing, so `bazel build //...`
still succeeds on CPU-only machines (cuda_configure says so once).
"""

load("@local_cuda//:defs.bzl", "CUDA_AVAILABLE", "CUDA_PATH")

NVCC_FLAGS = [
    "-O3",
    "-std=c++17",
    "--expt-relaxed-constexpr",
    "-Xcompiler=-fPIC,-Wall,-Wextra",
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90,code=sm_90",
    "-gencode=arch=compute_90,code=compute_90",
]

def cuda_library(name, srcs, hdrs = [], deps = [], **kwargs):
    """A cc_library whose .cu sources are compiled by nvcc into a static archive.

    Links cudart; add "@local_cuda//:nccl" to `deps` when needed (cuBLASLt:
    //kernels/cuda:cublaslt_loader).
    """
    if not CUDA_AVAILABLE:
        return
    archive = "lib%s_cu.a" % name
    objs = []
    cmds = []
    for src in srcs:
        obj = "$(@D)/_%s_%s.o" % (name, src.replace("/", "_"))
        objs.append(obj)
        cmds.append("%s/bin/nvcc %s -I. -I$(GENDIR) -c $(location %s) -o %s" %
                    (CUDA_PATH, " ".join(NVCC_FLAGS), src, obj))
    cmds.append("ar rcs $@ " + " ".join(objs))
    native.genrule(
        name = name + "_nvcc",
        srcs = srcs + hdrs,
        outs = [archive],
        cmd = " && ".join(cmds),
        message = "nvcc " + name,
    )
    native.cc_library(
        name = name,
        srcs = [archive],
        hdrs = hdrs,
        deps = deps + ["@local_cuda//:cudart"],
        alwayslink = True,
        **kwargs
    )

def cuda_cc_library(name, **kwargs):
    """A plain C++ library that calls CUDA host APIs (cudart; add
    "@local_cuda//:nccl" to deps); absent without CUDA."""
    if not CUDA_AVAILABLE:
        return
    deps = kwargs.pop("deps", [])
    native.cc_library(name = name, deps = deps + ["@local_cuda//:cudart"], **kwargs)

def cuda_test(name, tags = [], **kwargs):
    """A cc_test that needs a GPU: tagged `gpu` and `exclusive`; absent without CUDA."""
    if not CUDA_AVAILABLE:
        return
    native.cc_test(name = name, tags = tags + ["gpu", "exclusive"], **kwargs)

def cuda_binary(name, **kwargs):
    """A cc_binary that links CUDA; absent without CUDA."""
    if not CUDA_AVAILABLE:
        return
    native.cc_binary(name = name, **kwargs)
