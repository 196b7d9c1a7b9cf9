#include "kernels/sim/sim_backend.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <deque>
#include <functional>
#include <memory>
#include <set>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "kernels/backend.h"

namespace baton::kernels::sim {
namespace {

std::atomic<int64_t> op_delay_us{0};
std::atomic<bool> lazy{true};
std::atomic<int64_t> ops_run{0};
std::atomic<int64_t> memory_limit{0};  // bytes per device; 0: none
thread_local bool on_stream_thread = false;

// One stream: a thread running closures in order.
class SimStream {
 public:
  explicit SimStream(int device) : device_(device), thread_([this] { Loop(); }) {}

  ~SimStream() {
    Drain();
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    thread_.join();
  }

  int device() const { return device_; }

  // Returns the sequence number of the op (ops complete in that order).
  int64_t Enqueue(std::function<void()> op) {
    absl::MutexLock lock(&mu_);
    queue_.push_back(std::move(op));
    return ++enqueued_;
  }

  int64_t enqueued() {
    absl::MutexLock lock(&mu_);
    return enqueued_;
  }

  void WaitFor(int64_t seq) {
    absl::MutexLock lock(&mu_);
    release_ = std::max(release_, seq);
    auto done = [this, seq]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return done_ >= seq; };
    mu_.Await(absl::Condition(&done));
  }

  void Drain() { WaitFor(enqueued()); }

  // The stream's sticky error (SetSimStreamErrorForTesting), as the CUDA
  // backend keeps an op's failure.
  absl::Status error() {
    absl::MutexLock lock(&mu_);
    return error_;
  }
  void set_error(absl::Status status) {
    absl::MutexLock lock(&mu_);
    if (error_.ok()) error_ = std::move(status);
  }

  // Lets a lazy stream run up to op `seq` without waiting for it.
  void Release(int64_t seq) {
    absl::MutexLock lock(&mu_);
    release_ = std::max(release_, seq);
  }

 private:
  void Loop() {
    on_stream_thread = true;
    for (;;) {
      std::function<void()> op;
      {
        absl::MutexLock lock(&mu_);
        // Lazy: an op runs only once someone waits for it (or for a later
        // op of this stream).
        auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return stop_ || (!queue_.empty() && (done_ < release_ || !lazy_));
        };
        mu_.Await(absl::Condition(&ready));
        if (queue_.empty()) return;  // stopping
        op = std::move(queue_.front());
        queue_.pop_front();
      }
      const int64_t delay = op_delay_us.load(std::memory_order_relaxed);
      if (delay > 0) absl::SleepFor(absl::Microseconds(delay));
      op();
      ops_run.fetch_add(1, std::memory_order_relaxed);
      absl::MutexLock lock(&mu_);
      ++done_;
    }
  }

