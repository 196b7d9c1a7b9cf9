#include "worker/data/data_source.h"

#include "absl/strings/str_cat.h"

namespace baton::data {
namespace {

constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ull;

// SplitMix64's output function: a bijective 64-bit mix.
uint64_t Mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

bool HasShape(const kernels::Tensor& t, int64_t batch, int64_t seq) {
  return t.defined() && t.device().is_cpu() && t.dtype() == kernels::DType::kInt32 &&
         t.ndim() == 2 && t.dim(0) == batch && t.dim(1) == seq;
}

}  // namespace

SampleRng::SampleRng(std::initializer_list<uint64_t> key) : state_(0) {
  for (uint64_t k : key) state_ = Mix(state_ + kGolden + Mix(k + kGolden));
}

uint64_t SampleRng::Next() { return Mix(state_ += kGolden); }

absl::Status PrepareMicrobatch(int64_t step, int mb, int dp_rank, int64_t batch, int64_t seq,
                               MicrobatchData* out) {
  if (step < 0 || mb < 0 || dp_rank < 0) {
    return absl::InvalidArgumentError(absl::StrCat("data: step ", step, ", microbatch ", mb,
                                                   ", dp rank ", dp_rank,
                                                   ": none may be negative"));
  }
  if (!HasShape(out->tokens, batch, seq)) {
    out->tokens = kernels::Tensor::Zeros({batch, seq}, kernels::DType::kInt32);
  }
  if (!HasShape(out->targets, batch, seq)) {
    out->targets = kernels::Tensor::Zeros({batch, seq}, kernels::DType::kInt32);
  }
  return absl::OkStatus();
}

}  // namespace baton::data
