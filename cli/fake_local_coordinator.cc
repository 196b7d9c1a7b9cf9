// fake_local_coordinator: a stand-in for baton-coordinator in the tests of
// `batonctl local` (test-only). It takes the same flags, accepts worker
// registrations and sessions, and walks job_state through waiting (until
// pp·tp·dp workers are ready) → running (one step every 50 ms up to
// train.steps) → done, writing OUT/summary.json. With
// BATON_FAKE_FAIL_AT_STEP=K in its environment the job fails at step K with
// an error naming worker-1. SIGTERM/SIGINT stop it with exit code 0.
#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "baton/v1/coordinator.grpc.pb.h"
#include "common/file_io.h"
#include "common/ops_server.h"
#include "coordinator/job_spec.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:0", "gRPC address");
ABSL_FLAG(std::string, http_listen, "", "accepted and ignored");
ABSL_FLAG(std::string, port_file, "", "write {\"grpc\": N, \"http\": 0} here once serving");
ABSL_FLAG(std::string, job, "", "JobSpec file");
ABSL_FLAG(std::string, out, "", "directory for summary.json");

namespace baton {
namespace {

class FakeLocalCoordinator final : public v1::Coordinator::Service {
 public:
  FakeLocalCoordinator(const v1::JobSpec& job, std::string out_dir, int64_t fail_at_step)
      : job_(job), out_dir_(std::move(out_dir)), fail_at_step_(fail_at_step) {}

  grpc::Status Register(grpc::ServerContext*, const v1::RegisterRequest* req, v1::RegisterResponse* resp) override {
    absl::MutexLock lock(&mu_);
    const int64_t id = next_id_++;
    names_[id] = req->name();
    states_[req->name()] = v1::JOINING;
    resp->set_worker_id(id);
    resp->set_incarnation(1);
    resp->set_lease_ms(3000);
    resp->set_heartbeat_ms(200);
    return grpc::Status::OK;
  }

  grpc::Status Session(grpc::ServerContext*,
                       grpc::ServerReaderWriter<v1::CoordinatorMessage, v1::WorkerMessage>* stream) override {
    v1::WorkerMessage msg;
    if (!stream->Read(&msg)) return grpc::Status::OK;
    std::string name;
    {
      absl::MutexLock lock(&mu_);
      name = names_[msg.worker_id()];
      states_[name] = v1::READY;
    }
    while (stream->Read(&msg)) {
    }
    absl::MutexLock lock(&mu_);
    states_[name] = v1::LOST;
    return grpc::Status::OK;
  }

  grpc::Status GetStatus(grpc::ServerContext*, const v1::GetStatusRequest*, v1::GetStatusResponse* resp) override {
    absl::MutexLock lock(&mu_);
    resp->set_job(job_.name());
    resp->set_job_state(state_);
    resp->set_job_error(error_);
    resp->set_step(step_);
    resp->set_total_steps(job_.train().steps());
    resp->set_loss(Loss());
    resp->set_accuracy(0.01 * static_cast<double>(step_));
    resp->set_tokens_per_second(1000);
    resp->set_bubble_ratio(0.25);
    resp->set_comm_ratio(0.05);
    for (const auto& [name, state] : states_) {
      v1::WorkerInfo* w = resp->add_workers();
      w->set_name(name);
      w->set_state(state);
    }
    if (state_ != "waiting") {
      for (int i = 0; i < DimsOf(job_).world_size(); ++i) {
        v1::StageStatus* stage = resp->add_stages();
        stage->set_pp_rank(i);
        stage->add_workers(absl::StrCat("worker-", i));
      }
    }
    return grpc::Status::OK;
  }

  // Advances the job by one tick (every 50 ms).
  void Tick() {
    absl::MutexLock lock(&mu_);
    if (state_ == "waiting") {
      int ready = 0;
      for (const auto& [name, state] : states_) ready += state == v1::READY;
      const int world = DimsOf(job_).world_size();
      if (ready >= world) {
        state_ = "running";
        error_.clear();
      } else {
        // Like the real coordinator after --ready_timeout_s.
        error_ = absl::StrCat("needs pp*tp*dp = ", world, " ready workers, ", ready, " are ready; start ",
                              world - ready, " more");
      }
    } else if (state_ == "running") {
      ++step_;
      if (step_ == fail_at_step_) {
        state_ = "failed";
        error_ = absl::StrCat("stage 1 (worker-1) reported a non-finite loss at step ", step_);
      } else if (step_ >= job_.train().steps()) {
        const std::string summary = absl::StrCat(
            "{\"steps\": ", step_, ", \"final_loss\": ", Loss(),
            ", \"tokens_per_second\": 1000, \"bubble_ratio\": 0.25, \"comm_ratio\": 0.05, "
            "\"expected_bubble_ratio\": 0.2, \"note\": \"fake\"}\n");
        if (!WriteFileAtomically(absl::StrCat(out_dir_, "/summary.json"), summary).ok()) std::abort();
        state_ = "done";
      }
    }
  }

 private:
  double Loss() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return 4.0 / static_cast<double>(1 + step_); }

  const v1::JobSpec job_;
  const std::string out_dir_;
  const int64_t fail_at_step_;
  absl::Mutex mu_;
  int64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<int64_t, std::string> names_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, v1::WorkerState> states_ ABSL_GUARDED_BY(mu_);
  std::string state_ ABSL_GUARDED_BY(mu_) = "waiting";
  std::string error_ ABSL_GUARDED_BY(mu_);
  int64_t step_ ABSL_GUARDED_BY(mu_) = 0;
};

int Main() {
  absl::StatusOr<v1::JobSpec> job = LoadJobSpec(absl::GetFlag(FLAGS_job));
  if (!job.ok()) {
    std::fprintf(stderr, "fake coordinator: %s\n", std::string(job.status().message()).c_str());
    return 2;
  }
  int64_t fail_at_step = -1;
  if (const char* fail = std::getenv("BATON_FAKE_FAIL_AT_STEP")) {
    if (!absl::SimpleAtoi(fail, &fail_at_step)) return 2;
  }
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  FakeLocalCoordinator service(*job, absl::GetFlag(FLAGS_out), fail_at_step);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(absl::GetFlag(FLAGS_listen), grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || !WritePortFile(absl::GetFlag(FLAGS_port_file), port, 0).ok()) return 1;
  std::fprintf(stderr, "fake coordinator serving on port %d\n", port);

  absl::Notification stop;
  std::thread driver([&]() {
    while (!stop.WaitForNotificationWithTimeout(absl::Milliseconds(50))) service.Tick();
  });
  int sig = 0;
  sigwait(&signals, &sig);
  std::fprintf(stderr, "fake coordinator: stopping on signal %d\n", sig);
  stop.Notify();
  driver.join();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  return 0;
}

}  // namespace
}  // namespace baton

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return baton::Main();
}
