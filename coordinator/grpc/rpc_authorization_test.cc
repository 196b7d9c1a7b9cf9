// The authorization table and its enforcement: the decision as a unit, and
// a real server on a loopback port (the processor runs in the transport,
// which an in-process channel bypasses) with the real CoordinatorService
// behind it, to show that a refused call never reaches a handler.
#include "coordinator/grpc/rpc_authorization.h"

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "coordinator/grpc/coordinator_service.h"
#include "gtest/gtest.h"

namespace baton {
namespace {

constexpr char kToken[] = "s3cret-token-0123456789";

bool Contains(const grpc::Status& s, const std::string& text) {
  return s.error_message().find(text) != std::string::npos;
}

TEST(RpcAuthorizerTest, RolesAreCheckedPerMethodFromTheTable) {
  std::vector<std::pair<std::string, std::string>> refused;
  RpcAuthorizer::Options options;
  options.tls = true;
  options.on_refused = [&](const std::string& method, const std::string& reason) {
    refused.emplace_back(method, reason);
  };
  RpcAuthorizer authz(options);
  const std::vector<std::string> worker = {"worker"}, op = {"operator"}, none;
  EXPECT_TRUE(authz.Authorize("/baton.v1.Coordinator/Register", worker, std::nullopt).ok());
  EXPECT_TRUE(authz.Authorize("/baton.v1.Coordinator/KvWait", worker, std::nullopt).ok());
  EXPECT_TRUE(authz.Authorize("/baton.v1.Coordinator/GetTrace", op, std::nullopt).ok());

  // A worker certificate calling an operator RPC, and the reverse: named.
  grpc::Status s = authz.Authorize("/baton.v1.Coordinator/GetTrace", worker, std::nullopt);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_TRUE(Contains(s, "/baton.v1.Coordinator/GetTrace needs a client certificate with role 'operator'"))
      << s.error_message();
  EXPECT_TRUE(Contains(s, "this one has role worker")) << s.error_message();
  s = authz.Authorize("/baton.v1.Coordinator/Register", op, std::nullopt);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_TRUE(Contains(s, "/baton.v1.Coordinator/Register needs a client certificate with role 'worker'"))
      << s.error_message();
  s = authz.Authorize("/baton.v1.Coordinator/Session", none, std::nullopt);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_TRUE(Contains(s, "no baton role")) << s.error_message();

  // Deny by default: a method the table does not list.
  s = authz.Authorize("/baton.v1.Coordinator/Shutdown", op, std::nullopt);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_TRUE(Contains(s, "not in the coordinator's authorization table")) << s.error_message();
  s = authz.Authorize("", op, std::nullopt);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);

  ASSERT_EQ(refused.size(), 5u);
  EXPECT_EQ(refused[0], std::make_pair(std::string("/baton.v1.Coordinator/GetTrace"), std::string("role")));
  EXPECT_EQ(refused[3], std::make_pair(std::string("/baton.v1.Coordinator/Shutdown"), std::string("unknown_method")));
}

TEST(RpcAuthorizerTest, EveryCoordinatorRpcHasAnEntry) {
  // Deny by default makes a forgotten entry an unreachable RPC; this names it.
  const google::protobuf::ServiceDescriptor* service =
      v1::RegisterRequest::descriptor()->file()->FindServiceByName("Coordinator");
  ASSERT_NE(service, nullptr);
  for (int i = 0; i < service->method_count(); ++i) {
    const std::string path = absl::StrCat("/", service->full_name(), "/", service->method(i)->name());
    EXPECT_EQ(CoordinatorRpcTable().count(path), 1u) << path << " has no entry in CoordinatorRpcTable()";
  }
}

// The real service behind local (loopback) credentials with the processor.
class AuthorizedServer {
 public:
  explicit AuthorizedServer(RpcAuthorizer::Options authz) : service_(&registry_, &kv_, {}) {
    bool authorized = false;
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0",
                             MakeAuthorizedServerCredentials(TlsConfig(), /*insecure=*/false,
                                                             std::make_shared<const RpcAuthorizer>(authz),
                                                             &authorized),
                             &port_);
    EXPECT_TRUE(authorized);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    channel_ = grpc::CreateChannel(absl::StrCat("127.0.0.1:", port_), grpc::InsecureChannelCredentials());
    stub_ = v1::Coordinator::NewStub(channel_);
  }
  ~AuthorizedServer() { server_->Shutdown(std::chrono::system_clock::now()); }

  static void Prepare(grpc::ClientContext* ctx, const std::string& token) {
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    if (!token.empty()) ctx->AddMetadata("baton-join-token", token);
  }

  grpc::Status Register(const std::string& name, const std::string& token) {
    grpc::ClientContext ctx;
    Prepare(&ctx, token);
    v1::RegisterRequest req;
    req.set_name(name);
    req.set_device("cpu");
    req.set_host("host-a");
    req.set_pid(1);
    v1::RegisterResponse resp;
    return stub_->Register(&ctx, req, &resp);
  }

