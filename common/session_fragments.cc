#include "common/session_fragments.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace baton {

int64_t FragmentCount(int64_t total_bytes, size_t payload_bytes) {
  if (total_bytes <= 0) return 0;
  const int64_t payload = static_cast<int64_t>(payload_bytes);
  return (total_bytes - 1) / payload + 1;
}

v1::Fragment FragmentOf(absl::string_view serialized, int32_t index, size_t payload_bytes) {
  v1::Fragment f;
  const size_t begin = static_cast<size_t>(index) * payload_bytes;
  f.set_index(index);
  f.set_count(static_cast<int32_t>(FragmentCount(static_cast<int64_t>(serialized.size()), payload_bytes)));
  f.set_total_bytes(static_cast<int64_t>(serialized.size()));
  if (begin < serialized.size()) f.set_data(std::string(serialized.substr(begin, payload_bytes)));
  return f;
}

std::vector<v1::Fragment> SplitIntoFragments(absl::string_view serialized, size_t payload_bytes) {
  std::vector<v1::Fragment> out;
  const int64_t n = FragmentCount(static_cast<int64_t>(serialized.size()), payload_bytes);
  out.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out.push_back(FragmentOf(serialized, static_cast<int32_t>(i), payload_bytes));
  return out;
}

FragmentAssembler::FragmentAssembler(int64_t max_total_bytes, size_t payload_bytes)
    : max_total_bytes_(max_total_bytes), payload_bytes_(payload_bytes) {}

void FragmentAssembler::Reset() {
  count_ = 0;
  next_index_ = 0;
  total_bytes_ = 0;
  std::string().swap(buffer_);
}

absl::StatusOr<std::optional<std::string>> FragmentAssembler::Add(v1::Fragment fragment) {
  auto fail = [this](std::string what) {
    Reset();
    return absl::InvalidArgumentError(absl::StrCat("bad session fragment: ", what));
  };
  const int64_t payload = static_cast<int64_t>(payload_bytes_);
  if (count_ == 0) {
    // Opens a message: every bound is checked before a byte is kept.
    if (fragment.index() != 0) {
      return fail(absl::StrCat("fragment ", fragment.index(), " of ", fragment.count(),
                               " arrived with no message in assembly (a message starts at index 0)"));
    }
    if (fragment.total_bytes() <= payload) {
      return fail(absl::StrCat("total_bytes ", fragment.total_bytes(), " is not over the ", payload,
                               "-byte fragment payload (such a message travels whole)"));
    }
    if (fragment.total_bytes() > max_total_bytes_) {
      return fail(absl::StrCat("total_bytes ", fragment.total_bytes(), " is over this receiver's bound of ",
                               max_total_bytes_, " bytes"));
    }
    const int64_t want = FragmentCount(fragment.total_bytes(), payload_bytes_);
    if (fragment.count() != want) {
      return fail(absl::StrCat("count ", fragment.count(), " does not match total_bytes ", fragment.total_bytes(),
                               " (", want, " fragments of ", payload, " bytes)"));
    }
    count_ = fragment.count();
    total_bytes_ = fragment.total_bytes();
    next_index_ = 0;
  } else if (fragment.index() != next_index_ || fragment.count() != count_ ||
             fragment.total_bytes() != total_bytes_) {
    return fail(absl::StrCat("expected fragment ", next_index_, " of ", count_, " (", total_bytes_,
                             " bytes), got fragment ", fragment.index(), " of ", fragment.count(), " (",
                             fragment.total_bytes(), " bytes): another message may not start before this one "
                             "is complete"));
  }
  const bool last = next_index_ == count_ - 1;
  const int64_t want_size = last ? total_bytes_ - payload * (count_ - 1) : payload;
  if (static_cast<int64_t>(fragment.data().size()) != want_size) {
    return fail(absl::StrCat("fragment ", next_index_, " of ", count_, " carries ", fragment.data().size(),
                             " bytes, not ", want_size));
  }
  if (next_index_ == 0) {
    buffer_ = std::move(*fragment.mutable_data());
  } else {
    buffer_.append(fragment.data());
  }
  ++next_index_;
  if (!last) return std::optional<std::string>();
  std::string whole = std::move(buffer_);
  Reset();
  return std::optional<std::string>(std::move(whole));
}

}  // namespace baton
