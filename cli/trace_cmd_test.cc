#include "cli/trace_cmd.h"

#include <grpcpp/grpcpp.h>

#include <cstdlib>
#include <memory>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "baton/v1/coordinator.grpc.pb.h"
#include "common/file_io.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace baton::cli {
namespace {

using ::testing::HasSubstr;

// Serves a fixed trace, or refuses when asked for more steps than it has.
class FakeTraceCoordinator final : public v1::Coordinator::Service {
 public:
  grpc::Status GetTrace(grpc::ServerContext*, const v1::GetTraceRequest* req, v1::GetTraceResponse* resp) override {
    if (req->steps() > 2) return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "only 2 traced steps kept");
    resp->set_chrome_trace_json(absl::StrCat("{\"traceEvents\":[], \"steps\": ", req->steps(), "}"));
    return grpc::Status::OK;
  }
};

class TraceCommandTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(port_, 0);
    const char* tmp = std::getenv("TEST_TMPDIR");
    path_ = absl::StrCat(tmp ? tmp : "/tmp", "/trace.json");
  }
  void TearDown() override { server_->Shutdown(); }

  int RunTrace(const std::vector<std::string>& args) {
    out_.str("");
    err_.str("");
    return RunTraceCommand(args, out_, err_);
  }
  std::string Target() const { return absl::StrCat("127.0.0.1:", port_); }

  FakeTraceCoordinator service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::string path_;
  std::ostringstream out_, err_;
};

TEST_F(TraceCommandTest, WritesTheCoordinatorsTrace) {
  ASSERT_EQ(RunTrace({"--coordinator", Target(), "--steps=2", "--out=" + path_}), 0) << err_.str();
  EXPECT_EQ(*ReadFile(path_), "{\"traceEvents\":[], \"steps\": 2}");
  EXPECT_THAT(out_.str(), HasSubstr("ui.perfetto.dev"));
}

TEST_F(TraceCommandTest, RefusalAndUnreachableCoordinatorExitOne) {
  EXPECT_EQ(RunTrace({"--coordinator=" + Target(), "--steps=5", "--out=" + path_}), 1);
  EXPECT_THAT(err_.str(), HasSubstr("only 2 traced steps kept"));
  EXPECT_EQ(RunTrace({"--coordinator=127.0.0.1:1", "--out=" + path_, "--timeout_ms=300"}), 1);
  EXPECT_THAT(err_.str(), HasSubstr("cannot reach the coordinator at 127.0.0.1:1"));
  EXPECT_EQ(RunTrace({"--coordinator=" + Target(), "--out=/nonexistent/dir/t.json"}), 1);
}

TEST_F(TraceCommandTest, BadFlagsExitTwo) {
  EXPECT_EQ(RunTrace({"--coordinator=" + Target()}), 2);  // no --out
  EXPECT_EQ(RunTrace({"--out=" + path_}), 2);             // no --coordinator
  EXPECT_EQ(RunTrace({"--coordinator=" + Target(), "--out=" + path_, "--steps=0"}), 2);
  EXPECT_EQ(RunTrace({"--coordinator=" + Target(), "--out=" + path_, "--step=1"}), 2);
}

}  // namespace
}  // namespace baton::cli
