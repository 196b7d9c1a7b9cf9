// The training losses of a job's steps.jsonl, for end-to-end tests.
#ifndef BATON_TESTS_TESTING_STEPS_LOG_H_
#define BATON_TESTS_TESTING_STEPS_LOG_H_

#include <cstdint>
#include <string>
#include <vector>

namespace baton::testing {

struct StepLosses {
  std::vector<double> values;
  // Each step's `"loss": ...` exactly as written, for bitwise comparisons
  // (the number as text, not parsed and printed again).
  std::vector<std::string> text;
};

// The loss of every step line of `path` (lines of a step with a loss, in
// file order); empty when the file is missing.
StepLosses ReadStepLosses(const std::string& path);

// The evaluation lines of `path` (train.eval_every_steps), in file order.
struct EvalLine {
  int64_t step = 0;  // the step whose weights were evaluated
  double loss = 0, perplexity = 0;
  int64_t tokens = 0;
  std::string loss_text;  // `"loss": ...` exactly as written
};
std::vector<EvalLine> ReadEvalLines(const std::string& path);

// Numeric field `key` of every step line of `path` that has it, in file
// order (e.g. "max_optimizer_bytes", "max_dp_bytes").
std::vector<double> ReadStepField(const std::string& path, const std::string& key);

}  // namespace baton::testing

#endif  // BATON_TESTS_TESTING_STEPS_LOG_H_
