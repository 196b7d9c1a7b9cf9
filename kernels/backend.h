// Backend seam: how tensor ops reach a device.
//
// CONTRACT
//
// 1. One code path. The model (worker/model), the stage models and the step
//    executor call the ops of kernels/ops.h with an ExecContext and never
//    branch on the device. ops.cc checks shapes and dtypes (a mismatch is a
//    programming error and aborts with the op's name), then calls the entry of
//    the Backend registered for ctx.device.type. Every entry below is
//    required; a backend that lacks a kernel sets the entry to a function that
//    aborts naming it (never null). Exceptions, which may be null:
//    fused_attention (see there); the context-parallel attention entries
//    (kv_of_qkv .. qkv_grad_of_kv), for which ops.cc aborts naming the op and
//    saying the backend has no context-parallel attention kernel yet (none
//    today: CPU, sim and CUDA have them; CUDA's in kernels/cuda/ring_attention.cu);
//    and the Mixture-of-Experts routing entries (router_top_k ..
//    load_balancing_loss), for which ops.cc aborts naming the op and saying
//    the backend has no MoE routing kernel yet (none today: CPU, sim and
//    CUDA have them; CUDA's in kernels/cuda/moe.cu).
//
// 2. Backends. kCpu: kernels/cpu, linked into everything, always registered;
//    it runs each op inline on the calling thread (its Stream and Event are
//    trivial) and gives exactly the bits the CPU kernels gave before this
//    seam. kCuda: kernels/cuda (owner gpu-kernels), registered by a static
//    initializer in a cc_library with alwayslink = 1 (see
//    BATON_REGISTER_BACKEND). kSim: kernels/sim, test-only: host memory tagged
//    as device memory, streams on threads (see kernels/sim/sim_backend.h).
//    Backends never depend on each other; a CUDA backend may use the CPU
//    kernels as references in its tests.
//
// 3. Memory. Tensor memory belongs to one Device. Tensors on a device other
//    than the CPU are never dereferenced on the host: Tensor's host accessors
//    (f32(), i32(), raw()) abort for them; backends read device addresses
//    with Tensor::address() / data<T>(). Data crosses between host and device
//    only through Copy (stream-ordered) followed by a wait. Device memory comes
//    from `allocate` (a system allocation: counted, may synchronise) and is
//    reused through kernels::Arena (activations, op scratch) and the
//    parameter store (parameters, gradients, moments; allocated once), so a
//    training step after the first makes no system allocation
//    (GetMemoryStats(device).system_allocations stays flat; tests assert it).
//    `free` must be safe while the stream still uses the memory (CUDA: the
//    allocation is freed only after the device finished with it, e.g.
//    cudaFreeAsync on the stream, or a synchronise first).
//
// 4. Streams and events. Every op is enqueued on ctx.stream and returns
//    before it runs (on the CPU it has already run). Work on one stream runs
//    in order; work on two streams is ordered only by events: Record(event,
//    producer) then StreamWait(consumer, event). Host code that reads results
//    (a loss, a norm) first copies them into host memory with Copy and then
//    waits (Event::Synchronize or Stream::Synchronize); every such wait is a
//    host synchronisation and counts in GetMemoryStats-like counters
//    (HostSyncCount()). Launch and kernel errors are sticky on the stream:
//    the next Synchronize / Record / StreamWait returns them.
//
// 5. Scalars without host round trips. Ops that reduce to a scalar (loss sum,
//    argmax hits, sum of squares) ADD into a one-element device tensor
//    (float64 or int64) instead of returning a value, so a whole step can
//    run with its results read back once at the end. (LoadBalancingLoss adds
//    into a float32 one: the double loss rounded once, then added in float.)
//
// 6. Precision. Master weights, gradients, AdamW moments, LayerNorm/softmax/
//    loss math and every reduction are float32 (scalars float64). With
//    Precision::kBFloat16 (train.precision = bf16) a backend may take bf16
//    GEMM inputs (Linear*, Attention*: x / weight / qkv tensors of dtype
//    kBFloat16, accumulation in fp32, output dtype as given), pipeline
//    messages may be bf16 (Cast), and AdamW writes a bf16 copy of the updated
//    parameters when given one. The CPU backend is the reference for every
//    bf16 op (kernels/cpu_backend.cc): operands widened exactly, fp32
//    accumulation, one round to nearest even per bf16 output
//    (kernels/bfloat16.h), attention's P and dS rounded where the CUDA path
//    stores them; a CUDA result differs from it only by accumulation order
//    (docs/gpu.md states the bounds). bf16 tensors are accepted by Cast,
//    Linear* (x/weight or dout/weight or dout/x bf16; weight gradients
//    fp32), LayerNorm's and RmsNorm's output, RopePack's qkv and
//    RopePackBackward's dqkv, dq, dk and dv, Attention* (every tensor bf16),
//    AdamW's copy and Copy/FillZero; every other op is fp32 only. Precision::kFloat32 on
//    CUDA means true fp32 (no TF32), so the float32 goldens hold.
//
// 7. Determinism. Same device, shapes, precision and inputs = the same bits,
//    run to run: no atomics whose order changes a result; reductions in a
//    fixed order (gradients of embeddings, biases and LayerNorm included).
//
// 8. Availability. `probe(index)` says whether device `index` can be used:
//    OK, or UNAVAILABLE naming the cause (for CUDA the message of
//    cudaGetDeviceCount, e.g. "CUDA driver version is insufficient"). The
//    worker calls ProbeDevice() at Configure and fails that job with the
//    error; the daemon stays up. kernels/device.{h,cc} holds the probe for
//    CUDA (owner gpu-seam), usable before the CUDA backend is linked.
#ifndef BATON_KERNELS_BACKEND_H_
#define BATON_KERNELS_BACKEND_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/cpu/adamw.h"
#include "kernels/tensor.h"

