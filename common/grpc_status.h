// absl::Status <-> grpc::Status, in one place (codes map one to one).
#ifndef BATON_COMMON_GRPC_STATUS_H_
#define BATON_COMMON_GRPC_STATUS_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace baton {

inline grpc::Status ToGrpcStatus(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

// `what` names the call, e.g. "Register at 127.0.0.1:5000".
inline absl::Status FromGrpcStatus(const grpc::Status& s, absl::string_view what) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), absl::StrCat(what, ": ", s.error_message()));
}

}  // namespace baton

#endif  // BATON_COMMON_GRPC_STATUS_H_
