#include "coordinator/worker_registry.h"

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/match.h"

namespace baton {
namespace {

// A generation counts the job's configurations (one per start or recovery);
// a worker claiming more held a job of no coordinator. Bounded so adopting it
// (the next generation is one above) cannot overflow.
constexpr int64_t kMaxHeldGeneration = int64_t{1} << 53;

absl::Status ValidateRequest(const v1::RegisterRequest& r) {
  if (absl::Status s = ValidateWorkerName(r.name()); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("Register: ", s.message()));
  }
  if (absl::Status s = ValidateHostName(r.host()); !s.ok() && !r.host().empty()) {  // empty: one unnamed host
    return absl::InvalidArgumentError(absl::StrCat("Register: ", s.message()));
  }
  if (!IsValidDevice(r.device())) {
    return absl::InvalidArgumentError(
        absl::StrCat("Register: device '", r.device(), "' must be \"cpu\" or \"cuda:N\""));
  }
  if (r.http_port() < 0 || r.http_port() > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("Register: http_port ", r.http_port(), " is not a port"));
  }
  if (r.memory_bytes() < 0) return absl::InvalidArgumentError("Register: memory_bytes must be >= 0");
  if (!IsValidGpuUuid(r.device_uuid())) {
    return absl::InvalidArgumentError(
        "Register: device_uuid must be at most 64 letters, digits and '-' (a GPU UUID as nvidia-smi prints it)");
  }
  if (!r.device_uuid().empty() && !absl::StartsWith(r.device(), "cuda:")) {
    return absl::InvalidArgumentError(
        absl::StrCat("Register: device_uuid is set but device '", r.device(), "' is not a GPU"));
  }
  if (r.fused_attention_bf16() && !absl::StartsWith(r.device(), "cuda:")) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Register: fused_attention_bf16 is set but device '", r.device(), "' is not a GPU"));
  }
  if (r.held().job().size() > 256 || r.held().steps_size() > 16 || r.held().pp_rank() < 0 || r.held().tp_rank() < 0 ||
      r.held().dp_rank() < 0 || r.held().generation() < 0 || r.held().generation() > kMaxHeldGeneration) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Register: held must name a job of at most 256 characters, ranks >= 0, a generation in [0, ",
        kMaxHeldGeneration, "], at most 16 steps"));
  }
  return absl::OkStatus();
}

}  // namespace

WorkerRegistry::WorkerRegistry(Clock* clock, absl::Duration lease, int64_t first_id, Limits limits)
    : clock_(clock), lease_(lease), limits_(limits), next_id_(first_id), last_sweep_(clock->Now()) {}