namespace baton::kernels {

struct Backend;
class Arena;

enum class Precision { kFloat32, kBFloat16 };

// An ordered queue of work on one device. Created by the backend; not
// copyable. Thread-compatible: one thread enqueues on a stream at a time.
class Stream {
 public:
  static absl::StatusOr<std::unique_ptr<Stream>> Create(Device device);
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  Device device() const { return device_; }
  // The backend's handle (cudaStream_t on CUDA; null on the CPU).
  void* native() const { return native_; }
  // Blocks the host until everything enqueued so far is done; the stream's
  // sticky error, if any. A host synchronisation.
  absl::Status Synchronize();
  // Enqueues `fn` to run on a host thread when the stream reaches it; work
  // enqueued afterwards starts after it returns. Does not block the caller
  // (on the CPU, whose work runs inline, `fn` runs now). `fn` must not call
  // into the backend (CUDA: cudaLaunchHostFunc's rule, no CUDA calls) and
  // reports its own errors: they are not the stream's sticky error. It may
  // block (a host communicator's op), which holds back the stream's later
  // work, so it must be bounded (an op timeout).
  absl::Status LaunchHostFunc(std::function<void()> fn);

 private:
  Stream(const Backend* backend, Device device, void* native)
      : backend_(backend), device_(device), native_(native) {}
  friend struct ExecContext;
  friend class Event;
  const Backend* backend_;
  Device device_;
  void* native_;
};

// A point in a stream's work.
class Event {
 public:
  static absl::StatusOr<std::unique_ptr<Event>> Create(Device device);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  // Captures the work enqueued on `stream` so far (and the time it finishes).
  absl::Status Record(Stream& stream);
  // Work enqueued on `stream` after this call starts after the recorded
  // work finished. Does not block the host.
  absl::Status StreamWait(Stream& stream);
  // Blocks the host until the recorded work is done. A host synchronisation.
  absl::Status Synchronize();
  // Seconds from `start`'s recorded point to this one's (both complete).
  absl::StatusOr<double> SecondsSince(const Event& start) const;

 private:
  Event(const Backend* backend, Device device, void* native)
      : backend_(backend), device_(device), native_(native) {}
  const Backend* backend_;
  Device device_;
  void* native_;
};

// Where and how an op runs.
struct ExecContext {
  Device device;
  const Backend* backend = nullptr;  // the backend of device.type
  Stream* stream = nullptr;          // null: the CPU's inline execution
  // Temporaries of single ops (GEMM workspaces, attention scratch), on
  // `device`; a backend may allocate from it during an op. May be null when
  // no op needs one. Reset by its owner between steps only.
  Arena* scratch = nullptr;
  Precision precision = Precision::kFloat32;

