// The cuBLASLt loader on a machine with the CUDA toolkit and no GPU (CI): the
// library is not in the process until LoadCublasLt, then it is, and the
// forwarded functions reach it (cublasLtCreate answers as the real library
// does without a driver, not with the loader's own "not loaded" answer).
#include "kernels/cuda/cublaslt_loader.h"

#include <cublasLt.h>

#include <fstream>
#include <string>

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace baton::cuda {
namespace {

bool Mapped(const std::string& library) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    if (absl::StrContains(line, library)) return true;
  }
  return false;
}

TEST(CublasLtLoaderTest, LoadsOnFirstUseAndForwards) {
  EXPECT_FALSE(Mapped("libcublasLt")) << "cuBLASLt was loaded at process start";
  const absl::Status loaded = LoadCublasLt();
  ASSERT_TRUE(loaded.ok()) << loaded;
  EXPECT_TRUE(Mapped("libcublasLt.so.")) << "LoadCublasLt succeeded without mapping the library";
  // The real library's names, through the forwarders.
  EXPECT_STREQ(cublasLtGetStatusName(CUBLAS_STATUS_INVALID_VALUE), "CUBLAS_STATUS_INVALID_VALUE");
  cublasLtMatrixLayout_t layout = nullptr;
  ASSERT_EQ(cublasLtMatrixLayoutCreate(&layout, CUDA_R_32F, 4, 8, 4), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasLtMatrixLayoutDestroy(layout), CUBLAS_STATUS_SUCCESS);
}

}  // namespace
}  // namespace baton::cuda
