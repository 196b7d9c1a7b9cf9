// Token files: every format (raw uint16/uint32, llm.c shards, Megatron
// .bin/.idx) round-trips through files the test writes itself; directories
// and globs of shards read in sorted order; epochs visit every window once in
// an order that is a pure function of (seed, epoch); every bad input fails at
// open (or, for an id the open-time sample misses, at the step that reads it)
// with the file and what to change.
#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/data/epoch_shuffle.h"
#include "worker/data/file_sources.h"
#include "worker/data/make_data_source.h"
#include "worker/data/mapped_file.h"
#include "worker/data/shard_paths.h"
#include "worker/data/token_shards.h"

namespace baton::data {
namespace {

using ::testing::HasSubstr;

std::vector<int32_t> Ids(const kernels::Tensor& t) { return {t.i32(), t.i32() + t.numel()}; }

std::pair<std::vector<int32_t>, std::vector<int32_t>> Draw(const DataSource& source, int64_t step, int mb,
                                                           int dp_rank) {
  MicrobatchData data;
  const absl::Status status = source.Fill(step, mb, dp_rank, &data);
  EXPECT_TRUE(status.ok()) << status;
  if (!status.ok()) return {};
  return {Ids(data.tokens), Ids(data.targets)};
}

// A fresh directory under the test's temporary directory.
std::string TestDir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = std::string(tmp != nullptr ? tmp : "/tmp") + "/" + name;
  EXPECT_EQ(std::system(("rm -rf '" + dir + "' && mkdir -p '" + dir + "'").c_str()), 0);
  return dir;
}

void WriteFile(const std::string& path, const std::string& bytes) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr) << path;
  ASSERT_EQ(std::fwrite(bytes.data(), 1, bytes.size(), f), bytes.size());
  std::fclose(f);
}

template <typename T>
void Append(std::string* bytes, T value) {
  char raw[sizeof(T)];
  std::memcpy(raw, &value, sizeof(T));  // the test host is little-endian, as token_shards.cc asserts
  bytes->append(raw, sizeof(T));
}

template <typename T>
std::string Packed(const std::vector<int64_t>& ids) {
  std::string bytes;
  for (int64_t id : ids) Append<T>(&bytes, static_cast<T>(id));
  return bytes;
}

std::string LlmcShard(int32_t magic, int32_t version, const std::vector<int64_t>& ids, int width) {
  std::string bytes;
  std::vector<int32_t> header(kLlmcHeaderInts, 0);
  header[0] = magic;
  header[1] = version;
  header[2] = static_cast<int32_t>(ids.size());
  for (int32_t h : header) Append<int32_t>(&bytes, h);
  return bytes + (width == 2 ? Packed<uint16_t>(ids) : Packed<uint32_t>(ids));
}

// A Megatron indexed data set as megatron/core/datasets/indexed_dataset.py's
// IndexedDatasetBuilder writes it: each document one sequence.
struct Megatron {
  std::string idx, bin;
};

template <typename T>
Megatron MegatronDataSet(uint8_t code, const std::vector<std::vector<int64_t>>& documents) {
  Megatron m;
  std::vector<int32_t> lengths;
  for (const auto& doc : documents) {
    m.bin += Packed<T>(doc);
    lengths.push_back(static_cast<int32_t>(doc.size()));
  }
  m.idx = std::string("MMIDIDX\0\0", 9);
  Append<uint64_t>(&m.idx, 1);
  Append<uint8_t>(&m.idx, code);
  Append<uint64_t>(&m.idx, lengths.size());
  Append<uint64_t>(&m.idx, lengths.size() + 1);  // document indices start with 0
  for (int32_t l : lengths) Append<int32_t>(&m.idx, l);
  int64_t pointer = 0;
  for (int32_t l : lengths) {
    Append<int64_t>(&m.idx, pointer);
    pointer += int64_t{l} * static_cast<int64_t>(sizeof(T));
  }
  for (size_t d = 0; d <= lengths.size(); ++d) Append<int64_t>(&m.idx, static_cast<int64_t>(d));
  return m;
}

void WriteMegatron(const std::string& prefix, const Megatron& m) {
  WriteFile(prefix + ".idx", m.idx);
  WriteFile(prefix + ".bin", m.bin);
}

std::vector<int64_t> Iota(int64_t n, int64_t first = 0) {
  std::vector<int64_t> ids(n);
  std::iota(ids.begin(), ids.end(), first);
  return ids;
}

