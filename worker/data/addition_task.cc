#include "worker/data/addition_task.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/cross_entropy.h"

namespace baton::data {
namespace {

constexpr int kOperandLimit = 100;  // 10^kAdditionDigits
static_assert(kAdditionDigits == 2, "kOperandLimit must be 10^kAdditionDigits");

// Appends one problem a + b to `stream`; `scored` marks its answer digits.
void AppendProblem(int a, int b, std::vector<int32_t>* stream, std::vector<bool>* scored) {
  auto push = [&](int token, bool is_answer) {
    stream->push_back(token);
    scored->push_back(is_answer);
  };
  auto push_digits = [&](int value, int digits) {  // most significant first
    int scale = 1;
    for (int d = 1; d < digits; ++d) scale *= 10;
    for (; scale > 0; scale /= 10) push(value / scale % 10, false);
  };
  push_digits(a, kAdditionDigits);
  push(kPlusToken, false);
  push_digits(b, kAdditionDigits);
  push(kEqualsToken, false);
  int sum = a + b;
  for (int d = 0; d <= kAdditionDigits; ++d, sum /= 10) push(sum % 10, true);  // least first
  push(kEndToken, false);
}

}  // namespace

absl::StatusOr<std::unique_ptr<AdditionTask>> AdditionTask::Create(uint64_t seed, int vocab,
                                                                   int64_t seq_len,
                                                                   int64_t micro_batch_size) {
  if (vocab < kAdditionVocab) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model.vocab = ", vocab, ": the addition task needs at least ", kAdditionVocab,
        " token ids (digits 0-9, '+', '=', ';'); raise model.vocab or choose another data source"));
  }
  // The first problem's answer ends at stream position kAdditionProblemTokens
  // - 2, which is scored when it is a target, i.e. at most seq_len.
  if (seq_len < kAdditionProblemTokens - 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("model.seq_len = ", seq_len, ": the addition task needs at least ",
                     kAdditionProblemTokens - 2, " positions to hold one problem and its answer"));
  }
  if (micro_batch_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("train.micro_batch_size = ", micro_batch_size, ": must be positive"));
  }
  return std::unique_ptr<AdditionTask>(new AdditionTask(seed, seq_len, micro_batch_size));
}

absl::Status AdditionTask::Fill(int64_t step, int mb, int dp_rank, MicrobatchData* out) const {
  if (absl::Status s = PrepareMicrobatch(step, mb, dp_rank, batch_, seq_, out); !s.ok()) return s;
  std::vector<int32_t> stream;
  std::vector<bool> scored;
  for (int64_t row = 0; row < batch_; ++row) {
    SampleRng rng({seed_, static_cast<uint64_t>(step), static_cast<uint64_t>(mb),
                   static_cast<uint64_t>(dp_rank), static_cast<uint64_t>(row)});
    stream.clear();
    scored.clear();
    while (static_cast<int64_t>(stream.size()) < seq_ + 1) {
      const int a = static_cast<int>(rng.Below(kOperandLimit));
      const int b = static_cast<int>(rng.Below(kOperandLimit));
      AppendProblem(a, b, &stream, &scored);
    }
    int32_t* tokens = out->tokens.i32() + row * seq_;
    int32_t* targets = out->targets.i32() + row * seq_;
    for (int64_t i = 0; i < seq_; ++i) {
      tokens[i] = stream[i];
      targets[i] = scored[i + 1] ? stream[i + 1] : kernels::cpu::kIgnoreTarget;
    }
  }
  return absl::OkStatus();
}

}  // namespace baton::data
