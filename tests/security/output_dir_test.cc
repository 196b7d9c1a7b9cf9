// Workers write only under their --output_dir: a real coordinator whose
// --out leads outside it (through a symlink) gets its save refused, the job
// fails naming the path and the flag, nothing is written there, and the
// workers stay up. With the output under --output_dir the same job saves.
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <memory>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "baton/v1/coordinator.grpc.pb.h"
#include "common/file_io.h"
#include "common/http_get.h"
#include "gtest/gtest.h"
#include "tests/testing/process.h"

namespace baton {
namespace {

using testing::ReadPortFile;
using testing::RunfilePath;
using testing::Subprocess;
using testing::TempDir;

// Files in `dir` whose name ends with ".safetensors" (0 when it does not exist).
int Shards(const std::string& dir) {
  int n = 0;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) {
      const std::string name = e->d_name;
      n += name.size() > 12 && name.compare(name.size() - 12, 12, ".safetensors") == 0;
    }
    closedir(d);
  }
  return n;
}

class OutputDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = TempDir(::testing::UnitTest::GetInstance()->current_test_info()->name());
    allowed_ = dir_ + "/allowed";
    ASSERT_EQ(mkdir(allowed_.c_str(), 0755), 0);
    ASSERT_EQ(mkdir((dir_ + "/elsewhere").c_str(), 0755), 0);
    // Inside --output_dir by name, outside it in fact.
    ASSERT_EQ(symlink((dir_ + "/elsewhere").c_str(), (allowed_ + "/escape").c_str()), 0);
    job_ = dir_ + "/job.textproto";
    std::ofstream(job_) << "name: \"confined\" model { layers: 2 synthetic { forward_ms: 1 activation_bytes: 64 } } "
                           "parallel { pp: 2 } schedule { kind: \"1f1b\" microbatches: 2 } "
                           "train { steps: 2 micro_batch_size: 1 lr: 0.001 }\n";
  }

  // Runs the job with the coordinator's --out at `out`; returns the final status.
  v1::GetStatusResponse Run(const std::string& out) {
    coordinator_ = std::make_unique<Subprocess>(
        RunfilePath("coordinator/baton-coordinator"),
        std::vector<std::string>{"--listen=127.0.0.1:0", "--http_listen=127.0.0.1:0",
                                 "--port_file=" + dir_ + "/c.json", "--job=" + job_, "--out=" + out},
        dir_ + "/coordinator.log");
    EXPECT_TRUE(coordinator_->Start().ok());
    auto ports = ReadPortFile(dir_ + "/c.json", absl::Seconds(10));
    EXPECT_TRUE(ports.ok()) << coordinator_->Log();
    if (!ports.ok()) return {};
    const std::string target = absl::StrCat("127.0.0.1:", ports->first);
    for (int i = 0; i < 2; ++i) {
      const std::string name = absl::StrCat("w", i);
      workers_.push_back(std::make_unique<Subprocess>(
          RunfilePath("worker/baton-worker"),
          std::vector<std::string>{"--coordinator=" + target, "--name=" + name, "--output_dir=" + allowed_,
                                   "--port_file=" + dir_ + "/" + name + ".json"},
          dir_ + "/" + name + ".log"));
      EXPECT_TRUE(workers_.back()->Start().ok());
    }
    auto stub = v1::Coordinator::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
    const absl::Time deadline = absl::Now() + absl::Seconds(120);
    v1::GetStatusResponse status;
    while (absl::Now() < deadline) {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
      status.Clear();
      if (stub->GetStatus(&ctx, {}, &status).ok() && (status.job_state() == "done" || status.job_state() == "failed")) {
        break;
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
    return status;
  }

  std::string dir_, allowed_, job_;
  std::unique_ptr<Subprocess> coordinator_;
  std::vector<std::unique_ptr<Subprocess>> workers_;
};

TEST_F(OutputDirTest, ASaveOutsideTheOutputDirFailsTheJobAndTheWorkerStaysUp) {
  v1::GetStatusResponse status = Run(allowed_ + "/escape/out");
  ASSERT_EQ(status.job_state(), "failed") << status.DebugString() << coordinator_->Log();
  // The error names the path, where it resolves to, and the flag.
  EXPECT_NE(status.job_error().find(allowed_ + "/escape/out/final"), std::string::npos) << status.job_error();
  EXPECT_NE(status.job_error().find(dir_ + "/elsewhere/out/final"), std::string::npos) << status.job_error();
  EXPECT_NE(status.job_error().find("outside this worker's --output_dir="), std::string::npos) << status.job_error();
  // Nothing was written there (the coordinator made the directory; no shard is in it).
  EXPECT_EQ(Shards(dir_ + "/elsewhere/out/final"), 0);
  EXPECT_NE(workers_[0]->Log().find("refused to save"), std::string::npos) << workers_[0]->Log();
  // The daemons are still up and healthy.
  for (auto& w : workers_) {
    EXPECT_FALSE(w->Wait(absl::ZeroDuration()).has_value()) << w->Log();
  }
  auto ports = ReadPortFile(dir_ + "/w0.json", absl::Seconds(5));
  ASSERT_TRUE(ports.ok());
  auto health = HttpGet("127.0.0.1", ports->second, "/healthz");
  ASSERT_TRUE(health.ok());
  EXPECT_EQ(health->code, 200);
}

TEST_F(OutputDirTest, ASaveUnderTheOutputDirIsWritten) {
  v1::GetStatusResponse status = Run(allowed_ + "/out");
  ASSERT_EQ(status.job_state(), "done") << status.DebugString() << coordinator_->Log() << workers_[0]->Log();
  EXPECT_TRUE(ReadFile(allowed_ + "/out/summary.json").ok());
  EXPECT_EQ(Shards(allowed_ + "/out/final"), 2);  // one per stage
}

}  // namespace
}  // namespace baton