absl::StatusOr<std::unique_ptr<TokensFileSource>> Source(const std::vector<std::string>& paths, TokenFormat format,
                                                         TokensFileOptions options) {
  std::vector<TokenShard> shards;
  for (const std::string& p : paths) {
    absl::StatusOr<TokenShard> shard = TokenShard::Open(p, format, "data.tokens_file");
    if (!shard.ok()) return shard.status();
    shards.push_back(*std::move(shard));
  }
  return TokensFileSource::Create(std::move(shards), options);
}

TokensFileOptions Options(int vocab, int64_t seq, int64_t batch, uint64_t seed = 1) {
  TokensFileOptions o;
  o.seed = seed;
  o.vocab = vocab;
  o.seq_len = seq;
  o.micro_batch_size = batch;
  return o;
}

// Reads one whole epoch (the source's windows divide evenly into steps) and
// checks each row is window w's ids with next-id targets, where ids[i] is
// the value of token i of the concatenated shards; returns the windows in
// the order read.
std::vector<int64_t> ReadEpoch(const TokensFileSource& source, const std::vector<int64_t>& ids, int64_t epoch) {
  const int64_t seq = source.seq_len(), batch = source.micro_batch_size();
  EXPECT_EQ(source.windows_per_epoch() % batch, 0);
  const int64_t steps = source.windows_per_epoch() / batch;
  std::vector<int64_t> order;
  for (int64_t step = epoch * steps; step < (epoch + 1) * steps; ++step) {
    EXPECT_EQ(source.EpochOfStep(step), epoch);
    const auto [tokens, targets] = Draw(source, step, 0, 0);
    for (int64_t row = 0; row < batch; ++row) {
      absl::StatusOr<TokensFileSource::Location> at = source.Locate(step, 0, 0, row);
      EXPECT_TRUE(at.ok()) << at.status();
      EXPECT_EQ(at->epoch, epoch);
      order.push_back(at->window);
      // Find the window's first id in `ids` by value: the test's ids are distinct.
      const auto first = std::find(ids.begin(), ids.end(), tokens[row * seq]);
      EXPECT_NE(first, ids.end());
      const int64_t start = first - ids.begin();
      for (int64_t i = 0; i < seq; ++i) {
        EXPECT_EQ(tokens[row * seq + i], ids[start + i]) << "step " << step << " row " << row << " i " << i;
        EXPECT_EQ(targets[row * seq + i], ids[start + i + 1]) << "step " << step << " row " << row << " i " << i;
      }
    }
  }
  return order;
}

void ExpectEveryWindowOnce(std::vector<int64_t> order, int64_t windows) {
  std::sort(order.begin(), order.end());
  EXPECT_EQ(order, Iota(windows));
}

// --- EpochShuffle ---

TEST(EpochShuffleTest, IsAPermutationForEverySize) {
  for (uint64_t n : {1ull, 2ull, 3ull, 4ull, 5ull, 7ull, 8ull, 9ull, 31ull, 100ull, 1000ull, 4097ull, 65537ull}) {
    EpochShuffle shuffle(3, 0, n);
    std::vector<bool> seen(n, false);
    for (uint64_t pos = 0; pos < n; ++pos) {
      const uint64_t item = shuffle.At(pos);
      ASSERT_LT(item, n);
      EXPECT_FALSE(seen[item]) << "n " << n << ": item " << item << " twice";
      seen[item] = true;
    }
  }
}

TEST(EpochShuffleTest, OrderIsAPureFunctionOfSeedAndEpoch) {
  auto order = [](uint64_t seed, uint64_t epoch) {
    EpochShuffle s(seed, epoch, 1000);
    std::vector<uint64_t> o;
    for (uint64_t p = 0; p < 1000; ++p) o.push_back(s.At(p));
    return o;
  };
  EXPECT_EQ(order(7, 2), order(7, 2));  // two instances, the same order
  EXPECT_NE(order(7, 2), order(7, 3));  // the next epoch reshuffles
  EXPECT_NE(order(7, 2), order(8, 2));  // another seed too
  std::vector<uint64_t> identity(1000);
  std::iota(identity.begin(), identity.end(), 0);
  EXPECT_NE(order(7, 2), identity);
}

TEST(EpochShuffleTest, EveryItemIsEquallyLikelyFirst) {
  std::map<uint64_t, int> first;
  for (uint64_t epoch = 0; epoch < 8000; ++epoch) ++first[EpochShuffle(11, epoch, 8).At(0)];
  ASSERT_EQ(first.size(), 8u);
  for (const auto& [item, count] : first) {
    EXPECT_GT(count, 800) << "item " << item;  // 1000 expected; 4 standard deviations is 112
    EXPECT_LT(count, 1200) << "item " << item;
  }
}

