#include "cli/local_cmd.h"

#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <memory>
#include <optional>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "baton/v1/coordinator.grpc.pb.h"
#include "cli/args.h"
#include "cli/child_process.h"
#include "common/file_io.h"
#include "common/json.h"
#include "coordinator/job_spec.h"

namespace baton::cli {
namespace {

constexpr absl::Duration kTick = absl::Milliseconds(100);
constexpr absl::Duration kPollPeriod = absl::Milliseconds(500);
constexpr absl::Duration kInjectPollPeriod = absl::Milliseconds(10);
constexpr absl::Duration kRpcTimeout = absl::Seconds(1);
constexpr absl::Duration kPortFileTimeout = absl::Seconds(30);
constexpr absl::Duration kSilentCoordinatorLimit = absl::Seconds(60);
constexpr absl::Duration kStopGrace = absl::Seconds(5);
constexpr int kLogTailLines = 20;

// The signal that asked batonctl local to stop (0: none yet).
volatile sig_atomic_t g_stop_signal = 0;

void OnStopSignal(int sig) { g_stop_signal = sig; }

// Routes SIGINT and SIGTERM to g_stop_signal while in scope. No SA_RESTART,
// so sleeps end early.
class ScopedStopSignals {
 public:
  ScopedStopSignals() {
    g_stop_signal = 0;
    struct sigaction action = {};
    action.sa_handler = OnStopSignal;
    sigemptyset(&action.sa_mask);
    sigaction(SIGINT, &action, &old_int_);
    sigaction(SIGTERM, &action, &old_term_);
  }
  ~ScopedStopSignals() {
    sigaction(SIGINT, &old_int_, nullptr);
    sigaction(SIGTERM, &old_term_, nullptr);
  }

