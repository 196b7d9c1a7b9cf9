#include "worker/comm/communicator.h"

#include <cstdint>
#include <limits>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace baton::comm {

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kInt64:
      return 8;
    case DType::kUInt8:
      return 1;
  }
  return 1;
}

namespace {

class FailedWork : public Work {
 public:
  explicit FailedWork(absl::Status status) : status_(std::move(status)) {}
  absl::Status Wait(absl::Duration) override { return status_; }
  bool IsCompleted() override { return true; }

 private:
  const absl::Status status_;
};

}  // namespace

std::shared_ptr<Work> CompletedWork(absl::Status status) { return std::make_shared<FailedWork>(std::move(status)); }

namespace {

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
    case DType::kUInt8:
      return "uint8";
  }
  return "?";
}

// Checks one counts vector of a group of `size`: one entry per rank, none
// negative, their sum at most `max_sum` (so that its bytes fit in int64).
// On success `*sum` is their sum.
absl::Status CheckCounts(absl::string_view what, absl::string_view name,
                         const std::vector<int64_t>& counts, int size, int64_t max_sum,
                         int64_t* sum) {
  if (counts.size() != static_cast<size_t>(size)) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", name, " holds ", counts.size(),
                                                   " value(s); it needs one per rank of the group (",
                                                   size, ")"));
  }
  int64_t total = 0;
  for (size_t j = 0; j < counts.size(); ++j) {
    if (counts[j] < 0) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": ", name, "[", j, "] is ", counts[j],
                                                     "; counts must be zero or more"));
    }
    if (counts[j] > max_sum - total) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": ", name, " add up to more than ", max_sum,
          " elements (the count overflows: their bytes do not fit in int64); check how the counts "
          "were computed"));
    }
    total += counts[j];
  }
  *sum = total;
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckAllToAllVArgs(absl::string_view what, const Buffer& in,
                                const std::vector<int64_t>& send_counts, const Buffer& out,
                                const std::vector<int64_t>& recv_counts, int rank, int size) {
  if (in.dtype != out.dtype) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": in is ", DTypeName(in.dtype), ", out is ",
                                                   DTypeName(out.dtype),
                                                   "; both buffers must have the same dtype"));
  }
  const int64_t max_elements =
      std::numeric_limits<int64_t>::max() / static_cast<int64_t>(DTypeSize(in.dtype));
  int64_t send_sum = 0, recv_sum = 0;
  absl::Status s = CheckCounts(what, "send_counts", send_counts, size, max_elements, &send_sum);
  if (s.ok()) s = CheckCounts(what, "recv_counts", recv_counts, size, max_elements, &recv_sum);
  if (!s.ok()) return s;
  if (in.count != send_sum) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": in has ", in.count,
                                                   " elements, send_counts add up to ", send_sum,
                                                   "; in.count must be their sum"));
  }
  if (out.count != recv_sum) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": out has ", out.count,
                                                   " elements, recv_counts add up to ", recv_sum,
                                                   "; out.count must be their sum"));
  }
  if ((in.count > 0 && in.data == nullptr) || (out.count > 0 && out.data == nullptr)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", in.count > 0 && in.data == nullptr ? "in" : "out",
                     " has no data for its elements"));
  }
  if (rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": rank ", rank, " is not in a group of ", size));
  }
  if (send_counts[rank] != recv_counts[rank]) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": send_counts[", rank, "] is ", send_counts[rank], ", recv_counts[", rank, "] is ",
        recv_counts[rank], "; the chunk rank ", rank, " keeps for itself must have one count"));
  }
  return absl::OkStatus();
}

std::vector<int64_t> ChunkOffsets(const std::vector<int64_t>& counts) {
  std::vector<int64_t> offsets(counts.size(), 0);
  for (size_t j = 1; j < counts.size(); ++j) offsets[j] = offsets[j - 1] + counts[j - 1];
  return offsets;
}

absl::StatusOr<std::vector<int64_t>> ExchangeCounts(Communicator& comm,
                                                    const std::vector<int64_t>& send_counts,
                                                    absl::Duration timeout) {
  const int n = comm.size();
  const std::string what = absl::StrCat("ExchangeCounts on rank ", comm.rank(), " of ", n);
  int64_t sum = 0;
  absl::Status valid = CheckCounts(what, "send_counts", send_counts, n,
                                   std::numeric_limits<int64_t>::max(), &sum);
  if (!valid.ok()) return valid;
  if (comm.RunsOnStreams()) {
    return absl::UnimplementedError(absl::StrCat(
        what, ": it exchanges counts in host memory, which the ", comm.backend(),
        " communicator does not take (its ops run on CUDA streams); exchange device counts with "
        "AllToAllV, one int64 per peer"));
  }
  std::vector<int64_t> recv_counts(n, 0);
  const std::vector<int64_t> ones(n, 1);
  std::shared_ptr<Work> work =
      comm.AllToAllV(Buffer{const_cast<int64_t*>(send_counts.data()), n, DType::kInt64, -1}, ones,
                     Buffer{recv_counts.data(), n, DType::kInt64, -1}, ones);
  absl::Status s = work->Wait(timeout);
  if (!s.ok() && !work->IsCompleted()) {
    // The op would write into recv_counts after we return: abort, after
    // which no backend touches a host buffer again.
    comm.Abort(absl::StrCat(what, ": counts not exchanged within ", absl::FormatDuration(timeout)));
    return absl::Status(
        s.code(), absl::StrCat(what, ": ", s.message(),
                               "; ExchangeCounts aborted the communicator (its buffers cannot "
                               "outlive the call): check that every rank of the group exchanges "
                               "counts at this point"));
  }
  if (!s.ok()) s = work->Wait(absl::ZeroDuration());  // completed since: its final status
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
  for (int j = 0; j < n; ++j) {
    if (recv_counts[j] < 0) {
      return absl::DataLossError(absl::StrCat(what, ": rank ", j, " announced ", recv_counts[j],
                                              " elements; counts are never negative (do all "
                                              "ranks run the same build?)"));
    }
  }
  return recv_counts;
}

std::shared_ptr<Work> Communicator::GroupOnStream(const std::vector<P2POp>&, void*) {
  return CompletedWork(absl::UnimplementedError(
      absl::StrCat("the ", backend(), " communicator does not run ops on CUDA streams")));
}

std::shared_ptr<Work> Communicator::AllReduceSumOnStream(Buffer, void*) {
  return CompletedWork(absl::UnimplementedError(
      absl::StrCat("the ", backend(), " communicator does not run ops on CUDA streams")));
}

std::shared_ptr<Work> Communicator::AllGatherOnStream(Buffer, Buffer, void*) {
  return CompletedWork(absl::UnimplementedError(
      absl::StrCat("the ", backend(), " communicator does not run ops on CUDA streams")));
}

std::shared_ptr<Work> Communicator::ReduceScatterSumOnStream(Buffer, Buffer, void*) {
  return CompletedWork(absl::UnimplementedError(
      absl::StrCat("the ", backend(), " communicator does not run ops on CUDA streams")));
}

}  // namespace baton::comm