absl::StatusOr<WorkerRegistry::Registration> WorkerRegistry::Register(const v1::RegisterRequest& request,
                                                                      absl::Duration heartbeat) {
  if (absl::Status s = ValidateRequest(request); !s.ok()) return s;
  const absl::Time now = clock_->Now();
  absl::MutexLock lock(&mu_);
  Registration result;
  auto it = by_name_.find(request.name());
  if (it == by_name_.end() && static_cast<int>(by_name_.size()) >= limits_.max_workers) {
    return absl::ResourceExhaustedError(absl::StrCat("Register: this coordinator already holds ", by_name_.size(),
                                                     " worker names (the limit); '", request.name(),
                                                     "' is refused until lost workers are forgotten"));
  }
  Worker& w = by_name_[request.name()];
  if (w.info.worker_id() != 0) {
    const v1::WorkerState state = w.info.state();
    const bool live = (state == v1::JOINING || state == v1::READY || state == v1::DRAINING) &&
                      now - w.last_heartbeat <= lease_;
    if (live) {
      return absl::AlreadyExistsError(absl::StrCat(
          "Register: worker name '", request.name(), "' is held by a live worker on host '", w.info.host(),
          "' pid ", w.pid, " (", absl::AsciiStrToLower(v1::WorkerState_Name(state)), ", last heartbeat ",
          absl::FormatDuration(absl::Trunc(now - w.last_heartbeat, absl::Milliseconds(1))),
          " ago); stop that worker or give this one another --name. It is taken over once the holder's "
          "session ends or its lease (",
          absl::FormatDuration(lease_), ") expires"));
    }
    result.replaced_previous = true;
    result.replaced = std::move(w.session);
    name_of_id_.erase(w.info.worker_id());
  }
  const int64_t id = next_id_++;
  w = Worker();
  w.pid = request.pid();
  w.info.set_worker_id(id);
  w.info.set_incarnation(id);
  w.info.set_name(request.name());
  w.info.set_host(request.host());
  w.info.set_device(request.device());
  w.info.set_memory_bytes(request.memory_bytes());
  w.info.set_device_uuid(request.device_uuid());
  w.info.set_fused_attention_bf16(request.fused_attention_bf16());
  w.info.set_verdict_in_run_step(request.verdict_in_run_step());
  w.info.set_report_groups(request.report_groups());
  w.info.set_report_group_columns(request.report_group_columns());
  w.info.set_http_port(request.http_port());
  if (request.has_held()) *w.info.mutable_held() = request.held();  // job adoption (owner: recovery)
  w.info.set_state(v1::JOINING);
  w.last_heartbeat = now;
  name_of_id_[id] = request.name();
  result.response.set_worker_id(id);
  result.response.set_incarnation(id);
  result.response.set_lease_ms(absl::ToInt64Milliseconds(lease_));
  result.response.set_heartbeat_ms(absl::ToInt64Milliseconds(heartbeat));
  return result;
}

absl::StatusOr<WorkerRegistry::Worker*> WorkerRegistry::FindLocked(int64_t worker_id, int64_t incarnation) {
  auto it = name_of_id_.find(worker_id);
  if (it == name_of_id_.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat("worker id ", worker_id, " is unknown to this coordinator; register again"));
  }
  Worker& w = by_name_[it->second];
  if (w.info.incarnation() != incarnation) {
    return absl::FailedPreconditionError(absl::StrCat("incarnation ", incarnation, " of worker '", it->second,
                                                      "' is stale (current ", w.info.incarnation(),
                                                      "); register again"));
  }
  if (w.info.state() == v1::LOST || w.info.state() == v1::LEFT) {
    return absl::FailedPreconditionError(absl::StrCat("worker '", it->second, "' incarnation ", incarnation, " is ",
                                                      v1::WorkerState_Name(w.info.state()), "; register again"));
  }
  return &w;
}

absl::Status WorkerRegistry::OpenSession(int64_t worker_id, int64_t incarnation,
                                         std::shared_ptr<SessionHandle> session) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Worker*> w = FindLocked(worker_id, incarnation);
  if (!w.ok()) return w.status();
  if ((*w)->session != nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("worker '", (*w)->info.name(), "' already has a session; register again"));
  }
  (*w)->session = std::move(session);
  (*w)->info.set_state(v1::READY);
  (*w)->last_heartbeat = clock_->Now();
  return absl::OkStatus();
}

absl::Status WorkerRegistry::Heartbeat(int64_t worker_id, int64_t incarnation, const v1::Heartbeat& heartbeat) {
  return Renew(worker_id, incarnation, std::max<int64_t>(0, heartbeat.step()));
}

absl::Status WorkerRegistry::Renew(int64_t worker_id, int64_t incarnation, int64_t step) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Worker*> w = FindLocked(worker_id, incarnation);
  if (!w.ok()) return w.status();
  (*w)->last_heartbeat = clock_->Now();
  if (step >= 0) (*w)->info.set_step(step);
  return absl::OkStatus();
}

absl::Status WorkerRegistry::Goodbye(int64_t worker_id, int64_t incarnation) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Worker*> w = FindLocked(worker_id, incarnation);
  if (!w.ok()) return w.status();
  (*w)->info.set_state(v1::DRAINING);
  return absl::OkStatus();
}

