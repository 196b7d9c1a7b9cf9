// Runs everywhere (not tagged gpu): the per-block choice of the bf16 ring's
// path without a cuDNN state on the stream (no driver, or no libcudnn): every
// block takes the fp32 kernels, with the reason — the block's own for a
// block cuDNN never takes (an expected fallback, kept quiet), "no cuDNN on
// this stream" for one it would.
#include "kernels/cuda/ring_sdpa.h"

#include <string>

#include "gtest/gtest.h"
#include "kernels/cuda/sdpa_plan.h"

namespace baton::cuda {
namespace {

RingSdpaBlock Block(int64_t q_len, int64_t k_len, int64_t q_offset, int64_t k_offset) {
  RingSdpaBlock b;
  b.batch = 2;
  b.q_len = q_len;
  b.k_len = k_len;
  b.channels = 128;
  b.heads = 2;
  b.q_offset = q_offset;
  b.k_offset = k_offset;
  return b;
}

TEST(RingSdpaTest, WithoutCudnnEveryBlockTakesTheFp32KernelsSayingWhy) {
  alignas(16) static char buffer[64];
  struct Case {
    RingSdpaBlock block;
    const char* why;
  };
  const Case cases[] = {
      {Block(64, 64, 64, 64), "no cuDNN on this stream"},  // the diagonal
      {Block(64, 64, 128, 0), "no cuDNN on this stream"},  // fully visible
      {Block(64, 64, 80, 64), "partly visible"},
      {Block(64, 64, 0, 64), "invisible"},
  };
  for (const Case& c : cases) {
    const RingSdpaChoice choice = ChooseRingSdpa(nullptr, c.block, {buffer, buffer + 16});
    EXPECT_FALSE(choice.cudnn);
    EXPECT_TRUE(choice.expected) << choice.why_not_cudnn;
    EXPECT_NE(choice.why_not_cudnn.find(c.why), std::string::npos) << choice.why_not_cudnn;
  }
}

}  // namespace
}  // namespace baton::cuda
