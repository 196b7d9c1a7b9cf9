// Fuzzes the coordinator's RPC handlers: each input is decoded into a
// sequence of RPCs sent through gRPC's in-process channel to a real
// CoordinatorService over a real WorkerRegistry, KvStore and (optionally) a
// running JobRunner, all fresh for the input. Asserted: the process never
// crashes, hangs or grows without bound, and every reply is OK or a status
// that carries a message. Every call has a ~50 ms deadline, so an input
// takes milliseconds.
//
// The input is a byte-level script (every byte string is a valid one):
//   header byte: bit 0 a JobRunner drives a synthetic job; bit 1 the job
//     has 2 pipeline stages (else 1); bit 2 worker RPCs need a join token;
//     bit 3 calls carry a wrong token.
//   then up to kMaxOps ops, each an op byte (mod 12) and its arguments:
//    0 Register      flags, name, [device], [host], pid, [memory], [held job], [raw proto merged in]
//    1 OpenSession   slot, who (a registration, or raw ids), [raw first message]
//    2 Send          slot, kind: heartbeat, goodbye, the answer to the last
//                    command (ok / with an error and code; a RunStep with a
//                    verdict: which half, or the StepDone in the report; 0-2
//                    member reports in the report), a raw message
//                    (own / raw ids), a snapshot, a heartbeat with wrong ids,
//                    a raw Fragment (fuzzed index, count, total_bytes, data),
//                    a snapshot over 3 MiB as its fragments (all; one left
//                    out; a heartbeat between two; the last one repeated)
//    3 Await         slot: waits up to 20 ms for a command on the session
//    4 CloseSession  slot, clean (WritesDone) or cancelled
//    5 KvSet  6 KvGet  7 KvAdd  8 KvWait (0-3 keys, timeout 0-19 ms)
//    9 GetStatus / ListWorkers   10 GetTrace   11 advance the clock and sweep
//      leases (what the coordinator's sweeper thread does)
// A string argument is a length byte and that many bytes; names, jobs and
// keys are usually picked from small pools so that calls collide.
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "baton/v1/coordinator.grpc.pb.h"
#include "common/clock.h"
#include "common/grpc_credentials.h"
#include "common/session_fragments.h"
#include "coordinator/grpc/coordinator_service.h"
#include "coordinator/job_runner.h"
#include "coordinator/job_spec.h"
#include "coordinator/kv_store.h"
#include "coordinator/worker_registry.h"
#include "prometheus/registry.h"

namespace baton {
namespace {

constexpr int kMaxOps = 64;
constexpr int kSlots = 3;
constexpr int kMaxWorkers = 16;  // the registry's limit in this fuzzer
constexpr auto kCallDeadline = std::chrono::milliseconds(50);
constexpr char kJob[] = "fuzz";
constexpr char kToken[] = "fuzz-join-token";

// The script's bytes; reading past the end gives zeros.
class Script {
 public:
  Script(const uint8_t* data, size_t size) : p_(data), n_(size) {}
  bool empty() const { return n_ == 0; }
  uint8_t Byte() {
    if (n_ == 0) return 0;
    --n_;
    return *p_++;
  }
  uint64_t U64() {
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v = (v << 8) | Byte();
    return v;
  }
  std::string Str() {
    const size_t len = std::min<size_t>(Byte(), n_);
    std::string s(reinterpret_cast<const char*>(p_), len);
    p_ += len;
    n_ -= len;
    return s;
  }

 private:
  const uint8_t* p_;
  size_t n_;
};

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "coordinator_rpc_fuzz: %s\n", what.c_str());
  abort();
}

void CheckReply(const char* rpc, const grpc::Status& s) {
  if (!s.ok() && s.error_message().empty()) {
    Die(absl::StrCat(rpc, " returned status ", s.error_code(), " without a message"));
  }
}

// A request with invalid UTF-8 in a string field does not parse on the
// server: gRPC answers INTERNAL without a message before any handler runs.
// That is gRPC's reply, not the coordinator's, so it is let through.
void CheckReply(const char* rpc, const grpc::Status& s, const google::protobuf::Message& request) {
  std::unique_ptr<google::protobuf::Message> copy(request.New());
  if (!s.ok() && s.error_code() == grpc::StatusCode::INTERNAL && !copy->ParseFromString(request.SerializeAsString())) {
    return;
  }
  CheckReply(rpc, s);
}

