#include "coordinator/grpc/rpc_authorization.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log.h"

namespace baton {
namespace {

constexpr size_t kMaxLoggedMethod = 128;

std::string Clip(absl::string_view s) { return std::string(s.substr(0, kMaxLoggedMethod)); }

// Adapts RpcAuthorizer to gRPC's per-call hook.
class AuthorizationProcessor : public grpc::AuthMetadataProcessor {
 public:
  explicit AuthorizationProcessor(std::shared_ptr<const RpcAuthorizer> authorizer)
      : authorizer_(std::move(authorizer)) {}

  // Cheap and non-blocking: runs inline in the transport.
  bool IsBlocking() const override { return false; }

  grpc::Status Process(const InputMetadata& metadata, grpc::AuthContext* context, OutputMetadata*,
                       OutputMetadata*) override {
    absl::string_view method;
    std::optional<absl::string_view> token;
    for (const auto& [key, value] : metadata) {
      if (key == ":path") method = absl::string_view(value.data(), value.size());
      if (key == kJoinTokenMetadata) token = absl::string_view(value.data(), value.size());
    }
    std::vector<std::string> roles;
    if (authorizer_->tls() && context != nullptr) roles = PeerRoles(*context);
    return authorizer_->Authorize(method, roles, token);
  }

 private:
  const std::shared_ptr<const RpcAuthorizer> authorizer_;
};

}  // namespace

const std::map<std::string, RpcRule>& CoordinatorRpcTable() {
  static const auto* table = [] {
    const RpcRule worker{{kRoleWorker}, /*join_token=*/true};
    const RpcRule operator_{{kRoleOperator}, /*join_token=*/false};
    auto* t = new std::map<std::string, RpcRule>{
        {"/baton.v1.Coordinator/Register", worker},
        {"/baton.v1.Coordinator/Session", worker},
        {"/baton.v1.Coordinator/KvSet", worker},
        {"/baton.v1.Coordinator/KvGet", worker},
        {"/baton.v1.Coordinator/KvWait", worker},
        {"/baton.v1.Coordinator/KvAdd", worker},
        {"/baton.v1.Coordinator/GetStatus", operator_},
        {"/baton.v1.Coordinator/ListWorkers", operator_},
        {"/baton.v1.Coordinator/GetTrace", operator_},
        // Health on the main port, for any member; probes use --health_listen.
        {"/grpc.health.v1.Health/Check", {{kRoleWorker, kRoleOperator}, false}},
        {"/grpc.health.v1.Health/Watch", {{kRoleWorker, kRoleOperator}, false}},
        // Served only with --reflection.
        {"/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", operator_},
    };
    return t;
  }();
  return *table;
}

RpcAuthorizer::RpcAuthorizer(Options options) : options_(std::move(options)) {}

grpc::Status RpcAuthorizer::Refuse(absl::string_view method, const char* reason, grpc::Status status) const {
  if (options_.on_refused) options_.on_refused(Clip(method), reason);
  BATON_LOG(WARNING) << "refused " << Clip(method) << ": " << status.error_message();
  return status;
}

grpc::Status RpcAuthorizer::Authorize(absl::string_view method, const std::vector<std::string>& roles,
                                      std::optional<absl::string_view> token) const {
  auto rule = options_.table.find(std::string(method));
  if (rule == options_.table.end()) {
    return Refuse(method, "unknown_method",
                  grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                               absl::StrCat("'", Clip(method),
                                            "' is not in the coordinator's authorization table: refused "
                                            "(coordinator/grpc/rpc_authorization.cc)")));
  }
  if (options_.tls) {
    const auto allowed = [&](const std::string& role) {
      return std::find(rule->second.roles.begin(), rule->second.roles.end(), role) != rule->second.roles.end();
    };
    if (std::none_of(roles.begin(), roles.end(), allowed)) {
      std::vector<std::string> needed;
      for (const std::string& r : rule->second.roles) needed.push_back(absl::StrCat("'", r, "'"));
      return Refuse(
          method, "role",
          grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                       absl::StrCat(method, " needs a client certificate with role ", absl::StrJoin(needed, " or "),
                                    " (URI SAN ", kRoleUriPrefix, rule->second.roles.front(), "); this one has ",
                                    roles.empty() ? "no baton role" : absl::StrCat("role ", roles.front()),
                                    " (docs/security.md)")));
    }
  }
  if (rule->second.join_token && !options_.join_token.empty()) {
    if (!token.has_value()) {
      return Refuse(method, "token",
                    grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                                 absl::StrCat(method, ": no join token; start the worker with --join_token_file "
                                                      "naming a file that holds the coordinator's token")));
    }
    if (!ConstantTimeEquals(*token, options_.join_token)) {
      return Refuse(method, "token",
                    grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                                 absl::StrCat(method, ": wrong join token; the worker's --join_token_file must "
                                                      "hold the same token as the coordinator's")));
    }
  }
  return grpc::Status::OK;
}

std::shared_ptr<grpc::AuthMetadataProcessor> MakeAuthorizationProcessor(
    std::shared_ptr<const RpcAuthorizer> authorizer) {
  return std::make_shared<AuthorizationProcessor>(std::move(authorizer));
}

std::shared_ptr<grpc::ServerCredentials> MakeAuthorizedServerCredentials(
    const TlsConfig& tls, bool insecure, std::shared_ptr<const RpcAuthorizer> authorizer, bool* authorized) {
  std::shared_ptr<grpc::ServerCredentials> creds;
  if (tls.enabled) {
    creds = MakeServerCredentials(tls);
  } else if (!insecure) {
    creds = grpc::experimental::LocalServerCredentials(LOCAL_TCP);
  } else {
    *authorized = false;
    return grpc::InsecureServerCredentials();
  }
  creds->SetAuthMetadataProcessor(MakeAuthorizationProcessor(std::move(authorizer)));
  *authorized = true;
  return creds;
}

}  // namespace baton
