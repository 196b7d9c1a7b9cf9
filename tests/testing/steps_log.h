// The training losses of a job's steps.jsonl, for end-to-end tests.
#ifndef BATON_TESTS_TESTING_STEPS_LOG_H_
#define BATON_TESTS_TESTING_STEPS_LOG_H_

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

}  // namespace baton::testing

#endif  // BATON_TESTS_TESTING_STEPS_LOG_H_
