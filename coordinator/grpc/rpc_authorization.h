// Who may call which coordinator RPC: one table, one decision, enforced for
// every call before its handler runs (docs/security.md "Authorisation").
//
// The table maps each full method path ("/baton.v1.Coordinator/Register") to
// the certificate roles allowed to call it and whether the call must carry
// the join token. A method that is not in the table is refused
// (PERMISSION_DENIED): a new RPC is unreachable until someone decides who may
// call it.
//
// Enforcement: an AuthMetadataProcessor attached to the server credentials
// (MakeAuthorizedServerCredentials). gRPC runs it in the transport for every
// call, with the peer's verified certificate and the call's metadata
// (including ":path"), before the call is dispatched; a refusal is the
// status the client gets and the handler never runs. (A server interceptor
// cannot do this in gRPC 1.51: server interceptors cannot end a call, so the
// handler would still run — e.g. register the intruder — before the status
// could be replaced. See grpc/grpc#24017.)
//
// Roles are checked only with TLS (without it no peer is authenticated and
// the daemon listens on loopback only); the join token is checked whenever
// one is configured.
#ifndef BATON_COORDINATOR_GRPC_RPC_AUTHORIZATION_H_
#define BATON_COORDINATOR_GRPC_RPC_AUTHORIZATION_H_

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <grpcpp/security/auth_metadata_processor.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/support/status.h>

#include "absl/strings/string_view.h"
#include "common/grpc_credentials.h"

namespace baton {

struct RpcRule {
  std::vector<std::string> roles;  // certificate roles allowed to call (any of them)
  bool join_token = false;         // the call must carry the join token (when one is configured)
};

// The coordinator's table: every RPC the coordinator serves (baton.v1.Coordinator,
// grpc.health.v1.Health, and reflection when --reflection is given).
const std::map<std::string, RpcRule>& CoordinatorRpcTable();

// Decides. Thread-safe (immutable after construction).
class RpcAuthorizer {
 public:
  struct Options {
    bool tls = false;        // check the roles of the peer's certificate
    std::string join_token;  // required by rules with join_token when non-empty
    std::map<std::string, RpcRule> table = CoordinatorRpcTable();
    // Called once per refusal, with the method and the reason: "role",
    // "token" or "unknown_method".
    std::function<void(const std::string& method, const std::string& reason)> on_refused;
  };
  explicit RpcAuthorizer(Options options);

  // OK when a peer whose verified certificate carries `roles`, sending `token`
  // (nullopt when the call has none), may call `method`. Otherwise
  // PERMISSION_DENIED (not in the table; wrong role, naming the role needed
  // and the method) or UNAUTHENTICATED (join token missing or wrong).
  grpc::Status Authorize(absl::string_view method, const std::vector<std::string>& roles,
                         std::optional<absl::string_view> token) const;

  bool tls() const { return options_.tls; }

 private:
  grpc::Status Refuse(absl::string_view method, const char* reason, grpc::Status status) const;

  const Options options_;
};

// Runs `authorizer` on every call in the transport (see the file comment).
std::shared_ptr<grpc::AuthMetadataProcessor> MakeAuthorizationProcessor(
    std::shared_ptr<const RpcAuthorizer> authorizer);

// The coordinator's server credentials with `authorizer` attached: mTLS
// when `tls` is enabled; otherwise plaintext local credentials, which accept
// connections from loopback peers only. With `insecure` (plaintext beyond
// loopback, --insecure) gRPC offers no credentials a processor can be
// attached to: the result is plain insecure credentials and *authorized is
// false (nothing is checked, the join token included).
std::shared_ptr<grpc::ServerCredentials> MakeAuthorizedServerCredentials(
    const TlsConfig& tls, bool insecure, std::shared_ptr<const RpcAuthorizer> authorizer, bool* authorized);

}  // namespace baton

#endif  // BATON_COORDINATOR_GRPC_RPC_AUTHORIZATION_H_
