// Status propagation macros (Abseil 20220623 ships none).
//
//   BATON_RETURN_IF_ERROR(DoThing());
//   BATON_ASSIGN_OR_RETURN(auto value, ComputeValue());
//   BATON_RETURN_IF_ERROR(Load(path)) << is not supported; use
//   BATON_RETURN_IF_ERROR_CTX(Load(path), "while loading ", path);
#ifndef BATON_COMMON_STATUS_MACROS_H_
#define BATON_COMMON_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace baton {

// Returns `status` with `context` prepended to its message, code kept.
// Keeps the status's payloads (e.g. kernels::IsOutOfMemory's mark).
inline absl::Status WithContext(const absl::Status& status, absl::string_view context) {
  if (status.ok()) return status;
  absl::Status with(status.code(), absl::StrCat(context, ": ", status.message()));
  status.ForEachPayload([&with](absl::string_view type, const absl::Cord& payload) { with.SetPayload(type, payload); });
  return with;
}

}  // namespace baton

#define BATON_STATUS_CONCAT_INNER_(a, b) a##b
#define BATON_STATUS_CONCAT_(a, b) BATON_STATUS_CONCAT_INNER_(a, b)

#define BATON_RETURN_IF_ERROR(expr)                  \
  do {                                               \
    ::absl::Status baton_status_ = (expr);           \
    if (!baton_status_.ok()) return baton_status_;   \
  } while (0)

// Adds context (StrCat of the remaining arguments) to an error as it rises.
#define BATON_RETURN_IF_ERROR_CTX(expr, ...)                                       \
  do {                                                                             \
    ::absl::Status baton_status_ = (expr);                                         \
    if (!baton_status_.ok())                                                       \
      return ::baton::WithContext(baton_status_, ::absl::StrCat(__VA_ARGS__));     \
  } while (0)

#define BATON_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  if (!tmp.ok()) return tmp.status();                \
  lhs = std::move(*tmp)

#define BATON_ASSIGN_OR_RETURN(lhs, expr) \
  BATON_ASSIGN_OR_RETURN_IMPL_(BATON_STATUS_CONCAT_(baton_statusor_, __COUNTER__), lhs, expr)

#endif  // BATON_COMMON_STATUS_MACROS_H_
