// Test helpers for the step executor's pipeline messages (testonly):
// RecordingStage (a two-stage model that writes and checks known bit patterns
// on any device), RecordingCommunicator (records what crosses the wire) and
// RunTwoStages (one traced 1F1B step of two stages on two ranks, one thread
// each). Used by executor_message_test (CPU, simulated device) and
// nccl_executor_test (two GPUs over NCCL).
#ifndef BATON_WORKER_EXECUTOR_MESSAGE_TESTING_H_
#define BATON_WORKER_EXECUTOR_MESSAGE_TESTING_H_

#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "coordinator/schedule/builders.h"
#include "coordinator/schedule/ir.h"
#include "coordinator/schedule/lowering.h"
#include "gtest/gtest.h"
#include "kernels/ops.h"
#include "worker/comm/communicator.h"
#include "worker/comm/forwarding_communicator.h"
#include "worker/executor.h"

namespace baton::message_testing {

inline constexpr int64_t kElements = 24;
inline constexpr int kMicrobatches = 3;
inline constexpr uint64_t kStampBit = uint64_t{1} << 62;

// Stage 0 writes a known bit pattern into its output; stage 1 checks it and
// writes another into its input gradient, which stage 0 checks. Every
// message buffer seen is recorded. On the simulated device the patterns go
// through kernels::Copy on the stage's stream (a test may wait on the host).
class RecordingStage : public StageModel {
 public:
  RecordingStage(int stage, kernels::DType dtype, kernels::Device device) : stage_(stage), dtype_(dtype) {
    if (!device.is_cpu()) {
      stream_ = *kernels::Stream::Create(device);
      ctx_ = kernels::ExecContext::On(stream_.get());
    }
  }
  int64_t activation_elements() const override { return kElements; }
  kernels::DType activation_dtype() const override { return dtype_; }
  const kernels::ExecContext& context() const override { return ctx_; }
  absl::Status Synchronize() override { return stream_ ? stream_->Synchronize() : absl::OkStatus(); }
  absl::Status Forward(int mb, const MicrobatchData&, const kernels::Tensor& input,
                       const kernels::Tensor& output) override {
    if (stage_ == 0) {
      Note(output);
      return Fill(output, 3 * mb + 1);
    }
    Note(input);
    return Check(input, 3 * mb + 1, "activations changed in transit");
  }
  absl::Status BackwardInput(int mb, const kernels::Tensor& grad_output,
                             const kernels::Tensor& grad_input) override {
    if (stage_ == 1) {
      Note(grad_input);
      return Fill(grad_input, 5 * mb + 2);
    }
    Note(grad_output);
    return Check(grad_output, 5 * mb + 2, "gradients changed in transit");
  }
  absl::Status BackwardWeight(int) override { return absl::OkStatus(); }
  void ZeroGrad() override {}
  void DropInFlight() override {}
  kernels::Tensor Gradients() override { return kernels::Tensor::View(grads_, {1}); }
  double LocalGradSqNorm() const override { return 0; }
  absl::Status SyncTiedGradients() override { return absl::OkStatus(); }
  absl::Status OptimizerStep(float) override { return absl::OkStatus(); }
  model::StepScore score() const override { return {}; }
  std::vector<NamedShard> Shards() override { return {}; }
  ChunkState CaptureState() const override { return {}; }
  absl::Status RestoreState(const ChunkState&) override { return absl::OkStatus(); }

  std::vector<size_t> bytes_seen;
  std::vector<kernels::DType> dtypes_seen;

 private:
  void Note(const kernels::Tensor& t) {
    bytes_seen.push_back(t.bytes());
    dtypes_seen.push_back(t.dtype());
  }
  static std::vector<unsigned char> Pattern(size_t bytes, int seed) {
    std::vector<unsigned char> p(bytes);
    for (size_t i = 0; i < bytes; ++i) p[i] = static_cast<unsigned char>(seed * 31 + i);
    return p;
  }
  // A host view of `bytes` bytes as a tensor of t's shape and dtype.
  static kernels::Tensor HostView(const kernels::Tensor& t, void* p) {
    return kernels::Tensor::View(p, t.shape(), t.dtype());
  }
  absl::Status Fill(const kernels::Tensor& t, int seed) {
    std::vector<unsigned char> p = Pattern(t.bytes(), seed);
    if (stream_ == nullptr) {
      std::memcpy(t.raw(), p.data(), p.size());
      return absl::OkStatus();
    }
    kernels::Copy(ctx_, t, HostView(t, p.data()));
    return stream_->Synchronize();  // p dies here
  }
  absl::Status Check(const kernels::Tensor& t, int seed, const char* what) {
    std::vector<unsigned char> got(t.bytes());
    if (stream_ == nullptr) {
      std::memcpy(got.data(), t.raw(), got.size());
    } else {
      kernels::Copy(ctx_, HostView(t, got.data()), t);
      if (absl::Status s = stream_->Synchronize(); !s.ok()) return s;
    }
    return got == Pattern(t.bytes(), seed) ? absl::OkStatus() : absl::DataLossError(what);
  }
  int stage_;
  kernels::DType dtype_;
  std::unique_ptr<kernels::Stream> stream_;
  kernels::ExecContext ctx_ = kernels::ExecContext::Host();
  float grads_[1] = {0};
};

// What crossed the wire: every op a rank posted, with the stamp values it
// sent from host memory (the simulated device's included).
struct WireOp {
  bool send;
  uint64_t tag;
  size_t bytes;
  comm::DType dtype;
  int64_t stamp = 0;   // the value of a sent stamp (host memory only)
  bool group = false;  // posted in a stream-ordered group (GroupOnStream)
};

// Forwards to another communicator and records the point-to-point ops.
class RecordingCommunicator : public comm::ForwardingCommunicator {
 public:
  explicit RecordingCommunicator(comm::Communicator* inner) : ForwardingCommunicator(inner) {}
  std::shared_ptr<comm::Work> Send(comm::Buffer buf, int peer, uint64_t tag) override {
    WireOp op{true, tag, buf.bytes(), buf.dtype};
    // Read as the communicator reads it (from the batch's host function on
    // the simulated device).
    if ((tag & kStampBit) != 0 && buf.bytes() == sizeof(int64_t) && buf.device < 0) {
      std::memcpy(&op.stamp, buf.data, sizeof(int64_t));
    }
    Add(op);
    return inner()->Send(buf, peer, tag);
  }
  std::shared_ptr<comm::Work> Recv(comm::Buffer buf, int peer, uint64_t tag) override {
    Add(WireOp{false, tag, buf.bytes(), buf.dtype});
    return inner()->Recv(buf, peer, tag);
  }
  std::shared_ptr<comm::Work> GroupOnStream(const std::vector<comm::P2POp>& ops, void* stream) override {
    for (const comm::P2POp& op : ops) {
      WireOp w{op.send, op.tag, op.buf.bytes(), op.buf.dtype};
      w.group = true;
      Add(w);
    }
    return inner()->GroupOnStream(ops, stream);
  }

