// control_plane_bench: one real coordinator (the baton-coordinator binary,
// in a child process, with a synthetic job) and N simulated workers that
// speak the real protocol over real gRPC on loopback: Register, the Session
// stream, heartbeats at the period the coordinator asks for, Configured,
// GradsReady, StepDone and Saved with zero-cost compute. The workers are
// packed into a few processes (gRPC callback API: no thread per worker).
//
//   bazel build -c opt //bench:control_plane_bench //coordinator:baton-coordinator
//   bazel-bin/bench/control_plane_bench --workers=1024
//
// The job: synthetic, pp*tp*dp = N, 1f1b with m = 2*pp, --steps steps. After
// the job is done the workers keep heartbeating for --idle_s seconds while
// the coordinator's CPU time is read from /proc. Prints one JSON object:
//   heartbeat_p50_ms / _p99_ms   heartbeat round trips (ack received - sent)
//                                while idle; *_steps_ms: while steps ran
//                                (*_steps_in_ms: of those, sent -> handled
//                                by the coordinator, from the ack's stamp)
//                                (heartbeats_measured_steps of them; -1
//                                when none: reports carried the liveness)
//   coordinator_cpu_s_per_s      coordinator CPU seconds per wall second while
//                                idle (heartbeats only); cpu_us_per_heartbeat
//   configure_seconds            last worker ready -> every worker configured
//                                (includes the job runner's 100 ms readiness poll;
//                                -1 with --job_ranks: spares join meanwhile)
//   step_overhead_ms             median over steps 2.. of the coordinator's step
//                                wall (steps.jsonl) minus the slowest worker's
//                                own time in that step
//   coordinator_cpu_ms_per_step  CPU time of the coordinator (and, sims_*, of
//                                the simulated workers' processes) per step,
//                                between two status polls while running
//
// --verdict_in_run_step=false registers the workers as ones from before
// RunStep carried the previous step's verdict (each verdict a message of its
// own): the same coordinator, one message per worker and step more.
// --heartbeat_while_busy=true heartbeats every period, as workers before any
// message renewed the lease (baton's workers leave heartbeats out while
// they send others).
// --workers_per_connection (default 128) packs that many simulated workers
// onto one gRPC channel; 1 gives each its own connection, as deployed
// workers have (about 2.4x the coordinator's CPU per message). --bdp_probe
// turns gRPC's bandwidth-delay probing back on for the simulated workers
// (baton-worker turns it off).
// --step_done_in_report=false answers every StepDone apart, as workers from
// before RunStep.step_done_in_report (the sims never snapshot, so with it
// each step's StepDone rides in the next report).
// --job_ranks=K (< --workers) runs a job of K ranks; the other workers are
// spares that only heartbeat, so the coordinator holds N sessions while K
// of them step: the load group leaders would leave it (docs/architecture.md,
// "Scaling the step protocol"; K = N/pp), less their handling of the members'
// reports inside the leaders' ones. The step figures then count only steps
// that began after every worker was ready, and the CPU per step only polls
// that saw every worker ready.
// --report_groups registers the workers as able to run in report groups
// (docs/protocol.md "Report groups"; of several columns too) and has the
// coordinator use them: each group's leader gets RunStep, passes it on to
// its members (in-process calls standing in for the group's communicator)
// and sends their reports inside its own. The workers are packed into
// processes by whole groups and whole data-parallel replicas, so every
// group is in one process.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <fstream>
#include <map>
#include <memory>
#include <numeric>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "baton/v1/coordinator.grpc.pb.h"
#include "common/grpc_transport.h"
#include "common/report_group.h"
#include "grpcpp/grpcpp.h"

ABSL_FLAG(int, workers, 64, "simulated workers (pp*tp*dp of the job, unless --job_ranks)");
ABSL_FLAG(int, job_ranks, 0, "pp*tp*dp of the job (0: --workers); the other workers are spares");
ABSL_FLAG(int, procs, 4, "processes the simulated workers are packed into");
ABSL_FLAG(int, steps, 12, "training steps of the synthetic job");
ABSL_FLAG(int, idle_s, 8, "seconds of heartbeats only, after the job, for CPU and latency");
ABSL_FLAG(std::string, coordinator, "", "baton-coordinator binary (default: beside bazel-bin/bench)");
ABSL_FLAG(bool, verdict_in_run_step, true,
          "the workers register verdict_in_run_step (false: as workers before it, each verdict a message of its own)");
ABSL_FLAG(bool, heartbeat_while_busy, false,
          "the workers heartbeat every period (false: as baton's workers, only when nothing else went out for a "
          "period, and at least every 10 periods)");
