// transformers' own GPT-2 against baton's: tests/hf/testdata holds a tiny
// GPT2LMHeadModel saved by save_pretrained (whole and sharded) and the loss
// transformers computed for a fixed batch in float64 (gen_hf_golden.py).
// The directory goes through `batonctl checkpoint import-hf`'s importer into
// a v2 checkpoint, that checkpoint is loaded into baton's model at several
// layouts, and baton's forward must give transformers' loss.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cli/hf_checkpoint.h"
#include "common/checkpoint_manifest.h"
#include "common/safetensors.h"
#include "gtest/gtest.h"
#include "kernels/tensor.h"
#include "worker/model/gpt_config.h"
#include "worker/model/inproc_model.h"

namespace baton {
namespace {

constexpr char kTestdata[] = "tests/hf/testdata";

struct Golden {
  int batch = 0, seq = 0;
  std::vector<int32_t> tokens, targets;
  double loss = 0;
};

Golden LoadGolden() {
  absl::StatusOr<SafetensorsFile> f = SafetensorsFile::Read(absl::StrCat(kTestdata, "/gpt2_tiny_golden.safetensors"));
  EXPECT_TRUE(f.ok()) << f.status();
  Golden g;
  g.batch = static_cast<int>(*f->MetadataInt("batch"));
  g.seq = static_cast<int>(*f->MetadataInt("seq_len"));
  const std::vector<int64_t> tokens = *f->Ints("tokens"), targets = *f->Ints("targets");
  g.tokens.assign(tokens.begin(), tokens.end());
  g.targets.assign(targets.begin(), targets.end());
  g.loss = f->Floats("loss")->at(0);
  return g;
}

std::string TmpDir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return absl::StrCat(tmp ? tmp : "/tmp", "/", name);
}

class HfGoldenTest : public ::testing::TestWithParam<std::string> {};

TEST_P(HfGoldenTest, BatonLossEqualsTransformersAtEveryLayout) {
  const Golden golden = LoadGolden();
  ASSERT_EQ(golden.tokens.size(), static_cast<size_t>(golden.batch * golden.seq));
  const std::string ckpt = TmpDir("ckpt_" + GetParam());
  absl::StatusOr<checkpoint::ModelShape> shape =
      cli::ImportHfCheckpoint(absl::StrCat(kTestdata, "/", GetParam()), ckpt, {});
  ASSERT_TRUE(shape.ok()) << shape.status();
  absl::StatusOr<checkpoint::FullState> state = checkpoint::LoadFullState(ckpt);
  ASSERT_TRUE(state.ok()) << state.status();

  model::GptConfig config;
  config.layers = shape->layers;
  config.d_model = shape->d_model;
  config.heads = shape->heads;
  config.vocab = shape->vocab;
  config.seq_len = shape->seq_len;
  ASSERT_EQ(config.seq_len, golden.seq);
  kernels::Tensor tokens = kernels::Tensor::Zeros({golden.batch, golden.seq}, kernels::DType::kInt32);
  kernels::Tensor targets = kernels::Tensor::Zeros({golden.batch, golden.seq}, kernels::DType::kInt32);
  std::memcpy(tokens.i32(), golden.tokens.data(), tokens.bytes());
  std::memcpy(targets.i32(), golden.targets.data(), targets.bytes());

  struct Layout {
    int pp, tp;
  };
  for (const Layout l : {Layout{1, 1}, Layout{2, 1}, Layout{1, 2}, Layout{2, 2}}) {
    SCOPED_TRACE(absl::StrCat("pp ", l.pp, " tp ", l.tp));
    auto model = model::InProcModel::Create(config, l.pp, l.tp, /*seed=*/7, /*microbatches=*/1,
                                            /*vocab_parallel=*/false);
    ASSERT_TRUE(model.ok()) << model.status();
    const std::vector<std::string> names = (*model)->ParameterNames();
    ASSERT_EQ(names.size(), state->tensors.size());
    for (const std::string& name : names) {
      auto it = state->tensors.find(name);
      ASSERT_NE(it, state->tensors.end()) << name;
      ASSERT_TRUE((*model)->SetParameter(name, it->second.values).ok()) << name;
    }
    absl::StatusOr<double> loss = (*model)->ForwardBackward({tokens}, {targets});
    ASSERT_TRUE(loss.ok()) << loss.status();
    EXPECT_LE(std::abs(*loss - golden.loss) / std::abs(golden.loss), 1e-5)
        << "baton " << *loss << " vs transformers " << golden.loss;
  }
}

INSTANTIATE_TEST_SUITE_P(WholeAndSharded, HfGoldenTest, ::testing::Values("gpt2_tiny", "gpt2_tiny_sharded"));

}  // namespace
}  // namespace baton