v1::JobSpec FuzzJob(int pp) {
  const std::string text = absl::StrCat(
      "name: \"", kJob, "\"\n",
      "model { layers: 2 synthetic { forward_ms: 0 backward_input_ms: 0 backward_weight_ms: 0 "
      "activation_bytes: 16 } }\n",
      "parallel { pp: ", pp, " tp: 1 dp: 1 }\n",
      "schedule { kind: \"1f1b\" microbatches: 2 }\n",
      "train { steps: 3 micro_batch_size: 1 lr: 0.001 seed: 1 }\n",
      "fault_tolerance { replacement_timeout_s: 1 max_restarts: 2 }\n");
  absl::StatusOr<v1::JobSpec> job = ParseJobSpec(text, "fuzz job");
  if (!job.ok()) Die(absl::StrCat("the fuzz job does not parse: ", job.status().ToString()));
  if (absl::Status s = ValidateJobSpec(*job); !s.ok()) Die(absl::StrCat("the fuzz job is invalid: ", s.ToString()));
  return *job;
}

// The job runner's time: every reading moves it on by 20 ms, so the runner's
// waits (which poll the clock every few ms) pass about ten times faster than
// real time and its timeouts fire within an input's run. The registry's
// leases use a FakeClock that only the script advances.
class RushingClock : public Clock {
 public:
  absl::Time Now() const override {
    return absl::UnixEpoch() + absl::Hours(24) + absl::Microseconds(now_us_.fetch_add(20000));
  }

 private:
  mutable std::atomic<int64_t> now_us_{0};
};

// One in-process gRPC server serves every input (building one costs more
// than most inputs): it forwards each RPC to the current input's
// CoordinatorService and counts the handlers still running, so an input ends
// only when all of its handlers have returned (and, for Session streams,
// which run on gRPC's callback API, when the service saw them done).
class Forwarder final : public v1::Coordinator::WithCallbackMethod_Session<v1::Coordinator::Service> {
 public:
  void Set(CoordinatorService* service) {
    absl::MutexLock lock(&mu_);
    service_ = service;
  }
  // Waits until no handler runs; false after `timeout`.
  bool AwaitIdle(absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return running_ == 0; };
    return mu_.AwaitWithTimeout(absl::Condition(&idle), timeout);
  }

  grpc::Status Register(grpc::ServerContext* c, const v1::RegisterRequest* q, v1::RegisterResponse* r) override {
    return Call([&](CoordinatorService* s) { return s->Register(c, q, r); });
  }
  grpc::ServerBidiReactor<v1::WorkerMessage, v1::CoordinatorMessage>* Session(
      grpc::CallbackServerContext* c) override {
    {
      absl::MutexLock lock(&mu_);
      if (service_ != nullptr) return service_->Session(c);
    }
    // Between inputs: refused at once.
    class Refused final : public grpc::ServerBidiReactor<v1::WorkerMessage, v1::CoordinatorMessage> {
     public:
      Refused() { Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "fuzz: between inputs")); }
      void OnDone() override { delete this; }
    };
    return new Refused;
  }
  grpc::Status KvSet(grpc::ServerContext* c, const v1::KvSetRequest* q, v1::KvSetResponse* r) override {
    return Call([&](CoordinatorService* s) { return s->KvSet(c, q, r); });
  }
  grpc::Status KvGet(grpc::ServerContext* c, const v1::KvGetRequest* q, v1::KvGetResponse* r) override {
    return Call([&](CoordinatorService* s) { return s->KvGet(c, q, r); });
  }
  grpc::Status KvWait(grpc::ServerContext* c, const v1::KvWaitRequest* q, v1::KvWaitResponse* r) override {
    return Call([&](CoordinatorService* s) { return s->KvWait(c, q, r); });
  }
  grpc::Status KvAdd(grpc::ServerContext* c, const v1::KvAddRequest* q, v1::KvAddResponse* r) override {
    return Call([&](CoordinatorService* s) { return s->KvAdd(c, q, r); });
  }
  grpc::Status GetStatus(grpc::ServerContext* c, const v1::GetStatusRequest* q, v1::GetStatusResponse* r) override {
    return Call([&](CoordinatorService* s) { return s->GetStatus(c, q, r); });
  }
  grpc::Status ListWorkers(grpc::ServerContext* c, const v1::ListWorkersRequest* q,
                           v1::ListWorkersResponse* r) override {
    return Call([&](CoordinatorService* s) { return s->ListWorkers(c, q, r); });
  }
  grpc::Status GetTrace(grpc::ServerContext* c, const v1::GetTraceRequest* q, v1::GetTraceResponse* r) override {
    return Call([&](CoordinatorService* s) { return s->GetTrace(c, q, r); });
  }

 private:
  template <typename F>
  grpc::Status Call(F f) {
    CoordinatorService* service;
    {
      absl::MutexLock lock(&mu_);
      service = service_;
      if (service == nullptr) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "fuzz: between inputs");
      ++running_;
    }
    grpc::Status s = f(service);
    absl::MutexLock lock(&mu_);
    --running_;
    return s;
  }

  absl::Mutex mu_;
  CoordinatorService* service_ ABSL_GUARDED_BY(mu_) = nullptr;
  int running_ ABSL_GUARDED_BY(mu_) = 0;
};