ABSL_FLAG(bool, step_done_in_report, true,
          "the workers put a StepDone in the next report where RunStep allows it (false: as workers before it)");
ABSL_FLAG(int, workers_per_connection, 128,
          "simulated workers sharing one gRPC channel (one TCP connection); 1: a connection per worker, as "
          "deployed workers have");
ABSL_FLAG(bool, bdp_probe, false,
          "the simulated workers' channels probe the bandwidth-delay product (gRPC's default; baton-worker turns "
          "it off: a PING per message received)");
ABSL_FLAG(bool, report_groups, false,
          "the workers run in report groups: RunStep to each group's leader, which passes it on and reports for "
          "its members");
ABSL_FLAG(std::string, mesh, "",
          "PPxTPxDP of the job, e.g. 1x8x128 (default: the mesh of docs/BENCHMARKS.md for the job's ranks; other "
          "sizes: pp = ranks)");
ABSL_FLAG(std::string, dir, "", "working directory (default: a fresh one under /tmp)");
// Internal: a process of simulated workers.
ABSL_FLAG(std::string, sim, "", "internal: ADDRESS:FIRST:COUNT:OUTFILE");

namespace baton {
namespace {

int64_t NowUs() { return absl::ToUnixMicros(absl::Now()); }

[[noreturn]] void Die(const std::string& why) {
  std::fprintf(stderr, "control_plane_bench: %s\n", why.c_str());
  std::exit(1);
}

// ---- simulated workers ----

struct Record {
  absl::Mutex mu;
  // (ack time, rtt, sent -> coordinator's stamp) in us; one clock: one machine
  std::vector<std::array<int64_t, 3>> rtts;
  std::vector<int64_t> ready, configured;
  // step -> (first RunStep seen, last StepDone sent, slowest own time)
  std::map<int64_t, std::array<int64_t, 3>> steps;
  int errors = 0;
  std::string first_error;
};

class SimWorker;

// The simulated workers of one process by report group, as configured:
// (generation, group) -> workers by seat (common/report_group.h).
struct Groups {
  absl::Mutex mu;
  std::map<std::array<int64_t, 2>, std::map<int, SimWorker*>> by_group ABSL_GUARDED_BY(mu);
};

class SimWorker : public grpc::ClientBidiReactor<v1::WorkerMessage, v1::CoordinatorMessage> {
 public:
  SimWorker(v1::Coordinator::Stub* stub, std::string name, Record* rec, Groups* groups)
      : stub_(stub), name_(std::move(name)), rec_(rec), groups_(groups) {}

  void Start() {
    req_.set_name(name_);
    req_.set_host("127.0.0.1");
    req_.set_device("cpu");
    req_.set_version("bench");
    req_.set_pid(getpid());
    req_.set_verdict_in_run_step(absl::GetFlag(FLAGS_verdict_in_run_step));
    req_.set_report_groups(absl::GetFlag(FLAGS_report_groups));
    req_.set_report_group_columns(absl::GetFlag(FLAGS_report_groups));
    reg_ctx_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
    stub_->async()->Register(&reg_ctx_, &req_, &reg_, [this](grpc::Status s) { OnRegistered(s); });
  }

  // Called by the ticker: sends a heartbeat when one is due.
  void Tick(int64_t now) {
    if (!open_.load() || now < next_beat_.load()) return;
    next_beat_ = now + period_us_;
    // As WorkerAgent::HeartbeatDue: any message renews the lease where the
    // coordinator says so.
    if (!absl::GetFlag(FLAGS_heartbeat_while_busy) && reg_.any_message_renews_lease() &&
        now - last_sent_.load() < period_us_ && skipped_ < 9) {
      ++skipped_;
      return;
    }
    skipped_ = 0;
    v1::WorkerMessage beat;
    beat.mutable_heartbeat()->set_step(step_.load());
    beat.mutable_heartbeat()->set_send_time_us(NowUs());
    Send(std::move(beat));
  }