 private:
  struct sigaction old_int_ = {}, old_term_ = {};
};

bool IsExecutable(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && access(path.c_str(), X_OK) == 0;
}

std::string Dirname(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

// The gRPC port from a --port_file ({"grpc": N, "http": M}), once written.
std::optional<int> ReadGrpcPort(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFile(path);
  if (!text.ok()) return std::nullopt;
  absl::StatusOr<JsonValue> j = JsonValue::Parse(*text);
  if (!j.ok() || j->Find("grpc") == nullptr || !j->Find("grpc")->integer()) return std::nullopt;
  const int64_t port = *j->Find("grpc")->integer();
  if (port <= 0 || port > 65535) return std::nullopt;
  return static_cast<int>(port);
}

std::string Percent(double ratio) { return absl::StrFormat("%.1f%%", 100 * ratio); }

// One progress line, e.g.
// step 12/200  loss 1.234  acc 45.6%  tok/s 12345  bubble 12.3%  comm 4.5%
// and, once an evaluation ran (train.eval_every_steps), "  eval 1.301 (ppl 3.67 @10)".
std::string ProgressLine(const v1::GetStatusResponse& s) {
  std::string line =
      absl::StrFormat("step %d/%d  loss %.3f  acc %s  tok/s %.0f  bubble %s  comm %s", s.step(), s.total_steps(),
                      s.loss(), Percent(s.accuracy()), s.tokens_per_second(), Percent(s.bubble_ratio()),
                      Percent(s.comm_ratio()));
  if (s.eval_step() > 0) {
    absl::StrAppend(&line, absl::StrFormat("  eval %.3f (ppl %.2f @%d)", s.eval_loss(), s.eval_perplexity(),
                                           s.eval_step()));
  }
  return line;
}

// Prints progress lines: rewritten in place on a terminal, one per line
// otherwise; other messages first end a pending in-place line.
class ProgressPrinter {
 public:
  ProgressPrinter(std::ostream& out, bool tty) : out_(out), tty_(tty) {}

  void Progress(const std::string& line) {
    if (tty_) {
      out_ << "\r" << line << "\033[K" << std::flush;
      pending_ = true;
    } else {
      out_ << line << std::endl;
    }
  }
  std::ostream& Line() {
    EndLine();
    return out_;
  }
  void EndLine() {
    if (pending_) out_ << "\n" << std::flush;
    pending_ = false;
  }

 private:
  std::ostream& out_;
  const bool tty_;
  bool pending_ = false;
};

std::string FormatSummaryValue(const std::string& key, const JsonValue& v) {
  if (v.is_number()) {
    if (absl::EndsWith(key, "_ratio") || key == "accuracy" || absl::EndsWith(key, "_accuracy")) {
      return absl::StrCat(Percent(v.number()), " (", JsonNumber(v.number()), ")");
    }
    if (v.integer()) return absl::StrCat(*v.integer());
    return absl::StrFormat("%.6g", v.number());
  }
  if (v.is_string()) return v.str();
  if (v.kind() == JsonValue::Kind::kBool) return v.bool_value() ? "true" : "false";
  if (v.kind() == JsonValue::Kind::kNull) return "null";
  return "(see summary.json)";
}

// `name` appears in `text` as a whole name ("worker-1" not inside "worker-12").
bool MentionsName(const std::string& text, const std::string& name) {
  for (size_t at = text.find(name); at != std::string::npos; at = text.find(name, at + 1)) {
    const size_t end = at + name.size();
    const bool left_ok = at == 0 || !(absl::ascii_isalnum(text[at - 1]) || text[at - 1] == '-');
    const bool right_ok = end == text.size() || !(absl::ascii_isalnum(text[end]) || text[end] == '-');
    if (left_ok && right_ok) return true;
  }
  return false;
}

// --inject=KIND:TARGET@WHEN, one fault:
//   KIND    kill (SIGKILL) | stop (SIGSTOP: a frozen worker)
//   TARGET  stage=P[,tp=T][,dp=D][,cp=C] (the worker holding that rank now) |
//           worker=NAME
//   WHEN    step=N[,after_ms=M][,for=S]: once the job reached step N, M ms
//           later (0..60000; a point inside a later step); for stop, for=S
//           sends SIGCONT S seconds (0.001..3600) after the SIGSTOP (a thaw).
struct Injection {
  int sig = SIGKILL;
  int stage = -1, tp = -1, dp = -1, cp = -1;  // a worker of this rank, or
  std::string worker;                // this worker
  int64_t step = 0;
  int64_t after_ms = 0;
  double thaw_after_s = 0;  // > 0: SIGCONT this long after the SIGSTOP
  // Progress.
  bool armed = false, done = false, thawed = false;
  absl::Time fire_at, thaw_at;
  std::string victim;
  int64_t armed_step = 0;
};

absl::StatusOr<std::optional<Injection>> ParseInjection(const std::string& text) {
  if (text.empty()) return std::optional<Injection>();
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(
        absl::StrCat("--inject=", text, ": ", why,
                     " (expected KIND:TARGET@step=N[,after_ms=M][,for=S] with KIND kill or stop, TARGET "
                     "stage=P[,tp=T][,dp=D][,cp=C] or worker=NAME; e.g. kill:stage=1@step=300, "
                     "stop:stage=0,tp=1@step=50,for=5)"));
  };
  Injection inj;
  const size_t colon = text.find(':'), at = text.find('@');
  if (colon == std::string::npos || at == std::string::npos || at < colon) return bad("malformed");
  const std::string kind = text.substr(0, colon), target = text.substr(colon + 1, at - colon - 1),
                    when = text.substr(at + 1);
  if (kind == "kill") {
    inj.sig = SIGKILL;
  } else if (kind == "stop") {
    inj.sig = SIGSTOP;
  } else {
    return bad(absl::StrCat("unknown fault '", kind, "'"));
  }
  if (absl::StartsWith(target, "worker=") && target.size() > 7) {
    inj.worker = target.substr(7);
  } else if (absl::StartsWith(target, "stage=")) {
    for (absl::string_view part : absl::StrSplit(target, ',')) {
      int* field = absl::ConsumePrefix(&part, "stage=") ? &inj.stage
                   : absl::ConsumePrefix(&part, "tp=")  ? &inj.tp
                   : absl::ConsumePrefix(&part, "dp=")  ? &inj.dp
                   : absl::ConsumePrefix(&part, "cp=")  ? &inj.cp
                                                        : nullptr;
      if (field == nullptr) return bad(absl::StrCat("unknown target part '", part, "'"));
      if (*field >= 0 || !absl::SimpleAtoi(part, field) || *field < 0) {
        return bad("stage, tp, dp and cp must each be given once, as a number >= 0");
      }
    }
  } else {
    return bad("the target must be stage=P[,tp=T][,dp=D][,cp=C] or worker=NAME");
  }
  bool have_step = false;
  for (absl::string_view part : absl::StrSplit(when, ',')) {
    if (absl::ConsumePrefix(&part, "step=")) {
      if (!absl::SimpleAtoi(part, &inj.step) || inj.step < 1) return bad("the time must be step=N with N >= 1");
      have_step = true;
    } else if (absl::ConsumePrefix(&part, "after_ms=")) {
      if (!absl::SimpleAtoi(part, &inj.after_ms) || inj.after_ms < 0 || inj.after_ms > 60000) {
        return bad("after_ms must be between 0 and 60000");
      }
    } else if (absl::ConsumePrefix(&part, "for=")) {
      if (!absl::SimpleAtod(part, &inj.thaw_after_s) || !(inj.thaw_after_s >= 0.001 && inj.thaw_after_s <= 3600)) {
        return bad("for must be between 0.001 and 3600 seconds");
      }
    } else {
      return bad(absl::StrCat("unknown time part '", part, "'"));
    }
  }
  if (!have_step) return bad("the time must be step=N with N >= 1");
  if (inj.thaw_after_s > 0 && inj.sig != SIGSTOP) return bad("for=S only goes with stop (a kill cannot be undone)");
  return std::optional<Injection>(inj);
}

// The rank a worker's log says it was configured for last ("configured for
// job 'x' generation G: stage P, tp T, dp D[, cp C], ..."; cp 0 when the
// line has none), or false.
bool LastConfiguredRank(const std::string& log_path, int* stage, int* tp, int* dp, int* cp) {
  absl::StatusOr<std::string> log = ReadFile(log_path);
  if (!log.ok()) return false;
  const size_t line = log->rfind("configured for job");
  if (line == std::string::npos) return false;
  const size_t at = log->find(": stage ", line);
  if (at == std::string::npos) return false;
  if (std::sscanf(log->c_str() + at, ": stage %d, tp %d, dp %d", stage, tp, dp) != 3) return false;
  *cp = 0;
  const size_t end = log->find('\n', at);
  const size_t cp_at = log->find(", cp ", at);
  if (cp_at != std::string::npos && cp_at < end) std::sscanf(log->c_str() + cp_at, ", cp %d", cp);
  return true;
}

// Runs one job; the children live as long as this object.
class LocalRun {
 public:
  LocalRun(std::ostream& out, std::ostream& err, bool tty) : err_(err), printer_(out, tty) {}

