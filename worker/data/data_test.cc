// Data sources: the addition task writes correct, learnable problems with only
// the answer digits scored; file sources window the file byte for byte; every
// source is a pure function of (seed, step, microbatch, dp rank); bad specs
// are errors naming the JobSpec field.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "worker/data/addition_task.h"
#include "worker/data/file_sources.h"
#include "worker/data/make_data_source.h"

namespace baton::data {
namespace {

std::vector<int32_t> Ids(const kernels::Tensor& t) { return {t.i32(), t.i32() + t.numel()}; }

// Fills and returns (tokens, targets) as flat vectors.
std::pair<std::vector<int32_t>, std::vector<int32_t>> Draw(const DataSource& source, int64_t step,
                                                           int mb, int dp_rank) {
  MicrobatchData data;
  const absl::Status status = source.Fill(step, mb, dp_rank, &data);
  EXPECT_TRUE(status.ok()) << status;
  EXPECT_EQ(data.tokens.dim(0), source.micro_batch_size());
  EXPECT_EQ(data.tokens.dim(1), source.seq_len());
  return {Ids(data.tokens), Ids(data.targets)};
}

std::string WriteTempFile(const std::string& name, const std::string& bytes) {
  const char* dir = std::getenv("TEST_TMPDIR");
  const std::string path = std::string(dir != nullptr ? dir : "/tmp") + "/" + name;
  std::FILE* f = std::fopen(path.c_str(), "wb");
  EXPECT_NE(f, nullptr);
  std::fwrite(bytes.data(), 1, bytes.size(), f);
  std::fclose(f);
  return path;
}

int DigitsValue(const std::vector<int32_t>& ids, size_t begin, int count) {
  int value = 0;
  for (int i = 0; i < count; ++i) value = value * 10 + ids[begin + i];
  return value;
}

TEST(AdditionTaskTest, RowsArePackedCorrectSumsWithOnlyAnswerDigitsScored) {
  const int64_t seq = 37;  // three whole problems and one cut after its first answer digit
  auto task = AdditionTask::Create(/*seed=*/1, /*vocab=*/16, seq, /*micro_batch_size=*/8);
  ASSERT_TRUE(task.ok()) << task.status();
  int carries = 0, problems = 0;
  for (int mb = 0; mb < 4; ++mb) {
    const auto [tokens, targets] = Draw(**task, /*step=*/3, mb, /*dp_rank=*/0);
    for (int64_t row = 0; row < 8; ++row) {
      const std::vector<int32_t> r(tokens.begin() + row * seq, tokens.begin() + (row + 1) * seq);
      const std::vector<int32_t> t(targets.begin() + row * seq,
                                   targets.begin() + (row + 1) * seq);
      for (int64_t p = 0; p + kAdditionProblemTokens <= seq; p += kAdditionProblemTokens) {
        SCOPED_TRACE(::testing::Message() << "mb " << mb << " row " << row << " offset " << p);
        EXPECT_EQ(r[p + 2], kPlusToken);
        EXPECT_EQ(r[p + 5], kEqualsToken);
        EXPECT_EQ(r[p + 9], kEndToken);
        const int a = DigitsValue(r, p, 2), b = DigitsValue(r, p + 3, 2);
        const int sum = r[p + 6] + 10 * r[p + 7] + 100 * r[p + 8];  // least significant first
        EXPECT_EQ(a + b, sum);
        carries += (a % 10 + b % 10) >= 10;
        ++problems;
        // Scored: the positions whose next token is an answer digit.
        for (int i = 0; i < kAdditionProblemTokens; ++i) {
          const int64_t pos = p + i;
          if (i >= 5 && i <= 7) {
            EXPECT_EQ(t[pos], r[pos + 1]);
          } else {
            EXPECT_EQ(t[pos], -1) << "position " << pos;
          }
        }
      }
      // The cut problem (from position 30) scores the answer digits that fit:
      // its units digit (token 36) and its tens digit (the row's next token).
      EXPECT_EQ(r[35], kEqualsToken);
      const int a = DigitsValue(r, 30, 2), b = DigitsValue(r, 33, 2);
      EXPECT_EQ(t[35], (a + b) % 10);
      EXPECT_EQ(r[36], (a + b) % 10);
      EXPECT_EQ(t[36], (a + b) / 10 % 10);
    }
  }
  // Uniform operands: about 45% of problems carry out of the units digit.
  EXPECT_GT(carries, problems / 4);
  EXPECT_LT(carries, problems * 3 / 4);
}

TEST(AdditionTaskTest, DataIsAPureFunctionOfSeedStepMicrobatchAndDpRank) {
  auto a = AdditionTask::Create(7, 13, 20, 4);
  auto b = AdditionTask::Create(7, 13, 20, 4);
  auto other_seed = AdditionTask::Create(8, 13, 20, 4);
  ASSERT_TRUE(a.ok() && b.ok() && other_seed.ok());
  const auto base = Draw(**a, 5, 1, 2);
  EXPECT_EQ(Draw(**b, 5, 1, 2), base);  // another instance, same bits
  EXPECT_EQ(Draw(**a, 5, 1, 2), base);  // and again
  EXPECT_NE(Draw(**a, 6, 1, 2).first, base.first);
  EXPECT_NE(Draw(**a, 5, 0, 2).first, base.first);
  EXPECT_NE(Draw(**a, 5, 1, 3).first, base.first);
  EXPECT_NE(Draw(**other_seed, 5, 1, 2).first, base.first);
  // Filling reused tensors gives the same bits.
  MicrobatchData reused;
  ASSERT_TRUE((*a)->Fill(9, 0, 0, &reused).ok());
  const int32_t* before = reused.tokens.i32();
  ASSERT_TRUE((*a)->Fill(5, 1, 2, &reused).ok());
  EXPECT_EQ(reused.tokens.i32(), before);
  EXPECT_EQ(std::make_pair(Ids(reused.tokens), Ids(reused.targets)), base);
}

TEST(AdditionTaskTest, BadSpecsNameTheField) {
  auto vocab = AdditionTask::Create(1, 12, 20, 4);
  EXPECT_EQ(vocab.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(vocab.status().message().find("model.vocab"), absl::string_view::npos);
  auto seq = AdditionTask::Create(1, 13, 7, 4);
  EXPECT_NE(seq.status().message().find("model.seq_len"), absl::string_view::npos);
  EXPECT_TRUE(AdditionTask::Create(1, 13, 8, 4).ok());  // one answer just fits
  auto batch = AdditionTask::Create(1, 13, 20, 0);
  EXPECT_NE(batch.status().message().find("train.micro_batch_size"), absl::string_view::npos);
  MicrobatchData data;
  auto task = AdditionTask::Create(1, 13, 20, 4);
  EXPECT_EQ((*task)->Fill(-1, 0, 0, &data).code(), absl::StatusCode::kInvalidArgument);
}

TEST(TextFileSourceTest, RowsAreWindowsOfTheFileWithNextByteTargets) {
  std::string text;
  for (int i = 0; i < 40; ++i) text += static_cast<char>(200 + i);  // bytes past 127 too
  const std::string path = WriteTempFile("text.txt", text);
  const int64_t seq = 8;
  auto source = TextFileSource::Create(path, 3, 256, seq, 4);
  ASSERT_TRUE(source.ok()) << source.status();
  std::set<int> starts;
  for (int step = 0; step < 100; ++step) {
    const auto [tokens, targets] = Draw(**source, step, 0, 0);
    for (int64_t row = 0; row < 4; ++row) {
      const int start = tokens[row * seq] - 200;
      ASSERT_GE(start, 0);
      ASSERT_LE(start, 40 - (seq + 1));
      starts.insert(start);
      for (int64_t i = 0; i < seq; ++i) {
        EXPECT_EQ(tokens[row * seq + i], 200 + start + i);
        EXPECT_EQ(targets[row * seq + i], 200 + start + i + 1);
      }
    }
  }
  EXPECT_EQ(starts.size(), 40u - seq);  // every window start is drawn
  EXPECT_EQ(Draw(**source, 4, 1, 1), Draw(**source, 4, 1, 1));
}

TEST(TextFileSourceTest, BadSpecsNameTheField) {
  const std::string path = WriteTempFile("short.txt", "0123456789");
  auto vocab = TextFileSource::Create(path, 1, 255, 4, 1);
  EXPECT_EQ(vocab.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(vocab.status().message().find("model.vocab"), absl::string_view::npos);
  auto too_short = TextFileSource::Create(path, 1, 256, 10, 1);  // needs 11 bytes
  EXPECT_EQ(too_short.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(too_short.status().message().find("data.text_file"), absl::string_view::npos);
  EXPECT_NE(too_short.status().message().find("model.seq_len"), absl::string_view::npos);
  EXPECT_TRUE(TextFileSource::Create(path, 1, 256, 9, 1).ok());
  auto missing = TextFileSource::Create(path + ".missing", 1, 256, 4, 1);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find(path + ".missing"), absl::string_view::npos);
}

std::string Uint16File(const std::vector<int>& ids) {
  std::string bytes;
  for (int id : ids) {
    bytes += static_cast<char>(id & 0xff);
    bytes += static_cast<char>(id >> 8);
  }
  return bytes;
}

TEST(TokensFileSourceTest, ReadsLittleEndianIdsAndRejectsIdsOutsideTheVocabulary) {
  std::vector<int> ids;
  for (int i = 0; i < 30; ++i) ids.push_back(1000 + 7 * i);  // two-byte values
  const std::string path = WriteTempFile("ids.bin", Uint16File(ids));
  const int64_t seq = 6;
  auto source = TokensFileSource::Create(path, 2, 2000, seq, 3);
  ASSERT_TRUE(source.ok()) << source.status();
  EXPECT_EQ((*source)->num_tokens(), 30);
  const auto [tokens, targets] = Draw(**source, 0, 0, 0);
  for (int64_t row = 0; row < 3; ++row) {
    const int start = (tokens[row * seq] - 1000) / 7;
    for (int64_t i = 0; i < seq; ++i) {
      EXPECT_EQ(tokens[row * seq + i], ids[start + i]);
      EXPECT_EQ(targets[row * seq + i], ids[start + i + 1]);
    }
  }
  ids[3] = 2000;  // one past the vocabulary, at byte offset 6
  const std::string bad = WriteTempFile("bad.bin", Uint16File(ids));
  auto out_of_vocab = TokensFileSource::Create(bad, 2, 2000, seq, 3);
  EXPECT_EQ(out_of_vocab.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(out_of_vocab.status().message().find(bad), absl::string_view::npos);
  EXPECT_NE(out_of_vocab.status().message().find("byte offset 6"), absl::string_view::npos)
      << out_of_vocab.status();
  const std::string odd = WriteTempFile("odd.bin", Uint16File(ids) + "x");
  EXPECT_NE(TokensFileSource::Create(odd, 2, 4000, seq, 3).status().message().find("uint16"),
            absl::string_view::npos);
  auto too_short = TokensFileSource::Create(path, 2, 2000, 30, 3);
  EXPECT_NE(too_short.status().message().find("data.tokens_file"), absl::string_view::npos);
}

TEST(MakeDataSourceTest, PicksTheSourceTheJobNames) {
  v1::JobSpec job;
  job.mutable_model()->set_vocab(256);
  job.mutable_model()->set_seq_len(16);
  job.mutable_train()->set_micro_batch_size(2);
  job.mutable_train()->set_seed(5);
  auto by_default = MakeDataSource(job, testing::TempDir());
  ASSERT_TRUE(by_default.ok()) << by_default.status();
  EXPECT_NE(dynamic_cast<AdditionTask*>(by_default->get()), nullptr);
  auto direct = AdditionTask::Create(5, 256, 16, 2);
  EXPECT_EQ(Draw(**by_default, 1, 0, 0), Draw(**direct, 1, 0, 0));  // seeded by train.seed

  job.mutable_data()->mutable_synthetic()->set_task("addition");
  auto addition = MakeDataSource(job, testing::TempDir());
  ASSERT_TRUE(addition.ok());
  EXPECT_NE(dynamic_cast<AdditionTask*>(addition->get()), nullptr);

  job.mutable_data()->mutable_synthetic()->set_task("sorting");
  auto unknown = MakeDataSource(job, testing::TempDir());
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(unknown.status().message().find("data.synthetic.task"), absl::string_view::npos);

  job.mutable_data()->set_text_file(WriteTempFile("job.txt", std::string(100, 'a')));
  auto text = MakeDataSource(job, testing::TempDir());
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_NE(dynamic_cast<TextFileSource*>(text->get()), nullptr);

  job.mutable_data()->set_tokens_file(WriteTempFile("job.bin", Uint16File({1, 2, 3})));
  auto tokens = MakeDataSource(job, testing::TempDir());
  EXPECT_NE(tokens.status().message().find("data.tokens_file"), absl::string_view::npos);

  job.clear_data();
  job.mutable_model()->set_vocab(8);
  auto small = MakeDataSource(job, testing::TempDir());
  EXPECT_NE(small.status().message().find("model.vocab"), absl::string_view::npos);
}

TEST(MakeDataSourceTest, TheEvalSourceIsHeldOutAndNamesItsOwnFields) {
  v1::JobSpec job;
  job.mutable_model()->set_vocab(256);
  job.mutable_model()->set_seq_len(16);
  job.mutable_train()->set_micro_batch_size(2);
  job.mutable_train()->set_seed(5);
  EXPECT_NE(MakeEvalDataSource(job, testing::TempDir()).status().message().find("train.eval_data"),
            absl::string_view::npos);
  job.mutable_train()->mutable_eval_data()->mutable_synthetic()->set_task("addition");
  auto train = MakeDataSource(job, testing::TempDir());
  auto eval = MakeEvalDataSource(job, testing::TempDir());
  auto again = MakeEvalDataSource(job, testing::TempDir());
  ASSERT_TRUE(train.ok() && eval.ok() && again.ok()) << eval.status();
  // Other samples than training's at the same step, the same ones every time.
  EXPECT_NE(Draw(**eval, 1, 0, 0), Draw(**train, 1, 0, 0));
  EXPECT_EQ(Draw(**eval, 1, 0, 0), Draw(**again, 1, 0, 0));

  job.mutable_train()->mutable_eval_data()->set_tokens_file("missing/val.bin");
  auto missing = MakeEvalDataSource(job, testing::TempDir());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound) << missing.status();
  EXPECT_NE(missing.status().message().find("train.eval_data.tokens_file"), absl::string_view::npos)
      << missing.status();
  job.mutable_train()->mutable_eval_data()->set_text_file("../outside.txt");
  EXPECT_NE(MakeEvalDataSource(job, testing::TempDir()).status().message().find("train.eval_data.text_file"),
            absl::string_view::npos);
  job.mutable_train()->mutable_eval_data()->mutable_synthetic()->set_task("sorting");
  EXPECT_NE(MakeEvalDataSource(job, testing::TempDir()).status().message().find("train.eval_data.synthetic.task"),
            absl::string_view::npos);
}

// Issue 12: a fake coordinator made a worker read /etc/passwd, and
// text_file: "/dev/zero" was read until the worker died. Data files come only
// from under the worker's --data_dir and must be regular files.
TEST(MakeDataSourceTest, DataFilesComeOnlyFromUnderTheDataDir) {
  const std::string root = testing::TempDir() + "/data_root";
  ASSERT_EQ(system(("mkdir -p " + root + "/sub && ln -sf /etc/passwd " + root + "/escape").c_str()), 0);
  std::ofstream(root + "/sub/ok.txt") << std::string(100, 'a');
  v1::JobSpec job;
  job.mutable_model()->set_vocab(256);
  job.mutable_model()->set_seq_len(16);
  job.mutable_train()->set_micro_batch_size(2);
  auto text = [&](const std::string& path, const std::string& data_dir) {
    job.mutable_data()->set_text_file(path);
    return MakeDataSource(job, data_dir).status();
  };
  EXPECT_TRUE(text("sub/ok.txt", root).ok()) << text("sub/ok.txt", root);
  EXPECT_TRUE(text(root + "/sub/ok.txt", root).ok());
  struct Case {
    std::string path, data_dir;
    absl::StatusCode code;
    const char* message;
  };
  const Case cases[] = {
      {"/etc/passwd", root, absl::StatusCode::kPermissionDenied, "outside this worker's --data_dir"},
      {[] { std::string up; for (int i = 0; i < 64; ++i) up += "../"; return up + "etc/passwd"; }(), root,
       absl::StatusCode::kPermissionDenied, "outside"},
      {"escape", root, absl::StatusCode::kPermissionDenied, "resolves to /etc/passwd"},
      {"/dev/zero", root, absl::StatusCode::kPermissionDenied, "outside"},
      {"/dev/zero", "/", absl::StatusCode::kInvalidArgument, "is not a regular file"},
      {"sub", root, absl::StatusCode::kInvalidArgument, "is not a regular file"},
      {"missing.txt", root, absl::StatusCode::kNotFound, "cannot open under --data_dir"},
      {"sub/ok.txt", "", absl::StatusCode::kFailedPrecondition, "start it with --data_dir=DIR"},
  };
  for (const Case& c : cases) {
    absl::Status s = text(c.path, c.data_dir);
    EXPECT_EQ(s.code(), c.code) << c.path << " in '" << c.data_dir << "': " << s;
    EXPECT_NE(s.message().find("data.text_file"), std::string::npos) << s;
    EXPECT_NE(s.message().find(c.message), std::string::npos) << s;
  }
}

}  // namespace
}  // namespace baton::data