  void OnWriteDone(bool ok) override {
    v1::WorkerMessage next;
    {
      absl::MutexLock lock(&mu_);
      if (!ok || queue_.empty()) {
        writing_ = false;
        if (!ok) failed_ = true;
        if (!failed_ || queue_.empty()) return;
      }
      if (failed_) {
        writing_ = false;
        return;
      }
      out_ = std::move(queue_.front());
      queue_.pop_front();
    }
    StartWrite(&out_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;
    const int64_t now = NowUs();
    const v1::CoordinatorMessage& m = in_;
    if (m.has_ack()) {
      if (!ready_) {
        ready_ = true;
        absl::MutexLock lock(&rec_->mu);
        rec_->ready.push_back(now);
      }
      absl::MutexLock lock(&rec_->mu);
      rec_->rtts.push_back({now, now - m.ack().worker_send_time_us(),
                            m.ack().coordinator_time_us() - m.ack().worker_send_time_us()});
    } else if (m.has_configure()) {
      {
        absl::MutexLock lock(&rec_->mu);
        rec_->configured.push_back(now);
      }
      v1::WorkerMessage reply;
      reply.mutable_configured()->set_ok(true);
      const v1::Plan& plan = m.configure().plan();
      {
        absl::MutexLock lock(&step_mu_);
        generation_ = plan.generation();
        members_.clear();
        leader_ = false;
        if (plan.report_groups() && plan.ranks_size() == 1) {
          const v1::RankAssignment& rank = plan.ranks(0);
          const ReportGroupSeat seat = ReportGroupSeatOf(plan.pp(), plan.tp(), plan.dp(), plan.report_group_columns(),
                                                         rank.pp_rank(), rank.tp_rank(), rank.dp_rank());
          leader_ = seat.rank == 0;
          group_size_ = seat.size;
          group_ = {generation_, seat.group};
          absl::MutexLock groups(&groups_->mu);
          groups_->by_group[group_][seat.rank] = this;
        }
        reply.mutable_configured()->set_generation(generation_);
      }
      Send(std::move(reply));
    } else if (m.has_run_step()) {
      // A leader passes the step on to its members first, then runs its
      // own and reports for the group.
      std::vector<v1::StepReport> members;
      std::string missing;
      for (SimWorker* member : Members(&missing)) members.push_back(member->Step(m.run_step(), now));
      v1::WorkerMessage reply;
      *reply.mutable_report() = Step(m.run_step(), now);
      if (!missing.empty()) {
        Error(missing);
        reply.mutable_report()->set_error(missing);
        reply.mutable_report()->set_code(13);  // INTERNAL
      } else {
        for (v1::StepReport& r : members) *reply.mutable_report()->add_members() = std::move(r);
      }
      Send(std::move(reply));
    } else if (m.has_commit() || m.has_discard()) {
      absl::MutexLock lock(&step_mu_);
      OnVerdict(m.has_commit() ? m.commit().step() : m.discard().step(), m.has_commit(), now, nullptr);
    } else if (m.has_save_weights()) {  // an empty shard file, so the manifest has something to list
      v1::WorkerMessage reply;
      const std::string file = absl::StrCat(name_, ".bench");
      std::ofstream(absl::StrCat(m.save_weights().dir(), "/", file)).flush();
      reply.mutable_saved()->set_ok(true);
      reply.mutable_saved()->add_files(file);
      {
        absl::MutexLock lock(&step_mu_);
        reply.mutable_saved()->set_generation(generation_);
      }
      Send(std::move(reply));
    } else if (m.has_abort()) {
      Error(absl::StrCat("abort: ", m.abort().reason()));
    }
    StartRead(&in_);
  }

  // RunStep `run`, received (by this worker or its leader) at `now`: the
  // previous step's verdict, when it rides along, first (its StepDone in
  // the report where the coordinator allows it), then the step's report.
  v1::StepReport Step(const v1::RunStep& run, int64_t now) {
    absl::MutexLock lock(&step_mu_);
    const bool hold = run.step_done_in_report() && absl::GetFlag(FLAGS_step_done_in_report);
    v1::StepReport r;
    if (run.has_commit()) OnVerdict(run.commit().step(), true, now, hold ? &r : nullptr);
    if (run.has_discard()) OnVerdict(run.discard().step(), false, now, hold ? &r : nullptr);
    step_ = run.step();
    run_at_ = now;
    r.set_step(run.step());
    r.set_finite(true);
    r.set_generation(generation_);
    own_ = NowUs() - now;
    return r;
  }

  // A leader's members by seat (none for others); `missing` says which is
  // not in this process.
  std::vector<SimWorker*> Members(std::string* missing) {
    absl::MutexLock lock(&step_mu_);
    if (!leader_ || !members_.empty()) return members_;
    absl::MutexLock groups(&groups_->mu);
    const std::map<int, SimWorker*>& group = groups_->by_group[group_];
    for (int seat = 1; seat < group_size_; ++seat) {
      auto it = group.find(seat);
      if (it == group.end()) {
        *missing = absl::StrCat("seat ", seat, " of report group ", group_[1],
                                " is not in this process (the bench packs processes by whole groups)");
        members_.clear();
        return {};
      }
      members_.push_back(it->second);
    }
    return members_;
  }

  // Commit or Discard of `step`, received at `now`: StepDone, inside
  // `report` when not null.
  void OnVerdict(int64_t step, bool committed, int64_t now, v1::StepReport* report)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu_) {
    v1::WorkerMessage reply;
    v1::StepDone* done = report != nullptr ? report->mutable_step_done() : reply.mutable_step_done();
    done->set_step(step);
    done->set_committed(committed);
    done->set_generation(generation_);
    const int64_t sent = NowUs();
    own_ += sent - now;
    if (report == nullptr) Send(std::move(reply));
    absl::MutexLock lock(&rec_->mu);
    auto [it, fresh] = rec_->steps.try_emplace(step, std::array<int64_t, 3>{run_at_, sent, own_});
    if (!fresh) {
      it->second[0] = std::min(it->second[0], run_at_);
      it->second[1] = std::max(it->second[1], sent);
      it->second[2] = std::max(it->second[2], own_);
    }
  }

