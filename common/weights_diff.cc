#include "common/weights_diff.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace baton::checkpoint {
namespace {

constexpr size_t kListed = 5;  // names listed per kind of mismatch

double ElementDiff(float x, float y) {
  if (std::isnan(x) || std::isnan(y)) {
    return std::isnan(x) && std::isnan(y) ? 0.0 : std::numeric_limits<double>::infinity();
  }
  if (x == y) return 0.0;  // also equal infinities
  return std::fabs(static_cast<double>(x) - static_cast<double>(y));
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

std::string List(const std::vector<std::string>& names) {
  std::vector<std::string> shown(names.begin(), names.begin() + std::min(names.size(), kListed));
  return absl::StrCat(absl::StrJoin(shown, ", "),
                      names.size() > kListed ? absl::StrCat(" and ", names.size() - kListed, " more") : "");
}

}  // namespace

absl::StatusOr<WeightsDiff> CompareWeights(const std::map<std::string, FullTensor>& a,
                                           const std::map<std::string, FullTensor>& b) {
  std::vector<std::string> only_a, only_b, shapes;
  for (const auto& [name, t] : a) {
    auto it = b.find(name);
    if (it == b.end()) {
      only_a.push_back(name);
    } else if (it->second.shape != t.shape) {
      shapes.push_back(absl::StrCat(name, " ", ShapeString(t.shape), " vs ", ShapeString(it->second.shape)));
    }
  }
  for (const auto& [name, t] : b) {
    if (a.count(name) == 0) only_b.push_back(name);
  }
  if (!only_a.empty() || !only_b.empty() || !shapes.empty()) {
    std::vector<std::string> parts;
    if (!only_a.empty()) parts.push_back(absl::StrCat("only in the first: ", List(only_a)));
    if (!only_b.empty()) parts.push_back(absl::StrCat("only in the second: ", List(only_b)));
    if (!shapes.empty()) parts.push_back(absl::StrCat("shapes differ: ", List(shapes)));
    return absl::FailedPreconditionError(
        absl::StrCat("the weight sets hold different tensors (", absl::StrJoin(parts, "; "), ")"));
  }
  WeightsDiff diff;
  double all_diff_sq = 0, all_ref_sq = 0;
  for (const auto& [name, ta] : a) {
    const FullTensor& tb = b.at(name);
    TensorDiff t;
    t.name = name;
    t.shape = ta.shape;
    double diff_sq = 0, ref_sq = 0;
    for (size_t i = 0; i < ta.values.size(); ++i) {
      const double d = ElementDiff(ta.values[i], tb.values[i]);
      t.max_abs_diff = std::max(t.max_abs_diff, d);
      diff_sq += d * d;
      ref_sq += static_cast<double>(tb.values[i]) * tb.values[i];
    }
    if (diff_sq > 0) {
      t.rel_diff = ref_sq > 0 ? std::sqrt(diff_sq) / std::sqrt(ref_sq) : std::numeric_limits<double>::infinity();
    }
    diff.max_abs_diff = std::max(diff.max_abs_diff, t.max_abs_diff);
    diff.max_rel_diff = std::max(diff.max_rel_diff, t.rel_diff);
    diff.tensors.push_back(std::move(t));
    all_diff_sq += diff_sq;
    all_ref_sq += ref_sq;
  }
  if (all_diff_sq > 0) {
    diff.rel_l2 = all_ref_sq > 0 ? std::sqrt(all_diff_sq) / std::sqrt(all_ref_sq)
                                 : std::numeric_limits<double>::infinity();
  }
  return diff;
}

namespace {

std::map<std::string, FullTensor> MomentsOf(const FullState& s) {
  std::map<std::string, FullTensor> out;
  for (const auto& [name, t] : s.tensors) {
    FullTensor m;
    m.shape = t.shape;
    m.values = t.adam_m;
    out.emplace(kAdamMPrefix + name, std::move(m));
    FullTensor v;
    v.shape = t.shape;
    v.values = t.adam_v;
    out.emplace(kAdamVPrefix + name, std::move(v));
  }
  return out;
}

}  // namespace

absl::StatusOr<WeightsDiff> CompareMoments(const FullState& a, const FullState& b) {
  if (!a.has_moments || !b.has_moments) {
    return absl::FailedPreconditionError(absl::StrCat("the ", !a.has_moments ? "first" : "second",
                                                      " checkpoint holds no optimizer moments"));
  }
  return CompareWeights(MomentsOf(a), MomentsOf(b));
}

}  // namespace baton::checkpoint
