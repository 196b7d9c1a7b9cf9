"""Finds the CUDA toolkit (nvcc, cudart, cuBLAS, NCCL, cuDNN) on this machine.

Generates @local_cuda with:
  defs.bzl   CUDA_AVAILABLE, CUDA_PATH, CUDNN_AVAILABLE
  BUILD      :cudart (headers + cudart) and :nccl when available; :cudnn when
             cuDNN's headers are in the toolkit's include directory too.
Set BATON_CUDA_PATH to use a toolkit other than /usr/local/cuda. Without nvcc
the GPU targets are left out of the build and this rule says so once.
"""

def _cuda_configure_impl(ctx):
    cuda_path = ctx.os.environ.get("BATON_CUDA_PATH", "/usr/local/cuda")
    nvcc = ctx.path(cuda_path + "/bin/nvcc")
    nccl = ctx.path(cuda_path + "/include/nccl.h")
    available = nvcc.exists and nccl.exists
    cudnn_available = available and ctx.path(cuda_path + "/include/cudnn.h").exists
    if not available:
        print("baton: no CUDA toolkit with NCCL at %s (set BATON_CUDA_PATH); " % cuda_path +
              "GPU targets are left out of this build.")
    ctx.file("defs.bzl", "CUDA_AVAILABLE = %s\nCUDA_PATH = %r\nCUDNN_AVAILABLE = %s\n" %
                         (available, cuda_path, cudnn_available))
    if available:
        ctx.symlink(cuda_path + "/include", "include")
        ctx.file("BUILD", """
package(default_visibility = ["//visibility:public"])

# Link only what a target needs. cuBLASLt is never linked: kernels/cuda
# opens it on first use (cublaslt_loader.h), since loading it costs ~150 MB
# resident and a large static TLS block in every process.
cc_library(
    name = "cudart",
    hdrs = glob(["include/**/*.h", "include/**/*.hpp", "include/**/*.inl", "include/**/*.cuh"]),
    includes = ["include"],
    linkopts = ["-L{p}/lib64", "-Wl,-rpath,{p}/lib64", "-lcudart"],
)

cc_library(
    name = "nccl",
    linkopts = ["-L{p}/lib64", "-Wl,-rpath,{p}/lib64", "-lnccl"],
    deps = [":cudart"],
)
""".format(p = cuda_path) + ("""
# cuDNN: its headers (in :cudart's include directory). libcudnn is never
# linked: the cuDNN frontend opens it on first use (kernels/cuda/cudnn_attention.h LoadCudnn),
# so a worker that never runs bf16 attention on a GPU never loads it.
cc_library(
    name = "cudnn",
    linkopts = ["-ldl"],
    deps = [":cudart"],
)
""" if cudnn_available else ""))
    else:
        ctx.file("BUILD", "package(default_visibility = [\"//visibility:public\"])\n")

cuda_configure = repository_rule(
    implementation = _cuda_configure_impl,
    environ = ["BATON_CUDA_PATH"],
    local = True,
)