  void OnDone(const grpc::Status& s) override {
    open_ = false;
    if (!s.ok() && !stopping_.load()) Error(absl::StrCat("session ended: ", s.error_message()));
  }

  void Stop() {
    stopping_ = true;
    ctx_.TryCancel();
  }

 private:
  void OnRegistered(const grpc::Status& s) {
    if (!s.ok()) {
      Error(absl::StrCat("Register: ", s.error_message()));
      return;
    }
    period_us_ = std::max<int64_t>(10, reg_.heartbeat_ms()) * 1000;
    stub_->async()->Session(&ctx_, this);
    StartRead(&in_);
    v1::WorkerMessage hello;
    hello.mutable_heartbeat()->set_send_time_us(NowUs());
    next_beat_ = NowUs() + period_us_;
    Send(std::move(hello));
    StartCall();
    open_ = true;
  }

  void Send(v1::WorkerMessage m) {
    m.set_worker_id(reg_.worker_id());
    m.set_incarnation(reg_.incarnation());
    if (!m.has_heartbeat()) last_sent_ = NowUs();
    {
      absl::MutexLock lock(&mu_);
      if (failed_) return;
      if (writing_) {
        queue_.push_back(std::move(m));
        return;
      }
      writing_ = true;
      out_ = std::move(m);
    }
    StartWrite(&out_);
  }

  void Error(const std::string& why) {
    absl::MutexLock lock(&rec_->mu);
    if (rec_->errors++ == 0) rec_->first_error = absl::StrCat(name_, ": ", why);
  }

  v1::Coordinator::Stub* const stub_;
  const std::string name_;
  Record* const rec_;
  Groups* const groups_;
  grpc::ClientContext reg_ctx_, ctx_;
  v1::RegisterRequest req_;
  v1::RegisterResponse reg_;
  v1::CoordinatorMessage in_;  // reader side only
  bool ready_ = false;
  // A step runs on this worker's reader thread or its leader's.
  absl::Mutex step_mu_;
  int64_t run_at_ ABSL_GUARDED_BY(step_mu_) = 0, own_ ABSL_GUARDED_BY(step_mu_) = 0,
          generation_ ABSL_GUARDED_BY(step_mu_) = 0;
  bool leader_ ABSL_GUARDED_BY(step_mu_) = false;
  int group_size_ ABSL_GUARDED_BY(step_mu_) = 0;
  std::array<int64_t, 2> group_ ABSL_GUARDED_BY(step_mu_) = {0, 0};
  std::vector<SimWorker*> members_ ABSL_GUARDED_BY(step_mu_);
  std::atomic<bool> open_{false}, stopping_{false};
  std::atomic<int64_t> next_beat_{0}, step_{0}, last_sent_{0};
  int skipped_ = 0;  // the ticker's
  int64_t period_us_ = 500000;
  absl::Mutex mu_;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool failed_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<v1::WorkerMessage> queue_ ABSL_GUARDED_BY(mu_);
  v1::WorkerMessage out_;
};

int RunSimProcess(const std::string& arg) {
  std::vector<std::string> parts = absl::StrSplit(arg, '|');
  int first = 0, count = 0;
  if (parts.size() != 4 || !absl::SimpleAtoi(parts[1], &first) || !absl::SimpleAtoi(parts[2], &count)) {
    Die("bad --sim");
  }
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);  // threads started below inherit it

