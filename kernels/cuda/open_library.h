// Opening a CUDA math library on first use (dlopen) instead of linking it:
// cuBLASLt and cuDNN cost hundreds of MB resident per process just by being
// loaded, and a worker that never runs a GEMM or fused attention on a GPU
// should not need them installed.
#ifndef BATON_KERNELS_CUDA_OPEN_LIBRARY_H_
#define BATON_KERNELS_CUDA_OPEN_LIBRARY_H_

#include <string>

namespace baton::cuda {

// dlopen(`name`, RTLD_NOW | RTLD_LOCAL) (RTLD_LOCAL: its symbols must not
// interpose baton's forwarding functions): first through the loader's own
// search (LD_LIBRARY_PATH, the system's directories), then from the lib64
// directory of the CUDA toolkit baton was built with, as the rpath of a
// cudart link would. The handle, or null with `*error` saying why each
// attempt failed.
void* OpenCudaLibrary(const std::string& name, std::string* error);

}  // namespace baton::cuda

#endif  // BATON_KERNELS_CUDA_OPEN_LIBRARY_H_