struct Shared {
  Forwarder forwarder;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<v1::Coordinator::Stub> stub;
};

Shared* GetShared() {
  static Shared* shared = [] {
    auto* s = new Shared;
    grpc::ServerBuilder builder;
    // Few polling threads that stay: gRPC's thread manager starting and
    // retiring threads between inputs shows up in libFuzzer's per-input leak
    // check (third_party/sanitizers/lsan.supp).
    builder.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::NUM_CQS, 1);
    builder.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::MIN_POLLERS, 1);
    builder.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::MAX_POLLERS, 64);
    builder.RegisterService(&s->forwarder);
    s->server = builder.BuildAndStart();
    if (s->server == nullptr) Die("the in-process gRPC server did not start");
    s->stub = v1::Coordinator::NewStub(s->server->InProcessChannel(grpc::ChannelArguments()));
    return s;
  }();
  return shared;
}

struct Registration {
  std::string name;
  int64_t id = 0, incarnation = 0;
};

// One worker's Session stream; a thread reads what the coordinator sends.
class Session {
 public:
  Session(v1::Coordinator::Stub* stub, const std::string& token, Registration who) : who_(std::move(who)) {
    // A backstop only: sessions are closed long before.
    ctx_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    if (!token.empty()) ctx_.AddMetadata(kJoinTokenMetadata, token);
    stream_ = stub->Session(&ctx_);
    reader_ = std::thread([this] {
      v1::CoordinatorMessage m;
      while (stream_->Read(&m)) {
        if (m.has_ack()) continue;
        absl::MutexLock lock(&mu_);
        commands_.push_back(m);
        if (commands_.size() > 16) commands_.pop_front();
        ++received_;
      }
    });
  }
  ~Session() { Close(/*clean=*/false); }

  const Registration& who() const { return who_; }
  bool Write(const v1::WorkerMessage& m) { return !closed_ && stream_->Write(m); }

  // Waits up to `timeout` for a command not seen by an earlier Await.
  void Await(absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    auto more = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return received_ > awaited_; };
    mu_.AwaitWithTimeout(absl::Condition(&more), timeout);
    awaited_ = received_;
  }
  // The newest command (an empty message when none came).
  v1::CoordinatorMessage Last() {
    absl::MutexLock lock(&mu_);
    return commands_.empty() ? v1::CoordinatorMessage() : commands_.back();
  }

  void Close(bool clean) {
    if (closed_) return;
    closed_ = true;
    if (clean) {
      stream_->WritesDone();
    } else {
      ctx_.TryCancel();
    }
    reader_.join();
    CheckReply("Session", stream_->Finish());
  }

 private:
  const Registration who_;
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::WorkerMessage, v1::CoordinatorMessage>> stream_;
  std::thread reader_;
  bool closed_ = false;
  absl::Mutex mu_;
  std::deque<v1::CoordinatorMessage> commands_ ABSL_GUARDED_BY(mu_);
  int64_t received_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t awaited_ ABSL_GUARDED_BY(mu_) = 0;
};

