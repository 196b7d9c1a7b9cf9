// The authenticated control plane with real certificates (made at test time
// by gen_certs.sh with the openssl CLI), a real coordinator and real workers
// on loopback: who is refused, with which status, and a whole TLS job.
#include <fstream>
#include <memory>
#include <regex>

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "baton/v1/coordinator.grpc.pb.h"
#include "common/file_io.h"
#include "common/http_get.h"
#include "gtest/gtest.h"
#include "tests/testing/process.h"

namespace baton {
namespace {

using testing::ReadPortFile;
using testing::RunCommand;
using testing::RunfilePath;
using testing::Subprocess;
using testing::TempDir;

std::string Read(const std::string& path) {
  auto s = ReadFile(path);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *s : "";
}

class TlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = TempDir(::testing::UnitTest::GetInstance()->current_test_info()->name());
    certs_ = dir_ + "/certs";
    auto r = RunCommand("/bin/bash", {RunfilePath("tests/security/gen_certs.sh"), certs_}, absl::Seconds(60));
    ASSERT_EQ(r.exit_code, 0) << "gen_certs.sh (needs the openssl CLI: scripts/setup.sh):\n" << r.output;
  }

  std::vector<std::string> TlsFlags(const std::string& who, const std::string& ca = "ca") {
    return {"--tls_cert=" + certs_ + "/" + who + ".pem", "--tls_key=" + certs_ + "/" + who + ".key",
            "--tls_ca=" + certs_ + "/" + ca + ".pem"};
  }

  void StartCoordinator(std::vector<std::string> extra, const std::string& cert = "coordinator") {
    const std::string port_file = dir_ + "/coordinator.json";
    std::vector<std::string> flags = {"--listen=127.0.0.1:0", "--http_listen=127.0.0.1:0",
                                      "--port_file=" + port_file, "--join_token_file=" + certs_ + "/token",
                                      "--lease_ms=1500", "--heartbeat_ms=250"};
    for (auto& f : TlsFlags(cert)) flags.push_back(f);
    for (auto& f : extra) flags.push_back(f);
    coordinator_ = std::make_unique<Subprocess>(RunfilePath("coordinator/baton-coordinator"), flags,
                                                dir_ + "/coordinator.log");
    ASSERT_TRUE(coordinator_->Start().ok());
    auto ports = ReadPortFile(port_file, absl::Seconds(10));
    ASSERT_TRUE(ports.ok()) << coordinator_->Log();
    target_ = absl::StrCat("127.0.0.1:", ports->first);
    http_port_ = ports->second;
  }

  // A worker daemon with the given certificate and token file.
  Subprocess* StartWorker(const std::string& name, const std::string& cert, const std::string& token,
                          const std::string& ca = "ca") {
    std::vector<std::string> flags = {"--coordinator=" + target_, "--name=" + name,
                                      "--port_file=" + dir_ + "/" + name + ".json", "--output_dir=" + dir_};
    for (auto& f : TlsFlags(cert, ca)) flags.push_back(f);
    if (!token.empty()) flags.push_back("--join_token_file=" + certs_ + "/" + token);
    workers_.push_back(std::make_unique<Subprocess>(RunfilePath("worker/baton-worker"), flags,
                                                    dir_ + "/" + name + ".log"));
    EXPECT_TRUE(workers_.back()->Start().ok());
    return workers_.back().get();
  }

  std::shared_ptr<grpc::ChannelCredentials> Creds(const std::string& who, const std::string& ca = "ca") {
    grpc::SslCredentialsOptions o;
    o.pem_root_certs = Read(certs_ + "/" + ca + ".pem");
    if (!who.empty()) {
      o.pem_cert_chain = Read(certs_ + "/" + who + ".pem");
      o.pem_private_key = Read(certs_ + "/" + who + ".key");
    }
    return grpc::SslCredentials(o);
  }

  grpc::Status GetStatus(std::shared_ptr<grpc::ChannelCredentials> creds, v1::GetStatusResponse* resp = nullptr) {
    auto stub = v1::Coordinator::NewStub(grpc::CreateChannel(target_, creds));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::GetStatusResponse ignored;
    return stub->GetStatus(&ctx, {}, resp ? resp : &ignored);
  }

