// CompareWeights: how far apart two weight sets are (as LoadFullWeights
// returns them), overall and per tensor, for `batonctl checkpoint diff` and
// the layout-equivalence tests.
//
//   abs diff of a tensor: max over elements of |a − b|
//   rel diff of a tensor: ‖a − b‖₂ / ‖b‖₂ (0 when both are zero, +inf when
//                         only b is zero)
// NaN against NaN counts as equal; NaN against a number, or infinities of
// different sign, as an infinite difference. Overall values are the maxima
// over tensors.
#ifndef BATON_COMMON_WEIGHTS_DIFF_H_
#define BATON_COMMON_WEIGHTS_DIFF_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/checkpoint_manifest.h"

namespace baton::checkpoint {

struct TensorDiff {
  std::string name;
  std::vector<int64_t> shape;
  double max_abs_diff = 0;
  double rel_diff = 0;
};

struct WeightsDiff {
  double max_abs_diff = 0;
  double max_rel_diff = 0;
  double rel_l2 = 0;  // ||a - b|| / ||b|| with all tensors as one vector
  std::vector<TensorDiff> tensors;  // in name order
};

// FAILED_PRECONDITION when the two sets do not hold the same tensor names
// with the same shapes; the message lists which (first few of each kind).
absl::StatusOr<WeightsDiff> CompareWeights(const std::map<std::string, FullTensor>& a,
                                           const std::map<std::string, FullTensor>& b);

// The AdamW moments of two full states compared the same way, as tensors
// named "adam_m/<name>" and "adam_v/<name>". FAILED_PRECONDITION when either
// state has no moments, or as CompareWeights.
absl::StatusOr<WeightsDiff> CompareMoments(const FullState& a, const FullState& b);

}  // namespace baton::checkpoint

#endif  // BATON_COMMON_WEIGHTS_DIFF_H_
