// StepExecutor: runs one worker's schedule Program for a training step and
// accounts for every second of it.
//
// RunStep(n) executes the program's actions in order up to the optimizer:
// F/B/I/W on the StageModel chunks this rank holds, SEND_*/RECV_* on the
// pipeline group (a maximal run of consecutive communication actions is
// posted as one batch and waited for together, the execution model of
// coordinator/schedule/ir.h), REDUCE_GRADS as the tied-embedding sum and the
// data-parallel all-reduce (gradients are averaged over DP replicas; on its
// own stream, ordered by events, where the DP group can reduce the chunk's
// gradients from one). It
// returns the GradsReady report. Commit(n, clip) applies the optimizer with
// the coordinator's clip factor; Discard(n) drops the step's gradients.
//
// Time accounting (DESIGN.md section 7), per step:
//   compute = time in F/B/I/W and the optimizer, minus TP communication inside them
//   comm    = p2p transfers after the peer posted its send (stream-ordered:
//             only while no chunk of this rank computes), TP all-reduces,
//             DP all-reduce
//   bubble  = wall - compute - comm (waiting for a peer, or for the coordinator)
// Compute time is the device's: a chunk whose context has a stream (a GPU, the
// simulated device) gets a pair of events recorded around each action, read
// once the step's results have been waited for (and after the optimizer, at
// Commit), so an action counts the time the device spent on it, not the time
// the host took to enqueue it. A chunk without a stream (the CPU) runs its ops
// inline, and host time around the action is its compute time. The waits for
// a chunk before a send or the DP all-reduce count as neither comm nor compute
// (the device work they wait for is already counted as compute). At pp > 1 the
// tied-embedding sum of a chunk with a stream is timed by an event pair on
// that stream (dp): it may run there (GptStageModel on the simulated device).
// An overlapped pair (an F with overlap_with_next, then a B or I of another
// microbatch; DualPipe's F&B) runs its halves back to back; on the host path
// the forward half's SEND_F is posted right after it, before the backward
// half, so its bytes move while the backward computes (PostEarlySend); the
// batch after the pair then waits for it with the rest.
// Every pipeline message is followed by a small side message (same peer,
// tag | kStampTagBit, one int64) holding the sender's post time on the
// coordinator clock, so a receive that waited splits into bubble (before the
// peer posted) and comm (after); the payload itself is exactly the
// activations or gradients. On the stream path the stamp is device memory
// written on the communication stream just before the batch
// (kernels::StampTime) and the received stamps are read back with the step's
// results (no wait of their own); on the host path it is host memory.
//
// Devices: message buffers live on the device of the chunk that produces or
// consumes them (StageModel::context()). When the chunks have streams and the
// pipeline communicator can carry their buffers from a stream
// (comm::CanEnqueueP2P: the simulated device over a host communicator, as a
// host function on the stream; CUDA memory over NCCL, as one NCCL group on
// the stream), a batch is stream-ordered, with no host wait: each sending chunk records an
// event after the action that filled its buffer, the batch runs on a
// communication stream that waits for those events (comm/stream_p2p.h), and
// each receiving chunk's stream waits for the batch's end event before the
// action that reads it. The batch's comm time is the communication stream's
// (an event pair around it) less the part before the last peer posted (the
// stamps); a failed or timed-out op fails the step at its host wait
// (ReadStepResults), naming the op. Otherwise (the CPU; CUDA memory over a
// host communicator) the sending chunks are synchronised before the batch,
// which is posted and waited for on the host.
// Buffers are pooled and reused across steps (no allocation after the first
// step) and go back to the pool only at the end of a step, after every chunk
// (and the communication stream) has finished. The executor never branches
// on the device.
//
// Data: replica d runs global microbatches d*m .. d*m+m-1 of the step, so a
// DP=k run consumes the same global batch as one replica with k*m microbatches.
//
// Mixture of Experts: once the step's results are read (every chunk idle),
// each chunk's routing counts and load-balancing loss (StageModel::
// ReadMoeStats) are summed over the rank's chunks into the step's StepDone
// (moe_routed_tokens, moe_kept_tokens, moe_aux_loss), a discarded step's too.
//
// Not thread-safe: one thread runs a worker's steps.
#ifndef BATON_WORKER_EXECUTOR_H_
#define BATON_WORKER_EXECUTOR_H_

