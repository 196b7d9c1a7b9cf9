#include "common/safetensors.h"

#include <unistd.h>

#include <cstdlib>
#include <random>
#include <string>

#include "gtest/gtest.h"

namespace baton {
namespace {

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
           R"( "ids" : {"dtype":"I32","shape":[1,3],"data_offsets":[8,20]}}   )",
           data));
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(*file->MetadataInt("layers"), 3);
  EXPECT_EQ(*file->Floats("w"), (std::vector<double>{1.5, -2.0}));
  EXPECT_EQ(*file->Float32s("w"), (std::vector<float>{1.5f, -2.0f}));
  EXPECT_EQ(*file->Ints("ids"), (std::vector<int64_t>{7, 8, 9}));
  EXPECT_EQ(file->tensors().at("ids").shape, (std::vector<int64_t>{1, 3}));
  EXPECT_FALSE(file->Floats("ids").ok());  // wrong dtype is an error, not a cast
  EXPECT_FALSE(file->Float32s("ids").ok());
  EXPECT_EQ(file->Floats("missing").status().code(), absl::StatusCode::kNotFound);
}

TEST(SafetensorsTest, MalformedFilesAreErrorsThatSayWhy) {
  const std::string data(8, '\0');
  const std::pair<const char*, const char*> bad_headers[] = {
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,16]}})", "outside"},
      {R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", "bytes for 3 elements"},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})", "bad header"},
      {R"({"w":{"dtype":"X9","shape":[2],"data_offsets":[0,8]}})", "unknown dtype"},
      {R"({"w":{"dtype":"F32","shape":[2]}})", "data_offsets"},
      {R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", "non-negative"},
      {R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", "tensors cover 4"},
      {R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", "belong to no tensor"},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
       R"("v":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", "overlap"},
      {R"({"__metadata__":{"k":1}})", "not a string"},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
       R"("w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", "duplicate member \"w\""},
      {R"([1,2])", "not a JSON object"},
  };
  for (const auto& [header, why] : bad_headers) {
    auto file = SafetensorsFile::Parse(File(header, data));
    ASSERT_FALSE(file.ok()) << header;
    EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument) << header;
    EXPECT_NE(file.status().message().find(why), absl::string_view::npos) << file.status();
  }
  EXPECT_FALSE(SafetensorsFile::Parse("short").ok());
  std::string huge_header = File("{}", "");
  huge_header[0] = '\x7f';  // header length past the end of the file
  EXPECT_NE(SafetensorsFile::Parse(huge_header).status().message().find("past the end"),
            absl::string_view::npos);
  EXPECT_EQ(SafetensorsFile::Read("/nonexistent/file").status().code(), absl::StatusCode::kNotFound);
}

TEST(SafetensorsTest, WriterOutputReadsBackAndEveryTruncationIsAnError) {
  SafetensorsWriter w;
  w.SetMetadata("step", "12");
  w.SetMetadata("quote\"d", "line\nbreak");
  ASSERT_TRUE(w.AddFloat32("b.weight", {2, 2}, std::vector<float>{1, -0.0f, 3.25f, 1e-30f}).ok());
  ASSERT_TRUE(w.AddInt32("a.ids", {3}, std::vector<int32_t>{-1, 0, 7}).ok());
  ASSERT_TRUE(w.AddFloat32("empty", {0, 4}, {}).ok());
  EXPECT_FALSE(w.AddFloat32("a.ids", {1}, std::vector<float>{1}).ok());  // twice
  EXPECT_FALSE(w.AddFloat32("x", {3}, std::vector<float>{1, 2}).ok());  // count vs shape
  EXPECT_FALSE(w.AddFloat32("__metadata__", {1}, std::vector<float>{1}).ok());

  const std::string bytes = w.Serialize();
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<uint8_t>(bytes[i]);
  EXPECT_EQ(header_len % 8, 0u);  // aligned data, as the reference writer does
  auto file = SafetensorsFile::Parse(bytes);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->metadata().at("quote\"d"), "line\nbreak");
  EXPECT_EQ(*file->MetadataInt("step"), 12);
  const std::vector<float> back = *file->Float32s("b.weight");
  EXPECT_EQ(back, (std::vector<float>{1, -0.0f, 3.25f, 1e-30f}));
  EXPECT_TRUE(std::signbit(back[1]));  // bit-exact, not just equal
  EXPECT_EQ(*file->Ints("a.ids"), (std::vector<int64_t>{-1, 0, 7}));
  EXPECT_EQ(file->tensors().at("empty").shape, (std::vector<int64_t>{0, 4}));

  for (size_t n = 0; n < bytes.size(); ++n) {
    EXPECT_FALSE(SafetensorsFile::Parse(bytes.substr(0, n)).ok()) << "truncated to " << n;
  }
  EXPECT_FALSE(SafetensorsFile::Parse(bytes + "junk").ok());
}

TEST(SafetensorsTest, RandomlyCorruptedFilesNeverCrash) {
  SafetensorsWriter w;
  w.SetMetadata("baton.layout.x", "{\"full_shape\":[2,3]}");
  ASSERT_TRUE(w.AddFloat32("x", {2, 3}, std::vector<float>(6, 1.0f)).ok());
  ASSERT_TRUE(w.AddInt32("y", {4}, std::vector<int32_t>(4, 2)).ok());
  const std::string good = w.Serialize();
  std::mt19937 rng(42);
  int parsed = 0;
  for (int trial = 0; trial < 5000; ++trial) {
    std::string bytes = good;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f) bytes[rng() % bytes.size()] = static_cast<char>(rng());
    auto file = SafetensorsFile::Parse(bytes);
    if (!file.ok()) continue;
    ++parsed;  // a flip in the data section or in header whitespace is still a valid file
    for (const auto& [name, entry] : file->tensors()) {
      (void)file->Floats(name);
      (void)file->Ints(name);
    }
  }
  EXPECT_GT(parsed, 0);
}

TEST(SafetensorsTest, WriteFileReplacesAtomically) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string path = std::string(tmp ? tmp : "/tmp") + "/w.safetensors";
  SafetensorsWriter a;
  ASSERT_TRUE(a.AddFloat32("x", {1}, std::vector<float>{1}).ok());
  ASSERT_TRUE(a.WriteFile(path).ok());
  SafetensorsWriter b;
  ASSERT_TRUE(b.AddFloat32("x", {2}, std::vector<float>{2, 3}).ok());
  ASSERT_TRUE(b.WriteFile(path).ok());
  EXPECT_EQ(*SafetensorsFile::Read(path)->Float32s("x"), (std::vector<float>{2, 3}));
  EXPECT_FALSE(a.WriteFile("/nonexistent/dir/w.safetensors").ok());
}

}  // namespace
}  // namespace baton