std::string WorkerRegistry::SessionEnded(int64_t worker_id, int64_t incarnation, const SessionHandle* session) {
  absl::MutexLock lock(&mu_);
  auto it = name_of_id_.find(worker_id);
  if (it == name_of_id_.end()) return "";
  Worker& w = by_name_[it->second];
  if (w.info.incarnation() != incarnation || w.session.get() != session) return "";
  w.session.reset();
  w.ended = clock_->Now();
  if (w.info.state() == v1::DRAINING) {
    w.info.set_state(v1::LEFT);
  } else if (w.info.state() != v1::LEFT) {
    w.info.set_state(v1::LOST);
  }
  return it->second;
}

std::string WorkerRegistry::NameOf(int64_t worker_id) const {
  absl::MutexLock lock(&mu_);
  auto it = name_of_id_.find(worker_id);
  return it == name_of_id_.end() ? "" : it->second;
}

std::shared_ptr<SessionHandle> WorkerRegistry::SessionOf(const std::string& name) const {
  absl::MutexLock lock(&mu_);
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : it->second.session;
}

std::vector<std::shared_ptr<SessionHandle>> WorkerRegistry::SessionsOf(const std::vector<std::string>& names) const {
  std::vector<std::shared_ptr<SessionHandle>> sessions;
  sessions.reserve(names.size());
  absl::MutexLock lock(&mu_);
  for (const std::string& name : names) {
    auto it = by_name_.find(name);
    sessions.push_back(it == by_name_.end() ? nullptr : it->second.session);
  }
  return sessions;
}

std::vector<WorkerRegistry::Expired> WorkerRegistry::ExpireLeases(absl::Duration* stalled) {
  std::vector<Expired> expired;
  const absl::Time now = clock_->Now();
  absl::MutexLock lock(&mu_);
  const absl::Duration gap = now - last_sweep_;
  last_sweep_ = now;
  if (gap > lease_) {
    // We were not running: the silence is ours, not the workers'.
    for (auto& [name, w] : by_name_) w.last_heartbeat = std::max(w.last_heartbeat, now);
    if (stalled != nullptr) *stalled = gap;
    return expired;
  }
  for (auto it = by_name_.begin(); it != by_name_.end();) {
    Worker& w = it->second;
    const v1::WorkerState s = w.info.state();
    if ((s == v1::LOST || s == v1::LEFT) && now - w.ended > limits_.forget_after) {
      name_of_id_.erase(w.info.worker_id());
      by_name_.erase(it++);
      continue;
    }
    ++it;
    if (s != v1::JOINING && s != v1::READY && s != v1::DRAINING) continue;
    if (now - w.last_heartbeat <= lease_) continue;
    w.info.set_state(v1::LOST);
    w.ended = now;
    expired.push_back({w.info.name(), std::move(w.session)});
  }
  return expired;
}

std::vector<std::shared_ptr<SessionHandle>> WorkerRegistry::Sessions() const {
  std::vector<std::shared_ptr<SessionHandle>> all;
  absl::MutexLock lock(&mu_);
  for (const auto& [name, w] : by_name_) {
    if (w.session != nullptr) all.push_back(w.session);
  }
  return all;
}

std::vector<v1::WorkerInfo> WorkerRegistry::List() const {
  const absl::Time now = clock_->Now();
  std::vector<v1::WorkerInfo> out;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [name, w] : by_name_) {
      out.push_back(w.info);
      out.back().set_last_heartbeat_age_seconds(absl::ToDoubleSeconds(now - w.last_heartbeat));
    }
  }
  std::sort(out.begin(), out.end(), [](const v1::WorkerInfo& a, const v1::WorkerInfo& b) { return a.name() < b.name(); });
  return out;
}

std::map<v1::WorkerState, int> WorkerRegistry::CountByState() const {
  std::map<v1::WorkerState, int> counts;
  absl::MutexLock lock(&mu_);
  for (const auto& [name, w] : by_name_) ++counts[w.info.state()];
  return counts;
}

}  // namespace baton