// --- Formats ---

TEST(TokenFilesTest, RawUint16IsReadInShuffledEpochsOfWindows) {
  const std::string dir = TestDir("raw16");
  const std::vector<int64_t> ids = Iota(41, 1000);  // 10 windows of 4 (+1)
  WriteFile(dir + "/ids.bin", Packed<uint16_t>(ids));
  auto source = Source({dir + "/ids.bin"}, TokenFormat::kRawUint16, Options(2000, 4, 2));
  ASSERT_TRUE(source.ok()) << source.status();
  EXPECT_EQ((*source)->windows_per_epoch(), 10);
  EXPECT_EQ((*source)->num_tokens(), 41);
  EXPECT_EQ((*source)->ids_checked_at_open(), 41);  // small: checked whole
  const std::vector<int64_t> epoch0 = ReadEpoch(**source, ids, 0);
  const std::vector<int64_t> epoch1 = ReadEpoch(**source, ids, 1);
  ExpectEveryWindowOnce(epoch0, 10);
  ExpectEveryWindowOnce(epoch1, 10);
  EXPECT_NE(epoch0, epoch1);
  EXPECT_EQ((*source)->EpochOfStep(9), 1);
  EXPECT_EQ((*source)->EpochOfStep(10), 2);
  EXPECT_EQ((*source)->EpochOfStep(-1), -1);

  // A source over the same file and seed reads the same bits; another seed
  // another order.
  auto again = Source({dir + "/ids.bin"}, TokenFormat::kRawUint16, Options(2000, 4, 2));
  auto other_seed = Source({dir + "/ids.bin"}, TokenFormat::kRawUint16, Options(2000, 4, 2, /*seed=*/2));
  ASSERT_TRUE(again.ok() && other_seed.ok());
  EXPECT_EQ(ReadEpoch(**again, ids, 1), epoch1);
  EXPECT_NE(ReadEpoch(**other_seed, ids, 0), epoch0);
  for (int step : {0, 3, 17}) EXPECT_EQ(Draw(**again, step, 0, 0), Draw(**source, step, 0, 0));
}

TEST(TokenFilesTest, RawUint32HoldsIdsPast65535) {
  const std::string dir = TestDir("raw32");
  const std::vector<int64_t> ids = Iota(25, 70000);
  WriteFile(dir + "/ids.bin", Packed<uint32_t>(ids));
  auto source = Source({dir + "/ids.bin"}, TokenFormat::kRawUint32, Options(100000, 8, 3));
  ASSERT_TRUE(source.ok()) << source.status();
  ExpectEveryWindowOnce(ReadEpoch(**source, ids, 0), 3);
}

TEST(TokenFilesTest, LlmcShardsOfGpt2AndLlama3) {
  const std::string dir = TestDir("llmc");
  const std::vector<int64_t> ids16 = Iota(33, 50000), ids32 = Iota(33, 120000);
  WriteFile(dir + "/gpt2.bin", LlmcShard(kLlmcMagicGpt2, 1, ids16, 2));
  WriteFile(dir + "/llama3.bin", LlmcShard(kLlmcMagicLlama3, 7, ids32, 4));
  auto gpt2 = Source({dir + "/gpt2.bin"}, TokenFormat::kLlmc, Options(50257, 8, 2));
  ASSERT_TRUE(gpt2.ok()) << gpt2.status();
  EXPECT_EQ((*gpt2)->num_tokens(), 33);  // the header is not read as ids
  ExpectEveryWindowOnce(ReadEpoch(**gpt2, ids16, 0), 4);
  auto llama3 = Source({dir + "/llama3.bin"}, TokenFormat::kLlmc, Options(128256, 8, 2));
  ASSERT_TRUE(llama3.ok()) << llama3.status();
  ExpectEveryWindowOnce(ReadEpoch(**llama3, ids32, 0), 4);
}

TEST(TokenFilesTest, MegatronDataSetsReadDocumentsBackToBack) {
  const std::string dir = TestDir("megatron");
  // Documents of uneven lengths; windows run across their boundaries, as
  // Megatron's GPTDataset samples do.
  const std::vector<std::vector<int64_t>> docs = {Iota(7, 100), Iota(3, 200), Iota(12, 300), Iota(5, 400)};
  std::vector<int64_t> all;
  for (const auto& d : docs) all.insert(all.end(), d.begin(), d.end());  // 27 ids: 6 windows of 4
  WriteMegatron(dir + "/u16_text_document", MegatronDataSet<uint16_t>(8, docs));
  WriteMegatron(dir + "/i32_text_document", MegatronDataSet<int32_t>(4, docs));
  for (const char* name : {"u16_text_document", "i32_text_document"}) {
    SCOPED_TRACE(name);
    auto source = Source({dir + "/" + name}, TokenFormat::kMegatron, Options(1000, 4, 3));
    ASSERT_TRUE(source.ok()) << source.status();
    EXPECT_EQ((*source)->num_tokens(), 27);
    ExpectEveryWindowOnce(ReadEpoch(**source, all, 0), 6);
    EXPECT_EQ((*source)->num_shards(), 1);
  }
}