  FakeClock clock_;
  WorkerRegistry registry_{&clock_, absl::Seconds(3)};
  KvStore kv_;
  CoordinatorService service_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
};

TEST(RpcAuthorizationServerTest, WorkerRpcsNeedTheJoinTokenAndRefusedCallsNeverRunTheirHandler) {
  RpcAuthorizer::Options options;
  options.join_token = kToken;
  AuthorizedServer s(options);
  grpc::Status none = s.Register("w1", "");
  EXPECT_EQ(none.error_code(), grpc::StatusCode::UNAUTHENTICATED) << none.error_message();
  EXPECT_TRUE(Contains(none, "/baton.v1.Coordinator/Register: no join token")) << none.error_message();
  grpc::Status wrong = s.Register("w1", "s3cret-token-0123456780");
  EXPECT_EQ(wrong.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(Contains(wrong, "wrong join token")) << wrong.error_message();
  EXPECT_TRUE(s.registry_.List().empty());  // nothing was registered
  EXPECT_TRUE(s.Register("w1", kToken).ok());
  EXPECT_EQ(s.registry_.List().size(), 1u);

  // The KV and the Session stream too: the rendezvous is for members only.
  {
    grpc::ClientContext ctx;
    AuthorizedServer::Prepare(&ctx, "");
    v1::KvSetRequest set;
    set.mutable_key()->set_job("job");
    set.mutable_key()->set_key("rank0");
    set.set_value("10.0.0.1:1234");
    v1::KvSetResponse resp;
    EXPECT_EQ(s.stub_->KvSet(&ctx, set, &resp).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  {
    grpc::ClientContext ctx;
    AuthorizedServer::Prepare(&ctx, kToken);
    v1::KvGetRequest get;
    get.mutable_key()->set_job("job");
    get.mutable_key()->set_key("rank0");
    v1::KvGetResponse resp;
    // Past the authorizer, the handler answers: the refused KvSet stored nothing.
    EXPECT_EQ(s.stub_->KvGet(&ctx, get, &resp).error_code(), grpc::StatusCode::NOT_FOUND);
  }
  {
    grpc::ClientContext ctx;
    AuthorizedServer::Prepare(&ctx, "");
    auto stream = s.stub_->Session(&ctx);
    v1::CoordinatorMessage msg;
    EXPECT_FALSE(stream->Read(&msg));
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  // Operator RPCs do not need the token (batonctl has none).
  grpc::ClientContext ctx;
  AuthorizedServer::Prepare(&ctx, "");
  v1::GetStatusResponse status;
  EXPECT_TRUE(s.stub_->GetStatus(&ctx, {}, &status).ok());
  EXPECT_EQ(status.workers_size(), 1);
}

TEST(RpcAuthorizationServerTest, AnRpcNotInTheTableIsRefusedByDefault) {
  // The production table: a method the server does not serve is refused by
  // the authorizer (PERMISSION_DENIED), not answered UNIMPLEMENTED.
  {
    AuthorizedServer s({});
    grpc::GenericStub generic(s.channel_);
    grpc::ClientContext ctx;
    AuthorizedServer::Prepare(&ctx, "");
    grpc::Slice empty("");  // an empty message
    grpc::ByteBuffer request(&empty, 1), response;
    grpc::Status status;
    absl::Notification done;
    generic.UnaryCall(&ctx, "/baton.v1.Coordinator/Shutdown", grpc::StubOptions(), &request, &response,
                      [&](grpc::Status st) {
                        status = st;
                        done.Notify();
                      });
    done.WaitForNotification();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << status.error_message();
    EXPECT_TRUE(Contains(status, "not in the coordinator's authorization table")) << status.error_message();
  }
  // A served RPC whose entry is missing from the table is refused too, and
  // its handler does not run.
  RpcAuthorizer::Options options;
  options.table.erase("/baton.v1.Coordinator/Register");
  AuthorizedServer s(options);
  grpc::Status r = s.Register("w1", "");
  EXPECT_EQ(r.error_code(), grpc::StatusCode::PERMISSION_DENIED) << r.error_message();
  EXPECT_TRUE(Contains(r, "'/baton.v1.Coordinator/Register' is not in")) << r.error_message();
  EXPECT_TRUE(s.registry_.List().empty());
  grpc::ClientContext ctx;
  AuthorizedServer::Prepare(&ctx, "");
  v1::ListWorkersResponse list;
  EXPECT_TRUE(s.stub_->ListWorkers(&ctx, {}, &list).ok());
}

TEST(RpcAuthorizationServerTest, PlaintextBeyondLoopbackIsNotAuthorized) {
  bool authorized = true;
  auto creds = MakeAuthorizedServerCredentials(TlsConfig(), /*insecure=*/true,
                                               std::make_shared<const RpcAuthorizer>(RpcAuthorizer::Options()),
                                               &authorized);
  EXPECT_NE(creds, nullptr);
  EXPECT_FALSE(authorized);
}

}  // namespace
}  // namespace baton