#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "baton/v1/coordinator.pb.h"
#include "baton/v1/program.pb.h"
#include "kernels/backend.h"
#include "worker/comm/communicator.h"
#include "worker/comm/stream_collectives.h"
#include "worker/comm/stream_p2p.h"
#include "worker/comm/timed_communicator.h"
#include "worker/stage_model.h"

namespace baton {

struct ExecutorOptions {
  int num_stages = 1;  // pp * virtual_stages
  int microbatches = 1;
  // The data replica this rank reads microbatches of (batch index dp_rank ·
  // microbatches + mb), and the size of the group its gradients are
  // averaged over: the dp group's, which under context parallelism is the
  // dp x cp ranks (so dp_size is then dp · cp).
  int dp_rank = 0;
  int dp_size = 1;
  int64_t tokens_per_microbatch = 0;  // micro_batch_size * seq_len
  absl::Duration op_timeout = absl::Minutes(5);
  // Now on the coordinator's clock, in microseconds.
  std::function<int64_t()> clock_us;
  // An evaluator (train.eval_every_steps): the program is forward only
  // (ForwardOnlyProgram), RunStep reduces no gradients, and each chunk drops
  // a microbatch's activations right after its forward (nothing will read
  // them), so an evaluation holds one microbatch's activations per chunk.
  // RunStep's report carries the loss (StepReport.loss, .predicted); nothing
  // of the training state changes but the gradients, which the next step
  // zeroes anyway. Commit and Discard are not for an evaluator.
  bool forward_only = false;
};

// `program` without backward work: its FORWARD, SEND_F and RECV_F actions in
// their order, overlapped pairs undone. Every rank's forwards keep their
// relative order and depend only on forwards, so the result is deadlock-free
// wherever the program is.
v1::Program ForwardOnlyProgram(const v1::Program& program);

// Fills one global microbatch of a step (tokens and targets).
using BatchFn = std::function<absl::Status(int64_t step, int global_microbatch, MicrobatchData* out)>;

class StepExecutor {
 public:
  // `chunks`: stage index -> model, for the stages this rank holds. `pipeline`
  // has one rank per pipeline rank (null when pp == 1); `tp` wraps the TP
  // group the chunks use (null when tp == 1); `dp` the replicas of this
  // (pp, tp) rank (null when dp == 1; the dp x cp ranks under context
  // parallelism); `cp` wraps the context-parallel ring the chunks' attention
  // uses (null when cp == 1): its waits inside an action are cp comm, not
  // compute. Expert parallelism (ep > 1): `edp` is the expert-data-parallel
  // group (the dp ranks holding this rank's experts; null when dp == ep),
  // over which the chunks' expert gradients (StageModel::expert_elements)
  // are summed instead of over `dp`; `ep` wraps the expert group the MoE
  // blocks exchange tokens in: its waits are all-to-all comm, not compute.
  StepExecutor(v1::Program program, ExecutorOptions options, std::map<int, StageModel*> chunks, BatchFn batch,
               comm::Communicator* pipeline, comm::TimedCommunicator* tp, comm::Communicator* dp,
               comm::TimedCommunicator* cp = nullptr, comm::Communicator* edp = nullptr,
               comm::TimedCommunicator* ep = nullptr);
  // Waits for the communication stream's work (it uses the pipeline
  // communicator and the message buffers).
  ~StepExecutor();

  absl::StatusOr<v1::StepReport> RunStep(int64_t step, bool trace);
  absl::StatusOr<v1::StepDone> Commit(int64_t step, float clip_factor);
  v1::StepDone Discard(int64_t step);

 private:
  struct Message {
    kernels::Tensor payload;  // activation_elements() floats on the chunk's device
    int64_t sent_us = 0;      // host path: the sender's post time (its own side message)
  };
  using Key = std::pair<int, int>;  // (stage, microbatch)