TEST(TokenFilesTest, DirectoriesAndGlobsAreShardsInSortedOrderAndWindowsStayInsideShards) {
  const std::string dir = TestDir("shards");
  // Written out of order; each shard's ids are distinct. 9 ids = 2 windows of 4.
  WriteFile(dir + "/train_002.bin", LlmcShard(kLlmcMagicGpt2, 1, Iota(9, 300), 2));
  WriteFile(dir + "/train_000.bin", LlmcShard(kLlmcMagicGpt2, 1, Iota(9, 100), 2));
  WriteFile(dir + "/train_001.bin", LlmcShard(kLlmcMagicGpt2, 1, Iota(10, 200), 2));  // one id left over
  WriteFile(dir + "/val_000.bin", LlmcShard(kLlmcMagicGpt2, 1, Iota(9, 900), 2));
  WriteFile(dir + "/notes.txt", "not a shard");
  auto glob = ExpandTokenShards(dir, "train_*.bin", TokenFormat::kLlmc, "data.tokens_file");
  ASSERT_TRUE(glob.ok()) << glob.status();
  ASSERT_EQ(glob->size(), 3u);
  EXPECT_THAT((*glob)[0], HasSubstr("train_000.bin"));
  EXPECT_THAT((*glob)[2], HasSubstr("train_002.bin"));
  auto source = Source(*glob, TokenFormat::kLlmc, Options(1000, 4, 2));
  ASSERT_TRUE(source.ok()) << source.status();
  EXPECT_EQ((*source)->windows_per_epoch(), 6);
  std::vector<int64_t> all = Iota(9, 100);
  for (int64_t id : Iota(10, 200)) all.push_back(id);
  for (int64_t id : Iota(9, 300)) all.push_back(id);
  ExpectEveryWindowOnce(ReadEpoch(**source, all, 0), 6);
  // Window w of the list is in shard w / 2, and its first id is a multiple
  // of 4 into that shard: no window straddles two files.
  for (int64_t step = 0; step < 3; ++step) {
    for (int64_t row = 0; row < 2; ++row) {
      auto at = (*source)->Locate(step, 0, 0, row);
      ASSERT_TRUE(at.ok());
      EXPECT_EQ(at->shard, at->window / 2);
      EXPECT_EQ(at->first_token, (at->window % 2) * 4);
    }
  }

  // A directory holds every *.bin: val_000.bin too, not notes.txt.
  auto listed = ExpandTokenShards(dir, ".", TokenFormat::kLlmc, "data.tokens_file");
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 4u);
  EXPECT_THAT(listed->back(), HasSubstr("val_000.bin"));

  // Megatron: a glob or directory of .idx/.bin pairs gives one prefix each.
  const std::string mdir = TestDir("megatron_shards");
  WriteMegatron(mdir + "/b_text_document", MegatronDataSet<uint16_t>(8, {Iota(9, 500)}));
  WriteMegatron(mdir + "/a_text_document", MegatronDataSet<uint16_t>(8, {Iota(9, 400)}));
  for (const char* spec : {"*_text_document*", "*.idx", "."}) {
    auto prefixes = ExpandTokenShards(mdir, spec, TokenFormat::kMegatron, "data.tokens_file");
    ASSERT_TRUE(prefixes.ok()) << spec << ": " << prefixes.status();
    ASSERT_EQ(prefixes->size(), 2u) << spec;
    EXPECT_TRUE(absl::EndsWith((*prefixes)[0], "/a_text_document")) << spec << ": " << (*prefixes)[0];
    auto m = Source(*prefixes, TokenFormat::kMegatron, Options(1000, 4, 2));
    ASSERT_TRUE(m.ok()) << m.status();
    std::vector<int64_t> mall = Iota(9, 400);
    for (int64_t id : Iota(9, 500)) mall.push_back(id);
    ExpectEveryWindowOnce(ReadEpoch(**m, mall, 0), 4);
  }
  // A prefix given with its extension is the prefix.
  auto with_ext = ExpandTokenShards(mdir, "a_text_document.bin", TokenFormat::kMegatron, "data.tokens_file");
  ASSERT_TRUE(with_ext.ok()) << with_ext.status();
  ASSERT_EQ(with_ext->size(), 1u);
  EXPECT_TRUE(absl::EndsWith(with_ext->front(), "/a_text_document")) << with_ext->front();
}

