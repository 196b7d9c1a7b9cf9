// WorkerAgent: the worker's session with the coordinator.
//
// Registers, opens the Session stream and heartbeats on it (when the
// coordinator says any message renews the lease, only when nothing else went
// out for a heartbeat period, and at least every kMaxSkippedHeartbeats + 1
// periods for the clock offset; else every period); when the stream
// ends for any reason (coordinator restart, lease expiry, network) it
// registers again with exponential backoff and never exits on its own.
// Commands pushed by the coordinator go to the handler given at construction.
// A message over 3 MiB (a snapshot, a fetched state; a Configure with a
// state) crosses as fragments both ways (common/session_fragments.h); a bad
// fragment stream from the coordinator ends the session as broken.
//
// A coordinator that goes silent (frozen, partitioned) makes the worker not
// ready once nothing came from it for a lease, no ack nor command (counted in
// baton_coordinator_unresponsive_total); the stream itself is kept, so a
// coordinator that resumes finds its workers still there. gRPC keepalive on
// the channel (see worker/main.cc) ends a connection whose peer is gone.
//
// Thread-safe: Run() blocks in one thread; Stop() and Readiness() may be
// called from any other.
#ifndef BATON_WORKER_AGENT_H_
#define BATON_WORKER_AGENT_H_

#include <functional>
#include <cstdint>
#include <memory>
#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "baton/v1/coordinator.grpc.pb.h"
#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/registry.h"

namespace baton {

class WorkerAgent {
 public:
  struct Options {
    std::string coordinator;  // HOST:PORT
    std::string name;
    std::string host;
    std::string device = "cpu";
    int http_port = 0;
    int64_t memory_bytes = 0;
    std::string device_uuid;  // the GPU's UUID (kernels::DescribeCudaDevice); empty for cpu or unknown
    // Its bf16 attention keeps the softmax stats and o, not P
    // (kernels::DescribeCudaDevice); false for cpu or unknown.
    bool fused_attention_bf16 = false;
    absl::Duration rpc_timeout = absl::Seconds(5);
    absl::Duration backoff_min = absl::Milliseconds(100);
    absl::Duration backoff_max = absl::Seconds(2);
    // Adds what this worker holds to each registration (job adoption by a
    // restarted coordinator); may be null.
    std::function<void(v1::RegisterRequest*)> describe;
  };
  // Runs on the session's reader thread: it must not block.
  using CommandHandler = std::function<void(const v1::CoordinatorMessage&)>;

  // Metrics are registered in `metrics`; `on_command` (commands pushed by
  // the coordinator) and `on_session_end` (after a session that was open
  // ended) may be null.
  WorkerAgent(Options options, std::shared_ptr<grpc::Channel> channel, prometheus::Registry& metrics,
              CommandHandler on_command = nullptr, std::function<void()> on_session_end = nullptr);

  // Runs sessions until Stop(). Returns when stopped.
  void Run();

  // Says goodbye on the open session (if any), closes it and makes Run()
  // return within `grace` (the stream is cancelled after that).
  void Stop(absl::Duration grace = absl::Seconds(2));

  // OK while a session is open; otherwise why not (e.g. coordinator unreachable).
  absl::Status Readiness() const;

  // Heartbeats left out in a row at most while other messages renew the lease.
  static constexpr int kMaxSkippedHeartbeats = 9;
  // Whether a heartbeat goes out now: always when the coordinator renews
  // leases on heartbeats only (`any_message_renews_lease` false in its
  // RegisterResponse); else when nothing else went out for a `period`
  // (`since_sent` ago), or after kMaxSkippedHeartbeats left out.
  static bool HeartbeatDue(bool any_message_renews_lease, absl::Duration since_sent, absl::Duration period,
                           int skipped) {
    return !any_message_renews_lease || since_sent >= period || skipped >= kMaxSkippedHeartbeats;
  }

  // The training step heartbeats report (the last one this worker ran).
  void SetStep(int64_t step);

  // Sends `message` on the open session (ids filled in), as its fragments in
  // a row when it is over kFragmentPayloadBytes; false when none is open (or
  // the message is over kMaxFragmentedMessageBytes). Blocks until written.
  bool Send(v1::WorkerMessage message);

  // Now on the coordinator's clock (microseconds since the Unix epoch), from
  // the heartbeat round trip with the smallest delay seen recently (NTP-style
  // offset = coordinator_time - (send + receive) / 2).
  int64_t CoordinatorNowMicros() const;

 private:
  // One Register + Session; returns why it ended.
  absl::Status RunSession(bool* opened);
  void Heartbeats(grpc::ClientReaderWriter<v1::WorkerMessage, v1::CoordinatorMessage>* stream,
                  const v1::RegisterResponse& reg, absl::Duration period);

  const Options options_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;

  CommandHandler on_command_;
  std::function<void()> on_session_end_;
  prometheus::Counter* heartbeats_;
  prometheus::Counter* heartbeats_left_out_;
  prometheus::Counter* reconnects_;
  prometheus::Counter* unresponsive_total_;
  prometheus::Gauge* connected_;

  // State; never held across a blocking stream write.
  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool in_session_ ABSL_GUARDED_BY(mu_) = false;    // stream open, heartbeats due
  bool session_open_ ABSL_GUARDED_BY(mu_) = false;  // coordinator acknowledged us
  absl::Status not_ready_ ABSL_GUARDED_BY(mu_) = absl::UnavailableError("not registered yet");
  int64_t step_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t sessions_opened_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time last_heard_ ABSL_GUARDED_BY(mu_);  // any message from the coordinator
  absl::Duration lease_ ABSL_GUARDED_BY(mu_) = absl::Seconds(3);
  bool unresponsive_ ABSL_GUARDED_BY(mu_) = false;
  // Clock offset to the coordinator, from the best recent round trip.
  int64_t clock_offset_us_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t best_rtt_us_ ABSL_GUARDED_BY(mu_) = INT64_MAX;
  absl::Time best_rtt_at_ ABSL_GUARDED_BY(mu_);

  // The open stream; writes are serialised under this lock (gRPC allows one
  // writer and one reader at a time).
  absl::Mutex stream_mu_ ABSL_ACQUIRED_AFTER(mu_);
  grpc::ClientContext* session_ctx_ ABSL_GUARDED_BY(stream_mu_) = nullptr;
  grpc::ClientReaderWriter<v1::WorkerMessage, v1::CoordinatorMessage>* stream_ ABSL_GUARDED_BY(stream_mu_) =
      nullptr;
  v1::RegisterResponse registration_ ABSL_GUARDED_BY(stream_mu_);
  absl::Time last_sent_ ABSL_GUARDED_BY(stream_mu_) = absl::InfinitePast();  // a message other than a heartbeat
};

}  // namespace baton

#endif  // BATON_WORKER_AGENT_H_
