#include "kernels/device.h"

#include <string>

#include "common/worker_identity.h"
#include "gtest/gtest.h"

namespace baton::kernels {
namespace {

TEST(DeviceTest, ParsesTheDeviceNamesWorkersTake) {
  EXPECT_TRUE(ParseDevice("cpu").ok());
  EXPECT_EQ(ParseDevice("cuda:3")->index, 3);
  EXPECT_EQ(ParseDevice("cuda:3")->type, DeviceType::kCuda);
  EXPECT_EQ(ParseDevice("sim:1")->type, DeviceType::kSim);
  const absl::StatusOr<Device> bad = ParseDevice("gpu0");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("cuda:N"), std::string::npos) << bad.status();
}

// The form nvidia-smi -L prints, so an operator can match a worker to a GPU.
TEST(DeviceTest, GpuUuidsAreWrittenAsNvidiaSmiWritesThem) {
  const unsigned char bytes[16] = {0x5f, 0xb0, 0xe0, 0xa4, 0x5c, 0xf0, 0x7c, 0x1e,
                                   0x3d, 0x31, 0x5b, 0x0e, 0x6f, 0x3e, 0x2a, 0x19};
  EXPECT_EQ(FormatGpuUuid(bytes), "GPU-5fb0e0a4-5cf0-7c1e-3d31-5b0e6f3e2a19");
  EXPECT_TRUE(IsValidGpuUuid(FormatGpuUuid(bytes)));  // what the coordinator accepts
  const unsigned char zeros[16] = {};
  EXPECT_EQ(FormatGpuUuid(zeros), "GPU-00000000-0000-0000-0000-000000000000");
}

}  // namespace
}  // namespace baton::kernels
