// Test helpers for Communicator::AllToAllV on any backend: an uneven pattern
// of counts (zero-element chunks, a rank that sends nothing, a rank that
// receives nothing) and a run on one rank that gets its receive counts with
// ExchangeCounts, as an MoE dispatch does, then checks every element it got.
#ifndef BATON_WORKER_COMM_ALL_TO_ALL_V_TESTING_H_
#define BATON_WORKER_COMM_ALL_TO_ALL_V_TESTING_H_

#include <cstdint>
#include <memory>
#include <numeric>
#include <type_traits>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "worker/comm/communicator.h"

namespace baton::comm {

// Elements rank `from` sends rank `to` in a group of `size`.
inline int64_t UnevenCount(int size, int from, int to) {
  if (size >= 3 && from == 1) return 0;  // rank 1 sends nothing
  if (size >= 4 && to == 2) return 0;    // rank 2 receives nothing
  if ((from * 7 + to * 3) % 5 == 0) return 0;
  return 1 + (from * 13 + to * 29) % 37 + (from + to) % 3 * 1000;
}

// Element i (< 10000) of the chunk rank `from` sends rank `to`: distinct for
// every (from, to, i) of a group of up to 9 ranks and exact in every dtype.
template <typename T>
T ChunkValue(int from, int to, int64_t i) {
  const int64_t v = from * 1000000 + to * 10000 + i;
  if constexpr (std::is_same_v<T, int64_t>) return (int64_t{1} << 40) * (from + 1) + v;
  return static_cast<T>(v);
}

template <typename T>
DType DTypeOf() {
  if constexpr (std::is_same_v<T, float>) return DType::kFloat32;
  if constexpr (std::is_same_v<T, int32_t>) return DType::kInt32;
  if constexpr (std::is_same_v<T, int64_t>) return DType::kInt64;
  return DType::kUInt8;
}

// On `comm`'s rank: exchanges the pattern's counts (checking what arrives),
// runs the AllToAllV and checks every element received, and that `in` is
// left as it was. Every rank of the group must run it at the same time.
template <typename T>
void RunUnevenAllToAllV(Communicator& comm, absl::Duration timeout) {
  const int n = comm.size(), r = comm.rank();
  std::vector<int64_t> send_counts(n);
  for (int j = 0; j < n; ++j) send_counts[j] = UnevenCount(n, r, j);
  absl::StatusOr<std::vector<int64_t>> recv_counts = ExchangeCounts(comm, send_counts, timeout);
  ASSERT_TRUE(recv_counts.ok()) << recv_counts.status();
  ASSERT_EQ(recv_counts->size(), static_cast<size_t>(n));
  for (int j = 0; j < n; ++j) {
    ASSERT_EQ((*recv_counts)[j], UnevenCount(n, j, r)) << "count from rank " << j << " on rank " << r;
  }
  std::vector<T> in;
  for (int j = 0; j < n; ++j) {
    for (int64_t i = 0; i < send_counts[j]; ++i) in.push_back(ChunkValue<T>(r, j, i));
  }
  const std::vector<T> in_before = in;
  const int64_t total = std::accumulate(recv_counts->begin(), recv_counts->end(), int64_t{0});
  std::vector<T> out(total, static_cast<T>(-1));
  std::shared_ptr<Work> work =
      comm.AllToAllV(Buffer{in.data(), static_cast<int64_t>(in.size()), DTypeOf<T>(), -1}, send_counts,
                     Buffer{out.data(), total, DTypeOf<T>(), -1}, *recv_counts);
  const absl::Status s = work->Wait(timeout);
  ASSERT_TRUE(s.ok()) << s;
  int64_t k = 0;
  for (int j = 0; j < n; ++j) {
    for (int64_t i = 0; i < (*recv_counts)[j]; ++i, ++k) {
      ASSERT_EQ(out[k], ChunkValue<T>(j, r, i))
          << "rank " << r << ", element " << i << " of the chunk from rank " << j;
    }
  }
  EXPECT_EQ(k, total);
  EXPECT_EQ(in, in_before) << "AllToAllV must leave its input alone";
}

}  // namespace baton::comm

#endif  // BATON_WORKER_COMM_ALL_TO_ALL_V_TESTING_H_