  std::vector<WireOp> ops() const {
    absl::MutexLock lock(&mu_);
    return ops_;
  }

 private:
  void Add(const WireOp& op) {
    absl::MutexLock lock(&mu_);
    ops_.push_back(op);
  }
  mutable absl::Mutex mu_;
  std::vector<WireOp> ops_ ABSL_GUARDED_BY(mu_);
};

inline absl::Status FillBatch(int64_t, int, MicrobatchData* out) {
  out->tokens = kernels::Tensor::Zeros({1, 1}, kernels::DType::kInt32);
  out->targets = kernels::Tensor::Zeros({1, 1}, kernels::DType::kInt32);
  return absl::OkStatus();
}

struct TwoStageRun {
  std::vector<size_t> bytes;       // message buffers as the stages saw them
  std::vector<WireOp> wire[2];     // per rank
  v1::StepDone done[2];
  int64_t before_us = 0, after_us = 0;  // host clock around the step
};

// One traced 1F1B step of two stages on two ranks over `pipeline` (one
// communicator per rank), stage r on devices[r]; rank r's coordinator clock
// is the host clock plus clock_offset_us[r].
inline TwoStageRun RunTwoStages(kernels::DType dtype, const kernels::Device devices[2],
                                comm::Communicator* const pipeline[2], const int64_t clock_offset_us[2]) {
  auto compute = schedule::BuildSchedule(schedule::ScheduleSpec{"1f1b", 2, kMicrobatches, 1});
  EXPECT_TRUE(compute.ok()) << compute.status();
  auto lowered = schedule::Lower(*compute);
  EXPECT_TRUE(lowered.ok()) << lowered.status();
  std::vector<v1::Program> programs = schedule::ToPrograms(*lowered);
  RecordingCommunicator wire[2] = {RecordingCommunicator(pipeline[0]), RecordingCommunicator(pipeline[1])};
  RecordingStage stages[2] = {RecordingStage(0, dtype, devices[0]), RecordingStage(1, dtype, devices[1])};
  absl::Status results[2];
  TwoStageRun run;
  run.before_us = absl::ToUnixMicros(absl::Now());
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      ExecutorOptions options;
      options.num_stages = 2;
      options.microbatches = kMicrobatches;
      options.tokens_per_microbatch = 1;
      options.op_timeout = absl::Seconds(20);
      const int64_t offset = clock_offset_us[r];
      options.clock_us = [offset] { return absl::ToUnixMicros(absl::Now()) + offset; };
      StepExecutor exec(programs[r], options, {{r, &stages[r]}}, FillBatch, &wire[r], nullptr, nullptr);
      auto report = exec.RunStep(1, /*trace=*/true);
      results[r] = report.status();
      if (!report.ok()) return;
      auto done = exec.Commit(1, 1.0f);
      results[r] = done.status();
      if (done.ok()) run.done[r] = *done;
    });
  }
  for (auto& t : threads) t.join();
  run.after_us = absl::ToUnixMicros(absl::Now());
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(results[r].ok()) << "rank " << r << ": " << results[r];
    for (kernels::DType d : stages[r].dtypes_seen) EXPECT_EQ(d, dtype) << "rank " << r;
    run.bytes.insert(run.bytes.end(), stages[r].bytes_seen.begin(), stages[r].bytes_seen.end());
    run.wire[r] = wire[r].ops();
  }
  EXPECT_EQ(run.bytes.size(), 4u * kMicrobatches);  // act out, act in, grad out, grad in
  return run;
}

}  // namespace baton::message_testing

#endif  // BATON_WORKER_EXECUTOR_MESSAGE_TESTING_H_