  absl::Status RunCompute(const v1::Action& a, int64_t step);
  absl::Status RunCommBatch(const std::vector<const v1::Action*>& batch);
  // One message of a batch.
  struct CommOp {
    const v1::Action* action;
    Message* message;
    uint64_t tag;
    bool send;
    StageModel* model;
  };
  absl::StatusOr<CommOp> MakeCommOp(const v1::Action* action);
  // Before `consumer` reads what the chunk `producer` of this rank wrote (a
  // local hand-off: pp == 1, the tip of a V): on streams, its stream waits
  // for an event recorded now on the producer's.
  absl::Status AwaitLocalProducer(int producer, StageModel* consumer);
  // After the forward half of the overlapped pair at action `pair`: posts the
  // SEND_F of its activations from the batch after the pair (host path), so
  // the transfer runs while the backward half computes; that batch then
  // waits for it instead of posting it (early_sends_).
  absl::Status PostEarlySend(int pair);
  std::map<const v1::Action*, std::pair<std::shared_ptr<comm::Work>, std::shared_ptr<comm::Work>>> early_sends_;
  // The batch on comm_stream_, ordered by events (no host wait).
  absl::Status EnqueueCommBatch(const std::vector<CommOp>& ops, const std::string& name);
  // The batch posted and waited for on the host (chunks without a stream).
  absl::Status WaitCommBatch(const std::vector<CommOp>& ops, const std::string& name);
  // After every chunk waited for comm_stream_'s last batch: the first error
  // of its ops, else its exposed p2p time (needs spans_: before ResolveSpans).
  absl::Status ResolveComm();
  absl::Status ReduceGrads();
  // ZeRO-1: all-gathers the updated values of every chunk whose optimizer
  // state is sharded over DP (StageModel::DpShard), after its optimizer step.
  // ZeRO: the updated shards' all-gathers, enqueued on the streams of the
  // chunks whose data-parallel group can run there (their stages into
  // `gathered`), timed as dp spans; GatherShardedValues runs the others'
  // on the host.
  absl::Status EnqueueValueGathers(std::set<int>* gathered);
  absl::Status GatherShardedValues(const std::set<int>& gathered_on_stream);
  absl::Status EnsureDpStream(kernels::Device device);
  // Enqueues the chunk's DP all-reduce on dp_stream_ after its work so far;
  // its end event, or null where dp_ cannot reduce its gradients from a
  // stream (nothing enqueued).
  absl::StatusOr<kernels::Event*> StartDpReduce(int stage, StageModel* model);
  void Record(const std::string& name, const char* cat, absl::Time start, absl::Time end);
  // Device-time accounting (chunks with a stream): BeginSpan records the
  // start event of an action on the chunk's stream, EndSpan its end event;
  // ResolveSpans (every recorded event complete) adds the spans to compute_
  // and to the trace.
  absl::Status StartSpans();  // a step's (or Commit's) first event on each such chunk
  absl::Status BeginSpan(StageModel* model, int stage);
  absl::Status EndSpan(StageModel* model, int stage, std::string name, double tp_wait);
  absl::Status ResolveSpans();
  // An event from the pool of `key` (a stage, or kCommStream) recorded on `stream`.
  absl::StatusOr<kernels::Event*> RecordEvent(kernels::Stream* stream, int key);
  v1::StepDone Finish(int64_t step, bool committed);
  // Adds a chunk's MoE statistics to moe_.
  void AddMoeStats(const MoeStats& chunk);
  // The message of (stage, mb) in `map`, created from the pool if new.
  absl::StatusOr<Message*> Buffer(std::map<Key, Message>& map, int stage, int mb);
  // Returns all messages to the pool and drops the step's data, first
  // synchronising every chunk unless `chunks_idle` (their streams are known
  // to be done). Nothing to release: returns at once, without a wait.
  absl::Status ReleaseMessages(bool chunks_idle);

  const v1::Program program_;
  const ExecutorOptions options_;
  std::map<int, StageModel*> chunks_;
  BatchFn batch_;
  comm::Communicator* pipeline_;
  comm::TimedCommunicator* tp_;
  comm::Communicator* dp_;
  comm::TimedCommunicator* cp_;
  comm::Communicator* edp_;
  comm::TimedCommunicator* ep_;