  Record rec;
  Groups groups;
  // A channel per --workers_per_connection workers (each its own connection).
  const int per_connection = std::max(1, absl::GetFlag(FLAGS_workers_per_connection));
  std::vector<std::unique_ptr<v1::Coordinator::Stub>> stubs;
  std::vector<std::unique_ptr<SimWorker>> workers;
  for (int i = 0; i < count; ++i) {
    if (i % per_connection == 0) {
      grpc::ChannelArguments args;
      args.SetInt("bench.channel", first + i);  // distinct args: a connection of its own
      if (absl::GetFlag(FLAGS_bdp_probe)) {
        args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 1);
      } else {
        SetTransportArgs(&args);  // as baton-worker
      }
      stubs.push_back(v1::Coordinator::NewStub(
          grpc::CreateCustomChannel(parts[0], grpc::InsecureChannelCredentials(), args)));
    }
    // Zero-padded: the planner takes workers in name order, so a DP
    // replica's ranks are consecutive workers.
    workers.push_back(std::make_unique<SimWorker>(stubs.back().get(), absl::StrFormat("sim-%05d", first + i), &rec,
                                                  &groups));
  }
  for (auto& w : workers) w->Start();
  std::atomic<bool> stop{false};
  std::thread ticker([&] {
    while (!stop.load()) {
      const int64_t now = NowUs();
      for (auto& w : workers) w->Tick(now);
      absl::SleepFor(absl::Milliseconds(5));
    }
  });
  int sig = 0;
  sigwait(&set, &sig);
  stop = true;
  ticker.join();
  for (auto& w : workers) w->Stop();
  absl::SleepFor(absl::Milliseconds(300));
  std::ofstream out(parts[3]);
  absl::MutexLock lock(&rec.mu);
  out << "errors " << rec.errors << " " << (rec.first_error.empty() ? "-" : rec.first_error) << "\n";
  for (auto& [t, r, in] : rec.rtts) out << "rtt " << t << " " << r << " " << in << "\n";
  for (int64_t t : rec.ready) out << "ready " << t << "\n";
  for (int64_t t : rec.configured) out << "configured " << t << "\n";
  for (auto& [s, v] : rec.steps) out << "step " << s << " " << v[0] << " " << v[1] << " " << v[2] << "\n";
  out.close();
  std::_Exit(0);  // reactors may still be referenced by gRPC threads
}

// ---- driver ----

double CpuSeconds(pid_t pid) {
  std::ifstream f(absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  std::getline(f, line);
  const size_t close = line.rfind(')');
  std::vector<std::string> fields = absl::StrSplit(line.substr(close + 2), ' ');
  // fields[0] is field 3 (state); utime and stime are fields 14 and 15.
  double ut = 0, st = 0;
  if (fields.size() <= 13 || !absl::SimpleAtod(fields[11], &ut) || !absl::SimpleAtod(fields[12], &st)) {
    Die(absl::StrCat("cannot read CPU times from /proc/", pid, "/stat"));
  }
  return (ut + st) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

pid_t Spawn(const std::vector<std::string>& argv, const std::string& log) {
  pid_t pid = fork();
  if (pid == 0) {
    FILE* f = std::fopen(log.c_str(), "w");
    if (f != nullptr) {
      dup2(fileno(f), 1);
      dup2(fileno(f), 2);
    }
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  return pid;
}

std::string ReadFile(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return -1;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * v.size()))];
}

