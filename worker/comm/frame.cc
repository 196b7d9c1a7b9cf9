#include "worker/comm/frame.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace baton::comm {
namespace {

// Waits for `work` until `deadline` in slices (a long or infinite wait is
// many bounded ones: a pending op may be waited on again). Aborts `comm`
// when the op is still pending at the deadline.
absl::Status WaitUntil(Communicator& comm, Work& work, absl::Time deadline, absl::Duration timeout,
                       const std::string& what) {
  for (;;) {
    const absl::Duration left = std::max(deadline - absl::Now(), absl::ZeroDuration());
    absl::Status s = work.Wait(std::min(left, absl::Seconds(1)));
    if (s.code() != absl::StatusCode::kDeadlineExceeded || work.IsCompleted()) {
      return s.ok() ? s : WithContext(s, what);
    }
    if (absl::Now() >= deadline) {
      const absl::Status late =
          absl::DeadlineExceededError(absl::StrCat(what, ": not complete after ", absl::FormatDuration(timeout)));
      comm.Abort(late.message());
      return late;
    }
  }
}

absl::Time DeadlineOf(absl::Duration timeout) {
  return timeout == absl::InfiniteDuration() ? absl::InfiniteFuture() : absl::Now() + timeout;
}

}  // namespace

absl::Status SendFrame(Communicator& comm, int peer, uint64_t tag, const std::string& bytes, absl::Duration timeout,
                       const std::string& what) {
  const absl::Time deadline = DeadlineOf(timeout);
  int64_t length = static_cast<int64_t>(bytes.size());
  std::shared_ptr<Work> head = comm.Send(Buffer{&length, 1, DType::kInt64, -1}, peer, tag);
  std::shared_ptr<Work> body;
  if (length > 0) {
    body = comm.Send(Buffer{const_cast<char*>(bytes.data()), length, DType::kUInt8, -1}, peer, tag + 1);
  }
  absl::Status s = WaitUntil(comm, *head, deadline, timeout, what);
  if (s.ok() && body != nullptr) s = WaitUntil(comm, *body, deadline, timeout, what);
  if (!s.ok() && body != nullptr && !body->IsCompleted()) comm.Abort(s.message());  // the body's buffer ends here
  return s;
}

absl::StatusOr<std::string> RecvFrame(Communicator& comm, int peer, uint64_t tag, size_t max_bytes,
                                      absl::Duration timeout, const std::string& what) {
  const absl::Time deadline = DeadlineOf(timeout);
  int64_t length = -1;
  std::shared_ptr<Work> head = comm.Recv(Buffer{&length, 1, DType::kInt64, -1}, peer, tag);
  BATON_RETURN_IF_ERROR(WaitUntil(comm, *head, deadline, timeout, what));
  if (length < 0 || static_cast<uint64_t>(length) > max_bytes) {
    const absl::Status bad = absl::InvalidArgumentError(
        absl::StrCat(what, ": a frame of ", length, " bytes, over the bound of ", max_bytes));
    comm.Abort(bad.message());  // the sender's body is left unread
    return bad;
  }
  std::string bytes(static_cast<size_t>(length), '\0');
  if (length == 0) return bytes;
  std::shared_ptr<Work> body = comm.Recv(Buffer{bytes.data(), length, DType::kUInt8, -1}, peer, tag + 1);
  BATON_RETURN_IF_ERROR(WaitUntil(comm, *body, deadline, timeout, what));
  return bytes;
}

}  // namespace baton::comm