class Run {
 public:
  Run(Script* in) : in_(in) {
    const uint8_t header = in_->Byte();
    // The join token and roles are checked in the transport (rpc_authorization,
    // with its own tests), which the in-process channel bypasses; the metadata
    // still travels so handlers see what real workers send.
    token_ = (header & 8) ? "wrong" : ((header & 4) ? kToken : "");
    options_.heartbeat = absl::Milliseconds(500);
    options_.max_kv_wait = absl::Milliseconds(50);
    options_.job_name = kJob;
    options_.max_pending_kv_waits = 4;
    options_.max_pending_traces = 2;
    options_.metrics = &metrics_;
    if (header & 1) {
      JobRunner::Options job_options;
      job_options.ready_timeout = absl::Seconds(2);
      job_options.configure_timeout = absl::Seconds(2);
      job_options.step_timeout = absl::Seconds(2);
      job_options.settle = absl::Milliseconds(10);
      job_options.fetch_timeout = absl::Seconds(1);
      job_options.poll = absl::Milliseconds(1);
      job_options.adopt_grace = absl::Seconds(1);
      job_options.report_groups_min_ranks = 1;
      job_workers_ = MakeRegistryJobWorkers(&registry_, &kv_, kJob);
      runner_ = std::make_unique<JobRunner>(FuzzJob((header & 2) ? 2 : 1), job_workers_.get(), &job_clock_, job_options,
                                            metrics_);
      options_.job = runner_.get();
    }
    service_ = std::make_unique<CoordinatorService>(&registry_, &kv_, options_);
    shared_->forwarder.Set(service_.get());
    if (runner_) runner_->Start();
  }

  ~Run() {
    for (auto& s : sessions_) s.reset();
    // Every call had a 50 ms deadline and every session is cancelled: a
    // handler still running seconds later is a hang.
    if (!shared_->forwarder.AwaitIdle(absl::Seconds(5))) Die("an RPC handler still runs 5 s after its deadline");
    shared_->forwarder.Set(nullptr);
    if (!service_->AwaitSessionsDone(absl::Seconds(5))) Die("a Session stream is still open 5 s after its cancel");
    if (runner_) runner_->Stop();
  }

  void Go() {
    for (int op = 0; op < kMaxOps && !in_->empty(); ++op) Step(in_->Byte() % 12);
  }

 private:
  void Prepare(grpc::ClientContext* ctx) {
    ctx->set_deadline(std::chrono::system_clock::now() + kCallDeadline);
    if (!token_.empty()) ctx->AddMetadata(kJoinTokenMetadata, token_);
  }

  // The registry holds at most kMaxWorkers names, whatever was registered.
  static void CheckBounded(int listed) {
    if (listed > kMaxWorkers) Die(absl::StrCat(listed, " workers listed; the registry's limit is ", kMaxWorkers));
  }

  std::string Name() {
    const uint8_t b = in_->Byte();
    return b % 8 < 6 ? absl::StrCat("w", b % 3) : in_->Str();
  }

  v1::KvKey Key() {
    v1::KvKey key;
    const uint8_t j = in_->Byte();
    switch (j % 4) {
      case 0: key.set_job(kJob); break;
      case 1: key.set_job("other"); break;
      case 2: break;
      default: key.set_job(in_->Str()); break;
    }
    switch (in_->Byte() % 6) {
      case 0: key.set_generation(0); break;
      case 1: key.set_generation(1); break;
      case 2: key.set_generation(kv_.CurrentGeneration(kJob)); break;
      case 3: key.set_generation(kv_.CurrentGeneration(kJob) + 1); break;
      case 4: key.set_generation(std::numeric_limits<int64_t>::max()); break;
      default: key.set_generation(static_cast<int64_t>(in_->U64())); break;
    }
    const uint8_t k = in_->Byte();
    key.set_key(k & 0x80 ? in_->Str() : absl::StrCat("k", k % 4));
    return key;
  }