  const int device_;
  absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  int64_t enqueued_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t done_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t release_ ABSL_GUARDED_BY(mu_) = 0;  // lazy mode: run ops up to this one
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  const bool lazy_ = lazy.load();
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

struct Streams {
  absl::Mutex mu;
  std::set<SimStream*> live ABSL_GUARDED_BY(mu);
};

Streams& LiveStreams() {
  static Streams* streams = new Streams();
  return *streams;
}

struct SimEvent {
  SimStream* stream = nullptr;  // where it was last recorded
  int64_t seq = 0;
  std::shared_ptr<absl::Time> time = std::make_shared<absl::Time>();
};

[[noreturn]] void Die(const char* what) {
  std::fprintf(stderr, "baton::kernels::sim: %s\n", what);
  std::abort();
}

const Backend& Cpu() { return *FindBackend(DeviceType::kCpu); }

SimStream* S(const ExecContext& ctx) {
  if (ctx.stream == nullptr || ctx.stream->native() == nullptr) Die("op without a stream");
  return static_cast<SimStream*>(ctx.stream->native());
}

// The same memory seen as host memory, for the CPU kernel on the stream
// thread; non-owning, so an op never frees device memory.
Tensor H(const Tensor& t) {
  return t.defined() ? Tensor::View(t.address(), t.shape(), t.dtype(), Device::Cpu()) : Tensor();
}

const ExecContext& Host() { return ExecContext::Host(); }

absl::Status Probe(int index) {
  if (index < 0 || index > 7) return absl::UnavailableError("sim devices are sim:0 .. sim:7");
  return absl::OkStatus();
}

absl::StatusOr<void*> Allocate(int index, size_t bytes) {
  const int64_t limit = memory_limit.load(std::memory_order_relaxed);
  if (limit > 0) {
    const int64_t held = GetMemoryStats(Device::Sim(index)).reserved_bytes;
    if (bytes > static_cast<size_t>(limit) || held > limit - static_cast<int64_t>(bytes)) {
      return OutOfMemoryError(absl::StrCat("out of (simulated device) memory: ", held, " of ", limit, " bytes held"));
    }
  }
  void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (p == nullptr) return OutOfMemoryError("out of (simulated device) memory");
  return p;
}

void Free(int device, void* p) {
  // Memory may still be in use by queued work: it goes back once every
  // stream of the device has passed the work enqueued on it so far
  // (stream-ordered, as cudaFreeAsync). The host does not wait: a stream may
  // be blocked in a collective (a host function) until a peer thread, which
  // may be the one freeing, enqueues its side.
  std::shared_ptr<void> memory(p, std::free);
  if (on_stream_thread) return;
  Streams& s = LiveStreams();
  absl::MutexLock lock(&s.mu);
  for (SimStream* st : s.live) {
    if (st->device() == device) st->Enqueue([memory] {});
  }
}

absl::StatusOr<void*> CreateStream(int index) {
  auto* stream = new SimStream(index);
  Streams& s = LiveStreams();
  absl::MutexLock lock(&s.mu);
  s.live.insert(stream);
  return static_cast<void*>(stream);
}

void DestroyStream(int, void* p) {
  auto* stream = static_cast<SimStream*>(p);
  {
    Streams& s = LiveStreams();
    absl::MutexLock lock(&s.mu);
    s.live.erase(stream);
  }
  delete stream;
}

absl::Status SynchronizeStream(void* p) {
  static_cast<SimStream*>(p)->Drain();
  return static_cast<SimStream*>(p)->error();
}

absl::StatusOr<void*> CreateEvent(int) { return static_cast<void*>(new SimEvent()); }
void DestroyEvent(int, void* e) { delete static_cast<SimEvent*>(e); }

absl::Status RecordEvent(void* e, void* s) {
  auto* event = static_cast<SimEvent*>(e);
  auto* stream = static_cast<SimStream*>(s);
  if (absl::Status sticky = stream->error(); !sticky.ok()) return sticky;
  std::shared_ptr<absl::Time> time = event->time;
  event->stream = stream;
  event->seq = stream->Enqueue([time] { *time = absl::Now(); });
  return absl::OkStatus();
}

absl::Status StreamWaitEvent(void* s, void* e) {
  auto* event = static_cast<SimEvent*>(e);
  if (absl::Status sticky = static_cast<SimStream*>(s)->error(); !sticky.ok()) return sticky;
  if (event->stream == nullptr) return absl::OkStatus();  // never recorded: nothing to wait for
  SimStream* producer = event->stream;
  const int64_t seq = event->seq;
  static_cast<SimStream*>(s)->Enqueue([producer, seq] { producer->WaitFor(seq); });
  return absl::OkStatus();
}

absl::Status SynchronizeEvent(void* e) {
  auto* event = static_cast<SimEvent*>(e);
  if (event->stream != nullptr) event->stream->WaitFor(event->seq);
  return absl::OkStatus();
}

absl::StatusOr<double> EventSeconds(void* start, void* end) {
  return absl::ToDoubleSeconds(*static_cast<SimEvent*>(end)->time -
                               *static_cast<SimEvent*>(start)->time);
}

// A host function runs on the stream thread. It is released at once, even on
// a lazy stream: it stands for communication, which a device runs without the
// host waiting for it (a peer may be blocked on it); the stream's earlier
// work runs first.
absl::Status LaunchHostFunc(void* s, void (*fn)(void*), void* arg) {
  auto* stream = static_cast<SimStream*>(s);
  if (absl::Status sticky = stream->error(); !sticky.ok()) return sticky;
  stream->Release(stream->Enqueue([fn, arg] { fn(arg); }));
  return absl::OkStatus();
}

// Each entry enqueues the CPU kernel over host views of its tensors.
#define SIM_ENQUEUE(body) S(ctx)->Enqueue([=] { body; })

// Page-locked host memory: the CPU's memory here; what matters is that
// Copy (below) tells it from pageable memory, as CUDA does.
absl::StatusOr<void*> AllocateHost(int, size_t bytes) { return Cpu().allocate(0, bytes); }
void FreeHost(int, void* p) { Cpu().free(0, p); }

// As cudaMemcpyAsync: with a pinned (or device) host side the copy is
// enqueued and the host goes on; with pageable host memory on either side
// the host waits for the stream's earlier work and the copy (a host
// synchronisation, counted as one).
void Copy(const ExecContext& ctx, const Tensor& dst, const Tensor& src) {
  Tensor d = H(dst), s = H(src);
  SIM_ENQUEUE(Cpu().copy(Host(), d, s));
  const bool pageable = (dst.device().is_cpu() && !IsPinnedHost(dst)) || (src.device().is_cpu() && !IsPinnedHost(src));
  if (pageable) (void)ctx.stream->Synchronize();  // its error, if any, stays on the stream
}
void FillZero(const ExecContext& ctx, const Tensor& dst) {
  Tensor d = H(dst);
  SIM_ENQUEUE(Cpu().fill_zero(Host(), d));
}
void Cast(const ExecContext& ctx, const Tensor& dst, const Tensor& src) {
  Tensor d = H(dst), s = H(src);
  SIM_ENQUEUE(Cpu().cast(Host(), d, s));
}
// The clock is read on the stream thread when the stream reaches the op.
void StampTime(const ExecContext& ctx, const Tensor& out, int64_t offset_us) {
  Tensor d = H(out);
  SIM_ENQUEUE(Cpu().stamp_time(Host(), d, offset_us));
}
void Embedding(const ExecContext& ctx, const Tensor& out, const Tensor& tokens, const Tensor& wte,
               int64_t vocab_begin, const Tensor& wpe) {
  Tensor a = H(out), b = H(tokens), c = H(wte), d = H(wpe);
  SIM_ENQUEUE(Cpu().embedding(Host(), a, b, c, vocab_begin, d));
}
void EmbeddingBackward(const ExecContext& ctx, const Tensor& dwte, int64_t vocab_begin,
                       const Tensor& dwpe, const Tensor& dout, const Tensor& tokens) {
  Tensor a = H(dwte), b = H(dwpe), c = H(dout), d = H(tokens);
  SIM_ENQUEUE(Cpu().embedding_backward(Host(), a, vocab_begin, b, c, d));
}
void LayerNorm(const ExecContext& ctx, const Tensor& out, const Tensor& mean, const Tensor& rstd,
               const Tensor& x, const Tensor& weight, const Tensor& bias) {
  Tensor a = H(out), b = H(mean), c = H(rstd), d = H(x), e = H(weight), f = H(bias);
  SIM_ENQUEUE(Cpu().layernorm(Host(), a, b, c, d, e, f));
}
void LayerNormBackward(const ExecContext& ctx, const Tensor& dx, const Tensor& dweight,
                       const Tensor& dbias, const Tensor& dout, const Tensor& x,
                       const Tensor& weight, const Tensor& mean, const Tensor& rstd) {
  Tensor a = H(dx), b = H(dweight), c = H(dbias), d = H(dout), e = H(x), f = H(weight), g = H(mean),
         h = H(rstd);
  SIM_ENQUEUE(Cpu().layernorm_backward(Host(), a, b, c, d, e, f, g, h));
}
void Linear(const ExecContext& ctx, const Tensor& out, const Tensor& x, const Tensor& weight,
            const Tensor& bias) {
  Tensor a = H(out), b = H(x), c = H(weight), d = H(bias);
  SIM_ENQUEUE(Cpu().linear(Host(), a, b, c, d));
}
void LinearBackwardInput(const ExecContext& ctx, const Tensor& dx, const Tensor& dout,
                         const Tensor& weight, bool accumulate) {
  Tensor a = H(dx), b = H(dout), c = H(weight);
  SIM_ENQUEUE(Cpu().linear_backward_input(Host(), a, b, c, accumulate));
}
void LinearBackwardWeight(const ExecContext& ctx, const Tensor& dweight, const Tensor& dout,
                          const Tensor& x) {
  Tensor a = H(dweight), b = H(dout), c = H(x);
  SIM_ENQUEUE(Cpu().linear_backward_weight(Host(), a, b, c));
}
void AddBias(const ExecContext& ctx, const Tensor& out, const Tensor& bias) {
  Tensor a = H(out), b = H(bias);
  SIM_ENQUEUE(Cpu().add_bias(Host(), a, b));
}
void BiasBackward(const ExecContext& ctx, const Tensor& dbias, const Tensor& dout) {
  Tensor a = H(dbias), b = H(dout);
  SIM_ENQUEUE(Cpu().bias_backward(Host(), a, b));
}
void Gelu(const ExecContext& ctx, const Tensor& out, const Tensor& x) {
  Tensor a = H(out), b = H(x);
  SIM_ENQUEUE(Cpu().gelu(Host(), a, b));
}
void GeluBackward(const ExecContext& ctx, const Tensor& dx, const Tensor& x, const Tensor& dout) {
  Tensor a = H(dx), b = H(x), c = H(dout);
  SIM_ENQUEUE(Cpu().gelu_backward(Host(), a, b, c));
}
void Attention(const ExecContext& ctx, const Tensor& out, const Tensor& att, const Tensor& qkv,
               int heads) {
  Tensor a = H(out), b = H(att), c = H(qkv);
  SIM_ENQUEUE(Cpu().attention(Host(), a, b, c, heads));
}
void AttentionBackward(const ExecContext& ctx, const Tensor& dqkv, const Tensor& scratch,
                       const Tensor& dout, const Tensor& qkv, const Tensor& att, int heads) {
  Tensor a = H(dqkv), b = H(scratch), c = H(dout), d = H(qkv), e = H(att);
  SIM_ENQUEUE(Cpu().attention_backward(Host(), a, b, c, d, e, heads));
}
// The CPU's buffers (the CPU kernels run on the stream thread).
AttentionBuffers AttentionBuffersOf(const ExecContext&, int64_t batch, int64_t seq,
                                    int64_t channels, int heads, DType dtype) {
  return Cpu().attention_buffers(Host(), batch, seq, channels, heads, dtype);
}
void Residual(const ExecContext& ctx, const Tensor& out, const Tensor& a, const Tensor& b) {
  Tensor x = H(out), y = H(a), z = H(b);
  SIM_ENQUEUE(Cpu().residual(Host(), x, y, z));
}
void ResidualBackward(const ExecContext& ctx, const Tensor& da, const Tensor& db,
                      const Tensor& dout) {
  Tensor x = H(da), y = H(db), z = H(dout);
  SIM_ENQUEUE(Cpu().residual_backward(Host(), x, y, z));
}
void SoftmaxCrossEntropy(const ExecContext& ctx, const Tensor& logits_to_grad,
                         const Tensor& targets, float grad_scale, const Tensor& loss_sum) {
  Tensor a = H(logits_to_grad), b = H(targets), c = H(loss_sum);
  SIM_ENQUEUE(Cpu().softmax_cross_entropy(Host(), a, b, grad_scale, c));
}
void ShardedCrossEntropyStats(const ExecContext& ctx, const Tensor& logits_to_exp,
                              const Tensor& targets, int64_t vocab_begin, const Tensor& row_max,
                              const Tensor& lse, const Tensor& target_logit) {
  Tensor a = H(logits_to_exp), b = H(targets), c = H(row_max), d = H(lse), e = H(target_logit);
  SIM_ENQUEUE(Cpu().sharded_cross_entropy_stats(Host(), a, b, vocab_begin, c, d, e));
}
void ShardedCrossEntropyFinish(const ExecContext& ctx, const Tensor& exp_to_grad,
                               const Tensor& targets, int64_t vocab_begin, const Tensor& row_max,
                               const Tensor& lse_all, const Tensor& target_logit, float grad_scale,
                               const Tensor& loss_sum) {
  Tensor a = H(exp_to_grad), b = H(targets), c = H(row_max), d = H(lse_all), e = H(target_logit),
         f = H(loss_sum);
  SIM_ENQUEUE(Cpu().sharded_cross_entropy_finish(Host(), a, b, vocab_begin, c, d, e, grad_scale, f));
}
void ShardArgmax(const ExecContext& ctx, const Tensor& logits, int64_t vocab_begin,
                 const Tensor& max, const Tensor& index) {
  Tensor a = H(logits), b = H(max), c = H(index);
  SIM_ENQUEUE(Cpu().shard_argmax(Host(), a, vocab_begin, b, c));
}
void CountArgmaxHits(const ExecContext& ctx, const Tensor& max_all, const Tensor& index_all,
                     const Tensor& targets, const Tensor& hits) {
  Tensor a = H(max_all), b = H(index_all), c = H(targets), d = H(hits);
  SIM_ENQUEUE(Cpu().count_argmax_hits(Host(), a, b, c, d));
}
void AdamW(const ExecContext& ctx, const Tensor& param, const Tensor& grad, const Tensor& m,
           const Tensor& v, const cpu::AdamWConfig& config, int64_t step, float grad_scale,
           const Tensor& param_bf16) {
  Tensor a = H(param), b = H(grad), c = H(m), d = H(v), e = H(param_bf16);
  SIM_ENQUEUE(Cpu().adamw(Host(), a, b, c, d, config, step, grad_scale, e));
}
void SumOfSquares(const ExecContext& ctx, const Tensor& x, const Tensor& out) {
  Tensor a = H(x), b = H(out);
  SIM_ENQUEUE(Cpu().sum_of_squares(Host(), a, b));
}
void Scale(const ExecContext& ctx, const Tensor& x, float factor) {
  Tensor a = H(x);
  SIM_ENQUEUE(Cpu().scale(Host(), a, factor));
}

void RmsNorm(const ExecContext& ctx, const Tensor& out, const Tensor& rstd, const Tensor& x,
             const Tensor& weight, float eps) {
  Tensor a = H(out), b = H(rstd), c = H(x), d = H(weight);
  SIM_ENQUEUE(Cpu().rms_norm(Host(), a, b, c, d, eps));
}
void RmsNormBackward(const ExecContext& ctx, const Tensor& dx, const Tensor& dweight,
                     const Tensor& dout, const Tensor& x, const Tensor& weight,
                     const Tensor& rstd) {
  Tensor a = H(dx), b = H(dweight), c = H(dout), d = H(x), e = H(weight), f = H(rstd);
  SIM_ENQUEUE(Cpu().rms_norm_backward(Host(), a, b, c, d, e, f));
}
void SwiGlu(const ExecContext& ctx, const Tensor& out, const Tensor& gate, const Tensor& up) {
  Tensor a = H(out), b = H(gate), c = H(up);
  SIM_ENQUEUE(Cpu().swiglu(Host(), a, b, c));
}
void SwiGluBackward(const ExecContext& ctx, const Tensor& dgate, const Tensor& dup,
                    const Tensor& dout, const Tensor& gate, const Tensor& up) {
  Tensor a = H(dgate), b = H(dup), c = H(dout), d = H(gate), e = H(up);
  SIM_ENQUEUE(Cpu().swiglu_backward(Host(), a, b, c, d, e));
}
void RopePack(const ExecContext& ctx, const Tensor& qkv, const Tensor& q, const Tensor& k,
              const Tensor& v, int heads, int kv_heads, float theta, int64_t position_offset) {
  Tensor a = H(qkv), b = H(q), c = H(k), d = H(v);
  SIM_ENQUEUE(Cpu().rope_pack(Host(), a, b, c, d, heads, kv_heads, theta, position_offset));
}
void RopePackBackward(const ExecContext& ctx, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                      const Tensor& dqkv, int heads, int kv_heads, float theta,
                      int64_t position_offset) {
  Tensor a = H(dq), b = H(dk), c = H(dv), d = H(dqkv);
  SIM_ENQUEUE(
      Cpu().rope_pack_backward(Host(), a, b, c, d, heads, kv_heads, theta, position_offset));
}
void KvOfQkv(const ExecContext& ctx, const Tensor& kv, const Tensor& qkv) {
  Tensor a = H(kv), b = H(qkv);
  SIM_ENQUEUE(Cpu().kv_of_qkv(Host(), a, b));
}
void BlockAttention(const ExecContext& ctx, const Tensor& out, const Tensor& lse, const Tensor& qkv,
                    const Tensor& kv, int heads, int64_t q_offset, int64_t k_offset,
                    const Tensor& scratch) {
  Tensor a = H(out), b = H(lse), c = H(qkv), d = H(kv), e = H(scratch);
  SIM_ENQUEUE(Cpu().block_attention(Host(), a, b, c, d, heads, q_offset, k_offset, e));
}
void MergeAttentionBlock(const ExecContext& ctx, const Tensor& out, const Tensor& lse,
                         const Tensor& block_out, const Tensor& block_lse, int heads) {
  Tensor a = H(out), b = H(lse), c = H(block_out), d = H(block_lse);
  SIM_ENQUEUE(Cpu().merge_attention_block(Host(), a, b, c, d, heads));
}
void AttentionDelta(const ExecContext& ctx, const Tensor& delta, const Tensor& dout,
                    const Tensor& out, int heads) {
  Tensor a = H(delta), b = H(dout), c = H(out);
  SIM_ENQUEUE(Cpu().attention_delta(Host(), a, b, c, heads));
}
void BlockAttentionBackward(const ExecContext& ctx, const Tensor& dqkv, const Tensor& dkv,
                            const Tensor& dout, const Tensor& out, const Tensor& qkv,
                            const Tensor& kv, const Tensor& lse, const Tensor& delta, int heads,
                            int64_t q_offset, int64_t k_offset, const Tensor& scratch) {
  Tensor a = H(dqkv), b = H(dkv), c = H(dout), o = H(out), d = H(qkv), e = H(kv), f = H(lse),
         g = H(delta), h = H(scratch);
  SIM_ENQUEUE(Cpu().block_attention_backward(Host(), a, b, c, o, d, e, f, g, heads, q_offset,
                                             k_offset, h));
}
void QkvGradOfKv(const ExecContext& ctx, const Tensor& dqkv, const Tensor& dkv) {
  Tensor a = H(dqkv), b = H(dkv);
  SIM_ENQUEUE(Cpu().qkv_grad_of_kv(Host(), a, b));
}
void RouterTopK(const ExecContext& ctx, const Tensor& probs, const Tensor& expert,
                const Tensor& gate, const Tensor& logits, bool renormalize) {
  Tensor a = H(probs), b = H(expert), c = H(gate), d = H(logits);
  SIM_ENQUEUE(Cpu().router_top_k(Host(), a, b, c, d, renormalize));
}
void RouterTopKBackward(const ExecContext& ctx, const Tensor& dlogits, const Tensor& dgate,
                        const Tensor& expert, const Tensor& gate, const Tensor& probs,
                        bool renormalize) {
  Tensor a = H(dlogits), b = H(dgate), c = H(expert), d = H(gate), e = H(probs);
  SIM_ENQUEUE(Cpu().router_top_k_backward(Host(), a, b, c, d, e, renormalize));
}
void PlanDispatch(const ExecContext& ctx, const Tensor& slot, const Tensor& counts,
                  const Tensor& expert, int64_t capacity) {
  Tensor a = H(slot), b = H(counts), c = H(expert);
  SIM_ENQUEUE(Cpu().plan_dispatch(Host(), a, b, c, capacity));
}
void ExpertTokenCounts(const ExecContext& ctx, const Tensor& routed, const Tensor& expert) {
  Tensor a = H(routed), b = H(expert);
  SIM_ENQUEUE(Cpu().expert_token_counts(Host(), a, b));
}
void Permute(const ExecContext& ctx, const Tensor& expert_in, const Tensor& x, const Tensor& expert,
             const Tensor& slot) {
  Tensor a = H(expert_in), b = H(x), c = H(expert), d = H(slot);
  SIM_ENQUEUE(Cpu().permute(Host(), a, b, c, d));
}
void PermuteBackward(const ExecContext& ctx, const Tensor& dx, const Tensor& dexpert_in,
                     const Tensor& expert, const Tensor& slot) {
  Tensor a = H(dx), b = H(dexpert_in), c = H(expert), d = H(slot);
  SIM_ENQUEUE(Cpu().permute_backward(Host(), a, b, c, d));
}
void Combine(const ExecContext& ctx, const Tensor& y, const Tensor& expert_out, const Tensor& gate,
             const Tensor& expert, const Tensor& slot) {
  Tensor a = H(y), b = H(expert_out), c = H(gate), d = H(expert), e = H(slot);
  SIM_ENQUEUE(Cpu().combine(Host(), a, b, c, d, e));
}
void CombineBackward(const ExecContext& ctx, const Tensor& dexpert_out, const Tensor& dgate,
                     const Tensor& dy, const Tensor& expert_out, const Tensor& gate,
                     const Tensor& expert, const Tensor& slot) {
  Tensor a = H(dexpert_out), b = H(dgate), c = H(dy), d = H(expert_out), e = H(gate),
         f = H(expert), g = H(slot);
  SIM_ENQUEUE(Cpu().combine_backward(Host(), a, b, c, d, e, f, g));
}
void LoadBalancingLoss(const ExecContext& ctx, const Tensor& loss, const Tensor& dlogits_aux,
                       const Tensor& probs, const Tensor& expert, float coef, float grad_scale) {
  Tensor a = H(loss), b = H(dlogits_aux), c = H(probs), d = H(expert);
  SIM_ENQUEUE(Cpu().load_balancing_loss(Host(), a, b, c, d, coef, grad_scale));
}

#undef SIM_ENQUEUE

const Backend kSim = {
    "sim",
    DeviceType::kSim,
    Probe,
    Allocate,
    Free,
    AllocateHost,
    FreeHost,
    CreateStream,
    DestroyStream,
    SynchronizeStream,
    CreateEvent,
    DestroyEvent,
    RecordEvent,
    StreamWaitEvent,
    SynchronizeEvent,
    EventSeconds,
    LaunchHostFunc,
    Copy,
    FillZero,
    Cast,
    StampTime,
    Embedding,
    EmbeddingBackward,
    LayerNorm,
    LayerNormBackward,
    Linear,
    LinearBackwardInput,
    LinearBackwardWeight,
    AddBias,
    BiasBackward,
    Gelu,
    GeluBackward,
    Attention,
    AttentionBackward,
    AttentionBuffersOf,
    nullptr,  // fused_attention: the CPU path it runs keeps P
    Residual,
    ResidualBackward,
    SoftmaxCrossEntropy,
    ShardedCrossEntropyStats,
    ShardedCrossEntropyFinish,
    ShardArgmax,
    CountArgmaxHits,
    AdamW,
    SumOfSquares,
    Scale,
    RmsNorm,
    RmsNormBackward,
    SwiGlu,
    SwiGluBackward,
    RopePack,
    RopePackBackward,
    KvOfQkv,
    BlockAttention,
    MergeAttentionBlock,
    AttentionDelta,
    BlockAttentionBackward,
    QkvGradOfKv,
    RouterTopK,
    RouterTopKBackward,
    PlanDispatch,
    ExpertTokenCounts,
    Permute,
    PermuteBackward,
    Combine,
    CombineBackward,
    LoadBalancingLoss,
};

BATON_REGISTER_BACKEND(kSim);

}  // namespace

void SetSimLazy(bool on) { lazy.store(on); }

void SetSimOpDelay(absl::Duration delay) {
  op_delay_us.store(absl::ToInt64Microseconds(delay), std::memory_order_relaxed);
}

int64_t SimOpsRun() { return ops_run.load(std::memory_order_relaxed); }

void SetSimDeviceMemoryLimitForTesting(int64_t bytes) {
  memory_limit.store(bytes, std::memory_order_relaxed);
}

void SetSimStreamErrorForTesting(int device, absl::Status status) {
  Streams& s = LiveStreams();
  absl::MutexLock lock(&s.mu);
  for (SimStream* st : s.live) {
    if (st->device() == device) st->set_error(status);
  }
}

}  // namespace baton::kernels::sim
