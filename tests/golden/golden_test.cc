#include "tests/golden/golden.h"

#include <cstring>
#include <string>

#include "common/safetensors.h"
#include "gtest/gtest.h"
#include "kernels/cpu/gemm.h"

namespace baton::golden {
namespace {

class GoldenTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { kernels::cpu::SetBlasThreads(1); }

  Golden Load() {
    auto file = SafetensorsFile::Read("tests/golden/gpt_a.safetensors");
    EXPECT_TRUE(file.ok()) << file.status();
    auto golden = LoadGolden(*file);
    EXPECT_TRUE(golden.ok()) << golden.status();
    return *golden;
  }
};

TEST_F(GoldenTest, AWrongGradientIsReportedAgainstItsName) {
  Golden golden = Load();
  golden.grads["h.1.mlp.c_fc.weight"][5] += 1e-3;
  auto result = CompareWithGolden(golden, /*tp=*/2, /*pp=*/2, /*vocab_parallel=*/true);
  ASSERT_TRUE(result.ok()) << result.status();
  for (const Comparison& c : *result) {
    if (c.name == "h.1.mlp.c_fc.weight") {
      EXPECT_GT(c.rel_error, 1e-4);
    } else {
      EXPECT_LT(c.rel_error, 1e-4) << c.name;
    }
  }
}

TEST_F(GoldenTest, AGoldenForAnotherModelIsAnError) {
  Golden golden = Load();
  golden.params.erase("ln_f.bias");
  EXPECT_EQ(CompareWithGolden(golden, 1, 1, false).status().code(),
            absl::StatusCode::kInvalidArgument);
  golden = Load();
  // 4 heads cannot be split over 3 ranks.
  auto result = CompareWithGolden(golden, /*tp=*/3, 1, false);
  EXPECT_NE(result.status().message().find("parallel.tp"), absl::string_view::npos)
      << result.status();
}

}  // namespace
}  // namespace baton::golden
