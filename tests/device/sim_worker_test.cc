// The whole worker path on a device, without a GPU: two baton-worker processes
// built with the simulated device (//worker:baton-worker-sim, --device=sim:0;
// its memory aborts the process on any host access, its streams run on their
// own threads) train a 1F1B pp=2 job with a real coordinator, real gRPC and
// Gloo on loopback, a buddy snapshot after every step and the final weights
// written at the end. The same job on two --device=cpu workers of the same
// binary must give the same per-step losses and byte-identical final weight
// files; the sim workers export baton_device_memory_bytes{kind=in_use|
// reserved} and baton_host_syncs_total. The same in train.precision = bf16
// (bf16 copies of the weights on the device, bf16 pipeline messages): the
// simulated device gives the CPU's bf16 bits, which are not the fp32 ones.
#include <signal.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/http_get.h"
#include "gtest/gtest.h"
#include "tests/testing/process.h"

namespace baton {
namespace {

using testing::ReadPortFile;
using testing::RunfilePath;
using testing::Subprocess;
using testing::TempDir;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

struct JobRun {
  std::string summary, losses, metrics;
  std::map<std::string, std::string> final_files;  // name -> bytes
};

JobRun RunJob(const std::string& dir, const std::string& device, const std::string& precision = "fp32") {
  JobRun run;
  const std::string job_file = dir + "/job.textproto";
  std::ofstream(job_file) << R"pb(
    name: "simjob"
    model { layers: 4 d_model: 16 heads: 2 vocab: 16 seq_len: 20 }
    parallel { pp: 2 tp: 1 dp: 1 }
    schedule { kind: "1f1b" microbatches: 4 }
    data { synthetic { task: "addition" } }
  )pb" << "train { steps: 4 micro_batch_size: 2 lr: 0.003 seed: 3 precision: \"" << precision << "\" }\n";
  const std::string out = dir + "/out";
  Subprocess coordinator(RunfilePath("coordinator/baton-coordinator"),
                         {"--listen=127.0.0.1:0", "--http_listen=127.0.0.1:0",
                          "--port_file=" + dir + "/coordinator.json", "--job=" + job_file, "--out=" + out,
                          "--lease_ms=10000", "--heartbeat_ms=250"},
                         dir + "/coordinator.log");
  EXPECT_TRUE(coordinator.Start().ok());
  auto cports = ReadPortFile(dir + "/coordinator.json", absl::Seconds(30));
  EXPECT_TRUE(cports.ok()) << coordinator.Log();
  if (!cports.ok()) return run;
  std::vector<std::unique_ptr<Subprocess>> workers;
  for (int i = 0; i < 2; ++i) {
    workers.push_back(std::make_unique<Subprocess>(
        RunfilePath("worker/baton-worker-sim"),
        std::vector<std::string>{absl::StrCat("--coordinator=127.0.0.1:", cports->first), absl::StrCat("--name=w", i),
                                 "--device=" + device, absl::StrCat("--port_file=", dir, "/w", i, ".json"),
                                 "--output_dir=" + out},
        absl::StrCat(dir, "/w", i, ".log")));
    EXPECT_TRUE(workers.back()->Start().ok());
  }
  auto wports = ReadPortFile(dir + "/w1.json", absl::Seconds(30));
  EXPECT_TRUE(wports.ok()) << workers[1]->Log();
  const absl::Time deadline = absl::Now() + absl::Seconds(240);
  while (absl::Now() < deadline && !std::filesystem::exists(out + "/summary.json")) {
    absl::SleepFor(absl::Milliseconds(200));
  }
  run.summary = ReadFile(out + "/summary.json");
  if (wports.ok()) {
    auto metrics = HttpGet("127.0.0.1", wports->second, "/metrics", absl::Seconds(10));
    if (metrics.ok()) run.metrics = metrics->body;
  }
  std::istringstream steps(ReadFile(out + "/steps.jsonl"));
  for (std::string line; std::getline(steps, line);) {
    const size_t at = line.find("\"loss\": ");
    if (line.find("\"committed\": true") == std::string::npos || at == std::string::npos) continue;
    run.losses += line.substr(at, line.find_first_of(",}", at) - at) + "\n";
  }
  if (std::filesystem::is_directory(out + "/final")) {
    for (const auto& entry : std::filesystem::directory_iterator(out + "/final")) {
      run.final_files[entry.path().filename().string()] = ReadFile(entry.path().string());
    }
  }
  for (auto& w : workers) w->Signal(SIGTERM);
  for (auto& w : workers) EXPECT_EQ(w->Wait(absl::Seconds(30)), 0) << w->Log();
  coordinator.Signal(SIGTERM);
  coordinator.Wait(absl::Seconds(30));
  if (!absl::StrContains(run.summary, "\"state\": \"done\"")) {
    ADD_FAILURE() << device << " job did not finish:\n" << run.summary << "\ncoordinator log:\n" << coordinator.Log()
                  << "\nw0 log:\n" << workers[0]->Log() << "\nw1 log:\n" << workers[1]->Log();
  }
  return run;
}

// Same per-step losses and byte-identical final weight files.
void ExpectSameBits(const JobRun& cpu, const JobRun& sim) {
  ASSERT_TRUE(absl::StrContains(cpu.summary, "\"state\": \"done\"")) << cpu.summary;
  ASSERT_TRUE(absl::StrContains(sim.summary, "\"state\": \"done\"")) << sim.summary;
  EXPECT_EQ(std::count(cpu.losses.begin(), cpu.losses.end(), '\n'), 4) << cpu.losses;
  EXPECT_EQ(sim.losses, cpu.losses);
  ASSERT_EQ(cpu.final_files.size(), 3u);  // a weights file per pipeline stage and manifest.json
  ASSERT_EQ(sim.final_files.size(), cpu.final_files.size());
  for (const auto& [name, bytes] : cpu.final_files) {
    ASSERT_TRUE(sim.final_files.count(name)) << name;
    EXPECT_FALSE(bytes.empty()) << name;
    EXPECT_TRUE(sim.final_files.at(name) == bytes) << "final/" << name << " differs between cpu and sim:0";
  }
}

TEST(SimWorkerTest, PipelineJobOnTheSimulatedDeviceMatchesTheCpuBitForBit) {
  const JobRun cpu = RunJob(TempDir("sim_worker_cpu"), "cpu");
  const JobRun sim = RunJob(TempDir("sim_worker_sim"), "sim:0");
  ExpectSameBits(cpu, sim);
  // Device metrics: accelerator memory on the device worker only, the model
  // state's bytes on both; host waits on both.
  EXPECT_TRUE(absl::StrContains(sim.metrics, "baton_device_memory_bytes{")) << sim.metrics;
  EXPECT_TRUE(absl::StrContains(sim.metrics, "kind=\"in_use\"")) << sim.metrics;
  EXPECT_TRUE(absl::StrContains(sim.metrics, "kind=\"reserved\"")) << sim.metrics;
  EXPECT_FALSE(absl::StrContains(cpu.metrics, "kind=\"in_use\"")) << cpu.metrics;
  EXPECT_FALSE(absl::StrContains(cpu.metrics, "kind=\"reserved\"")) << cpu.metrics;
  for (const char* kind : {"weights", "grads", "optimizer"}) {
    EXPECT_TRUE(absl::StrContains(cpu.metrics, absl::StrCat("kind=\"", kind, "\""))) << kind << "\n" << cpu.metrics;
    EXPECT_TRUE(absl::StrContains(sim.metrics, absl::StrCat("kind=\"", kind, "\""))) << kind;
  }
  EXPECT_TRUE(absl::StrContains(sim.metrics, "baton_host_syncs_total{")) << sim.metrics;
}

TEST(SimWorkerTest, Bf16PipelineJobOnTheSimulatedDeviceMatchesTheCpuBitForBit) {
  const JobRun cpu = RunJob(TempDir("sim_worker_bf16_cpu"), "cpu", "bf16");
  const JobRun sim = RunJob(TempDir("sim_worker_bf16_sim"), "sim:0", "bf16");
  ExpectSameBits(cpu, sim);
  // bf16 really ran: the losses are not the fp32 job's.
  const JobRun fp32 = RunJob(TempDir("sim_worker_bf16_fp32"), "cpu", "fp32");
  ASSERT_EQ(std::count(fp32.losses.begin(), fp32.losses.end(), '\n'), 4) << fp32.losses;
  EXPECT_NE(cpu.losses, fp32.losses);
}

}  // namespace
}  // namespace baton