  void Step(int op) {
    switch (op) {
      case 0: Register(); break;
      case 1: OpenSession(); break;
      case 2: Send(); break;
      case 3: {
        Session* s = sessions_[in_->Byte() % kSlots].get();
        if (s != nullptr) s->Await(absl::Milliseconds(20));
        break;
      }
      case 4: {
        auto& s = sessions_[in_->Byte() % kSlots];
        if (s != nullptr) s->Close(/*clean=*/in_->Byte() & 1);
        s.reset();
        break;
      }
      case 5: {
        grpc::ClientContext ctx;
        Prepare(&ctx);
        v1::KvSetRequest req;
        *req.mutable_key() = Key();
        req.set_value(in_->Str());
        v1::KvSetResponse resp;
        CheckReply("KvSet", stub_->KvSet(&ctx, req, &resp), req);
        break;
      }
      case 6: {
        grpc::ClientContext ctx;
        Prepare(&ctx);
        v1::KvGetRequest req;
        *req.mutable_key() = Key();
        v1::KvGetResponse resp;
        CheckReply("KvGet", stub_->KvGet(&ctx, req, &resp), req);
        break;
      }
      case 7: {
        grpc::ClientContext ctx;
        Prepare(&ctx);
        v1::KvAddRequest req;
        *req.mutable_key() = Key();
        const uint8_t d = in_->Byte();
        req.set_delta(d & 0x80 ? static_cast<int64_t>(in_->U64()) : static_cast<int64_t>(d) - 64);
        v1::KvAddResponse resp;
        CheckReply("KvAdd", stub_->KvAdd(&ctx, req, &resp), req);
        break;
      }
      case 8: {
        grpc::ClientContext ctx;
        Prepare(&ctx);
        v1::KvWaitRequest req;
        const int n = in_->Byte() % 4;  // 0 keys is invalid on purpose
        for (int i = 0; i < n; ++i) *req.add_keys() = Key();
        const uint8_t t = in_->Byte();
        req.set_timeout_ms(t & 0x80 ? -1 : t % 20);
        v1::KvWaitResponse resp;
        CheckReply("KvWait", stub_->KvWait(&ctx, req, &resp), req);
        break;
      }
      case 9: {
        grpc::ClientContext ctx;
        Prepare(&ctx);
        if (in_->Byte() & 1) {
          v1::ListWorkersResponse resp;
          CheckReply("ListWorkers", stub_->ListWorkers(&ctx, {}, &resp));
          CheckBounded(resp.workers_size());
        } else {
          v1::GetStatusResponse resp;
          CheckReply("GetStatus", stub_->GetStatus(&ctx, {}, &resp));
          CheckBounded(resp.workers_size());
        }
        break;
      }
      case 10: {
        grpc::ClientContext ctx;
        Prepare(&ctx);
        v1::GetTraceRequest req;
        const int32_t steps[] = {1, 3, 0, -1, 1001};
        const uint8_t b = in_->Byte();
        req.set_steps(b < 5 ? steps[b] : static_cast<int32_t>(in_->U64()));
        v1::GetTraceResponse resp;
        CheckReply("GetTrace", stub_->GetTrace(&ctx, req, &resp), req);
        break;
      }
      default: Sweep(absl::Milliseconds(100) * in_->Byte()); break;
    }
  }

  void Register() {
    const uint8_t flags = in_->Byte();
    v1::RegisterRequest req;
    req.set_name(Name());
    req.set_device(flags & 1 ? in_->Str() : "cpu");
    req.set_host(flags & 2 ? in_->Str() : "fuzzhost");
    req.set_pid(in_->Byte());
    req.set_memory_bytes(flags & 4 ? static_cast<int64_t>(in_->U64()) : int64_t{8} << 30);
    if (flags & 64) req.set_device_uuid(in_->Str());  // GPU identity: the planner's NCCL choice and memory pools
    if (flags & 128) {  // verdicts then ride inside RunStep; a 2-stage job of two such workers runs in report groups
      req.set_verdict_in_run_step(true);
      req.set_report_groups(true);
      req.set_report_group_columns(true);
    }
    if (flags & 16) {  // what a worker holds of the job after a coordinator restart (adoption)
      v1::HeldJob* held = req.mutable_held();
      held->set_job(flags & 32 ? "other" : kJob);
      const uint8_t g = in_->Byte();
      held->set_generation(g & 0x80 ? static_cast<int64_t>(in_->U64()) : g);
      held->set_pp_rank(in_->Byte() % 3);
      for (int i = in_->Byte() % 4; i > 0; --i) held->add_steps(in_->Byte());
    }
    if (flags & 8) req.MergeFromString(in_->Str());  // garbage or any field
    grpc::ClientContext ctx;
    Prepare(&ctx);
    v1::RegisterResponse resp;
    const grpc::Status s = stub_->Register(&ctx, req, &resp);
    CheckReply("Register", s, req);
    if (s.ok()) {
      registrations_.push_back({req.name(), resp.worker_id(), resp.incarnation()});
      if (registrations_.size() > 8) registrations_.erase(registrations_.begin());
    }
  }