  grpc::Status Register(std::shared_ptr<grpc::ChannelCredentials> creds, const std::string& token_file,
                        const std::string& name = "intruder") {
    auto stub = v1::Coordinator::NewStub(grpc::CreateChannel(target_, creds));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    if (!token_file.empty()) {
      std::string token = Read(certs_ + "/" + token_file);
      ctx.AddMetadata("baton-join-token", token.substr(0, token.find('\n')));
    }
    v1::RegisterRequest req;
    req.set_name(name);
    req.set_device("cpu");
    v1::RegisterResponse resp;
    return stub->Register(&ctx, req, &resp);
  }

  int WorkerCount() {
    v1::GetStatusResponse status;
    EXPECT_TRUE(GetStatus(Creds("operator"), &status).ok());
    return status.workers_size();
  }

  std::string dir_, certs_, target_;
  int http_port_ = 0;
  std::unique_ptr<Subprocess> coordinator_;
  std::vector<std::unique_ptr<Subprocess>> workers_;
};

TEST_F(TlsTest, EveryoneWithoutTheRightCertificateRoleOrTokenIsRefused) {
  StartCoordinator({});
  // The right operator certificate works.
  ASSERT_TRUE(GetStatus(Creds("operator")).ok()) << coordinator_->Log();

  // Transport: no TLS at all, TLS without a client certificate, a client
  // certificate from another CA, an expired one. The handshake fails.
  struct Case {
    const char* what;
    std::shared_ptr<grpc::ChannelCredentials> creds;
  };
  for (const Case& c : std::vector<Case>{{"plaintext", grpc::InsecureChannelCredentials()},
                                          {"no client certificate", Creds("")},
                                          {"another CA", Creds("other_worker")},
                                          {"expired", Creds("expired")}}) {
    grpc::Status s = GetStatus(c.creds);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << c.what << ": " << s.error_message();
    s = Register(c.creds, "token");
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << c.what << ": " << s.error_message();
  }

  // Roles: a worker certificate may not read status; an operator or a
  // role-less certificate may not register.
  grpc::Status s = GetStatus(Creds("worker"));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  EXPECT_NE(s.error_message().find("role 'operator'"), std::string::npos) << s.error_message();
  s = Register(Creds("operator"), "token");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  EXPECT_NE(s.error_message().find("role 'worker'"), std::string::npos) << s.error_message();
  s = Register(Creds("norole"), "token");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  EXPECT_NE(s.error_message().find("no baton role"), std::string::npos) << s.error_message();

  // Join token: a valid worker certificate alone is not enough.
  s = Register(Creds("worker"), "");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
  EXPECT_NE(s.error_message().find("--join_token_file"), std::string::npos) << s.error_message();
  s = Register(Creds("worker"), "wrong_token");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
  EXPECT_NE(s.error_message().find("wrong join token"), std::string::npos) << s.error_message();
  EXPECT_EQ(WorkerCount(), 0) << "a refused caller was registered";
  EXPECT_TRUE(Register(Creds("worker"), "token", "rightful").ok());
  EXPECT_EQ(WorkerCount(), 1);

  // The refusals are counted.
  auto metrics = HttpGet("127.0.0.1", http_port_, "/metrics");
  ASSERT_TRUE(metrics.ok());
  EXPECT_NE(metrics->body.find("baton_rpc_refused_total{reason=\"role\"} 3"), std::string::npos) << metrics->body;
  EXPECT_NE(metrics->body.find("baton_rpc_refused_total{reason=\"token\"} 2"), std::string::npos) << metrics->body;
  EXPECT_NE(metrics->body.find("baton_tls 1"), std::string::npos) << metrics->body;

  // batonctl: an operator certificate works; a worker's is refused by name.
  const std::string ctl = RunfilePath("cli/batonctl");
  std::vector<std::string> args = {"status", "--coordinator=" + target_, "--timeout_ms=3000"};
  for (auto& f : TlsFlags("operator")) args.push_back(f);
  auto ok = RunCommand(ctl, args);
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_TRUE(std::regex_search(ok.output, std::regex("rightful +joining"))) << ok.output;
  args = {"status", "--coordinator=" + target_, "--timeout_ms=3000"};
  for (auto& f : TlsFlags("worker")) args.push_back(f);
  auto refused = RunCommand(ctl, args);
  EXPECT_EQ(refused.exit_code, 1) << refused.output;
  EXPECT_NE(refused.output.find("refused"), std::string::npos) << refused.output;
  auto plain = RunCommand(ctl, {"status", "--coordinator=" + target_, "--timeout_ms=1000"});
  EXPECT_EQ(plain.exit_code, 1) << plain.output;
}