// The same global batch (microbatches x dp x micro_batch_size) in another
// layout reads the same samples: dp = 2 with 2 microbatches per replica is
// dp = 1 with 4, microbatch k = Fill(step, k % 2, k / 2) — and the worker's
// call Fill(step, global microbatch, 0) is the same row too.
TEST(TokenFilesTest, DataIsAPureFunctionOfSeedStepMicrobatchAndDpRankAcrossLayouts) {
  const std::string dir = TestDir("layouts");
  WriteFile(dir + "/ids.bin", Packed<uint16_t>(Iota(401, 1)));
  TokensFileOptions dp2 = Options(1000, 4, 3), dp1 = Options(1000, 4, 3);
  dp2.microbatches = 2;
  dp2.dp = 2;
  dp1.microbatches = 4;
  auto a = Source({dir + "/ids.bin"}, TokenFormat::kRawUint16, dp2);
  auto b = Source({dir + "/ids.bin"}, TokenFormat::kRawUint16, dp1);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ((*a)->rows_per_step(), 12);
  for (int64_t step : {0, 7, 8, 9, 40}) {  // 100 windows, 12 rows a step: steps 8 and 9 cross into epoch 1
    for (int k = 0; k < 4; ++k) {
      SCOPED_TRACE(::testing::Message() << "step " << step << " microbatch " << k);
      EXPECT_EQ(Draw(**a, step, k % 2, k / 2), Draw(**b, step, k, 0));
      EXPECT_EQ(Draw(**a, step, k, 0), Draw(**b, step, k, 0));
    }
  }
  EXPECT_EQ((*a)->EpochOfStep(8), 0);  // rows 96..107: the step starts in epoch 0
  EXPECT_EQ((*a)->EpochOfStep(9), 1);
  MicrobatchData data;
  EXPECT_EQ((*a)->Fill(0, 4, 0, &data).code(), absl::StatusCode::kInvalidArgument);  // past 2 x 2
  EXPECT_EQ((*a)->Fill(0, 0, 2, &data).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*a)->Fill(-1, 0, 0, &data).code(), absl::StatusCode::kInvalidArgument);
}

// --- Bad input: each error names the file and what to change ---

void ExpectError(const absl::Status& status, absl::StatusCode code, const std::vector<std::string>& parts) {
  EXPECT_EQ(status.code(), code) << status;
  for (const std::string& part : parts) EXPECT_THAT(std::string(status.message()), HasSubstr(part));
}

absl::Status OpenStatus(const std::string& path, TokenFormat format) {
  return TokenShard::Open(path, format, "data.tokens_file").status();
}

