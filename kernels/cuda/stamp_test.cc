// GPU test (tag `gpu`; fails without a GPU): kernels::StampTime on CUDA
// writes, when the stream reaches it, the time on the host's Unix clock
// (%globaltimer plus the measured offset), in stream order.
#include <cstdint>
#include <cstdlib>
#include <memory>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cuda/stamp.cuh"
#include "kernels/ops.h"

namespace baton::cuda {
namespace {

using kernels::Device;
using kernels::DType;
using kernels::ExecContext;
using kernels::Tensor;

// The stamp may sit this far outside the host times around it: the offset's
// measured uncertainty is a few microseconds; this bound leaves room for a
// slow launch path, not for a wrong epoch or unit (those miss by far more).
constexpr int64_t kSlackUs = 2000;

TEST(CudaStampTest, OffsetIsMeasuredWithinAFewMicroseconds) {
  int count = 0;
  ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess) << "this test needs a GPU";
  ASSERT_GT(count, 0) << "this test needs a GPU";
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  int64_t offset = 0, uncertainty = -1;
  ASSERT_EQ(MeasureGlobalTimerOffset(&offset, &uncertainty), cudaSuccess);
  ::testing::Test::RecordProperty("host_minus_globaltimer_us", std::to_string(offset));
  ::testing::Test::RecordProperty("uncertainty_us", static_cast<int>(uncertainty));
  EXPECT_GE(uncertainty, 0);
  EXPECT_LT(uncertainty, kSlackUs);
}

// The backend measures again with a probe it keeps (timer_offset.h): two
// measurements 200 ms apart agree within their uncertainties and the drift
// bound, and measuring with a kept probe needs no device-wide wait.
TEST(CudaStampTest, AKeptProbeMeasuresAgainConsistently) {
  int count = 0;
  ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess) << "this test needs a GPU";
  ASSERT_GT(count, 0) << "this test needs a GPU";
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  GlobalTimerProbe probe;
  ASSERT_EQ(CreateGlobalTimerProbe(&probe), cudaSuccess);
  int64_t first = 0, first_unc = -1, second = 0, second_unc = -1;
  ASSERT_EQ(MeasureGlobalTimerOffset(probe, &first, &first_unc), cudaSuccess);
  absl::SleepFor(absl::Milliseconds(200));
  ASSERT_EQ(MeasureGlobalTimerOffset(probe, &second, &second_unc), cudaSuccess);
  DestroyGlobalTimerProbe(&probe);
  EXPECT_EQ(probe.stream, nullptr);
  ::testing::Test::RecordProperty("offset_change_over_200ms_us", std::to_string(second - first));
  EXPECT_LT(first_unc, kSlackUs);
  EXPECT_LT(second_unc, kSlackUs);
  // 100 ppm of 200 ms is 20 us; 2 us more for the timer's resolution.
  EXPECT_LE(std::abs(second - first), first_unc + second_unc + 22);
}

TEST(CudaStampTest, StampIsTheHostClockWhenTheStreamGetsThere) {
  absl::Status probe = kernels::ProbeDevice(Device::Cuda(0));
  ASSERT_TRUE(probe.ok()) << "this test needs a GPU: " << probe;
  absl::StatusOr<std::unique_ptr<kernels::Stream>> stream = kernels::Stream::Create(Device::Cuda(0));
  ASSERT_TRUE(stream.ok()) << stream.status();
  const ExecContext ctx = ExecContext::On(stream->get());
  absl::StatusOr<Tensor> stamps = kernels::ZerosOn(Device::Cuda(0), {2}, DType::kInt64);
  ASSERT_TRUE(stamps.ok()) << stamps.status();
  constexpr int64_t kOffset = 1'000'000'000;  // added as given
  // Warm-up: the first stamp measures the timer offset (a host wait).
  kernels::StampTime(ctx, stamps->Rows(0, 1), 0);
  ASSERT_TRUE((*stream)->Synchronize().ok());

  int64_t host[2] = {0, 0};
  const int64_t before = absl::ToUnixMicros(absl::Now());
  kernels::StampTime(ctx, stamps->Rows(0, 1), kOffset);
  kernels::StampTime(ctx, stamps->Rows(1, 2), 0);
  kernels::Copy(ctx, Tensor::View(host, {2}, DType::kInt64), *stamps);
  ASSERT_TRUE((*stream)->Synchronize().ok());
  const int64_t after = absl::ToUnixMicros(absl::Now());
  const int64_t first = host[0] - kOffset, second = host[1];
  EXPECT_GE(first, before - kSlackUs);
  EXPECT_LE(second, after + kSlackUs);
  EXPECT_LE(first, second) << "stamps out of stream order";
}

}  // namespace
}  // namespace baton::cuda
