// The GEMM ceiling on one GPU through baton's own cuBLASLt path
// (kernels/cuda/gemm.h): a large square bf16 GEMM (the ceiling), true-fp32
// GEMMs (no TF32), and the forward GEMMs of a GPT-2-small layer at 8192
// tokens, each as TFLOP/s and as a ratio to the square bf16 ceiling measured
// in the same run and to the datasheet peaks (989 TFLOP/s dense bf16, 67
// TFLOP/s fp32 on H100/H200 SXM). One JSON object per line on stdout.
//
//   bazel build //bench:gpu_gemm_bench && bazel-bin/bench/gpu_gemm_bench
#include <cuda_runtime.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/plan.h"

ABSL_FLAG(int, square, 8192, "M = N = K of the bf16 ceiling GEMM");
ABSL_FLAG(int, square_f32, 4096, "M = N = K of the fp32 GEMM");
ABSL_FLAG(int, tokens, 8192, "rows of the GPT-2-small layer GEMMs");
ABSL_FLAG(int, iters, 20, "timed repetitions per GEMM (after 3 untimed)");

namespace {

using baton::cuda::CublasLtGemm;
using baton::cuda::GemmArgs;
using baton::cuda::GemmDType;

constexpr double kPeakBf16 = 989e12;
constexpr double kPeakF32 = 67e12;

struct Result {
  double seconds = 0;  // per GEMM
  double tflops = 0;
};

// Times out[rows, out] = x[rows, in] · W[out, in]ᵀ (the Linear forward).
absl::StatusOr<Result> Time(CublasLtGemm& gemm, cudaStream_t stream, GemmDType type,
                            int64_t rows, int64_t in, int64_t out, int iters) {
  const size_t elem = type == GemmDType::kBF16 ? 2 : 4;
  void *x = nullptr, *w = nullptr, *y = nullptr;
  BATON_CUDA_RETURN_IF_ERROR(cudaMalloc(&x, rows * in * elem));
  BATON_CUDA_RETURN_IF_ERROR(cudaMalloc(&w, out * in * elem));
  BATON_CUDA_RETURN_IF_ERROR(cudaMalloc(&y, rows * out * elem));
  // Random-ish bits: constant data would understate power draw and clocks.
  BATON_CUDA_RETURN_IF_ERROR(cudaMemset(x, 0x3c, rows * in * elem));
  BATON_CUDA_RETURN_IF_ERROR(cudaMemset(w, 0x3b, out * in * elem));
  GemmArgs g;
  g.shape = baton::cuda::LinearForwardGemm(rows, in, out);
  g.ab_type = type;
  g.c_type = type;
  g.a = x;
  g.b = w;
  g.c = y;
  cudaEvent_t start, end;
  BATON_CUDA_RETURN_IF_ERROR(cudaEventCreate(&start));
  BATON_CUDA_RETURN_IF_ERROR(cudaEventCreate(&end));
  for (int i = 0; i < 3; ++i) {
    absl::Status s = gemm.Run(g, stream);
    if (!s.ok()) return s;
  }
  BATON_CUDA_RETURN_IF_ERROR(cudaEventRecord(start, stream));
  for (int i = 0; i < iters; ++i) {
    absl::Status s = gemm.Run(g, stream);
    if (!s.ok()) return s;
  }
  BATON_CUDA_RETURN_IF_ERROR(cudaEventRecord(end, stream));
  BATON_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(end));
  float ms = 0;
  BATON_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, start, end));
  cudaEventDestroy(start);
  cudaEventDestroy(end);
  cudaFree(x);
  cudaFree(w);
  cudaFree(y);
  Result r;
  r.seconds = ms / 1000.0 / iters;
  r.tflops = 2.0 * rows * in * out / r.seconds / 1e12;
  return r;
}

// `s` as the inside of a JSON string.
std::string JsonEscape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (c != '\n') out += c;
  }
  return out;
}

int Fail(const absl::Status& s) {
  std::printf("{\"error\": \"%s\"}\n", JsonEscape(std::string(s.message())).c_str());
  std::fprintf(stderr, "gpu_gemm_bench: %s\n", std::string(s.ToString()).c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  int count = 0;
  absl::Status s = baton::cuda::CudaDeviceCount(&count);
  if (!s.ok()) return Fail(s);
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  std::printf("{\"device\": \"%s\", \"sm\": %d, \"cc\": \"%d.%d\"}\n", prop.name,
              prop.multiProcessorCount, prop.major, prop.minor);
  cudaStream_t stream;
  if (cudaStreamCreate(&stream) != cudaSuccess) return Fail(absl::InternalError("no stream"));
  absl::StatusOr<std::unique_ptr<CublasLtGemm>> gemm = CublasLtGemm::Create();
  if (!gemm.ok()) return Fail(gemm.status());
  const int iters = absl::GetFlag(FLAGS_iters);

  const int64_t sq = absl::GetFlag(FLAGS_square);
  absl::StatusOr<Result> ceiling = Time(**gemm, stream, GemmDType::kBF16, sq, sq, sq, iters);
  if (!ceiling.ok()) return Fail(ceiling.status());
  std::printf(
      "{\"gemm\": \"bf16 square\", \"m\": %lld, \"tflops\": %.1f, \"of_peak_989\": %.3f}\n",
      static_cast<long long>(sq), ceiling->tflops, ceiling->tflops * 1e12 / kPeakBf16);

  const int64_t sq32 = absl::GetFlag(FLAGS_square_f32);
  absl::StatusOr<Result> f32 = Time(**gemm, stream, GemmDType::kF32, sq32, sq32, sq32, iters);
  if (!f32.ok()) return Fail(f32.status());
  std::printf("{\"gemm\": \"fp32 square (no TF32)\", \"m\": %lld, \"tflops\": %.1f, "
              "\"of_peak_67\": %.3f}\n",
              static_cast<long long>(sq32), f32->tflops, f32->tflops * 1e12 / kPeakF32);

  // The forward GEMMs of one GPT-2-small layer and its LM head.
  const int64_t n = absl::GetFlag(FLAGS_tokens);
  struct Shape {
    const char* name;
    int64_t in, out;
  };
  const Shape shapes[] = {{"qkv", 768, 2304},
                          {"attn_proj", 768, 768},
                          {"fc", 768, 3072},
                          {"fc_proj", 3072, 768},
                          {"lm_head", 768, 50304}};
  for (const Shape& sh : shapes) {
    absl::StatusOr<Result> r = Time(**gemm, stream, GemmDType::kBF16, n, sh.in, sh.out, iters);
    if (!r.ok()) return Fail(r.status());
    std::printf("{\"gemm\": \"bf16 gpt2-small %s\", \"m\": %lld, \"k\": %lld, \"n\": %lld, "
                "\"us\": %.1f, \"tflops\": %.1f, \"of_ceiling\": %.3f}\n",
                sh.name, static_cast<long long>(n), static_cast<long long>(sh.in),
                static_cast<long long>(sh.out), r->seconds * 1e6, r->tflops,
                r->tflops / ceiling->tflops);
  }
  std::printf("{\"summary\": \"bf16_ceiling_tflops\", \"value\": %.1f}\n", ceiling->tflops);
  cudaStreamDestroy(stream);
  return 0;
}