TEST(TokenFilesTest, BadShardsFailAtOpenNamingTheFile) {
  const std::string dir = TestDir("bad");
  const std::vector<int64_t> ids = Iota(20, 1);
  const absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;

  ExpectError(OpenStatus(dir + "/missing.bin", TokenFormat::kLlmc), absl::StatusCode::kNotFound,
              {"data.tokens_file", "missing.bin"});

  std::string shard = LlmcShard(kLlmcMagicGpt2, 1, ids, 2);
  WriteFile(dir + "/truncated.bin", shard.substr(0, shard.size() - 2));
  ExpectError(OpenStatus(dir + "/truncated.bin", TokenFormat::kLlmc), kInvalid,
              {"truncated.bin", "says 20 tokens", "truncated"});
  WriteFile(dir + "/padded.bin", shard + "xx");
  ExpectError(OpenStatus(dir + "/padded.bin", TokenFormat::kLlmc), kInvalid, {"padded.bin", "trailing bytes"});
  WriteFile(dir + "/header_only.bin", shard.substr(0, 100));
  ExpectError(OpenStatus(dir + "/header_only.bin", TokenFormat::kLlmc), kInvalid, {"1024-byte header"});
  WriteFile(dir + "/magic.bin", LlmcShard(20240326, 1, ids, 2));  // llm.c's model-file magic
  ExpectError(OpenStatus(dir + "/magic.bin", TokenFormat::kLlmc), kInvalid,
              {"magic.bin", "wrong magic 20240326", "raw_uint16"});
  WriteFile(dir + "/version.bin", LlmcShard(kLlmcMagicGpt2, 2, ids, 2));
  ExpectError(OpenStatus(dir + "/version.bin", TokenFormat::kLlmc), kInvalid, {"version.bin", "unknown version 2"});
  // An llm.c shard read as raw ids would train on its header.
  ExpectError(OpenStatus(dir + "/magic.bin", TokenFormat::kRawUint16), absl::StatusCode::kOk, {});
  WriteFile(dir + "/llmc_as_raw.bin", shard);
  ExpectError(OpenStatus(dir + "/llmc_as_raw.bin", TokenFormat::kRawUint16), kInvalid,
              {"llmc_as_raw.bin", "data.token_format: \"llmc\""});
  WriteFile(dir + "/odd.bin", Packed<uint16_t>(ids) + "x");
  ExpectError(OpenStatus(dir + "/odd.bin", TokenFormat::kRawUint16), kInvalid, {"odd.bin", "uint16"});
  WriteFile(dir + "/odd32.bin", Packed<uint16_t>(ids) + "xx");
  ExpectError(OpenStatus(dir + "/odd32.bin", TokenFormat::kRawUint32), kInvalid, {"odd32.bin", "uint32"});

  // Megatron.
  const Megatron good = MegatronDataSet<uint16_t>(8, {Iota(10, 1), Iota(10, 11)});
  const std::string m = dir + "/m";
  WriteFile(m + ".idx", good.idx);
  ExpectError(OpenStatus(m, TokenFormat::kMegatron), absl::StatusCode::kNotFound, {"m.bin", "m.idx exists"});
  WriteFile(m + ".bin", good.bin.substr(0, good.bin.size() - 2));
  ExpectError(OpenStatus(m, TokenFormat::kMegatron), kInvalid, {"m.bin", "says 2 sequences of 20 tokens", "truncated"});
  WriteFile(m + ".bin", good.bin);
  EXPECT_TRUE(OpenStatus(m, TokenFormat::kMegatron).ok());
  ExpectError(OpenStatus(dir + "/nothing", TokenFormat::kMegatron), absl::StatusCode::kNotFound,
              {"nothing.idx", "PREFIX.idx + PREFIX.bin"});
  auto corrupt = [&](size_t offset, const std::string& bytes) {
    std::string idx = good.idx;
    idx.replace(offset, bytes.size(), bytes);
    WriteFile(m + ".idx", idx);
    return OpenStatus(m, TokenFormat::kMegatron);
  };
  ExpectError(corrupt(0, "NNIDIDX"), kInvalid, {"m.idx", "wrong magic"});
  ExpectError(corrupt(9, std::string("\x02", 1)), kInvalid, {"m.idx", "unknown version 2"});
  ExpectError(corrupt(17, std::string("\x07", 1)), kInvalid, {"m.idx", "dtype code 7", "integer"});
  ExpectError(corrupt(18, std::string("\x03", 1)), kInvalid, {"m.idx", "does not match its header", "truncated"});
  // The second sequence's pointer (after 2 lengths and 1 pointer) off by 2.
  std::string moved;
  Append<int64_t>(&moved, 22);
  ExpectError(corrupt(34 + 8 + 8, moved), kInvalid, {"m.idx", "sequence 1", "back to back"});
  std::string last_doc;
  Append<int64_t>(&last_doc, 1);
  ExpectError(corrupt(34 + 8 + 16 + 16, last_doc), kInvalid, {"m.idx", "document indices"});
  WriteFile(m + ".idx", good.idx.substr(0, 20));
  ExpectError(OpenStatus(m, TokenFormat::kMegatron), kInvalid, {"m.idx", "34-byte MMIDIDX header"});
  WriteFile(m + ".idx", good.idx);
  ExpectError(OpenStatus(m + ".idx", TokenFormat::kRawUint16), kInvalid, {"Megatron index", "\"megatron\""});
}

