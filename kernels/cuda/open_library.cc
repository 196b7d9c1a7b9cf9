#include "kernels/cuda/open_library.h"

#include <dlfcn.h>

#include "absl/strings/str_cat.h"

namespace baton::cuda {
namespace {

void* Open(const std::string& path, std::string* error) {
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* e = dlerror();
    absl::StrAppend(error, error->empty() ? "" : "; ", e != nullptr ? e : path + ": unknown error");
  }
  return handle;
}

}  // namespace

void* OpenCudaLibrary(const std::string& name, std::string* error) {
  error->clear();
  void* handle = Open(name, error);
#ifdef BATON_CUDA_LIB_DIR
  if (handle == nullptr) handle = Open(absl::StrCat(BATON_CUDA_LIB_DIR, "/", name), error);
#endif
  return handle;
}

}  // namespace baton::cuda