  // The CPU context every ctx-less op uses.
  static const ExecContext& Host();
  // A context for `device` on `stream` (stream->device() must equal device).
  static ExecContext On(Stream* stream, Arena* scratch = nullptr,
                        Precision precision = Precision::kFloat32);
  bool on_host() const { return device.is_cpu(); }
};

// What attention keeps from its forward for its backward, for one call shape
// on one backend path: the `att` tensor of Attention / AttentionBackward (its
// shape and dtype; its contents are the backend's business) and the floats of
// AttentionBackward's `scratch`. The model allocates exactly these (see
// AttentionBuffersFor in ops.h), so a fused path that keeps only softmax
// statistics does not pay for the T×T probabilities.
struct AttentionBuffers {
  Shape saved;                          // att's shape
  DType saved_dtype = DType::kFloat32;  // att's dtype
  int64_t backward_scratch = 0;         // AttentionBackward's scratch, in floats
};

// Device memory counters (bytes), for metrics and tests.
struct MemoryStats {
  int64_t reserved_bytes = 0;      // held from the system now
  // Of those, in use by tensors: whole ZerosOn tensors and the allocated
  // part of arenas (the rest of an arena's blocks is reserved, free).
  int64_t in_use_bytes = 0;
  int64_t peak_reserved_bytes = 0;
  int64_t system_allocations = 0;  // calls to the backend's allocate, ever
};
MemoryStats GetMemoryStats(Device device);
// Host synchronisations (Stream::Synchronize, Event::Synchronize, and a
// Copy whose host side is pageable memory, which waits for the stream as
// cudaMemcpyAsync does) so far, over every device of this process.
int64_t HostSyncCount();
// For backends: counts one host synchronisation that is not a
// Stream/Event::Synchronize (a Copy to or from pageable host memory).
void NoteHostSync();

// RESOURCE_EXHAUSTED marked (a status payload) as a device or host that ran
// out of memory, as opposed to other exhausted bounds (a communicator's,
// a workspace's): backends' allocators return it, and the mark survives
// context added on the way up (WithContext keeps payloads), so the worker
// can say what to lower (model::WithOutOfMemoryAdvice).
absl::Status OutOfMemoryError(absl::string_view message);
bool IsOutOfMemory(const absl::Status& status);

// Allocates `bytes` of memory on `device` through its backend (64-byte
// aligned, uninitialised; counted in MemoryStats). Frees it with FreeDevice.
absl::StatusOr<void*> AllocateDevice(Device device, size_t bytes);
void FreeDevice(Device device, void* p, size_t bytes);
// Moves `delta` bytes into (or, negative, out of) in_use_bytes; for
// sub-allocators such as Arena.
void CountInUse(Device device, int64_t delta);
// An owning tensor on `device`, zero-filled (on the device's stream order:
// the fill is complete when this returns). A device (or, for the CPU, the
// host) without the memory: OutOfMemoryError; a shape AlignedBytes refuses:
// INVALID_ARGUMENT. Nothing is allocated then.
absl::StatusOr<Tensor> ZerosOn(Device device, Shape shape, DType dtype = DType::kFloat32);

// A zero-filled host tensor (Device::Cpu()) in page-locked memory of
// `device`'s backend, which that device copies to and from asynchronously:
// Copy between a device tensor and pageable host memory waits for the
// stream on the host first (CUDA's rule for cudaMemcpyAsync, which the
// simulated device follows), so a step's host-side buffers (tokens and
// targets, the step's results, the post-time stamps) are pinned. The caller
// keeps it unchanged until the stream has run the copy. On the CPU:
// Tensor::TryZeros (its failure marked as out of memory).
absl::StatusOr<Tensor> PinnedHostZeros(Device device, Shape shape, DType dtype = DType::kFloat32);
// True when all of host tensor `t` lies in memory from PinnedHostZeros.
bool IsPinnedHost(const Tensor& t);

// OK when `device` can run ops now; UNAVAILABLE naming why not (no backend
// linked for its type, no driver, no such ordinal).
absl::Status ProbeDevice(Device device);

// OK when bf16 attention on `device` takes a fused path that keeps only the
// softmax statistics and a copy of o (AttentionBuffers.saved) instead of the
// probabilities P — for the shapes that path accepts (on CUDA: sdpa_plan.h
// SdpaApplies, and cuDNN building the shape's graphs); otherwise the reason
// (no such path on this backend, no driver, no cuDNN, GPU too old). What a
// worker registers as RegisterRequest.fused_attention_bf16. Cheap: it
// creates no stream or context.
absl::Status ProbeFusedAttention(Device device);

// The function table of one device type. Kernel entries receive tensors
// already checked by ops.cc (see ops.h for shapes and semantics, which are
// the same on every backend) and enqueue on ctx.stream.
struct Backend {
  const char* name;  // "cpu", "cuda", "sim"
  DeviceType type;

