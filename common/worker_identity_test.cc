#include "common/worker_identity.h"

#include <string>

#include "gtest/gtest.h"

namespace baton {
namespace {

TEST(WorkerIdentityTest, DevicesAreCpuOrAnOrdinal) {
  for (const char* ok : {"cpu", "cuda:0", "cuda:7", "sim:0"}) EXPECT_TRUE(IsValidDevice(ok)) << ok;
  for (const char* bad : {"", "gpu", "cuda", "cuda:", "cuda:-1", "cuda:x", "cuda: 1", "CPU", "cuda:99999999999"}) {
    EXPECT_FALSE(IsValidDevice(bad)) << bad;
  }
}

TEST(WorkerIdentityTest, GpuUuidsAreShortAndPlain) {
  EXPECT_TRUE(IsValidGpuUuid(""));  // unknown, or a CPU worker
  EXPECT_TRUE(IsValidGpuUuid("GPU-5fb0e0a4-5cf0-7c1e-3d31-5b0e6f3e2a19"));
  EXPECT_TRUE(IsValidGpuUuid("MIG-5fb0e0a4-5cf0-7c1e-3d31-5b0e6f3e2a19"));
  EXPECT_FALSE(IsValidGpuUuid(std::string(65, 'a')));
  EXPECT_FALSE(IsValidGpuUuid("GPU-5fb0e0a4 5cf0"));
  EXPECT_FALSE(IsValidGpuUuid("GPU/../x"));
  EXPECT_FALSE(IsValidGpuUuid(std::string("GPU-\0", 5)));
}

TEST(WorkerIdentityTest, NamesAreBoundedAndPlain) {
  EXPECT_TRUE(ValidateWorkerName("w-0.a_b").ok());
  EXPECT_FALSE(ValidateWorkerName("").ok());
  EXPECT_FALSE(ValidateWorkerName(std::string(129, 'a')).ok());
  EXPECT_FALSE(ValidateWorkerName("a/b").ok());
}

TEST(WorkerIdentityTest, HostsAreDnsNames) {
  EXPECT_TRUE(ValidateHostName("gpu-node-17.us-east1.internal").ok());
  EXPECT_TRUE(ValidateHostName(std::string(253, 'a')).ok());
  EXPECT_FALSE(ValidateHostName("").ok());
  EXPECT_FALSE(ValidateHostName(std::string(254, 'a')).ok());
  const absl::Status bad = ValidateHostName("node 1");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("DNS name"), std::string::npos) << bad;
  EXPECT_FALSE(ValidateHostName("a/b").ok());
  EXPECT_FALSE(ValidateHostName(std::string("a\0b", 3)).ok());
}

}  // namespace
}  // namespace baton