TEST(TokenFilesTest, TooSmallShardsAndIdsOutsideTheVocabularyFailAtOpen) {
  const std::string dir = TestDir("bad_ids");
  WriteFile(dir + "/ok.bin", Packed<uint16_t>(Iota(20, 1)));
  WriteFile(dir + "/short.bin", Packed<uint16_t>(Iota(4, 1)));
  WriteFile(dir + "/empty.bin", "");
  auto short_shard = Source({dir + "/ok.bin", dir + "/short.bin"}, TokenFormat::kRawUint16, Options(100, 4, 1));
  ExpectError(short_shard.status(), absl::StatusCode::kInvalidArgument,
              {"short.bin", "holds 4 token ids", "model.seq_len + 1 = 5", "drop this shard"});
  auto empty = Source({dir + "/empty.bin"}, TokenFormat::kRawUint16, Options(100, 4, 1));
  ExpectError(empty.status(), absl::StatusCode::kInvalidArgument, {"empty.bin", "holds 0 token ids"});

  std::vector<int64_t> ids = Iota(20, 1);
  ids[7] = 100;  // == vocab, at byte offset 14
  WriteFile(dir + "/vocab.bin", Packed<uint16_t>(ids));
  ExpectError(Source({dir + "/vocab.bin"}, TokenFormat::kRawUint16, Options(100, 4, 1)).status(),
              absl::StatusCode::kInvalidArgument,
              {"vocab.bin", "token id 100 at byte offset 14", "model.vocab = 100", "re-tokenize"});
  const std::vector<std::vector<int64_t>> negative = {{1, 2, 3, -5, 4, 5, 6}};
  WriteMegatron(dir + "/neg", MegatronDataSet<int16_t>(3, negative));
  ExpectError(Source({dir + "/neg"}, TokenFormat::kMegatron, Options(100, 4, 1)).status(),
              absl::StatusCode::kInvalidArgument, {"neg.bin", "token id -5 at byte offset 6 is negative"});
}

