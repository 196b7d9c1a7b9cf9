// CompareWithGolden on the Mixture-of-Experts goldens (gen_moe_golden.py):
// the load-balancing loss is compared as "aux_loss", and an error in it is
// reported against that name alone. golden_check_moe_test runs every layout.
#include <string>

#include "common/safetensors.h"
#include "gtest/gtest.h"
#include "kernels/cpu/gemm.h"
#include "tests/golden/golden.h"

namespace baton::golden {
namespace {

Golden Load(const std::string& name) {
  auto file = SafetensorsFile::Read("tests/golden/" + name + ".safetensors");
  EXPECT_TRUE(file.ok()) << file.status();
  auto golden = LoadGolden(*file);
  EXPECT_TRUE(golden.ok()) << golden.status();
  return *golden;
}

TEST(GoldenMoeTest, AWrongAuxLossIsReportedAgainstItsName) {
  kernels::cpu::SetBlasThreads(1);
  for (const std::string name : {"moe_gpt2_top1_cap", "moe_llama_top2_cap"}) {
    SCOPED_TRACE(name);
    Golden golden = Load(name);
    ASSERT_GT(golden.aux_loss, 0);
    golden.aux_loss *= 1 + 1e-3;
    auto result = CompareWithGolden(golden, /*tp=*/2, /*pp=*/2, /*vocab_parallel=*/false);
    ASSERT_TRUE(result.ok()) << result.status();
    bool compared = false;
    for (const Comparison& c : *result) {
      if (c.name == "aux_loss") {
        compared = true;
        EXPECT_GT(c.rel_error, 5e-4);
      } else {
        EXPECT_LT(c.rel_error, 1e-4) << c.name;
      }
    }
    EXPECT_TRUE(compared) << "no aux_loss among the comparisons";
  }
}

}  // namespace
}  // namespace baton::golden
