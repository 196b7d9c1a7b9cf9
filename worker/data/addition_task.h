// AdditionTask: the default training data, a synthetic task with a
// meaningful accuracy — two-digit addition problems packed into sequences.
//
// One problem is 10 tokens, both operands zero-padded to two digits and the
// three-digit sum written least-significant digit first:
//
//   47 + 85 = 132  →  "4 7 + 8 5 = 2 3 1 ;"
//
// Reversing the answer lets the model produce each digit from the operand
// digits and the carry it has just written; most-significant first would need
// the whole carry chain before the first answer digit. Measured with a 2-layer,
// d_model 64 GPT, 32 rows of 20 tokens per step, AdamW lr 3e-3: answer-digit
// accuracy plateaus near 40% for the first 200-300 steps, then climbs to
// 70-98% by step 600 (addition_training_test.cc). Plan demos for 500+ steps.
//
// Token ids: digits 0–9 are ids 0–9, '+' is 10, '=' is 11, ';' (end of
// problem) is 12, so model.vocab must be at least kAdditionVocab = 13.
// A row of seq_len tokens is seq_len + 1 tokens of back-to-back problems
// starting at a problem boundary (tokens = the first seq_len, next tokens =
// the last seq_len); a problem cut by the row's end keeps its tokens. Only
// the three answer digits are scored: every other target is -1, so the
// reported accuracy is answer-digit accuracy (chance ≈ 23%: 10% per sum
// digit, about half for the leading carry).
//
// Operands are uniform in [0, 100), drawn from SampleRng({seed, step, mb,
// dp_rank, row}).
#ifndef BATON_WORKER_DATA_ADDITION_TASK_H_
#define BATON_WORKER_DATA_ADDITION_TASK_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "worker/data/data_source.h"

namespace baton::data {

inline constexpr int kAdditionDigits = 2;  // per operand
inline constexpr int kPlusToken = 10;
inline constexpr int kEqualsToken = 11;
inline constexpr int kEndToken = 12;
inline constexpr int kAdditionVocab = 13;
// Tokens per problem: a, '+', b, '=', sum (one digit longer), ';'.
inline constexpr int kAdditionProblemTokens = 3 * kAdditionDigits + 4;

class AdditionTask : public DataSource {
 public:
  // Errors (INVALID_ARGUMENT) name the JobSpec field: model.vocab below
  // kAdditionVocab; model.seq_len shorter than one problem up to its answer;
  // train.micro_batch_size not positive.
  static absl::StatusOr<std::unique_ptr<AdditionTask>> Create(uint64_t seed, int vocab,
                                                              int64_t seq_len,
                                                              int64_t micro_batch_size);

  absl::Status Fill(int64_t step, int mb, int dp_rank, MicrobatchData* out) const override;
  int64_t micro_batch_size() const override { return batch_; }
  int64_t seq_len() const override { return seq_; }

 private:
  AdditionTask(uint64_t seed, int64_t seq_len, int64_t micro_batch_size)
      : seed_(seed), seq_(seq_len), batch_(micro_batch_size) {}

  uint64_t seed_;
  int64_t seq_, batch_;
};

}  // namespace baton::data

#endif  // BATON_WORKER_DATA_ADDITION_TASK_H_