  // --- device, memory, streams, events (handles are opaque to callers) ---
  absl::Status (*probe)(int index);
  absl::StatusOr<void*> (*allocate)(int index, size_t bytes);
  void (*free)(int index, void* p);
  // Page-locked host memory this device copies to and from without a host
  // wait (CUDA: cudaHostAlloc); see PinnedHostZeros.
  absl::StatusOr<void*> (*allocate_host)(int index, size_t bytes);
  void (*free_host)(int index, void* p);
  absl::StatusOr<void*> (*create_stream)(int index);
  void (*destroy_stream)(int index, void* stream);
  absl::Status (*synchronize_stream)(void* stream);
  absl::StatusOr<void*> (*create_event)(int index);
  void (*destroy_event)(int index, void* event);
  absl::Status (*record_event)(void* event, void* stream);
  absl::Status (*stream_wait_event)(void* stream, void* event);
  absl::Status (*synchronize_event)(void* event);
  absl::StatusOr<double> (*event_seconds)(void* start, void* end);
  // Runs fn(arg) once, on a host thread, in the stream's order (see
  // Stream::LaunchHostFunc).
  absl::Status (*launch_host_func)(void* stream, void (*fn)(void* arg), void* arg);

  // --- data movement (either side may be host memory; same byte count) ---
  void (*copy)(const ExecContext& ctx, const Tensor& dst, const Tensor& src);
  void (*fill_zero)(const ExecContext& ctx, const Tensor& dst);
  // float32 <-> bfloat16 (round to nearest even), same element count.
  void (*cast)(const ExecContext& ctx, const Tensor& dst, const Tensor& src);
  // out: int64 [1]; see StampTime in ops.h (the device's clock, not the host's
  // enqueue time).
  void (*stamp_time)(const ExecContext& ctx, const Tensor& out, int64_t offset_us);