  // Per step.
  std::map<Key, Message> act_out_, act_in_, grad_out_, grad_in_;
  std::map<int, MicrobatchData> data_;  // kept across steps, refilled in place
  std::set<int> filled_;                // microbatches whose data this step has read
  std::vector<kernels::Tensor> pool_;  // message buffers for reuse
  absl::Time step_start_;
  double compute_ = 0, p2p_ = 0, tp_comm_ = 0, dp_comm_ = 0, cp_comm_ = 0, ep_comm_ = 0;
  // MoE: the chunks' routing counts and load-balancing loss of the step,
  // summed (read with the step's results; StepDone.moe_*).
  MoeStats moe_;
  // Communicators' collective_bytes_sent() (cp: p2p_bytes_sent()) when the
  // step started.
  int64_t tp_bytes_at_start_ = 0, dp_bytes_at_start_ = 0, cp_bytes_at_start_ = 0, ep_bytes_at_start_ = 0,
          edp_bytes_at_start_ = 0;
  double tp_waited_at_start_ = 0;  // tp_->waited_seconds() when the step started
  // tp_->all_gather_seconds() and reduce_scatter_seconds() then.
  double tp_gather_at_start_ = 0, tp_scatter_at_start_ = 0;
  bool trace_ = false;
  std::vector<v1::TraceEvent> events_;
  // Events of chunks with a stream, reused step after step.
  struct ChunkEvents {
    std::vector<std::unique_ptr<kernels::Event>> pool;
    size_t used = 0;
    kernels::Event* anchor = nullptr;  // recorded first in the step (or the Commit)
    absl::Time anchor_host;            // host time just after the anchor was recorded
  };
  std::map<int, ChunkEvents> chunk_events_;
  struct Span {
    int stage;
    kernels::Event* start;
    kernels::Event* end = nullptr;
    std::string name;  // for the trace
    double tp_wait = 0;
  };
  std::vector<Span> spans_;
  // Event pairs around the tied-embedding sum of chunks on a stream and the
  // data-parallel all-reduces on dp_stream_ (dp time).
  std::vector<std::pair<kernels::Event*, kernels::Event*>> dp_spans_;
  // The data-parallel gradient all-reduce of a chunk on a stream, where dp_
  // can reduce its gradients from one (comm/stream_collectives.h), runs on
  // dp_stream_ (created with the first reduction): after an event the chunk
  // recorded when its backward was enqueued, before the chunk's later work
  // (it waits for the end event), so the optimizer follows it without a host
  // wait. dp_status_ keeps the first failure, reported after the step's host
  // wait.
  // A chunk without the tied embedding starts its reduction right after its
  // last backward action (last_backward_: stage -> action index), which
  // overlaps the rank's other chunks' backward; dp_started_ holds its end
  // event until REDUCE_GRADS.
  static constexpr int kDpStream = -2;  // chunk_events_ key of dp_stream_
  std::map<int, int> last_backward_;
  std::map<int, kernels::Event*> dp_started_;  // per step
  std::unique_ptr<kernels::Stream> dp_stream_;
  std::shared_ptr<comm::StreamCollectives> dp_collectives_;  // of dp_
  const std::shared_ptr<comm::StreamCommStatus> dp_status_ = std::make_shared<comm::StreamCommStatus>();

  // Stream-ordered p2p (chunks on a stream, buffers the pipeline communicator
  // can carry from one): the batches run on comm_stream_ (created with the
  // first step), after events of the producing chunks; a consuming chunk's
  // stream waits for the batch's end event. comm_status_ keeps the first
  // error of its ops, reported at the step's host wait.
  static constexpr int kCommStream = -1;  // chunk_events_ key of comm_stream_
  std::unique_ptr<kernels::Stream> comm_stream_;
  const std::shared_ptr<comm::StreamCommStatus> comm_status_ = std::make_shared<comm::StreamCommStatus>();
  struct CommSpan {
    kernels::Event* start;
    kernels::Event* end;
    int64_t posted_slot;                  // stamps_ slot of the batch's post time
    std::vector<int64_t> received_slots;  // of the peers' post times
    std::string name;                     // for the trace
  };
  std::vector<CommSpan> comm_spans_;
  // The post-time stamps of stream-ordered batches (int64 µs on the
  // coordinator clock), in memory of comm_stream_'s device: one slot per
  // batch, written on the stream just before the batch (kernels::StampTime)
  // and sent after each of its payloads, and one per receive. Copied to
  // stamps_host_ with the step's results read (ReadStamps). Sized from the
  // program with the communication stream (no allocation after the first step).
  kernels::Tensor stamps_, stamps_host_;
  int64_t stamps_used_ = 0;
  absl::StatusOr<kernels::Tensor> StampSlot(int64_t* slot);
  // Enqueues the copy of the step's stamps to stamps_host_ on `stream`
  // (covered by the host wait that reads the step's results).
  void ReadStamps(kernels::Stream* stream);
};

}  // namespace baton

#endif  // BATON_WORKER_EXECUTOR_H_
