// A worker started with --device=cuda:0 on a machine whose CUDA runtime
// cannot reach a driver (CI and development machines: the toolkit is
// installed, no driver) must fail the job's Configure with an error that
// names the cause — the message of cudaGetDeviceCount — which the coordinator
// reports as the job error, and must stay up: still registered, still
// healthy, without having loaded cuBLAS. Real coordinator and worker
// processes on loopback.
//
// On a machine where CUDA works this test fails (it asserts the driver is
// missing), so it carries the tag `no_gpu` and CI runs it; a GPU machine runs
// `--test_tag_filters=gpu` instead.
#include <signal.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "baton/v1/coordinator.grpc.pb.h"
#include "common/http_get.h"
#include "gtest/gtest.h"
#include "tests/testing/process.h"

namespace baton {
namespace {

using testing::ReadPortFile;
using testing::RunfilePath;
using testing::Subprocess;
using testing::TempDir;

// What the worker names as the cause: CUDA's own message where the build links
// CUDA; otherwise that the build has none.
#ifdef BATON_WITH_CUDA
constexpr char kCause[] = "cudaGetDeviceCount failed";
#else
constexpr char kCause[] = "this build of baton has no CUDA support";
#endif

TEST(NoDriverTest, CudaWorkerFailsConfigureWithTheCauseAndStaysUp) {
  const std::string dir = TempDir("no_driver");
  const std::string job_file = dir + "/job.textproto";
  std::ofstream(job_file) << R"pb(
    name: "nodriver"
    model { layers: 2 d_model: 16 heads: 2 vocab: 16 seq_len: 20 }
    parallel { pp: 1 tp: 1 dp: 1 }
    schedule { kind: "1f1b" microbatches: 2 }
    train { steps: 3 micro_batch_size: 1 lr: 0.001 seed: 1 }
    data { synthetic { task: "addition" } }
  )pb";

  Subprocess coordinator(RunfilePath("coordinator/baton-coordinator"),
                         {"--listen=127.0.0.1:0", "--http_listen=127.0.0.1:0",
                          "--port_file=" + dir + "/coordinator.json", "--job=" + job_file,
                          "--lease_ms=3000", "--heartbeat_ms=250"},
                         dir + "/coordinator.log");
  ASSERT_TRUE(coordinator.Start().ok());
  auto cports = ReadPortFile(dir + "/coordinator.json", absl::Seconds(20));
  ASSERT_TRUE(cports.ok()) << coordinator.Log();

  Subprocess worker(RunfilePath("worker/baton-worker"),
                    {absl::StrCat("--coordinator=127.0.0.1:", cports->first), "--name=w0",
                     "--device=cuda:0", "--port_file=" + dir + "/w0.json"},
                    dir + "/w0.log");
  ASSERT_TRUE(worker.Start().ok());
  auto wports = ReadPortFile(dir + "/w0.json", absl::Seconds(20));
  ASSERT_TRUE(wports.ok()) << worker.Log();

  auto stub = v1::Coordinator::NewStub(grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", cports->first), grpc::InsecureChannelCredentials()));
  v1::GetStatusResponse status;
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (absl::Now() < deadline) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    status.Clear();
    if (stub->GetStatus(&ctx, {}, &status).ok() &&
        absl::StrContains(status.job_error(), kCause)) {
      break;
    }
    absl::SleepFor(absl::Milliseconds(200));
  }
  std::printf("coordinator job error: %s\n", status.job_error().c_str());
  // The coordinator's job error names the worker, the flag and CUDA's cause.
  EXPECT_TRUE(absl::StrContains(status.job_error(), kCause))
      << status.job_error() << "\ncoordinator log:\n" << coordinator.Log() << "\nworker log:\n"
      << worker.Log();
  EXPECT_TRUE(absl::StrContains(status.job_error(), "w0")) << status.job_error();
  EXPECT_TRUE(absl::StrContains(status.job_error(), "--device=cuda:0: cuda:0 is unavailable"))
      << status.job_error();
  // The worker log has the status code.
  EXPECT_TRUE(absl::StrContains(worker.Log(), "UNAVAILABLE")) << worker.Log();

  // The daemon stays up: alive, registered and healthy a while later.
  absl::SleepFor(absl::Seconds(1));
  EXPECT_FALSE(worker.Wait(absl::ZeroDuration()).has_value()) << worker.Log();
  auto healthz = HttpGet("127.0.0.1", wports->second, "/healthz", absl::Seconds(5));
  ASSERT_TRUE(healthz.ok()) << healthz.status();
  EXPECT_EQ(healthz->code, 200) << healthz->body;
  grpc::ClientContext ctx;
  v1::ListWorkersResponse workers;
  ASSERT_TRUE(stub->ListWorkers(&ctx, {}, &workers).ok());
  ASSERT_EQ(workers.workers_size(), 1);
  EXPECT_EQ(workers.workers(0).name(), "w0");
  EXPECT_EQ(workers.workers(0).device(), "cuda:0");
  EXPECT_NE(workers.workers(0).state(), v1::LOST);
  // Its GPU could not be asked: memory unknown (the planner's check skips
  // it), no UUID; never the host's RAM passed off as the GPU's memory.
  EXPECT_EQ(workers.workers(0).memory_bytes(), 0);
  EXPECT_EQ(workers.workers(0).device_uuid(), "");
  // Nor fused attention: without a driver the probe says no (and loads no
  // cuDNN, below), so the memory estimate keeps counting P.
  EXPECT_FALSE(workers.workers(0).fused_attention_bf16());
  EXPECT_TRUE(absl::StrContains(worker.Log(), "registering its memory as unknown")) << worker.Log();

  // cuBLASLt is opened by the first GEMM handle, never at start or by a job
  // that failed before it computed: loading it costs ~150 MB per process.
  std::ifstream maps(absl::StrCat("/proc/", worker.pid(), "/maps"));
  ASSERT_TRUE(maps.good());
  std::string line;
  while (std::getline(maps, line)) {
    EXPECT_FALSE(absl::StrContains(line, "libcublas")) << "the worker mapped cuBLAS: " << line;
    EXPECT_FALSE(absl::StrContains(line, "libcudnn.so")) << "the worker mapped cuDNN: " << line;
  }

  worker.Signal(SIGTERM);
  EXPECT_EQ(worker.Wait(absl::Seconds(20)), 0) << worker.Log();
  coordinator.Signal(SIGTERM);
  coordinator.Wait(absl::Seconds(20));
}

}  // namespace
}  // namespace baton