  // `output_dirs`: the workers' --output_dir (where the coordinator has them
  // save); `coordinator_flags`: more flags for the coordinator.
  int Run(const std::string& job_path, const std::string& out_dir, int workers, const LocalBinaries& bins,
          absl::Duration timeout, std::optional<Injection> inject, const std::string& resume,
          const std::string& output_dirs, const std::vector<std::string>& coordinator_flags);

 private:
  // Stops every child and returns `code`.
  int Stop(int code) {
    std::vector<ChildProcess*> all;
    for (auto& w : workers_) {
      // A worker still frozen by --inject=stop: thawed first, so that it
      // handles SIGTERM and leaves cleanly instead of waiting for SIGKILL.
      if (inject_ && inject_->done && inject_->sig == SIGSTOP && !inject_->thawed && w->name() == inject_->victim &&
          w->running()) {
        w->Signal(SIGCONT);
      }
      all.push_back(w.get());
    }
    if (coordinator_) all.push_back(coordinator_.get());
    StopAll(all, kStopGrace);
    return code;
  }
  // Prints `message` (and the end of `log_of`'s log) and stops with 1.
  int Fail(const std::string& message, const ChildProcess* log_of = nullptr) {
    printer_.EndLine();
    err_ << "batonctl local: " << message << "\n";
    if (log_of != nullptr) PrintLogTail(*log_of);
    return Stop(1);
  }
  int Interrupted() {
    printer_.EndLine();
    err_ << "batonctl local: " << strsignal(g_stop_signal) << "; stopping the coordinator and " << workers_.size()
         << (workers_.size() == 1 ? " worker\n" : " workers\n");
    return Stop(130);
  }
  void PrintLogTail(const ChildProcess& child) {
    const std::string tail = TailOfFile(child.log_path(), kLogTailLines);
    err_ << "--- last lines of " << child.log_path() << " ---\n" << (tail.empty() ? "(empty)\n" : tail);
  }
  // "worker-2 (pipeline stage 1)", from the last status.
  std::string Describe(const ChildProcess& child) const {
    for (const v1::StageStatus& stage : last_status_.stages()) {
      for (const std::string& w : stage.workers()) {
        if (w == child.name()) return absl::StrCat(child.name(), " (pipeline stage ", stage.pp_rank(), ")");
      }
    }
    return child.name();
  }
  // A worker died: the coordinator recovers (or fails the job, which ends the run).
  void WorkerExited(ChildProcess& child, int status) {
    printer_.EndLine();
    err_ << "batonctl local: " << Describe(child) << " " << DescribeWaitStatus(status)
         << "; the coordinator replaces it with a spare or fails the job\n";
    exited_.insert(&child);
  }
  // Arms the injection once its step is reached (picking the victim).
  void Inject(const v1::GetStatusResponse& s);
  // Fires an armed injection, and its thaw, when their time has come.
  void FireInjection();
  // The next instant FireInjection has something to do (InfiniteFuture: none).
  absl::Time NextInjectionEvent() const;
  int ChildExited(ChildProcess& child, int status) {
    printer_.EndLine();
    err_ << "batonctl local: " << Describe(child) << " " << DescribeWaitStatus(status)
         << " unexpectedly; stopping the run\n";
    PrintLogTail(child);
    return Stop(1);
  }
  int JobFailed(const v1::GetStatusResponse& s);
  int JobDone(const std::string& out_dir);
  // Prints state changes and progress; returns an exit code once the job ended.
  std::optional<int> OnStatus(const v1::GetStatusResponse& s, const std::string& out_dir);

