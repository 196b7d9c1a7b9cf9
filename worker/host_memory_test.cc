#include "worker/host_memory.h"

#include <cstdio>
#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace baton {
namespace {

constexpr int64_t kGiB = int64_t{1} << 30;

std::string File(const std::string& name, const std::string& text) {
  const std::string path = std::string(std::getenv("TEST_TMPDIR")) + "/" + name;
  std::ofstream(path) << text;
  return path;
}

TEST(HostMemoryTest, CgroupLimitsAreByteCountsOrNone) {
  EXPECT_EQ(ParseCgroupMemoryLimit("4294967296\n"), 4 * kGiB);
  EXPECT_EQ(ParseCgroupMemoryLimit("max\n"), std::nullopt);                  // v2, no limit
  EXPECT_EQ(ParseCgroupMemoryLimit("9223372036854771712"), std::nullopt);    // v1, no limit
  EXPECT_EQ(ParseCgroupMemoryLimit(""), std::nullopt);
  EXPECT_EQ(ParseCgroupMemoryLimit("0"), std::nullopt);
  EXPECT_EQ(ParseCgroupMemoryLimit("-1"), std::nullopt);
  EXPECT_EQ(ParseCgroupMemoryLimit("12ab"), std::nullopt);
  EXPECT_EQ(ParseCgroupMemoryLimit("99999999999999999999999"), std::nullopt);
}

// A pod limited to 4 GiB on a 256 GiB node registers 4 GiB.
TEST(HostMemoryTest, AContainersLimitIsWhatItHas) {
  const int64_t node = 256 * kGiB;
  EXPECT_EQ(UsableHostMemory(node, {File("v2_limited", "4294967296\n")}), 4 * kGiB);
  EXPECT_EQ(UsableHostMemory(node, {File("v2_max", "max\n")}), node);
  EXPECT_EQ(UsableHostMemory(node, {File("v1_unlimited", "9223372036854771712\n")}), node);
  EXPECT_EQ(UsableHostMemory(4 * kGiB, {File("v2_above", "8589934592\n")}), 4 * kGiB);  // never above the RAM
  // The first file that exists decides (v2 before v1); missing files are skipped.
  EXPECT_EQ(UsableHostMemory(node, {"/nonexistent/memory.max", File("v1_limited", "2147483648")}), 2 * kGiB);
  EXPECT_EQ(UsableHostMemory(node, {File("v2_first", "max"), File("v1_second", "2147483648")}), node);
  EXPECT_EQ(UsableHostMemory(node, {}), node);
  // A file of garbage, however long, is read to a bound and ignored.
  EXPECT_EQ(UsableHostMemory(node, {File("garbage", std::string(1 << 20, '7'))}), node);
}

}  // namespace
}  // namespace baton