  // --- kernels (see ops.h) ---
  void (*embedding)(const ExecContext&, const Tensor& out, const Tensor& tokens, const Tensor& wte,
                    int64_t vocab_begin, const Tensor& wpe);
  void (*embedding_backward)(const ExecContext&, const Tensor& dwte, int64_t vocab_begin,
                             const Tensor& dwpe, const Tensor& dout, const Tensor& tokens);
  void (*layernorm)(const ExecContext&, const Tensor& out, const Tensor& mean, const Tensor& rstd,
                    const Tensor& x, const Tensor& weight, const Tensor& bias);
  void (*layernorm_backward)(const ExecContext&, const Tensor& dx, const Tensor& dweight,
                             const Tensor& dbias, const Tensor& dout, const Tensor& x,
                             const Tensor& weight, const Tensor& mean, const Tensor& rstd);
  void (*linear)(const ExecContext&, const Tensor& out, const Tensor& x, const Tensor& weight,
                 const Tensor& bias);
  void (*linear_backward_input)(const ExecContext&, const Tensor& dx, const Tensor& dout,
                                const Tensor& weight, bool accumulate);
  void (*linear_backward_weight)(const ExecContext&, const Tensor& dweight, const Tensor& dout,
                                 const Tensor& x);
  void (*add_bias)(const ExecContext&, const Tensor& out, const Tensor& bias);
  void (*bias_backward)(const ExecContext&, const Tensor& dbias, const Tensor& dout);
  void (*gelu)(const ExecContext&, const Tensor& out, const Tensor& x);
  void (*gelu_backward)(const ExecContext&, const Tensor& dx, const Tensor& x, const Tensor& dout);
  void (*attention)(const ExecContext&, const Tensor& out, const Tensor& att, const Tensor& qkv,
                    int heads);
  void (*attention_backward)(const ExecContext&, const Tensor& dqkv, const Tensor& scratch,
                             const Tensor& dout, const Tensor& qkv, const Tensor& att, int heads);
  // The buffers of attention over qkv [batch, seq, 3·channels] of `dtype` with
  // `heads` heads on ctx's stream. The same answer for the same stream and
  // arguments, and a forward and backward given these buffers take the path
  // they were sized for.
  AttentionBuffers (*attention_buffers)(const ExecContext&, int64_t batch, int64_t seq,
                                        int64_t channels, int heads, DType dtype);
  // ProbeFusedAttention for device `index`; null where the backend has no
  // fused attention (CPU, sim: attention keeps P).
  absl::Status (*fused_attention)(int index);
  void (*residual)(const ExecContext&, const Tensor& out, const Tensor& a, const Tensor& b);
  void (*residual_backward)(const ExecContext&, const Tensor& da, const Tensor& db,
                            const Tensor& dout);
  // loss_sum: float64 [1], += Σ loss over scored rows (row order, double).
  void (*softmax_cross_entropy)(const ExecContext&, const Tensor& logits_to_grad,
                                const Tensor& targets, float grad_scale, const Tensor& loss_sum);
  void (*sharded_cross_entropy_stats)(const ExecContext&, const Tensor& logits_to_exp,
                                      const Tensor& targets, int64_t vocab_begin,
                                      const Tensor& row_max, const Tensor& lse,
                                      const Tensor& target_logit);
  void (*sharded_cross_entropy_finish)(const ExecContext&, const Tensor& exp_to_grad,
                                       const Tensor& targets, int64_t vocab_begin,
                                       const Tensor& row_max, const Tensor& lse_all,
                                       const Tensor& target_logit, float grad_scale,
                                       const Tensor& loss_sum);
  void (*shard_argmax)(const ExecContext&, const Tensor& logits, int64_t vocab_begin,
                       const Tensor& max, const Tensor& index);
  // hits: int64 [1], += scored rows whose first maximum is the target.
  void (*count_argmax_hits)(const ExecContext&, const Tensor& max_all, const Tensor& index_all,
                            const Tensor& targets, const Tensor& hits);
  // param_bf16: undefined, or a bf16 tensor of param's size that receives the
  // updated parameters rounded to bf16.
  void (*adamw)(const ExecContext&, const Tensor& param, const Tensor& grad, const Tensor& m,
                const Tensor& v, const cpu::AdamWConfig& config, int64_t step, float grad_scale,
                const Tensor& param_bf16);
  // out: float64 [1], += Σ x² (index order, double).
  void (*sum_of_squares)(const ExecContext&, const Tensor& x, const Tensor& out);
  void (*scale)(const ExecContext&, const Tensor& x, float factor);

  // --- Llama blocks (see ops.h) ---
  void (*rms_norm)(const ExecContext&, const Tensor& out, const Tensor& rstd, const Tensor& x,
                   const Tensor& weight, float eps);
  void (*rms_norm_backward)(const ExecContext&, const Tensor& dx, const Tensor& dweight,
                            const Tensor& dout, const Tensor& x, const Tensor& weight,
                            const Tensor& rstd);
  void (*swiglu)(const ExecContext&, const Tensor& out, const Tensor& gate, const Tensor& up);
  void (*swiglu_backward)(const ExecContext&, const Tensor& dgate, const Tensor& dup,
                          const Tensor& dout, const Tensor& gate, const Tensor& up);
  void (*rope_pack)(const ExecContext&, const Tensor& qkv, const Tensor& q, const Tensor& k,
                    const Tensor& v, int heads, int kv_heads, float theta,
                    int64_t position_offset);
  void (*rope_pack_backward)(const ExecContext&, const Tensor& dq, const Tensor& dk,
                             const Tensor& dv, const Tensor& dqkv, int heads, int kv_heads,
                             float theta, int64_t position_offset);

