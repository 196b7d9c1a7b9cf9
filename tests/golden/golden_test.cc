#include "tests/golden/golden.h"

#include <cstring>
#include <string>

#include "gtest/gtest.h"
#include "kernels/cpu/gemm.h"
#include "tests/golden/safetensors.h"

namespace baton::golden {
namespace {

// A safetensors file from a header string and data bytes.
std::string File(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + data;
}

TEST(SafetensorsTest, ReadsTensorsAndMetadata) {
  float f[2] = {1.5f, -2.0f};
  int32_t i[3] = {7, 8, 9};
  std::string data(reinterpret_cast<char*>(f), 8);
  data += std::string(reinterpret_cast<char*>(i), 12);
  auto file = SafetensorsFile::Parse(
      File(R"({"__metadata__":{"layers":"3"},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
           R"( "ids" : {"dtype":"I32","shape":[1,3],"data_offsets":[8,20]}})",
           data));
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(*file->MetadataInt("layers"), 3);
  EXPECT_EQ(*file->Floats("w"), (std::vector<double>{1.5, -2.0}));
  EXPECT_EQ(*file->Ints("ids"), (std::vector<int64_t>{7, 8, 9}));
  EXPECT_EQ(file->tensors().at("ids").shape, (std::vector<int64_t>{1, 3}));
  EXPECT_FALSE(file->Floats("ids").ok());  // wrong dtype is an error, not a cast
  EXPECT_EQ(file->Floats("missing").status().code(), absl::StatusCode::kNotFound);
}

TEST(SafetensorsTest, MalformedFilesAreErrors) {
  const std::string data(8, '\0');
  const char* bad_headers[] = {
      R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,16]}})",  // past the data
      R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})",   // size vs shape
      R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})",    // unbalanced
      R"({"w":{"dtype":"X9","shape":[2],"data_offsets":[0,8]}})",    // unknown dtype
      R"({"w":{"dtype":"F32","shape":[2]}})",                        // no offsets
      R"([1,2])",                                                    // not an object
  };
  for (const char* header : bad_headers) {
    EXPECT_EQ(SafetensorsFile::Parse(File(header, data)).status().code(),
              absl::StatusCode::kInvalidArgument)
        << header;
  }
  EXPECT_FALSE(SafetensorsFile::Parse("short").ok());
  std::string huge_header = File("{}", "");
  huge_header[0] = '\x7f';  // header length past the end of the file
  EXPECT_FALSE(SafetensorsFile::Parse(huge_header).ok());
  EXPECT_EQ(SafetensorsFile::Read("/nonexistent/file").status().code(),
            absl::StatusCode::kNotFound);
}

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