TEST_F(TlsTest, EachRpcIsCheckedAgainstTheTableByRoleAndMethod) {
  StartCoordinator({});
  auto channel = [&](const std::string& who) { return grpc::CreateChannel(target_, Creds(who)); };
  auto deadline = [](grpc::ClientContext* ctx) {
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  };
  // A worker certificate (with the token) calling operator RPCs.
  auto worker = v1::Coordinator::NewStub(channel("worker"));
  {
    grpc::ClientContext ctx;
    deadline(&ctx);
    v1::ListWorkersResponse resp;
    grpc::Status s = worker->ListWorkers(&ctx, {}, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
    EXPECT_NE(s.error_message().find("/baton.v1.Coordinator/ListWorkers needs a client certificate with role "
                                     "'operator'"),
              std::string::npos)
        << s.error_message();
    EXPECT_NE(s.error_message().find("this one has role worker"), std::string::npos) << s.error_message();
  }
  {
    grpc::ClientContext ctx;
    deadline(&ctx);
    v1::GetTraceRequest req;
    req.set_steps(1);
    v1::GetTraceResponse resp;
    grpc::Status s = worker->GetTrace(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
    EXPECT_NE(s.error_message().find("/baton.v1.Coordinator/GetTrace needs a client certificate with role 'operator'"),
              std::string::npos)
        << s.error_message();
  }
  // An operator certificate calling worker RPCs: Register (with the right
  // token, so only the role is wrong), the KV and the Session stream.
  grpc::Status s = Register(Creds("operator"), "token");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  EXPECT_NE(s.error_message().find("/baton.v1.Coordinator/Register needs a client certificate with role 'worker'"),
            std::string::npos)
      << s.error_message();
  EXPECT_NE(s.error_message().find("this one has role operator"), std::string::npos) << s.error_message();
  auto op = v1::Coordinator::NewStub(channel("operator"));
  {
    grpc::ClientContext ctx;
    deadline(&ctx);
    v1::KvGetRequest req;
    req.mutable_key()->set_job("j");
    req.mutable_key()->set_key("k");
    v1::KvGetResponse resp;
    s = op->KvGet(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
    EXPECT_NE(s.error_message().find("/baton.v1.Coordinator/KvGet needs"), std::string::npos) << s.error_message();
  }
  {
    grpc::ClientContext ctx;
    deadline(&ctx);
    auto stream = op->Session(&ctx);
    v1::CoordinatorMessage msg;
    EXPECT_FALSE(stream->Read(&msg));
    s = stream->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
    EXPECT_NE(s.error_message().find("/baton.v1.Coordinator/Session needs"), std::string::npos) << s.error_message();
  }
  // Deny by default: a method nobody listed, even for a valid operator.
  {
    grpc::GenericStub generic(channel("operator"));
    grpc::ClientContext ctx;
    deadline(&ctx);
    grpc::Slice empty("");
    grpc::ByteBuffer request(&empty, 1), response;
    grpc::Status status;
    absl::Notification done;
    generic.UnaryCall(&ctx, "/baton.v1.Coordinator/DropJob", grpc::StubOptions(), &request, &response,
                      [&](grpc::Status st) {
                        status = st;
                        done.Notify();
                      });
    done.WaitForNotification();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << status.error_message();
    EXPECT_NE(status.error_message().find("not in the coordinator's authorization table"), std::string::npos)
        << status.error_message();
  }
  EXPECT_EQ(WorkerCount(), 0) << "a refused caller was registered";
  auto metrics = HttpGet("127.0.0.1", http_port_, "/metrics");
  ASSERT_TRUE(metrics.ok());
  EXPECT_NE(metrics->body.find("baton_rpc_refused_total{reason=\"role\"} 5"), std::string::npos) << metrics->body;
  EXPECT_NE(metrics->body.find("baton_rpc_refused_total{reason=\"unknown_method\"} 1"), std::string::npos)
      << metrics->body;
  EXPECT_NE(metrics->body.find("baton_registrations_total{result=\"unauthorized\"} 1"), std::string::npos)
      << metrics->body;
}

TEST_F(TlsTest, WorkersJoinOnlyWithTokenAndVerifyTheCoordinator) {
  StartCoordinator({});
  StartWorker("good", "worker", "token");
  Subprocess* no_token = StartWorker("notoken", "worker", "");
  StartWorker("badtoken", "worker", "wrong_token");
  const absl::Time deadline = absl::Now() + absl::Seconds(15);
  std::string table;
  while (absl::Now() < deadline) {
    v1::GetStatusResponse status;
    if (GetStatus(Creds("operator"), &status).ok() && status.workers_size() == 1 &&
        status.workers(0).state() == v1::READY) {
      EXPECT_EQ(status.workers(0).name(), "good");
      break;
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
  absl::SleepFor(absl::Seconds(1));  // the refused ones have retried by now
  v1::GetStatusResponse status;
  ASSERT_TRUE(GetStatus(Creds("operator"), &status).ok());
  ASSERT_EQ(status.workers_size(), 1) << status.DebugString() << coordinator_->Log();
  EXPECT_EQ(status.workers(0).name(), "good");
  EXPECT_EQ(status.workers(0).state(), v1::READY);
  // The refused workers keep running, not ready, and say why.
  auto ports = ReadPortFile(dir_ + "/notoken.json", absl::Seconds(5));
  ASSERT_TRUE(ports.ok());
  auto ready = HttpGet("127.0.0.1", ports->second, "/readyz");
  ASSERT_TRUE(ready.ok());
  EXPECT_EQ(ready->code, 503);
  EXPECT_NE(ready->body.find("no join token"), std::string::npos) << ready->body;
  EXPECT_FALSE(no_token->Wait(absl::ZeroDuration()).has_value());

  // A coordinator whose certificate another CA signed is not trusted.
  Subprocess* fooled = StartWorker("fooled", "worker", "token", "other_ca");
  ports = ReadPortFile(dir_ + "/fooled.json", absl::Seconds(5));
  ASSERT_TRUE(ports.ok()) << fooled->Log();
  absl::SleepFor(absl::Seconds(1));
  ready = HttpGet("127.0.0.1", ports->second, "/readyz");
  ASSERT_TRUE(ready.ok());
  EXPECT_EQ(ready->code, 503) << ready->body;
  EXPECT_NE(ready->body.find("unreachable"), std::string::npos) << ready->body;
  ASSERT_TRUE(GetStatus(Creds("operator"), &status).ok());
  EXPECT_EQ(status.workers_size(), 1);
}

TEST_F(TlsTest, AWorkerCertificateCannotPoseAsTheCoordinator) {
  // The CA signed it and it names 127.0.0.1, but its role is worker.
  StartCoordinator({}, "impostor");
  Subprocess* w = StartWorker("victim", "worker", "token");
  auto ports = ReadPortFile(dir_ + "/victim.json", absl::Seconds(5));
  ASSERT_TRUE(ports.ok()) << w->Log();
  absl::SleepFor(absl::Seconds(2));
  auto ready = HttpGet("127.0.0.1", ports->second, "/readyz");
  ASSERT_TRUE(ready.ok());
  EXPECT_EQ(ready->code, 503) << ready->body;
  EXPECT_NE(ready->body.find("unreachable"), std::string::npos) << ready->body;
  // Nothing reached the impostor: it has no workers (an operator that checks
  // only the CA would see one).
  grpc::SslCredentialsOptions o;
  o.pem_root_certs = Read(certs_ + "/ca.pem");
  o.pem_cert_chain = Read(certs_ + "/operator.pem");
  o.pem_private_key = Read(certs_ + "/operator.key");
  v1::GetStatusResponse status;
  ASSERT_TRUE(GetStatus(grpc::SslCredentials(o), &status).ok());
  EXPECT_EQ(status.workers_size(), 0) << status.DebugString();
  // batonctl, too, refuses to talk to it.
  std::vector<std::string> args = {"status", "--coordinator=" + target_, "--timeout_ms=1500"};
  for (auto& f : TlsFlags("operator")) args.push_back(f);
  auto r = RunCommand(RunfilePath("cli/batonctl"), args);
  EXPECT_EQ(r.exit_code, 1) << r.output;
}

TEST_F(TlsTest, ATrainingJobRunsEndToEndOverMutualTls) {
  const std::string job = dir_ + "/job.textproto";
  std::ofstream(job) << "name: \"tls\"\nmodel { layers: 4 d_model: 32 heads: 4 vocab: 16 seq_len: 16 }\n"
                        "parallel { pp: 2 }\nschedule { kind: \"1f1b\" microbatches: 4 }\n"
                        "train { steps: 5 micro_batch_size: 2 lr: 0.003 seed: 7 }\n"
                        "data { synthetic { task: \"addition\" } }\n";
  StartCoordinator({"--job=" + job, "--out=" + dir_ + "/out"});
  StartWorker("w0", "worker", "token");
  StartWorker("w1", "worker", "token");
  const absl::Time deadline = absl::Now() + absl::Seconds(120);
  v1::GetStatusResponse status;
  while (absl::Now() < deadline) {
    if (GetStatus(Creds("operator"), &status).ok() &&
        (status.job_state() == "done" || status.job_state() == "failed")) {
      break;
    }
    absl::SleepFor(absl::Milliseconds(200));
  }
  ASSERT_EQ(status.job_state(), "done") << status.DebugString() << coordinator_->Log() << workers_[0]->Log();
  EXPECT_EQ(status.step(), 5);
  std::vector<std::string> args = {"status", "--coordinator=" + target_};
  for (auto& f : TlsFlags("operator")) args.push_back(f);
  auto table = RunCommand(RunfilePath("cli/batonctl"), args);
  EXPECT_EQ(table.exit_code, 0) << table.output;
  EXPECT_NE(table.output.find("job tls (done)"), std::string::npos) << table.output;
  EXPECT_TRUE(std::regex_search(table.output, std::regex("w1 +ready"))) << table.output;
  EXPECT_TRUE(ReadFile(dir_ + "/out/summary.json").ok());
}

TEST_F(TlsTest, PlaintextBeyondLoopbackNeedsInsecureAndIsFlagged) {
  const std::string coordinator = RunfilePath("coordinator/baton-coordinator");
  auto r = RunCommand(coordinator, {"--listen=0.0.0.0:0"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--insecure"), std::string::npos) << r.output;
  r = RunCommand(coordinator, {"--listen=127.0.0.1:0", "--tls_cert=" + certs_ + "/coordinator.pem"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("go together"), std::string::npos) << r.output;
  r = RunCommand(coordinator, {"--listen=127.0.0.1:0", "--join_token_file=/nonexistent"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  const std::string worker = RunfilePath("worker/baton-worker");
  r = RunCommand(worker, {"--coordinator=10.1.2.3:7070"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--coordinator"), std::string::npos) << r.output;
  r = RunCommand(RunfilePath("cli/batonctl"), {"status", "--coordinator=10.1.2.3:7070"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--insecure"), std::string::npos) << r.output;

  // With --insecure it serves, says so loudly, and the metric is 1.
  Subprocess c(coordinator, {"--listen=0.0.0.0:0", "--insecure", "--port_file=" + dir_ + "/insecure.json"},
               dir_ + "/insecure.log");
  ASSERT_TRUE(c.Start().ok());
  auto ports = ReadPortFile(dir_ + "/insecure.json", absl::Seconds(10));
  ASSERT_TRUE(ports.ok()) << c.Log();
  auto metrics = HttpGet("127.0.0.1", ports->second, "/metrics");
  ASSERT_TRUE(metrics.ok());
  EXPECT_NE(metrics->body.find("baton_insecure 1"), std::string::npos) << metrics->body;
  EXPECT_NE(c.Log().find("INSECURE"), std::string::npos) << c.Log();
}

}  // namespace
}  // namespace baton