// The open-time check samples a large shard; an id it misses fails the step
// that reads it, naming the file, the byte offset and the step.
TEST(TokenFilesTest, AnIdTheOpenSampleMissesFailsTheStepThatReadsIt) {
  const std::string dir = TestDir("late");
  std::vector<int64_t> ids(4001, 1);
  ids[2001] = 60000;  // in window 500 of seq 4; the one sampled block is ids 0..31
  WriteFile(dir + "/big.bin", Packed<uint16_t>(ids));
  TokensFileOptions options = Options(50257, 4, 4);
  options.open_check_ids = 32;
  auto source = Source({dir + "/big.bin"}, TokenFormat::kRawUint16, options);
  ASSERT_TRUE(source.ok()) << source.status();
  EXPECT_EQ((*source)->ids_checked_at_open(), 32);
  absl::Status failed;
  int64_t failed_step = -1;
  MicrobatchData data;
  for (int64_t step = 0; step < 250 && failed.ok(); ++step) {  // one epoch: 1000 windows, 4 a step
    failed = (*source)->Fill(step, 0, 0, &data);
    failed_step = step;
  }
  ExpectError(failed, absl::StatusCode::kInvalidArgument,
              {"big.bin", "token id 60000 at byte offset 4002", "model.vocab = 50257",
               absl::StrCat("step ", failed_step, ","), "epoch 0"});
  // The same step fails again when replayed; the others are fine.
  EXPECT_EQ((*source)->Fill(failed_step, 0, 0, &data).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE((*source)->Fill(failed_step == 0 ? 1 : 0, 0, 0, &data).ok());
}

TEST(TokenFilesTest, PathsThatNameNoShardAreErrors) {
  const std::string dir = TestDir("paths");
  ASSERT_EQ(std::system(("mkdir -p " + dir + "/empty " + dir + "/sub && ln -sf /etc/passwd " + dir + "/sub/x.bin")
                            .c_str()),
            0);
  const std::string field = "data.tokens_file";
  ExpectError(ExpandTokenShards(dir, "train_*.bin", TokenFormat::kLlmc, field).status(), absl::StatusCode::kNotFound,
              {"data.tokens_file = \"train_*.bin\"", "matches no file", "--data_dir"});
  ExpectError(ExpandTokenShards(dir, "empty", TokenFormat::kLlmc, field).status(), absl::StatusCode::kNotFound,
              {"\"empty\"", "no *.bin shard"});
  ExpectError(ExpandTokenShards(dir, "empty", TokenFormat::kMegatron, field).status(), absl::StatusCode::kNotFound,
              {"no *.idx shard"});
  ExpectError(ExpandTokenShards(dir, "missing.bin", TokenFormat::kRawUint16, field).status(),
              absl::StatusCode::kNotFound, {"missing.bin", "cannot open under --data_dir"});
  ExpectError(ExpandTokenShards(dir, "sub/*.bin", TokenFormat::kRawUint16, field).status(),
              absl::StatusCode::kPermissionDenied, {"resolves to /etc/passwd", "outside"});
  ExpectError(ExpandTokenShards(dir, "/etc/pass*", TokenFormat::kRawUint16, field).status(),
              absl::StatusCode::kPermissionDenied, {"outside"});
  ExpectError(ExpandTokenShards(dir, "/etc", TokenFormat::kRawUint16, field).status(),
              absl::StatusCode::kPermissionDenied, {"outside"});
  ExpectError(ExpandTokenShards(dir, "s*", TokenFormat::kRawUint16, field).status(),
              absl::StatusCode::kInvalidArgument, {"not a regular file"});
  ExpectError(ExpandTokenShards("", "x.bin", TokenFormat::kRawUint16, field).status(),
              absl::StatusCode::kFailedPrecondition, {"--data_dir=DIR"});
}

TEST(TokenFilesTest, MakeDataSourceReadsEveryFormatFromTheDataDir) {
  const std::string dir = TestDir("job");
  const std::vector<int64_t> ids = Iota(65, 1);
  WriteFile(dir + "/raw.bin", Packed<uint16_t>(ids));
  ASSERT_EQ(std::system(("mkdir -p " + dir + "/llmc").c_str()), 0);
  WriteFile(dir + "/llmc/train_000.bin", LlmcShard(kLlmcMagicGpt2, 1, ids, 2));
  WriteFile(dir + "/llmc/train_001.bin", LlmcShard(kLlmcMagicGpt2, 1, ids, 2));
  WriteFile(dir + "/raw32.bin", Packed<uint32_t>(ids));
  WriteMegatron(dir + "/mega_text_document", MegatronDataSet<uint16_t>(8, {ids}));
  v1::JobSpec job;
  job.mutable_model()->set_vocab(256);
  job.mutable_model()->set_seq_len(8);
  job.mutable_train()->set_micro_batch_size(2);
  job.mutable_train()->set_seed(9);
  job.mutable_schedule()->set_microbatches(2);
  job.mutable_parallel()->set_dp(2);
  struct Case {
    const char* path;
    const char* format;
    int64_t shards, windows;
  };
  for (const Case& c : {Case{"raw.bin", "", 1, 8}, Case{"raw.bin", "raw_uint16", 1, 8}, Case{"raw32.bin", "raw_uint32", 1, 8},
                        Case{"llmc/train_*.bin", "llmc", 2, 16}, Case{"llmc", "llmc", 2, 16},
                        Case{"mega_text_document", "megatron", 1, 8}}) {
    SCOPED_TRACE(::testing::Message() << c.path << " as '" << c.format << "'");
    job.mutable_data()->set_tokens_file(c.path);
    job.mutable_data()->set_token_format(c.format);
    auto source = MakeDataSource(job, dir);
    ASSERT_TRUE(source.ok()) << source.status();
    auto* tokens = dynamic_cast<TokensFileSource*>(source->get());
    ASSERT_NE(tokens, nullptr);
    EXPECT_EQ(tokens->num_shards(), c.shards);
    EXPECT_EQ(tokens->windows_per_epoch(), c.windows);
    EXPECT_EQ(tokens->rows_per_step(), 8);  // 2 microbatches x 2 replicas x 2 rows
    EXPECT_EQ(tokens->EpochOfStep(1), 8 / c.windows);
    const auto [t, targets] = Draw(*tokens, 3, 1, 1);
    EXPECT_EQ(t.size(), 16u);
  }
  job.mutable_data()->set_token_format("bpe");
  ExpectError(MakeDataSource(job, dir).status(), absl::StatusCode::kInvalidArgument,
              {"data.token_format = \"bpe\"", "\"megatron\""});
  job.mutable_data()->set_text_file("raw.bin");
  job.mutable_data()->set_token_format("llmc");
  ExpectError(MakeDataSource(job, dir).status(), absl::StatusCode::kInvalidArgument,
              {"data.token_format", "data.tokens_file only"});
}

TEST(MappedFileTest, MapsTheFileAndBoundsItsSize) {
  const std::string dir = TestDir("mapped");
  WriteFile(dir + "/f", "hello");
  auto file = MappedFile::Open(dir + "/f", "data.tokens_file", 100);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(file->data()), file->size()), "hello");
  MappedFile moved = *std::move(file);
  EXPECT_EQ(moved.size(), 5);
  moved.Release(0, 5);  // unmapped from this process: the next read maps the same bytes again
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(moved.data()), moved.size()), "hello");
  ExpectError(MappedFile::Open(dir + "/f", "data.tokens_file", 4).status(), absl::StatusCode::kInvalidArgument,
              {"holds 5 bytes", "at most 4", "split it into shards"});
  ExpectError(MappedFile::Open(dir, "data.tokens_file", 100).status(), absl::StatusCode::kInvalidArgument,
              {"not a regular file"});
  WriteFile(dir + "/empty", "");
  auto empty = MappedFile::Open(dir + "/empty", "data.tokens_file", 100);
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->size(), 0);
}

}  // namespace
}  // namespace baton::data
