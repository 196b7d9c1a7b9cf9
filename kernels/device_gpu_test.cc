// What a cuda:0 worker registers of its GPU (kernels::DescribeCudaDevice):
// the UUID nvidia-smi prints, the name and the memory. Tag gpu: fails
// without a GPU.
#include <cstdio>
#include <string>

#include "absl/strings/match.h"
#include "common/worker_identity.h"
#include "gtest/gtest.h"
#include "kernels/device.h"

namespace baton::kernels {
namespace {

TEST(DeviceIdentityTest, TheGpuIsDescribedAsNvidiaSmiNamesIt) {
  absl::StatusOr<CudaDeviceInfo> info = DescribeCudaDevice(0);
  ASSERT_TRUE(info.ok()) << info.status() << " (this test needs a GPU)";
  std::printf("cuda:0: %s %s, %.1f GiB\n", info->name.c_str(), info->uuid.c_str(),
              info->memory_bytes / 1073741824.0);
  EXPECT_TRUE(absl::StartsWith(info->uuid, "GPU-")) << info->uuid;
  EXPECT_EQ(info->uuid.size(), 40u) << info->uuid;
  EXPECT_TRUE(IsValidGpuUuid(info->uuid)) << info->uuid;
  EXPECT_NE(info->uuid, "GPU-00000000-0000-0000-0000-000000000000");
  EXPECT_FALSE(info->name.empty());
  EXPECT_GT(info->memory_bytes, int64_t{1} << 30);
  // Asked twice, the same GPU.
  EXPECT_EQ(DescribeCudaDevice(0)->uuid, info->uuid);
  // An ordinal past the visible devices: UNAVAILABLE, not a crash.
  EXPECT_EQ(DescribeCudaDevice(4096).status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace baton::kernels
