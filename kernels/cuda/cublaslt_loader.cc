#include "kernels/cuda/cublaslt_loader.h"

#include <cublasLt.h>
#include <dlfcn.h>

#include <array>
#include <string>

#include "absl/base/call_once.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/open_library.h"

namespace baton::cuda {
namespace {

// The forwarded functions, in the order of kNames.
enum Fn {
  kCreate,
  kDestroy,
  kGetStatusName,
  kGetStatusString,
  kMatmul,
  kMatmulAlgoGetHeuristic,
  kMatmulDescCreate,
  kMatmulDescDestroy,
  kMatmulDescSetAttribute,
  kMatmulPreferenceCreate,
  kMatmulPreferenceDestroy,
  kMatmulPreferenceSetAttribute,
  kMatrixLayoutCreate,
  kMatrixLayoutDestroy,
  kMatrixLayoutSetAttribute,
  kNumFns,
};

constexpr std::array<const char*, kNumFns> kNames = {
    "cublasLtCreate",
    "cublasLtDestroy",
    "cublasLtGetStatusName",
    "cublasLtGetStatusString",
    "cublasLtMatmul",
    "cublasLtMatmulAlgoGetHeuristic",
    "cublasLtMatmulDescCreate",
    "cublasLtMatmulDescDestroy",
    "cublasLtMatmulDescSetAttribute",
    "cublasLtMatmulPreferenceCreate",
    "cublasLtMatmulPreferenceDestroy",
    "cublasLtMatmulPreferenceSetAttribute",
    "cublasLtMatrixLayoutCreate",
    "cublasLtMatrixLayoutDestroy",
    "cublasLtMatrixLayoutSetAttribute",
};

struct Library {
  absl::once_flag once;
  absl::Status status;
  std::array<void*, kNumFns> fns = {};
};

Library& Lib() {
  static Library* lib = new Library();  // never destroyed: calls may come from exit handlers
  return *lib;
}

void Load(Library* lib) {
  const std::string name = absl::StrCat("libcublasLt.so.", CUBLAS_VER_MAJOR);
  std::string error;
  void* handle = OpenCudaLibrary(name, &error);
  if (handle == nullptr) {
    lib->status = absl::UnavailableError(
        absl::StrCat("cannot load ", name, " (cuBLASLt, needed for GEMMs on a CUDA device): ", error,
                     "; install the CUDA ", CUBLAS_VER_MAJOR, " math libraries or add their directory to "
                     "LD_LIBRARY_PATH"));
    return;
  }
  std::array<void*, kNumFns> fns = {};
  for (int i = 0; i < kNumFns; ++i) {
    fns[i] = dlsym(handle, kNames[i]);
    if (fns[i] == nullptr) {
      lib->status = absl::UnavailableError(absl::StrCat(name, " has no ", kNames[i], ": a cuBLASLt older than the ",
                                                        CUBLAS_VER_MAJOR, ".x headers baton was built with"));
      return;  // the handle stays open; nothing is forwarded
    }
  }
  lib->fns = fns;
}

template <typename F>
F Get(Fn fn) {
  Library& lib = Lib();
  absl::call_once(lib.once, Load, &lib);
  return reinterpret_cast<F>(lib.fns[fn]);
}

}  // namespace

absl::Status LoadCublasLt() {
  Library& lib = Lib();
  absl::call_once(lib.once, Load, &lib);
  return lib.status;
}

}  // namespace baton::cuda

// The cuBLASLt functions gemm.cc calls. Their declarations come from
// <cublasLt.h>, so a signature that differs from the headers' fails to build.
using baton::cuda::Get;

#define BATON_LT_FORWARD(fn, ...)                                   \
  auto f = Get<decltype(&::cublasLt##fn)>(baton::cuda::k##fn);       \
  return f == nullptr ? CUBLAS_STATUS_NOT_INITIALIZED : f(__VA_ARGS__)

extern "C" {

cublasStatus_t CUBLASWINAPI cublasLtCreate(cublasLtHandle_t* handle) { BATON_LT_FORWARD(Create, handle); }

cublasStatus_t CUBLASWINAPI cublasLtDestroy(cublasLtHandle_t handle) { BATON_LT_FORWARD(Destroy, handle); }

const char* CUBLASWINAPI cublasLtGetStatusName(cublasStatus_t status) {
  auto f = Get<decltype(&::cublasLtGetStatusName)>(baton::cuda::kGetStatusName);
  return f == nullptr ? "CUBLAS_STATUS_NOT_INITIALIZED" : f(status);
}

const char* CUBLASWINAPI cublasLtGetStatusString(cublasStatus_t status) {
  auto f = Get<decltype(&::cublasLtGetStatusString)>(baton::cuda::kGetStatusString);
  return f == nullptr ? "libcublasLt could not be loaded" : f(status);
}

cublasStatus_t CUBLASWINAPI cublasLtMatmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const void* alpha,
                                           const void* a, cublasLtMatrixLayout_t a_desc, const void* b,
                                           cublasLtMatrixLayout_t b_desc, const void* beta, const void* c,
                                           cublasLtMatrixLayout_t c_desc, void* d, cublasLtMatrixLayout_t d_desc,
                                           const cublasLtMatmulAlgo_t* algo, void* workspace,
                                           size_t workspace_bytes, cudaStream_t stream) {
  BATON_LT_FORWARD(Matmul, handle, desc, alpha, a, a_desc, b, b_desc, beta, c, c_desc, d, d_desc, algo, workspace,
                   workspace_bytes, stream);
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulAlgoGetHeuristic(
    cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a_desc, cublasLtMatrixLayout_t b_desc,
    cublasLtMatrixLayout_t c_desc, cublasLtMatrixLayout_t d_desc, cublasLtMatmulPreference_t preference,
    int requested, cublasLtMatmulHeuristicResult_t results[], int* returned) {
  BATON_LT_FORWARD(MatmulAlgoGetHeuristic, handle, desc, a_desc, b_desc, c_desc, d_desc, preference, requested,
                   results, returned);
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* desc, cublasComputeType_t compute,
                                                     cudaDataType_t scale) {
  BATON_LT_FORWARD(MatmulDescCreate, desc, compute, scale);
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc) {
  BATON_LT_FORWARD(MatmulDescDestroy, desc);
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc,
                                                           cublasLtMatmulDescAttributes_t attr, const void* buf,
                                                           size_t bytes) {
  BATON_LT_FORWARD(MatmulDescSetAttribute, desc, attr, buf, bytes);
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref) {
  BATON_LT_FORWARD(MatmulPreferenceCreate, pref);
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
  BATON_LT_FORWARD(MatmulPreferenceDestroy, pref);
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                                 cublasLtMatmulPreferenceAttributes_t attr,
                                                                 const void* buf, size_t bytes) {
  BATON_LT_FORWARD(MatmulPreferenceSetAttribute, pref, attr, buf, bytes);
}

cublasStatus_t CUBLASWINAPI cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout, cudaDataType type,
                                                       uint64_t rows, uint64_t cols, int64_t ld) {
  BATON_LT_FORWARD(MatrixLayoutCreate, layout, type, rows, cols, ld);
}

cublasStatus_t CUBLASWINAPI cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout) {
  BATON_LT_FORWARD(MatrixLayoutDestroy, layout);
}

cublasStatus_t CUBLASWINAPI cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t layout,
                                                             cublasLtMatrixLayoutAttribute_t attr, const void* buf,
                                                             size_t bytes) {
  BATON_LT_FORWARD(MatrixLayoutSetAttribute, layout, attr, buf, bytes);
}

}  // extern "C"