  void OpenSession() {
    auto& slot = sessions_[in_->Byte() % kSlots];
    slot.reset();
    const uint8_t who = in_->Byte();
    Registration r;
    if (!registrations_.empty() && !(who & 0x40)) {
      r = registrations_[who % registrations_.size()];
    } else {
      r.name = "w0";
      r.id = static_cast<int64_t>(in_->U64());
      r.incarnation = static_cast<int64_t>(in_->U64());
    }
    v1::WorkerMessage first;
    if (who & 0x80) first.ParseFromString(in_->Str());
    first.set_worker_id(r.id);
    first.set_incarnation(r.incarnation);
    if (!(who & 0x80)) first.mutable_heartbeat()->set_send_time_us(1);
    slot = std::make_unique<Session>(stub_, token_, r);
    slot->Write(first);
  }

  // The answer a worker gives to `command`; `error` makes it a failure.
  v1::WorkerMessage Answer(const Registration& who, const v1::CoordinatorMessage& c, const std::string& error,
                           int32_t code) {
    v1::WorkerMessage m;
    m.set_worker_id(who.id);
    m.set_incarnation(who.incarnation);
    if (c.has_configure()) generation_ = c.configure().plan().generation();
    switch (c.body_case()) {
      case v1::CoordinatorMessage::kConfigure: {
        v1::Configured* r = m.mutable_configured();
        r->set_ok(error.empty());
        r->set_error(error);
        r->set_generation(generation_);
        r->set_code(code);
        break;
      }
      case v1::CoordinatorMessage::kRunStep: {
        // A RunStep carrying the previous step's verdict stands for two
        // commands: answer either (bit 0), or the step with the verdict's
        // StepDone inside its report (bit 1; asked for or not).
        v1::StepReport* r = m.mutable_report();
        if (c.run_step().has_commit() || c.run_step().has_discard()) {
          const uint8_t how = in_->Byte();
          v1::CoordinatorMessage verdict;
          if (c.run_step().has_commit()) *verdict.mutable_commit() = c.run_step().commit();
          if (c.run_step().has_discard()) *verdict.mutable_discard() = c.run_step().discard();
          if (how & 1) return Answer(who, verdict, error, code);
          if (how & 2) *r->mutable_step_done() = Answer(who, verdict, error, code).step_done();
        }
        r->set_step(c.run_step().step());
        r->set_generation(generation_);
        r->set_loss(1.0 / (1 + c.run_step().step()));
        r->set_grad_sq_norm(code == 7 ? std::numeric_limits<double>::infinity() : 0.5);
        r->set_has_loss(true);
        r->set_finite(code != 7);
        r->set_tokens(4);
        r->set_correct(1);
        r->set_predicted(2);
        r->set_error(error);
        r->set_code(code);
        // A leader's report: one or two member reports (a copy of its own), right or wrong for the group.
        const v1::StepReport own = *r;
        for (int i = in_->Byte() % 3; i > 0; --i) *r->add_members() = own;
        break;
      }
      case v1::CoordinatorMessage::kCommit:
      case v1::CoordinatorMessage::kDiscard: {
        v1::StepDone* r = m.mutable_step_done();
        r->set_step(c.has_commit() ? c.commit().step() : c.discard().step());
        r->set_committed(c.has_commit());
        r->set_generation(generation_);
        r->set_wall_seconds(0.001);
        r->set_error(error);
        r->set_code(code);
        break;
      }
      case v1::CoordinatorMessage::kSaveWeights: {
        v1::Saved* r = m.mutable_saved();
        r->set_ok(error.empty());
        r->set_error(error);
        r->set_step(c.save_weights().step());
        r->set_generation(generation_);
        r->add_files("chunk0-tp0.safetensors");
        break;
      }
      case v1::CoordinatorMessage::kFetchState: {
        v1::ShardSnapshot* r = m.mutable_fetched_state();
        r->set_owner(c.fetch_state().owner());
        r->set_step(c.fetch_state().step());
        r->set_generation(generation_);
        r->set_error(error);
        r->set_code(code);
        if (error.empty()) r->set_data(in_->Str());
        break;
      }
      default:
        m.mutable_heartbeat()->set_send_time_us(2);
        break;
    }
    return m;
  }