  // --- context-parallel (ring) attention, fp32 or bf16 inputs (see ops.h);
  // null where the backend has none (none today): the ops then abort naming
  // themselves ---
  void (*kv_of_qkv)(const ExecContext&, const Tensor& kv, const Tensor& qkv);
  void (*block_attention)(const ExecContext&, const Tensor& out, const Tensor& lse,
                          const Tensor& qkv, const Tensor& kv, int heads, int64_t q_offset,
                          int64_t k_offset, const Tensor& scratch);
  void (*merge_attention_block)(const ExecContext&, const Tensor& out, const Tensor& lse,
                                const Tensor& block_out, const Tensor& block_lse, int heads);
  void (*attention_delta)(const ExecContext&, const Tensor& delta, const Tensor& dout,
                          const Tensor& out, int heads);
  void (*block_attention_backward)(const ExecContext&, const Tensor& dqkv, const Tensor& dkv,
                                   const Tensor& dout, const Tensor& out, const Tensor& qkv,
                                   const Tensor& kv,
                                   const Tensor& lse, const Tensor& delta, int heads,
                                   int64_t q_offset, int64_t k_offset, const Tensor& scratch);
  void (*qkv_grad_of_kv)(const ExecContext&, const Tensor& dqkv, const Tensor& dkv);

  // --- Mixture-of-Experts routing, fp32 data and int32 indices (see ops.h);
  // null where the backend has none (none today): the ops then abort naming
  // themselves ---
  void (*router_top_k)(const ExecContext&, const Tensor& probs, const Tensor& expert,
                       const Tensor& gate, const Tensor& logits, bool renormalize);
  void (*router_top_k_backward)(const ExecContext&, const Tensor& dlogits, const Tensor& dgate,
                                const Tensor& expert, const Tensor& gate, const Tensor& probs,
                                bool renormalize);
  void (*plan_dispatch)(const ExecContext&, const Tensor& slot, const Tensor& counts,
                        const Tensor& expert, int64_t capacity);
  void (*expert_token_counts)(const ExecContext&, const Tensor& routed, const Tensor& expert);
  void (*permute)(const ExecContext&, const Tensor& expert_in, const Tensor& x,
                  const Tensor& expert, const Tensor& slot);
  void (*permute_backward)(const ExecContext&, const Tensor& dx, const Tensor& dexpert_in,
                           const Tensor& expert, const Tensor& slot);
  void (*combine)(const ExecContext&, const Tensor& y, const Tensor& expert_out, const Tensor& gate,
                  const Tensor& expert, const Tensor& slot);
  void (*combine_backward)(const ExecContext&, const Tensor& dexpert_out, const Tensor& dgate,
                           const Tensor& dy, const Tensor& expert_out, const Tensor& gate,
                           const Tensor& expert, const Tensor& slot);
  // loss: float32 [1], += the loss; dlogits_aux overwritten.
  void (*load_balancing_loss)(const ExecContext&, const Tensor& loss, const Tensor& dlogits_aux,
                              const Tensor& probs, const Tensor& expert, float coef,
                              float grad_scale);
};

// Registers `backend` for its type (once per type; later calls for the same
// type abort). The CPU backend is always registered.
void RegisterBackend(const Backend* backend);
// The backend of `type`, or null when none is linked.
const Backend* FindBackend(DeviceType type);

}  // namespace baton::kernels

// In a backend's .cc (inside a cc_library with alwayslink = 1):
//   BATON_REGISTER_BACKEND(kCudaBackend);
#define BATON_REGISTER_BACKEND(table)                                     \
  static const bool baton_backend_registered_##table = [] {              \
    ::baton::kernels::RegisterBackend(&(table));                          \
    return true;                                                          \
  }()

#endif  // BATON_KERNELS_BACKEND_H_
