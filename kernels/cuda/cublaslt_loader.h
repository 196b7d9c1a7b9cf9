// cuBLASLt, loaded when the first GEMM handle is created instead of when the
// process starts.
//
// Merely loading libcublasLt costs a process ~150 MB resident, ~94 MB of it
// private (the library's relocated data and what its initialisers allocate;
// measured on CUDA 13.0). Every baton-worker links the CUDA backend, but most
// worker processes on CPU hosts never run a GEMM on a GPU, so the library is
// opened with dlopen on first use. cublaslt_loader.cc defines the cuBLASLt
// functions gemm.cc calls (same C names and signatures as <cublasLt.h>), each
// forwarding to the loaded library; nothing links -lcublasLt.
//
// The library is libcublasLt.so.<CUBLAS_VER_MAJOR of the headers>, found the
// way the dynamic loader finds any library (the binary's rpath, ld.so.conf,
// LD_LIBRARY_PATH). Without it every forwarded call returns
// CUBLAS_STATUS_NOT_INITIALIZED, and LoadCublasLt says why.
#ifndef BATON_KERNELS_CUDA_CUBLASLT_LOADER_H_
#define BATON_KERNELS_CUDA_CUBLASLT_LOADER_H_

#include "absl/status/status.h"

namespace baton::cuda {

// Loads libcublasLt and resolves every forwarded function, once per process
// (thread-safe). OK when loaded; UNAVAILABLE naming the library and the
// loader's error otherwise (the same answer on every later call).
absl::Status LoadCublasLt();

}  // namespace baton::cuda

#endif  // BATON_KERNELS_CUDA_CUBLASLT_LOADER_H_