  void Send() {
    Session* s = sessions_[in_->Byte() % kSlots].get();
    const uint8_t kind = in_->Byte();
    if (s == nullptr) return;
    const Registration& who = s->who();
    v1::WorkerMessage m;
    m.set_worker_id(who.id);
    m.set_incarnation(who.incarnation);
    switch (kind % 10) {
      case 0:
        m.mutable_heartbeat()->set_step(in_->Byte());
        m.mutable_heartbeat()->set_send_time_us(3);
        break;
      case 1: m.mutable_goodbye()->set_reason("fuzz"); break;
      case 2: m = Answer(who, s->Last(), "", 0); break;
      case 3: {
        std::string error = in_->Str();
        if (error.empty()) error = "fuzz failure";
        const int32_t code = static_cast<int32_t>(in_->Byte()) - 8;
        m = Answer(who, s->Last(), error, code);
        break;
      }
      case 4:
        m.ParseFromString(in_->Str());
        m.set_worker_id(who.id);
        m.set_incarnation(who.incarnation);
        break;
      case 5: m.ParseFromString(in_->Str()); break;
      case 6: {
        v1::ShardSnapshot* snap = m.mutable_snapshot();
        snap->set_owner(kind & 0x80 ? in_->Str() : who.name);
        snap->set_step(in_->Byte());
        snap->set_generation(generation_);
        snap->set_data(in_->Str());
        break;
      }
      case 8: {
        v1::Fragment* f = m.mutable_fragment();
        f->set_index(static_cast<int8_t>(in_->Byte()));
        f->set_count(static_cast<int8_t>(in_->Byte()));
        const uint8_t total = in_->Byte();
        f->set_total_bytes(total & 0x80 ? static_cast<int64_t>(in_->U64())
                                        : static_cast<int64_t>(kFragmentPayloadBytes) + total - 64);
        f->set_data(in_->Str());
        break;
      }
      case 9: {
        // A snapshot just over the fragment payload, as its fragments.
        const uint8_t how = in_->Byte();
        v1::ShardSnapshot* snap = m.mutable_snapshot();
        snap->set_owner(who.name);
        snap->set_step(in_->Byte());
        snap->set_generation(generation_);
        std::string data = in_->Str();
        data.resize(kFragmentPayloadBytes + data.size(), 's');
        snap->set_data(std::move(data));
        std::vector<v1::Fragment> fragments = SplitIntoFragments(m.SerializeAsString());
        const size_t skip = (how & 1) ? (how >> 4) % fragments.size() : fragments.size();
        for (size_t i = 0; i < fragments.size(); ++i) {
          if (i == skip) continue;
          v1::WorkerMessage piece;
          piece.set_worker_id(who.id);
          piece.set_incarnation(who.incarnation);
          *piece.mutable_fragment() = fragments[i];
          if (!s->Write(piece)) return;
          if (i == 0 && (how & 2)) {
            v1::WorkerMessage beat;
            beat.set_worker_id(who.id);
            beat.set_incarnation(who.incarnation);
            beat.mutable_heartbeat()->set_send_time_us(4);
            if (!s->Write(beat)) return;
          }
        }
        if (!(how & 4)) return;
        m.set_worker_id(who.id);
        m.set_incarnation(who.incarnation);
        *m.mutable_fragment() = fragments.back();  // a repeat of the last one
        break;
      }
      default:
        m.set_incarnation(who.incarnation + 1);
        m.mutable_heartbeat();
        break;
    }
    s->Write(m);
  }

  // What the coordinator's sweeper thread does (coordinator/main.cc).
  void Sweep(absl::Duration advance) {
    clock_.Advance(advance);
    for (WorkerRegistry::Expired& e : registry_.ExpireLeases()) {
      if (e.session) e.session->Close(absl::DeadlineExceededError("lease expired"));
      if (runner_) runner_->OnWorkerLost(e.name, "no heartbeat within its lease", /*hung=*/true);
    }
  }

  Script* const in_;
  Shared* const shared_ = GetShared();
  v1::Coordinator::Stub* const stub_ = shared_->stub.get();
  FakeClock clock_;
  RushingClock job_clock_;
  prometheus::Registry metrics_;
  WorkerRegistry registry_{&clock_, absl::Seconds(3), /*first_id=*/100,
                           WorkerRegistry::Limits{kMaxWorkers, /*forget_after=*/absl::Seconds(30)}};
  KvStore kv_;
  CoordinatorService::Options options_;
  std::unique_ptr<JobWorkers> job_workers_;
  std::unique_ptr<JobRunner> runner_;
  std::unique_ptr<CoordinatorService> service_;
  std::string token_;
  std::vector<Registration> registrations_;
  std::unique_ptr<Session> sessions_[kSlots];
  int64_t generation_ = 0;
};

}  // namespace
}  // namespace baton

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  baton::Script script(data, size);
  baton::Run run(&script);
  run.Go();
  return 0;
}