  std::ostream& err_;
  ProgressPrinter printer_;
  std::unique_ptr<ChildProcess> coordinator_;
  std::vector<std::unique_ptr<ChildProcess>> workers_;
  v1::GetStatusResponse last_status_;
  std::optional<Injection> inject_;
  std::string out_dir_;
  std::set<const ChildProcess*> exited_;
  std::string last_state_, last_recovery_;
  int last_ready_ = -1;
  std::string last_job_error_;
  int64_t last_step_ = 0;
};

int LocalRun::Run(const std::string& job_path, const std::string& out_dir, int workers, const LocalBinaries& bins,
                  absl::Duration timeout, std::optional<Injection> inject, const std::string& resume,
                  const std::string& output_dirs, const std::vector<std::string>& coordinator_flags) {
  const absl::Time deadline = absl::Now() + timeout;
  inject_ = std::move(inject);
  out_dir_ = out_dir;
  const std::string port_file = absl::StrCat(out_dir, "/coordinator.ports");
  unlink(port_file.c_str());  // a stale one would name a dead coordinator
  std::vector<std::string> coordinator_args = {"--listen=127.0.0.1:0", "--http_listen=127.0.0.1:0",
                                               "--port_file=" + port_file, "--job=" + job_path, "--out=" + out_dir};
  if (!resume.empty()) coordinator_args.push_back("--resume=" + resume);
  for (const std::string& f : coordinator_flags) coordinator_args.push_back(f);
  coordinator_ = std::make_unique<ChildProcess>("the coordinator", bins.coordinator, coordinator_args,
                                                absl::StrCat(out_dir, "/logs/coordinator.log"));
  if (absl::Status s = coordinator_->Start(); !s.ok()) return Fail(std::string(s.message()));

  std::optional<int> port;
  const absl::Time port_deadline = std::min(deadline, absl::Now() + kPortFileTimeout);
  while (!(port = ReadGrpcPort(port_file))) {
    if (g_stop_signal != 0) return Interrupted();
    if (std::optional<int> status = coordinator_->Poll()) return ChildExited(*coordinator_, *status);
    if (absl::Now() > port_deadline) {
      return Fail(absl::StrCat("the coordinator did not write ", port_file, " in time"), coordinator_.get());
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  const std::string target = absl::StrCat("127.0.0.1:", *port);
  for (int i = 0; i < workers; ++i) {
    const std::string name = absl::StrCat("worker-", i);
    workers_.push_back(std::make_unique<ChildProcess>(
        name, bins.worker,
        std::vector<std::string>{"--coordinator=" + target, "--name=" + name,
                                 absl::StrCat("--port_file=", out_dir, "/", name, ".ports"),
                                 "--output_dir=" + output_dirs,
                                 // data files: relative to the job file's directory (issue 12)
                                 "--data_dir=" + (job_path.rfind('/') == std::string::npos
                                                      ? std::string(".")
                                                      : job_path.substr(0, std::max<size_t>(1, job_path.rfind('/'))))},
        absl::StrCat(out_dir, "/logs/", name, ".log")));
    if (absl::Status s = workers_.back()->Start(); !s.ok()) return Fail(std::string(s.message()));
  }
  printer_.Line() << "coordinator on " << target << ", " << workers << " worker" << (workers == 1 ? "" : "s")
                  << "; logs in " << out_dir << "/logs/" << std::endl;

  auto stub = v1::Coordinator::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  absl::Time next_poll = absl::Now();
  absl::Time last_answer = absl::Now();
  for (;;) {
    if (g_stop_signal != 0) return Interrupted();
    if (std::optional<int> status = coordinator_->Poll()) return ChildExited(*coordinator_, *status);
    for (auto& w : workers_) {
      if (exited_.count(w.get())) continue;
      if (std::optional<int> status = w->Poll()) WorkerExited(*w, *status);
    }
    const absl::Time now = absl::Now();
    if (now > deadline) {
      return Fail(absl::StrCat("no result within --timeout_s=", absl::ToInt64Seconds(timeout), " (job state '",
                               last_state_, "', step ", last_step_, "); see the logs in ", out_dir, "/logs/"));
    }
    FireInjection();
    if (now >= next_poll) {
      // Closely while an injection waits for its step, so that it lands near it.
      next_poll = now + (inject_ && !inject_->armed ? kInjectPollPeriod : kPollPeriod);
      grpc::ClientContext ctx;
      ctx.set_deadline(absl::ToChronoTime(now + kRpcTimeout));
      v1::GetStatusResponse status;
      if (stub->GetStatus(&ctx, {}, &status).ok()) {
        last_answer = now;
        if (std::optional<int> code = OnStatus(status, out_dir)) return *code;
      } else if (now - last_answer > kSilentCoordinatorLimit) {
        return Fail(absl::StrCat("the coordinator has not answered for ",
                                 absl::ToInt64Seconds(kSilentCoordinatorLimit), " s"),
                    coordinator_.get());
      }
    }
    absl::SleepFor(std::max(absl::ZeroDuration(),
                            std::min({kTick, next_poll - absl::Now(), NextInjectionEvent() - absl::Now()})));
  }
}

std::optional<int> LocalRun::OnStatus(const v1::GetStatusResponse& s, const std::string& out_dir) {
  last_status_ = s;
  if (s.job_state() == "waiting") {
    int ready = 0;
    for (const v1::WorkerInfo& w : s.workers()) ready += w.state() == v1::READY;
    if (ready != last_ready_) {
      printer_.Line() << "waiting for workers: " << ready << " of " << workers_.size() << " ready" << std::endl;
    }
    last_ready_ = ready;
    // The coordinator says why it still waits (e.g. "start 3 more workers").
    if (!s.job_error().empty() && s.job_error() != last_job_error_) {
      printer_.Line() << "coordinator: " << s.job_error() << std::endl;
    }
    last_job_error_ = s.job_error();
  } else if (s.job_state() != last_state_ && s.job_state() != "done" && s.job_state() != "failed") {
    printer_.Line() << "job " << (s.job().empty() ? "" : s.job() + " ") << s.job_state() << std::endl;
  }
  last_state_ = s.job_state();
  if (!s.recovery().empty() && s.recovery() != last_recovery_) {
    printer_.Line() << (s.job_state() == "recovering" ? "recovering: " : "recovered: ") << s.recovery() << std::endl;
  }
  last_recovery_ = s.recovery();
  if (s.step() != last_step_ && s.step() > 0) {
    std::string line = ProgressLine(s);
    if (s.recoveries() > 0) {
      absl::StrAppend(&line, "  recoveries ", s.recoveries(), " (", s.replayed_steps(), " steps replayed)");
    }
    printer_.Progress(line);
  }
  Inject(s);
  last_step_ = s.step();
  if (s.job_state() == "failed") return JobFailed(s);
  if (s.job_state() == "done") return JobDone(out_dir);
  return std::nullopt;
}

void LocalRun::Inject(const v1::GetStatusResponse& s) {
  if (!inject_ || inject_->armed || s.job_state() != "running" || s.step() < inject_->step) return;
  std::string name = inject_->worker;
  if (name.empty()) {
    for (const v1::StageStatus& stage : s.stages()) {
      if (stage.pp_rank() != inject_->stage) continue;
      for (const std::string& w : stage.workers()) {
        if (inject_->tp < 0 && inject_->dp < 0) {
          name = w;
          break;
        }
        int pp = -1, tp = -1, dp = -1, cp = -1;
        if (LastConfiguredRank(absl::StrCat(out_dir_, "/logs/", w, ".log"), &pp, &tp, &dp, &cp) &&
            pp == inject_->stage && (inject_->tp < 0 || tp == inject_->tp) && (inject_->dp < 0 || dp == inject_->dp) &&
            (inject_->cp < 0 || cp == inject_->cp)) {
          name = w;
          break;
        }
      }
    }
  }
  if (name.empty()) return;  // not in the status (yet): the next one
  inject_->armed = true;
  inject_->victim = name;
  inject_->armed_step = s.step();
  inject_->fire_at = absl::Now() + absl::Milliseconds(inject_->after_ms);
  FireInjection();
}

absl::Time LocalRun::NextInjectionEvent() const {
  if (!inject_ || !inject_->armed) return absl::InfiniteFuture();
  if (!inject_->done) return inject_->fire_at;
  if (inject_->thaw_after_s > 0 && !inject_->thawed) return inject_->thaw_at;
  return absl::InfiniteFuture();
}

void LocalRun::FireInjection() {
  if (!inject_ || !inject_->armed || absl::Now() < NextInjectionEvent()) return;
  ChildProcess* victim = nullptr;
  for (auto& w : workers_) {
    if (w->name() == inject_->victim && !exited_.count(w.get())) victim = w.get();
  }
  // Wall time as the daemons' logs print it, to measure detection against.
  const std::string now = absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone());
  printer_.EndLine();
  if (!inject_->done) {
    inject_->done = true;
    inject_->thaw_at = absl::Now() + absl::Seconds(inject_->thaw_after_s);
    if (victim == nullptr) {
      inject_->thawed = true;
      err_ << "batonctl local: not injecting into " << inject_->victim << ": it is not running\n";
      return;
    }
    err_ << "batonctl local: injecting " << (inject_->sig == SIGKILL ? "SIGKILL" : "SIGSTOP") << " into "
         << Describe(*victim) << " (pid " << victim->pid() << ") after step " << inject_->armed_step
         << (inject_->after_ms > 0 ? absl::StrCat(" + ", inject_->after_ms, " ms") : "") << " at " << now << "\n";
    victim->Signal(inject_->sig);
    return;
  }
  inject_->thawed = true;
  if (victim == nullptr) return;
  err_ << "batonctl local: thawing " << victim->name() << " (pid " << victim->pid() << ", SIGCONT) at " << now
       << "\n";
  victim->Signal(SIGCONT);
}

int LocalRun::JobFailed(const v1::GetStatusResponse& s) {
  printer_.EndLine();
  err_ << "batonctl local: job failed: " << (s.job_error().empty() ? "(no reason given)" : s.job_error()) << "\n";
  // The workers the error names, else those the coordinator lost, else the
  // coordinator's own log.
  std::vector<const ChildProcess*> culprits;
  for (const auto& w : workers_) {
    if (MentionsName(s.job_error(), w->name())) culprits.push_back(w.get());
  }
  if (culprits.empty()) {
    for (const v1::WorkerInfo& info : s.workers()) {
      for (const auto& w : workers_) {
        if (info.state() == v1::LOST && info.name() == w->name()) culprits.push_back(w.get());
      }
    }
  }
  if (culprits.empty()) culprits.push_back(coordinator_.get());
  for (size_t i = 0; i < culprits.size() && i < 3; ++i) PrintLogTail(*culprits[i]);
  return Stop(1);
}

int LocalRun::JobDone(const std::string& out_dir) {
  printer_.EndLine();
  const std::string path = absl::StrCat(out_dir, "/summary.json");
  absl::StatusOr<std::string> text = ReadFile(path);
  absl::StatusOr<JsonValue> summary = text.ok() ? JsonValue::Parse(*text) : text.status();
  if (!summary.ok() || !summary->is_object()) {
    err_ << "batonctl local: the job is done but " << path << " is unreadable ("
         << (summary.ok() ? "not a JSON object" : summary.status().message()) << ")\n";
  } else {
    std::ostream& out = printer_.Line();
    out << "done" << (last_status_.job().empty() ? "" : absl::StrCat(": job ", last_status_.job())) << "\n";
    for (const auto& [key, value] : summary->members()) {
      out << absl::StrFormat("  %-24s %s\n", key, FormatSummaryValue(key, value));
    }
    out << "results in " << out_dir << "/" << std::endl;
  }
  return Stop(0);
}

}  // namespace

absl::StatusOr<std::string> LocateBinary(const std::string& subdir, const std::string& name,
                                         const std::string& bin_dir, const std::string& self_exe) {
  std::vector<std::string> candidates;
  if (!bin_dir.empty()) {
    candidates = {absl::StrCat(bin_dir, "/", subdir, "/", name), absl::StrCat(bin_dir, "/", name)};
  } else {
    const std::string exe_dir = Dirname(self_exe);
    candidates = {absl::StrCat(Dirname(exe_dir), "/", subdir, "/", name), absl::StrCat(exe_dir, "/", name),
                  absl::StrCat(self_exe, ".runfiles/baton/", subdir, "/", name)};
  }
  for (const std::string& c : candidates) {
    if (IsExecutable(c)) return c;
  }
  return absl::NotFoundError(absl::StrCat(
      "cannot find ", name, " (looked for ", absl::StrJoin(candidates, ", "), "); build it with `bazel build //",
      subdir, ":", name, "` or pass --bin_dir=DIR"));
}

std::string SelfExe() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : "";
}

absl::StatusOr<LocalBinaries> LocateBinaries(const std::string& bin_dir, const std::string& self_exe) {
  LocalBinaries bins;
  absl::StatusOr<std::string> coordinator = LocateBinary("coordinator", "baton-coordinator", bin_dir, self_exe);
  if (!coordinator.ok()) return coordinator.status();
  absl::StatusOr<std::string> worker = LocateBinary("worker", "baton-worker", bin_dir, self_exe);
  if (!worker.ok()) return worker.status();
  bins.coordinator = *coordinator;
  bins.worker = *worker;
  return bins;
}

int RunLocalCommand(const std::vector<std::string>& argv, std::ostream& out, std::ostream& err) {
  absl::StatusOr<Args> args =
      Args::Parse(argv, {"job", "out", "workers", "spares", "inject", "resume", "bin_dir", "timeout_s",
                         "report_groups_min_ranks"});
  if (!args.ok()) {
    err << "batonctl local: " << args.status().message() << "\n";
    return 2;
  }
  const std::string job_path = args->GetString("job", "");
  const std::string out_dir = args->GetString("out", "");
  absl::StatusOr<int64_t> timeout_s = args->GetInt("timeout_s", 3600);
  if (job_path.empty() || out_dir.empty() || !args->positionals().empty() || !timeout_s.ok() || *timeout_s <= 0) {
    err << "usage: batonctl local --job=FILE --out=DIR [--workers=N] [--spares=N] "
           "[--inject=kill|stop:stage=P[,tp=T][,dp=D]|worker=NAME@step=N[,after_ms=M][,for=S]] [--resume=CHECKPOINT] [--bin_dir=DIR] [--timeout_s=3600] "
           "[--report_groups_min_ranks=N]\n";
    return 2;
  }
  absl::StatusOr<v1::JobSpec> job = LoadJobSpec(job_path);
  if (!job.ok()) {
    err << "batonctl local: " << job.status().message() << "\n";
    return 2;
  }
  const ParallelDims dims = DimsOf(*job);
  absl::StatusOr<int64_t> workers = args->GetInt("workers", dims.world_size());
  if (!workers.ok() || *workers < 1 || *workers > 1024) {
    err << "batonctl local: --workers must be between 1 and 1024 (default pp·tp·dp = " << dims.world_size()
        << ")\n";
    return 2;
  }
  absl::StatusOr<int64_t> spares = args->GetInt("spares", 0);
  if (!spares.ok() || *spares < 0 || *workers + *spares > 1024) {
    err << "batonctl local: --spares must be >= 0, with --workers + --spares at most 1024\n";
    return 2;
  }
  std::vector<std::string> coordinator_flags;
  if (args->Has("report_groups_min_ranks")) {
    absl::StatusOr<int64_t> min_ranks = args->GetInt("report_groups_min_ranks", 0);
    if (!min_ranks.ok() || *min_ranks < 1 || *min_ranks > 65537) {
      err << "batonctl local: --report_groups_min_ranks must be between 1 and 65537 (the coordinator's flag: jobs "
             "of at least this many ranks run in report groups)\n";
      return 2;
    }
    coordinator_flags.push_back(absl::StrCat("--report_groups_min_ranks=", *min_ranks));
  }
  absl::StatusOr<std::optional<Injection>> inject = ParseInjection(args->GetString("inject", ""));
  if (!inject.ok()) {
    err << "batonctl local: " << inject.status().message() << "\n";
    return 2;
  }
  if (*inject && ((*inject)->stage >= dims.pp || (*inject)->tp >= dims.tp || (*inject)->dp >= dims.dp)) {
    err << "batonctl local: --inject: rank stage " << (*inject)->stage << ", tp " << (*inject)->tp << ", dp "
        << (*inject)->dp << " does not exist (the job has pp = " << dims.pp << ", tp = " << dims.tp
        << ", dp = " << dims.dp << ")\n";
    return 2;
  }
  absl::StatusOr<LocalBinaries> bins = LocateBinaries(args->GetString("bin_dir", ""), SelfExe());
  if (!bins.ok()) {
    err << "batonctl local: " << bins.status().message() << "\n";
    return 2;
  }
  if (absl::Status s = MakeDirectories(absl::StrCat(out_dir, "/logs")); !s.ok()) {
    err << "batonctl local: " << s.message() << "; pick another --out\n";
    return 2;
  }
  ScopedStopSignals signals;
  LocalRun run(out, err, &out == &std::cout && isatty(STDOUT_FILENO));
  // Workers save the final weights under --out and checkpoints under the
  // job's checkpoint.dir: only there (docs/security.md).
  std::string output_dirs = out_dir;
  if (!job->checkpoint().dir().empty()) absl::StrAppend(&output_dirs, ",", job->checkpoint().dir());
  return run.Run(job_path, out_dir, static_cast<int>(*workers + *spares), *bins, absl::Seconds(*timeout_s),
                 *std::move(inject), args->GetString("resume", ""), output_dirs, coordinator_flags);
}

}  // namespace baton::cli