int Main(int argc, char** argv) {
  const int n = absl::GetFlag(FLAGS_workers);
  const int ranks = absl::GetFlag(FLAGS_job_ranks) == 0 ? n : absl::GetFlag(FLAGS_job_ranks);
  // pp*tp*dp = ranks (the meshes of docs/BENCHMARKS.md; other sizes: pp = ranks).
  static const std::map<int, std::array<int, 3>> kMeshes = {
      {64, {4, 4, 4}}, {128, {8, 4, 4}}, {256, {8, 8, 4}}, {1024, {16, 8, 8}}, {4096, {32, 8, 16}}};
  int pp = ranks, tp = 1, dp = 1;
  if (auto it = kMeshes.find(ranks); it != kMeshes.end()) {
    pp = it->second[0];
    tp = it->second[1];
    dp = it->second[2];
  }
  const std::string mesh = absl::GetFlag(FLAGS_mesh);
  if (n < 1 || n > 4096) Die("--workers: 1..4096");
  if (ranks < 1 || ranks > n) Die("--job_ranks: 1 .. --workers");
  if (!mesh.empty()) {
    const std::vector<std::string> dims = absl::StrSplit(mesh, 'x');
    if (dims.size() != 3 || !absl::SimpleAtoi(dims[0], &pp) || !absl::SimpleAtoi(dims[1], &tp) ||
        !absl::SimpleAtoi(dims[2], &dp) || pp < 1 || tp < 1 || dp < 1 || pp > 4096 || tp > 4096 || dp > 4096 ||
        static_cast<int64_t>(pp) * tp * dp != ranks) {
      Die(absl::StrCat("--mesh=", mesh, ": want PPxTPxDP, each at least 1, whose product is the job's ", ranks,
                       " ranks"));
    }
  } else if (kMeshes.count(ranks) == 0 && ranks > 64) {
    Die("--job_ranks: 1..64, or 128, 256, 1024, 4096 (other sizes: give --mesh)");
  }
  const int m = 2 * pp;
  const int steps = absl::GetFlag(FLAGS_steps);

  std::string self(4096, '\0');
  self.resize(std::max<ssize_t>(0, readlink("/proc/self/exe", self.data(), self.size())));
  std::string coord = absl::GetFlag(FLAGS_coordinator);
  if (coord.empty()) coord = self.substr(0, self.rfind("/bench/")) + "/coordinator/baton-coordinator";
  if (access(coord.c_str(), X_OK) != 0) Die(absl::StrCat("no coordinator binary at ", coord, " (--coordinator)"));
  std::string dir = absl::GetFlag(FLAGS_dir);
  if (dir.empty()) {
    char tmpl[] = "/tmp/cp-bench.XXXXXX";
    if (mkdtemp(tmpl) == nullptr) Die("mkdtemp");
    dir = tmpl;
  }
  {
    std::ofstream job(dir + "/job.textproto");
    job << "name: \"cp-bench\"\n"
        << "model { layers: " << pp << " synthetic { forward_ms: 0 backward_input_ms: 0 backward_weight_ms: 0"
        << " activation_bytes: 4 } }\n"
        << "parallel { pp: " << pp << " tp: " << tp << " dp: " << dp << " }\n"
        << "schedule { kind: \"1f1b\" microbatches: " << m << " }\n"
        << "train { steps: " << steps << " micro_batch_size: 1 lr: 0.001 }\n";
  }
  const bool groups = absl::GetFlag(FLAGS_report_groups);
  pid_t cpid = Spawn({coord, "--listen=127.0.0.1:0", "--port_file=" + dir + "/ports.json",
                      "--job=" + dir + "/job.textproto", "--out=" + dir + "/out", "--ready_timeout_s=600",
                      // With --report_groups any job runs in groups; without, the sims never register them.
                      "--report_groups_min_ranks=1"},
                     dir + "/coordinator.log");
  int port = 0;
  for (int i = 0; i < 600 && port == 0; ++i) {
    absl::SleepFor(absl::Milliseconds(50));
    std::string ports = ReadFile(dir + "/ports.json");
    size_t at = ports.find("\"grpc\": ");
    if (at != std::string::npos &&
        !absl::SimpleAtoi(ports.substr(at + 8, ports.find_first_of(",}", at) - at - 8), &port)) {
      port = 0;
    }
  }
  if (port == 0) Die(absl::StrCat("coordinator did not start; see ", dir, "/coordinator.log"));
  const std::string address = absl::StrCat("127.0.0.1:", port);

  // Processes hold whole report groups and whole DP replicas (pp * lcm(k,
  // tp) consecutive workers, k the coordinator's columns per group) under
  // report groups, so a leader finds its members in its own process.
  const int group_columns = ReportGroupColumnsFor(pp, tp, dp, kDefaultReportGroupRanks);
  const int unit = groups ? pp * std::lcm(group_columns, tp) : 1;
  const int units = (n + unit - 1) / unit;
  const int procs = std::max(1, std::min(absl::GetFlag(FLAGS_procs), units));
  std::vector<pid_t> sims;
  const absl::Time start = absl::Now();
  const std::string verdict_flag =
      absl::StrCat("--verdict_in_run_step=", absl::GetFlag(FLAGS_verdict_in_run_step) ? "true" : "false");
  const std::string done_flag =
      absl::StrCat("--step_done_in_report=", absl::GetFlag(FLAGS_step_done_in_report) ? "true" : "false");
  const std::string beat_flag =
      absl::StrCat("--heartbeat_while_busy=", absl::GetFlag(FLAGS_heartbeat_while_busy) ? "true" : "false");
  for (int p = 0; p < procs; ++p) {
    const int first = std::min(n, units * p / procs * unit);
    const int count = std::min(n, units * (p + 1) / procs * unit) - first;
    sims.push_back(Spawn({self, absl::StrCat("--sim=", address, "|", first, "|", count, "|", dir, "/sim", p, ".txt"),
                          verdict_flag, done_flag, beat_flag,
                          absl::StrCat("--report_groups=", groups ? "true" : "false"),
                          absl::StrCat("--workers_per_connection=", absl::GetFlag(FLAGS_workers_per_connection)),
                          absl::StrCat("--bdp_probe=", absl::GetFlag(FLAGS_bdp_probe) ? "true" : "false")},
                         absl::StrCat(dir, "/sim", p, ".log")));
  }
  // Wait for the job to end (GetStatus).
  auto stub = v1::Coordinator::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  std::string state;
  absl::Time job_end;
  // CPU time of the coordinator and of the simulated workers over the steps
  // after the first one seen done (heartbeats included).
  int64_t cpu_from_step = -1, cpu_to_step = -1;
  double coord_cpu_from = 0, sims_cpu_from = 0, coord_cpu_to = 0, sims_cpu_to = 0;
  auto sims_cpu = [&sims]() {
    double s = 0;
    for (pid_t pid : sims) s += CpuSeconds(pid);
    return s;
  };
  for (;;) {
    absl::SleepFor(absl::Milliseconds(200));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::GetStatusRequest req;
    v1::GetStatusResponse resp;
    if (grpc::Status s = stub->GetStatus(&ctx, req, &resp); s.ok()) {
      state = resp.job_state();
      const bool all_ready =
          std::count_if(resp.workers().begin(), resp.workers().end(),
                        [](const v1::WorkerInfo& w) { return w.state() == v1::READY; }) == n;
      if (cpu_from_step < 0 && resp.step() >= 1 && state == "running" && all_ready) {
        cpu_from_step = resp.step();
        coord_cpu_from = CpuSeconds(cpid);
        sims_cpu_from = sims_cpu();
      }
      if (cpu_from_step >= 0 && resp.step() > cpu_to_step && state == "running" && all_ready) {
        cpu_to_step = resp.step();
        coord_cpu_to = CpuSeconds(cpid);
        sims_cpu_to = sims_cpu();
      }
      if (state == "done" || state == "failed") {
        if (state == "failed") std::fprintf(stderr, "job failed: %s\n", resp.job_error().c_str());
        job_end = absl::Now();
        break;
      }
    }
    if (absl::Now() - start > absl::Minutes(20)) Die("job did not finish within 20 minutes");
  }
  // Heartbeats only.
  absl::SleepFor(absl::Seconds(1));
  const int64_t idle_from = NowUs();
  const double cpu0 = CpuSeconds(cpid);
  absl::SleepFor(absl::Seconds(absl::GetFlag(FLAGS_idle_s)));
  const double cpu1 = CpuSeconds(cpid);
  const int64_t idle_to = NowUs();
  for (pid_t pid : sims) kill(pid, SIGTERM);
  for (pid_t pid : sims) waitpid(pid, nullptr, 0);
  kill(cpid, SIGTERM);
  waitpid(cpid, nullptr, 0);

  // Aggregate.
  std::vector<double> idle_rtt, step_rtt, step_in;
  std::vector<std::array<int64_t, 3>> job_rtt;  // (ack time, rtt, in) before the job ended
  int64_t last_ready = 0, last_configured = 0, first_step_at = INT64_MAX, ready_count = 0, configured_count = 0;
  int errors = 0;
  std::string first_error;
  std::map<int64_t, std::array<int64_t, 3>> step_agg;
  for (int p = 0; p < procs; ++p) {
    std::istringstream in(ReadFile(absl::StrCat(dir, "/sim", p, ".txt")));
    std::string kind;
    while (in >> kind) {
      if (kind == "errors") {
        int e = 0;
        std::string rest;
        in >> e;
        std::getline(in, rest);
        errors += e;
        if (e > 0 && first_error.empty()) first_error = rest;
      } else if (kind == "rtt") {
        int64_t t, r, to_coordinator;
        in >> t >> r >> to_coordinator;
        if (t >= idle_from && t <= idle_to) idle_rtt.push_back(r / 1e3);
        if (t < absl::ToUnixMicros(job_end)) job_rtt.push_back({t, r, to_coordinator});
      } else if (kind == "ready") {
        int64_t t;
        in >> t;
        last_ready = std::max(last_ready, t);
        ++ready_count;
      } else if (kind == "configured") {
        int64_t t;
        in >> t;
        last_configured = std::max(last_configured, t);
        ++configured_count;
      } else if (kind == "step") {
        int64_t s, a, b, c;
        in >> s >> a >> b >> c;
        auto [it, fresh] = step_agg.try_emplace(s, std::array<int64_t, 3>{a, b, c});
        if (!fresh) {
          it->second[0] = std::min(it->second[0], a);
          it->second[1] = std::max(it->second[1], b);
          it->second[2] = std::max(it->second[2], c);
        }
        first_step_at = std::min(first_step_at, a);
      }
    }
  }
  // While steps ran: from the first RunStep a worker saw to the job's end.
  for (const auto& [t, r, to_coordinator] : job_rtt) {
    if (t < first_step_at || (ranks < n && t < last_ready)) continue;
    step_rtt.push_back(r / 1e3);
    step_in.push_back(to_coordinator / 1e3);
  }
  // The coordinator's step walls.
  std::vector<double> overhead;
  {
    std::istringstream in(ReadFile(dir + "/out/steps.jsonl"));
    std::string line;
    while (std::getline(in, line)) {
      int64_t step = 0;
      double wall = 0;
      size_t a = line.find("\"step\": "), b = line.find("\"wall_seconds\": ");
      if (a == std::string::npos || b == std::string::npos) continue;
      if (!absl::SimpleAtoi(line.substr(a + 8, line.find(',', a) - a - 8), &step) ||
          !absl::SimpleAtod(line.substr(b + 16, line.find(',', b) - b - 16), &wall)) {
        continue;
      }
      if (step < 2) continue;  // warm-up
      // With spares: only steps that began once every worker was ready.
      if (ranks < n && (!step_agg.count(step) || step_agg[step][0] < last_ready)) continue;
      const double own = step_agg.count(step) ? step_agg[step][2] / 1e6 : 0;
      overhead.push_back((wall - own) * 1e3);
    }
  }
  const double idle_s = (idle_to - idle_from) / 1e6;
  const int64_t cpu_steps = std::max<int64_t>(0, cpu_to_step - cpu_from_step);
  // null when the job ran too few steps between two status polls (200 ms).
  auto per_step_ms = [cpu_steps](double seconds) {
    return cpu_steps > 0 ? absl::StrFormat("%.2f", seconds * 1e3 / cpu_steps) : std::string("null");
  };
  const double beats_per_s = n * 1e3 / 500.0;  // default --heartbeat_ms
  std::printf(
      "{\"workers\": %d, \"job_ranks\": %d, \"pp\": %d, \"tp\": %d, \"dp\": %d, \"microbatches\": %d, \"sim_processes\": %d, "
      "\"job_state\": \"%s\", \"errors\": %d, \"first_error\": \"%s\", \"ready\": %ld, \"configured\": %ld, "
      "\"heartbeat_p50_ms\": %.3f, \"heartbeat_p99_ms\": %.3f, \"heartbeats_measured\": %zu, "
      "\"heartbeat_p50_steps_ms\": %.3f, \"heartbeat_p99_steps_ms\": %.3f, \"heartbeats_measured_steps\": %zu, "
      "\"heartbeat_p50_steps_in_ms\": %.3f, \"heartbeat_p99_steps_in_ms\": %.3f, "
      "\"coordinator_cpu_s_per_s\": %.4f, \"cpu_us_per_heartbeat\": %.1f, "
      "\"configure_seconds\": %.4f, \"step_overhead_ms\": %.3f, \"steps_measured\": %zu, "
      "\"report_groups\": %s, \"verdict_in_run_step\": %s, \"step_done_in_report\": %s, \"heartbeat_while_busy\": %s, \"coordinator_cpu_ms_per_step\": %s, \"sims_cpu_ms_per_step\": %s, "
      "\"cpu_steps_measured\": %ld, \"dir\": \"%s\"}\n",
      n, ranks, pp, tp, dp, m, procs, state.c_str(), errors, first_error.c_str(), static_cast<long>(ready_count),
      static_cast<long>(configured_count), Percentile(idle_rtt, 0.5), Percentile(idle_rtt, 0.99), idle_rtt.size(),
      Percentile(step_rtt, 0.5), Percentile(step_rtt, 0.99), step_rtt.size(), Percentile(step_in, 0.5),
      Percentile(step_in, 0.99), (cpu1 - cpu0) / idle_s,
      (cpu1 - cpu0) / idle_s / beats_per_s * 1e6, ranks < n ? -1.0 : (last_configured - last_ready) / 1e6, Percentile(overhead, 0.5),
      overhead.size(), groups ? "true" : "false", absl::GetFlag(FLAGS_verdict_in_run_step) ? "true" : "false",
      absl::GetFlag(FLAGS_step_done_in_report) ? "true" : "false",
      absl::GetFlag(FLAGS_heartbeat_while_busy) ? "true" : "false",
      per_step_ms(coord_cpu_to - coord_cpu_from).c_str(), per_step_ms(sims_cpu_to - sims_cpu_from).c_str(),
      static_cast<long>(cpu_steps),
      dir.c_str());
  (void)argc;
  (void)argv;
  return 0;
}

}  // namespace
}  // namespace baton

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (!absl::GetFlag(FLAGS_sim).empty()) return baton::RunSimProcess(absl::GetFlag(FLAGS_sim));
  return baton::Main(argc, argv);
}
