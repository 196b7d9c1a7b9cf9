#include "kernels/cuda/cuda_backend.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/call_once.h"
#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "kernels/cuda/adamw.cuh"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/cast.cuh"
#include "kernels/cuda/column_reduce.cuh"
#include "kernels/cuda/cross_entropy.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/elementwise.cuh"
#include "kernels/cuda/embedding.cuh"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/grad_norm.cuh"
#include "kernels/cuda/layernorm.cuh"
#include "kernels/cuda/moe.cuh"
#include "kernels/cuda/plan.h"
#include "kernels/cuda/ring_attention.cuh"
#include "kernels/cuda/ring_sdpa.h"
#include "kernels/cuda/rmsnorm.cuh"
#include "kernels/cuda/rope.cuh"
#include "kernels/cuda/sdpa_plan.h"
#include "kernels/cuda/stamp.cuh"
#include "kernels/cuda/swiglu.cuh"
#include "kernels/cuda/timer_offset.h"

namespace baton::cuda {
namespace {

using kernels::Device;
using kernels::DType;
using kernels::ExecContext;
using kernels::Tensor;

[[noreturn]] void Die(const char* op, const std::string& what) {
  std::fprintf(stderr, "baton::kernels::%s (cuda): %s\n", op, what.c_str());
  std::abort();
}

// ------------------------------------------------------------ stream state

struct StreamState {
  int device = 0;
  std::unique_ptr<CublasLtGemm> gemm;  // created at the first GEMM
  CudnnAttentionPtr cudnn;             // created at the first bf16 attention; null: none
  bool cudnn_tried = false;
  void* workspace = nullptr;
  void* scratch = nullptr;
  size_t scratch_bytes = 0;
  // Scratch buffers outgrown (step 1 only: sizes repeat from step to step),
  // freed with the stream: a cudaFree now would wait for the whole device,
  // i.e. for an NCCL kernel or a host function on another stream that waits
  // for a peer, which may wait for work this thread has yet to enqueue.
  std::vector<std::pair<void*, size_t>> retired;
  // The first failure of an op on this stream. Ops enqueue from one thread,
  // but Record / StreamWait on this stream may come from another.
  absl::Mutex mu;
  absl::Status error ABSL_GUARDED_BY(mu);
};

struct States {
  absl::Mutex mu;
  absl::flat_hash_map<cudaStream_t, std::unique_ptr<StreamState>> map ABSL_GUARDED_BY(mu);
};

States& GetStates() {
  static States* states = new States();
  return *states;
}

StreamState* FindState(cudaStream_t stream) {
  States& s = GetStates();
  absl::MutexLock lock(&s.mu);
  auto it = s.map.find(stream);
  return it == s.map.end() ? nullptr : it->second.get();
}

// Makes `index` the calling thread's current device. Asks the runtime each
// time (a thread-local read) rather than caching: NCCL and other code set it too.
absl::Status UseDevice(int index) {
  int current = -1;
  if (cudaGetDevice(&current) == cudaSuccess && current == index) return absl::OkStatus();
  BATON_CUDA_RETURN_IF_ERROR(cudaSetDevice(index));
  return absl::OkStatus();
}

// The state of ctx's stream, with its device current. Aborts for a context
// without a CUDA stream (a wiring error).
StreamState& Enter(const ExecContext& ctx, const char* op) {
  if (ctx.stream == nullptr || ctx.stream->native() == nullptr) {
    Die(op, "the execution context has no CUDA stream");
  }
  StreamState* state = FindState(static_cast<cudaStream_t>(ctx.stream->native()));
  if (state == nullptr) Die(op, "the stream was not created by the CUDA backend");
  absl::Status s = UseDevice(state->device);
  if (!s.ok()) {
    absl::MutexLock lock(&state->mu);
    if (state->error.ok()) state->error = s;
  }
  return *state;
}

cudaStream_t Native(const ExecContext& ctx) {
  return static_cast<cudaStream_t>(ctx.stream->native());
}

// Keeps the first error of the stream, with the op's name.
void Note(StreamState& state, const char* op, const absl::Status& s) {
  if (s.ok()) return;
  absl::MutexLock lock(&state.mu);
  if (!state.error.ok()) return;
  state.error = WithContext(s, absl::StrCat(op, " on cuda:", state.device));  // keeps IsOutOfMemory
}
void Note(StreamState& state, const char* op, cudaError_t err) {
  if (err != cudaSuccess) Note(state, op, CudaStatus(err, op, __FILE__, __LINE__));
}

// The stream's scratch, grown to at least `bytes`. The outgrown buffer is
// retired, not freed (StreamState::retired): work enqueued on this stream may
// still use it, and cudaFree would wait for the whole device.
absl::StatusOr<void*> Scratch(StreamState& state, size_t bytes) {
  if (bytes <= state.scratch_bytes) return state.scratch;
  const Device device = Device::Cuda(state.device);
  if (state.scratch != nullptr) state.retired.emplace_back(state.scratch, state.scratch_bytes);
  state.scratch = nullptr;
  state.scratch_bytes = 0;
  const size_t rounded = (bytes + (size_t{1} << 20) - 1) & ~((size_t{1} << 20) - 1);
  absl::StatusOr<void*> p = kernels::AllocateDevice(device, rounded);
  if (!p.ok()) return p.status();
  state.scratch = *p;
  state.scratch_bytes = rounded;
  return *p;
}

absl::StatusOr<CublasLtGemm*> Gemm(StreamState& state) {
  if (state.gemm != nullptr) return state.gemm.get();
  // Allocated once: a handle that fails to build (no libcublasLt) must not
  // cost another workspace at every GEMM of the step.
  if (state.workspace == nullptr) {
    absl::StatusOr<void*> ws =
        kernels::AllocateDevice(Device::Cuda(state.device), kLtWorkspaceBytes);
    if (!ws.ok()) return ws.status();
    state.workspace = *ws;
  }
  absl::StatusOr<std::unique_ptr<CublasLtGemm>> g =
      CublasLtGemm::CreateWithWorkspace(state.workspace, kLtWorkspaceBytes);
  if (!g.ok()) return g.status();
  state.gemm = std::move(*g);
  return state.gemm.get();
}

// ------------------------------------------------- device, memory, streams

absl::Status Probe(int index) {
  int count = 0;
  absl::Status s = CudaDeviceCount(&count);
  if (!s.ok()) return s;
  if (index < 0 || index >= count) {
    return absl::UnavailableError(
        absl::StrCat("cuda:", index, " does not exist: ", count, " CUDA device(s) visible"));
  }
  return absl::OkStatus();
}

absl::StatusOr<void*> Allocate(int index, size_t bytes) {
  absl::Status s = UseDevice(index);
  if (!s.ok()) return s;
  void* p = nullptr;
  cudaError_t err = cudaMalloc(&p, bytes);
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    return kernels::OutOfMemoryError(
        absl::StrCat("cudaMalloc of ", bytes, " bytes on cuda:", index, ": out of device memory"));
  }
  if (err != cudaSuccess) return CudaStatus(err, "cudaMalloc", __FILE__, __LINE__);
  return p;
}

void Free(int index, void* p) {
  if (p == nullptr) return;
  if (UseDevice(index).ok()) cudaFree(p);
}

// Portable: every context of the process sees it as pinned.
absl::StatusOr<void*> AllocateHost(int index, size_t bytes) {
  absl::Status s = UseDevice(index);
  if (!s.ok()) return s;
  void* p = nullptr;
  cudaError_t err = cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    return kernels::OutOfMemoryError(absl::StrCat("cudaHostAlloc of ", bytes, " bytes: out of pinned host memory"));
  }
  if (err != cudaSuccess) return CudaStatus(err, "cudaHostAlloc", __FILE__, __LINE__);
  return p;
}

void FreeHost(int, void* p) {
  if (p != nullptr) cudaFreeHost(p);
}

absl::StatusOr<int64_t> TimerOffset(int device, bool refresh_if_due);

// Measures `device`'s timer offset again when due, with the device current
// for the measurement only (the calling thread's device is left as it was).
void RefreshTimerOffset(int device) {
  int previous = -1;
  if (cudaGetDevice(&previous) != cudaSuccess) return;
  if (previous != device && cudaSetDevice(device) != cudaSuccess) return;
  (void)TimerOffset(device, /*refresh_if_due=*/true);
  if (previous != device) cudaSetDevice(previous);
}

absl::StatusOr<void*> CreateStream(int index) {
  absl::Status s = Probe(index);
  if (!s.ok()) return s;
  s = UseDevice(index);
  if (!s.ok()) return s;
  // Measure the device's timer offset now, before any step: the measurement
  // allocates and frees pinned memory (cudaHostAlloc / cudaFreeHost wait for
  // the whole device), which inside a step — at the first StampTime — would
  // stall every stream of the device mid-step. A failure here is reported by
  // StampTime, which measures again.
  (void)TimerOffset(index, /*refresh_if_due=*/false);
  cudaStream_t stream = nullptr;
  BATON_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto state = std::make_unique<StreamState>();
  state->device = index;
  States& states = GetStates();
  absl::MutexLock lock(&states.mu);
  states.map[stream] = std::move(state);
  return static_cast<void*>(stream);
}

void DestroyStream(int index, void* native) {
  cudaStream_t stream = static_cast<cudaStream_t>(native);
  std::unique_ptr<StreamState> state;
  {
    States& states = GetStates();
    absl::MutexLock lock(&states.mu);
    auto it = states.map.find(stream);
    if (it != states.map.end()) {
      state = std::move(it->second);
      states.map.erase(it);
    }
  }
  if (!UseDevice(index).ok()) return;
  cudaStreamSynchronize(stream);  // the buffers below may still be in use
  if (state != nullptr) {
    state->cudnn.reset();
    state->gemm.reset();
    const Device device = Device::Cuda(index);
    kernels::FreeDevice(device, state->workspace, kLtWorkspaceBytes);
    kernels::FreeDevice(device, state->scratch, state->scratch_bytes);
    for (const auto& [p, bytes] : state->retired) kernels::FreeDevice(device, p, bytes);
  }
  cudaStreamDestroy(stream);
}

absl::Status StickyError(cudaStream_t stream) {
  StreamState* state = FindState(stream);
  if (state == nullptr) return absl::OkStatus();
  absl::MutexLock lock(&state->mu);
  return state->error;
}

absl::Status SynchronizeStream(void* native) {
  cudaStream_t stream = static_cast<cudaStream_t>(native);
  absl::Status sticky = StickyError(stream);
  if (!sticky.ok()) return sticky;
  BATON_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  // The host waited anyway: the time to follow the GPU timer's drift, when
  // due (at most every 10 s; a few microseconds on the probe's own stream).
  if (StreamState* state = FindState(stream); state != nullptr) RefreshTimerOffset(state->device);
  return absl::OkStatus();
}

absl::StatusOr<void*> CreateEvent(int index) {
  absl::Status s = UseDevice(index);
  if (!s.ok()) return s;
  cudaEvent_t event = nullptr;
  BATON_CUDA_RETURN_IF_ERROR(cudaEventCreate(&event));  // with timing
  return static_cast<void*>(event);
}

void DestroyEvent(int, void* event) { cudaEventDestroy(static_cast<cudaEvent_t>(event)); }

absl::Status RecordEvent(void* event, void* native) {
  cudaStream_t stream = static_cast<cudaStream_t>(native);
  absl::Status sticky = StickyError(stream);
  if (!sticky.ok()) return sticky;
  BATON_CUDA_RETURN_IF_ERROR(cudaEventRecord(static_cast<cudaEvent_t>(event), stream));
  return absl::OkStatus();
}

absl::Status StreamWaitEvent(void* native, void* event) {
  cudaStream_t stream = static_cast<cudaStream_t>(native);
  absl::Status sticky = StickyError(stream);
  if (!sticky.ok()) return sticky;
  BATON_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(event), 0));
  return absl::OkStatus();
}

absl::Status SynchronizeEvent(void* event) {
  BATON_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(static_cast<cudaEvent_t>(event)));
  return absl::OkStatus();
}

absl::StatusOr<double> EventSeconds(void* start, void* end) {
  float ms = 0;
  BATON_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start),
                                                  static_cast<cudaEvent_t>(end)));
  return static_cast<double>(ms) / 1000.0;
}

absl::Status LaunchHostFunc(void* native, void (*fn)(void*), void* arg) {
  cudaStream_t stream = static_cast<cudaStream_t>(native);
  absl::Status sticky = StickyError(stream);
  if (!sticky.ok()) return sticky;
  BATON_CUDA_RETURN_IF_ERROR(cudaLaunchHostFunc(stream, fn, arg));
  return absl::OkStatus();
}

// ------------------------------------------------------------ data movement

// With pageable host memory on either side cudaMemcpyAsync waits on the
// host for the stream's earlier work (and, to the host, for the copy): a
// host synchronisation, counted as one. Pinned memory (PinnedHostZeros) and
// device memory are copied in stream order.
void Copy(const ExecContext& ctx, const Tensor& dst, const Tensor& src) {
  StreamState& st = Enter(ctx, "Copy");
  if ((dst.device().is_cpu() && !kernels::IsPinnedHost(dst)) || (src.device().is_cpu() && !kernels::IsPinnedHost(src))) {
    kernels::NoteHostSync();
  }
  Note(st, "Copy",
       cudaMemcpyAsync(dst.address(), src.address(), src.bytes(), cudaMemcpyDefault, Native(ctx)));
}

void FillZero(const ExecContext& ctx, const Tensor& dst) {
  StreamState& st = Enter(ctx, "FillZero");
  Note(st, "FillZero", cudaMemsetAsync(dst.address(), 0, dst.bytes(), Native(ctx)));
}

void Cast(const ExecContext& ctx, const Tensor& dst, const Tensor& src) {
  StreamState& st = Enter(ctx, "Cast");
  const int64_t n = src.numel();
  if (dst.dtype() == src.dtype()) {
    Note(st, "Cast", cudaMemcpyAsync(dst.address(), src.address(), src.bytes(),
                                     cudaMemcpyDeviceToDevice, Native(ctx)));
  } else if (src.dtype() == DType::kFloat32 && dst.dtype() == DType::kBFloat16) {
    Note(st, "Cast", LaunchCastF32ToBf16(dst.data<__nv_bfloat16>(), src.data<float>(), n,
                                         Native(ctx)));
  } else if (src.dtype() == DType::kBFloat16 && dst.dtype() == DType::kFloat32) {
    Note(st, "Cast", LaunchCastBf16ToF32(dst.data<float>(), src.data<__nv_bfloat16>(), n,
                                         Native(ctx)));
  } else {
    Die("Cast", "only float32 <-> bfloat16");
  }
}

// The offset from %globaltimer to the host's Unix clock, per device: first
// measured when the device's first stream is created, then again, as the two
// clocks drift apart, at a host wait for a stream once it is due (every 10 s,
// timer_offset.h), with a probe kept for the process so that measuring waits
// only for the probe's own stream. The device must be current.
struct DeviceClock {
  GlobalTimerProbe probe;  // created with the first measurement
  TimerOffsetTracker tracker;
};

absl::StatusOr<int64_t> TimerOffset(int device, bool refresh_if_due) {
  static absl::Mutex mu(absl::kConstInit);
  static auto* clocks = new absl::flat_hash_map<int, DeviceClock>();
  absl::MutexLock lock(&mu);
  DeviceClock& clock = (*clocks)[device];
  const absl::Time now = absl::Now();
  if (clock.tracker.has_offset() && !(refresh_if_due && clock.tracker.Due(now))) {
    return clock.tracker.offset_us();
  }
  // Without an offset a stamp always measures (as at the first stamp); the
  // refresh at host waits keeps to Due()'s pace.
  if (refresh_if_due && !clock.tracker.Due(now)) {
    return absl::UnavailableError(
        absl::StrCat("the GPU timer's offset to the host clock of device ", device, " could not be measured"));
  }
  cudaError_t err = clock.probe.stream != nullptr ? cudaSuccess : CreateGlobalTimerProbe(&clock.probe);
  int64_t offset = 0, uncertainty = 0;
  // Fewer tries when measuring again: the device may be busy on other
  // streams, and a try waits for a free slot for the probe's kernel.
  const int tries = clock.tracker.has_offset() ? 3 : 8;
  if (err == cudaSuccess) err = MeasureGlobalTimerOffset(clock.probe, &offset, &uncertainty, tries);
  if (err == cudaSuccess) {
    clock.tracker.Offer(offset, uncertainty, absl::Now());
  } else {
    clock.tracker.Failed(now);
    if (!clock.tracker.has_offset()) {
      BATON_CUDA_RETURN_IF_ERROR(err);
    }
  }
  return clock.tracker.offset_us();
}

void StampTime(const ExecContext& ctx, const Tensor& out, int64_t offset_us) {
  StreamState& st = Enter(ctx, "StampTime");
  absl::StatusOr<int64_t> timer_offset = TimerOffset(st.device, /*refresh_if_due=*/false);
  if (!timer_offset.ok()) return Note(st, "StampTime", timer_offset.status());
  Note(st, "StampTime",
       LaunchStampGlobalTimer(out.data<int64_t>(), *timer_offset + offset_us, Native(ctx)));
}

// ------------------------------------------------------------------ kernels

void RequireF32(const char* op, std::initializer_list<const Tensor*> tensors) {
  for (const Tensor* t : tensors) {
    if (t->defined() && t->dtype() != DType::kFloat32) {
      Die(op, "has a float32 kernel only on CUDA; a tensor of another dtype was given");
    }
  }
}

GemmDType GemmType(const char* op, const Tensor& t) {
  if (t.dtype() == DType::kFloat32) return GemmDType::kF32;
  if (t.dtype() == DType::kBFloat16) return GemmDType::kBF16;
  Die(op, "GEMM operands must be float32 or bfloat16");
}

void Embedding(const ExecContext& ctx, const Tensor& out, const Tensor& tokens, const Tensor& wte,
               int64_t vocab_begin, const Tensor& wpe) {
  StreamState& st = Enter(ctx, "Embedding");
  RequireF32("Embedding", {&out, &wte, &wpe});
  Note(st, "Embedding",
       LaunchEmbeddingForward(out.data<float>(), tokens.data<int32_t>(), wte.data<float>(),
                              vocab_begin, wte.dim(0), wpe.defined() ? wpe.data<float>() : nullptr,
                              tokens.dim(0), tokens.dim(1), wte.dim(1), Native(ctx)));
}

void EmbeddingBackward(const ExecContext& ctx, const Tensor& dwte, int64_t vocab_begin,
                       const Tensor& dwpe, const Tensor& dout, const Tensor& tokens) {
  StreamState& st = Enter(ctx, "EmbeddingBackward");
  RequireF32("EmbeddingBackward", {&dwte, &dwpe, &dout});
  const int64_t b = tokens.dim(0), t = tokens.dim(1), c = dout.numel() / (b * t);
  absl::StatusOr<size_t> bytes = EmbeddingBackwardScratchBytes(b * t);
  absl::StatusOr<void*> scratch = bytes.ok() ? Scratch(st, *bytes) : bytes.status();
  if (!scratch.ok()) return Note(st, "EmbeddingBackward", scratch.status());
  Note(st, "EmbeddingBackward",
       LaunchEmbeddingBackward(dwte.defined() ? dwte.data<float>() : nullptr, vocab_begin,
                               dwte.defined() ? dwte.dim(0) : 0,
                               dwpe.defined() ? dwpe.data<float>() : nullptr, dout.data<float>(),
                               tokens.data<int32_t>(), b, t, c, static_cast<int32_t*>(*scratch),
                               Native(ctx)));
}

void LayerNorm(const ExecContext& ctx, const Tensor& out, const Tensor& mean, const Tensor& rstd,
               const Tensor& x, const Tensor& weight, const Tensor& bias) {
  StreamState& st = Enter(ctx, "LayerNorm");
  RequireF32("LayerNorm", {&mean, &rstd, &x, &weight, &bias});
  const int64_t c = weight.numel(), n = x.numel() / c;
  cudaError_t err;
  if (out.dtype() == DType::kBFloat16) {
    err = LaunchLayerNormForward(out.data<__nv_bfloat16>(), mean.data<float>(), rstd.data<float>(),
                                 x.data<float>(), weight.data<float>(), bias.data<float>(), n, c,
                                 Native(ctx));
  } else {
    RequireF32("LayerNorm", {&out});
    err = LaunchLayerNormForward(out.data<float>(), mean.data<float>(), rstd.data<float>(),
                                 x.data<float>(), weight.data<float>(), bias.data<float>(), n, c,
                                 Native(ctx));
  }
  Note(st, "LayerNorm", err);
}

void LayerNormBackward(const ExecContext& ctx, const Tensor& dx, const Tensor& dweight,
                       const Tensor& dbias, const Tensor& dout, const Tensor& x,
                       const Tensor& weight, const Tensor& mean, const Tensor& rstd) {
  StreamState& st = Enter(ctx, "LayerNormBackward");
  RequireF32("LayerNormBackward", {&dx, &dweight, &dbias, &dout, &x, &weight, &mean, &rstd});
  const int64_t c = weight.numel(), n = x.numel() / c;
  absl::StatusOr<size_t> bytes = ColumnReduceScratchBytes(n, c, 2);
  absl::StatusOr<void*> scratch = bytes.ok() ? Scratch(st, *bytes) : bytes.status();
  if (!scratch.ok()) return Note(st, "LayerNormBackward", scratch.status());
  Note(st, "LayerNormBackward",
       LaunchLayerNormBackward(dx.data<float>(), dweight.data<float>(), dbias.data<float>(),
                               dout.data<float>(), x.data<float>(), weight.data<float>(),
                               mean.data<float>(), rstd.data<float>(), n, c,
                               static_cast<float*>(*scratch), Native(ctx)));
}

void RunGemm(StreamState& st, const char* op, const GemmArgs& args, cudaStream_t stream) {
  absl::StatusOr<CublasLtGemm*> gemm = Gemm(st);
  if (!gemm.ok()) return Note(st, op, gemm.status());
  Note(st, op, (*gemm)->Run(args, stream));
}

void Linear(const ExecContext& ctx, const Tensor& out, const Tensor& x, const Tensor& weight,
            const Tensor& bias) {
  StreamState& st = Enter(ctx, "Linear");
  if (x.dtype() != weight.dtype()) Die("Linear", "x and weight must have the same dtype");
  const int64_t o = weight.dim(0), i = weight.dim(1), n = x.numel() / i;
  GemmArgs g;
  g.shape = LinearForwardGemm(n, i, o);
  g.ab_type = GemmType("Linear", x);
  g.c_type = GemmType("Linear", out);
  g.a = x.address();
  g.b = weight.address();
  g.c = out.address();
  if (bias.defined()) {
    g.epilogue = GemmEpilogue::kBias;
    g.bias = bias.address();
    g.bias_type = GemmType("Linear", bias);
  }
  absl::StatusOr<CublasLtGemm*> gemm = Gemm(st);
  if (!gemm.ok()) return Note(st, "Linear", gemm.status());
  absl::Status s = (*gemm)->Run(g, Native(ctx));
  if (absl::IsUnimplemented(s) && g.epilogue == GemmEpilogue::kBias &&
      g.c_type == GemmDType::kBF16 && g.bias_type == GemmDType::kF32) {
    // No bf16-output kernel takes the fp32 bias: the same sum into fp32
    // scratch, then one rounding to bf16 (plan.h WithFp32BiasOutput).
    const size_t bytes = static_cast<size_t>(n) * static_cast<size_t>(o) * sizeof(float);
    absl::StatusOr<void*> scratch = Scratch(st, bytes);
    if (!scratch.ok()) return Note(st, "Linear", scratch.status());
    absl::StatusOr<GemmArgs> wide = WithFp32BiasOutput(g, *scratch);
    if (!wide.ok()) return Note(st, "Linear", wide.status());
    s = (*gemm)->Run(*wide, Native(ctx));
    if (s.ok()) {
      s = CudaStatus(LaunchCastF32ToBf16(out.data<__nv_bfloat16>(),
                                         static_cast<const float*>(*scratch), n * o, Native(ctx)),
                     "LaunchCastF32ToBf16", __FILE__, __LINE__);
    }
  }
  Note(st, "Linear", s);
}

void LinearBackwardInput(const ExecContext& ctx, const Tensor& dx, const Tensor& dout,
                         const Tensor& weight, bool accumulate) {
  StreamState& st = Enter(ctx, "LinearBackwardInput");
  if (dout.dtype() != weight.dtype()) {
    Die("LinearBackwardInput", "dout and weight must have the same dtype");
  }
  const int64_t o = weight.dim(0), i = weight.dim(1), n = dout.numel() / o;
  GemmArgs g;
  g.shape = LinearBackwardInputGemm(n, i, o);
  g.ab_type = GemmType("LinearBackwardInput", dout);
  g.c_type = GemmType("LinearBackwardInput", dx);
  g.a = dout.address();
  g.b = weight.address();
  g.c = dx.address();
  g.beta = accumulate ? 1.0f : 0.0f;
  RunGemm(st, "LinearBackwardInput", g, Native(ctx));
}

void LinearBackwardWeight(const ExecContext& ctx, const Tensor& dweight, const Tensor& dout,
                          const Tensor& x) {
  StreamState& st = Enter(ctx, "LinearBackwardWeight");
  if (dout.dtype() != x.dtype()) Die("LinearBackwardWeight", "dout and x must have the same dtype");
  RequireF32("LinearBackwardWeight", {&dweight});
  const int64_t o = dweight.dim(0), i = dweight.dim(1), n = x.numel() / i;
  GemmArgs g;
  g.shape = LinearBackwardWeightGemm(n, i, o);
  g.ab_type = GemmType("LinearBackwardWeight", x);
  g.c_type = GemmDType::kF32;
  g.a = dout.address();
  g.b = x.address();
  g.c = dweight.address();
  g.beta = 1.0f;
  RunGemm(st, "LinearBackwardWeight", g, Native(ctx));
}

void AddBias(const ExecContext& ctx, const Tensor& out, const Tensor& bias) {
  StreamState& st = Enter(ctx, "AddBias");
  RequireF32("AddBias", {&out, &bias});
  const int64_t o = bias.numel();
  Note(st, "AddBias",
       LaunchAddBias(out.data<float>(), bias.data<float>(), out.numel() / o, o, Native(ctx)));
}

void BiasBackward(const ExecContext& ctx, const Tensor& dbias, const Tensor& dout) {
  StreamState& st = Enter(ctx, "BiasBackward");
  RequireF32("BiasBackward", {&dbias, &dout});
  const int64_t o = dbias.numel(), n = dout.numel() / o;
  absl::StatusOr<size_t> bytes = ColumnReduceScratchBytes(n, o, 1);
  absl::StatusOr<void*> scratch = bytes.ok() ? Scratch(st, *bytes) : bytes.status();
  if (!scratch.ok()) return Note(st, "BiasBackward", scratch.status());
  Note(st, "BiasBackward", LaunchColumnSum(dbias.data<float>(), dout.data<float>(), n, o,
                                           static_cast<float*>(*scratch), Native(ctx)));
}

void Gelu(const ExecContext& ctx, const Tensor& out, const Tensor& x) {
  StreamState& st = Enter(ctx, "Gelu");
  RequireF32("Gelu", {&out, &x});
  Note(st, "Gelu", LaunchGeluForward(out.data<float>(), x.data<float>(), x.numel(), Native(ctx)));
}

void GeluBackward(const ExecContext& ctx, const Tensor& dx, const Tensor& x, const Tensor& dout) {
  StreamState& st = Enter(ctx, "GeluBackward");
  RequireF32("GeluBackward", {&dx, &x, &dout});
  Note(st, "GeluBackward", LaunchGeluBackward(dx.data<float>(), x.data<float>(),
                                              dout.data<float>(), x.numel(), Native(ctx)));
}

// The plan and dtype of an attention call; the heads are this rank's (a
// tensor-parallel shard's qkv holds only its heads' columns).
absl::StatusOr<AttentionPlan> PlanFor(const Tensor& qkv, int heads) {
  absl::StatusOr<AttentionShard> shard =
      ShardAttention(qkv.dim(0), qkv.dim(1), qkv.dim(2) / 3, heads, 1);
  if (!shard.ok()) return shard.status();
  return PlanAttention(*shard);
}

// The stream's cuDNN attention state for bf16 (null for fp32, or where cuDNN
// is not in the build or does not load: attention then runs as GEMMs, and the
// first such stream says why on stderr).
CudnnAttention* CudnnFor(StreamState& st, GemmDType dtype) {
  if (dtype != GemmDType::kBF16) return nullptr;
  if (!st.cudnn_tried) {
    st.cudnn_tried = true;
    // FusedAttention's check first: what the worker registered
    // (RegisterRequest.fused_attention_bf16) is what its streams do.
    absl::Status supported = ProbeCudnnAttentionOn(st.device);
    absl::StatusOr<CudnnAttentionPtr> c =
        supported.ok() ? CreateCudnnAttention(st.device) : absl::StatusOr<CudnnAttentionPtr>(supported);
    if (c.ok()) {
      st.cudnn = std::move(*c);
    } else {
      static absl::once_flag once;
      absl::call_once(once, [&] {
        std::fprintf(stderr,
                     "baton: no cuDNN for bf16 attention on cuda:%d (attention runs as GEMMs + "
                     "softmax, context-parallel blocks as the fp32 ring kernels): %s\n",
                     st.device, std::string(c.status().message()).c_str());
      });
    }
  }
  return st.cudnn.get();
}

// kernels::ProbeFusedAttention: the device exists (Probe) and CudnnFor's
// device-level check passes. The one step not taken is creating the cuDNN
// handle (it would create a CUDA context in an idle worker daemon); should
// that fail on a stream, it runs attention as GEMMs and keeps P.
absl::Status FusedAttention(int index) {
  if (absl::Status s = Probe(index); !s.ok()) return s;
  return ProbeCudnnAttentionOn(index);
}

void Attention(const ExecContext& ctx, const Tensor& out, const Tensor& att, const Tensor& qkv,
               int heads) {
  StreamState& st = Enter(ctx, "Attention");
  const GemmDType dtype = GemmType("Attention", qkv);
  if (out.dtype() != qkv.dtype() || att.dtype() != qkv.dtype()) {
    Die("Attention", "out, att and qkv must have the same dtype");
  }
  absl::StatusOr<AttentionPlan> plan = PlanFor(qkv, heads);
  if (!plan.ok()) return Note(st, "Attention", plan.status());
  CudnnAttention* cudnn = CudnnFor(st, dtype);
  absl::StatusOr<AttentionChoice> choice = ChooseAttention(cudnn, plan->shard, dtype, att.bytes());
  if (!choice.ok()) return Note(st, "Attention", choice.status());
  if (cudnn != nullptr && choice->path == AttentionPath::kGemmSoftmax) {
    static absl::once_flag once;  // a slow path an operator should hear of, once
    absl::call_once(once, [&] {
      std::fprintf(stderr, "baton: bf16 attention with T=%ld, %ld heads of %ld on cuda:%d runs as "
                   "GEMMs + softmax, not cuDNN: %s\n", static_cast<long>(plan->shard.seq),
                   static_cast<long>(plan->shard.heads), static_cast<long>(plan->shard.head_dim),
                   st.device, choice->why_not_cudnn.c_str());
    });
  }
  const size_t bytes = choice->scratch_bytes;
  absl::StatusOr<void*> scratch = Scratch(st, bytes);
  if (!scratch.ok()) return Note(st, "Attention", scratch.status());
  absl::StatusOr<CublasLtGemm*> gemm = Gemm(st);
  if (!gemm.ok()) return Note(st, "Attention", gemm.status());
  Note(st, "Attention",
       AttentionForward(**gemm, cudnn, *plan, dtype, out.address(), att.address(), att.bytes(),
                        qkv.address(), *scratch, bytes, Native(ctx)));
}

void AttentionBackward(const ExecContext& ctx, const Tensor& dqkv, const Tensor&,
                       const Tensor& dout, const Tensor& qkv, const Tensor& att, int heads) {
  StreamState& st = Enter(ctx, "AttentionBackward");
  const GemmDType dtype = GemmType("AttentionBackward", qkv);
  if (dqkv.dtype() != qkv.dtype() || dout.dtype() != qkv.dtype() || att.dtype() != qkv.dtype()) {
    Die("AttentionBackward", "dqkv, dout, att and qkv must have the same dtype");
  }
  absl::StatusOr<AttentionPlan> plan = PlanFor(qkv, heads);
  if (!plan.ok()) return Note(st, "AttentionBackward", plan.status());
  // The stream scratch, sized for all heads of a batch row (the caller's
  // T·T scratch would force one head per launch), or cuDNN's workspace.
  CudnnAttention* cudnn = CudnnFor(st, dtype);
  absl::StatusOr<AttentionChoice> choice = ChooseAttention(cudnn, plan->shard, dtype, att.bytes());
  if (!choice.ok()) return Note(st, "AttentionBackward", choice.status());
  const size_t bytes = choice->scratch_bytes;
  absl::StatusOr<void*> scratch = Scratch(st, bytes);
  if (!scratch.ok()) return Note(st, "AttentionBackward", scratch.status());
  absl::StatusOr<CublasLtGemm*> gemm = Gemm(st);
  if (!gemm.ok()) return Note(st, "AttentionBackward", gemm.status());
  Note(st, "AttentionBackward",
       cuda::AttentionBackward(**gemm, cudnn, *plan, dtype, dqkv.address(), *scratch, bytes,
                               dout.address(), qkv.address(), att.address(), att.bytes(),
                               Native(ctx)));
}

// att as the path this stream takes for the shape keeps it (attention.h
// AttentionSaved); the backward uses the stream's scratch, not the caller's.
kernels::AttentionBuffers AttentionBuffersOf(const ExecContext& ctx, int64_t batch, int64_t seq,
                                             int64_t channels, int heads, DType dtype) {
  kernels::AttentionBuffers b;
  b.saved = {batch, heads, seq, seq};  // P, also where the attention op will report an error
  b.saved_dtype = dtype;
  if (dtype != DType::kBFloat16) return b;
  StreamState& st = Enter(ctx, "AttentionBuffersFor");
  absl::StatusOr<AttentionShard> shard = ShardAttention(batch, seq, channels, heads, 1);
  if (!shard.ok()) return b;
  absl::StatusOr<AttentionChoice> choice =
      ChooseAttentionToSave(CudnnFor(st, GemmDType::kBF16), *shard, GemmDType::kBF16);
  if (!choice.ok()) return b;
  const AttentionSavedShape saved = AttentionSaved(choice->path, *shard, GemmDType::kBF16);
  b.saved.assign(saved.dims.begin(), saved.dims.end());
  return b;
}

void Residual(const ExecContext& ctx, const Tensor& out, const Tensor& a, const Tensor& b) {
  StreamState& st = Enter(ctx, "Residual");
  RequireF32("Residual", {&out, &a, &b});
  Note(st, "Residual", LaunchResidualForward(out.data<float>(), a.data<float>(), b.data<float>(),
                                             a.numel(), Native(ctx)));
}

void ResidualBackward(const ExecContext& ctx, const Tensor& da, const Tensor& db,
                      const Tensor& dout) {
  StreamState& st = Enter(ctx, "ResidualBackward");
  RequireF32("ResidualBackward", {&da, &db, &dout});
  Note(st, "ResidualBackward",
       LaunchResidualBackward(da.defined() ? da.data<float>() : nullptr,
                              db.defined() ? db.data<float>() : nullptr, dout.data<float>(),
                              dout.numel(), Native(ctx)));
}

absl::StatusOr<double*> RowLosses(StreamState& st, int64_t rows) {
  absl::StatusOr<size_t> bytes = RowLossScratchBytes(rows);
  if (!bytes.ok()) return bytes.status();
  absl::StatusOr<void*> p = Scratch(st, *bytes);
  if (!p.ok()) return p.status();
  return static_cast<double*>(*p);
}

void SoftmaxCrossEntropy(const ExecContext& ctx, const Tensor& logits_to_grad,
                         const Tensor& targets, float grad_scale, const Tensor& loss_sum) {
  StreamState& st = Enter(ctx, "SoftmaxCrossEntropy");
  RequireF32("SoftmaxCrossEntropy", {&logits_to_grad});
  const int64_t n = targets.numel();
  absl::StatusOr<double*> rows = RowLosses(st, n);
  if (!rows.ok()) return Note(st, "SoftmaxCrossEntropy", rows.status());
  Note(st, "SoftmaxCrossEntropy",
       LaunchSoftmaxCrossEntropy(logits_to_grad.data<float>(), targets.data<int32_t>(), n,
                                 logits_to_grad.numel() / n, grad_scale, *rows,
                                 loss_sum.data<double>(), Native(ctx)));
}

void ShardedCrossEntropyStats(const ExecContext& ctx, const Tensor& logits_to_exp,
                              const Tensor& targets, int64_t vocab_begin, const Tensor& row_max,
                              const Tensor& lse, const Tensor& target_logit) {
  StreamState& st = Enter(ctx, "ShardedCrossEntropyStats");
  RequireF32("ShardedCrossEntropyStats", {&logits_to_exp, &row_max, &lse, &target_logit});
  const int64_t n = targets.numel();
  Note(st, "ShardedCrossEntropyStats",
       LaunchShardedCrossEntropyStats(logits_to_exp.data<float>(), targets.data<int32_t>(), n,
                                      vocab_begin, logits_to_exp.numel() / n, row_max.data<float>(),
                                      lse.data<float>(), target_logit.data<float>(), Native(ctx)));
}

void ShardedCrossEntropyFinish(const ExecContext& ctx, const Tensor& exp_to_grad,
                               const Tensor& targets, int64_t vocab_begin, const Tensor& row_max,
                               const Tensor& lse_all, const Tensor& target_logit, float grad_scale,
                               const Tensor& loss_sum) {
  StreamState& st = Enter(ctx, "ShardedCrossEntropyFinish");
  RequireF32("ShardedCrossEntropyFinish", {&exp_to_grad, &row_max, &lse_all, &target_logit});
  const int64_t n = targets.numel();
  absl::StatusOr<double*> rows = RowLosses(st, n);
  if (!rows.ok()) return Note(st, "ShardedCrossEntropyFinish", rows.status());
  Note(st, "ShardedCrossEntropyFinish",
       LaunchShardedCrossEntropyFinish(exp_to_grad.data<float>(), targets.data<int32_t>(), n,
                                       vocab_begin, exp_to_grad.numel() / n, row_max.data<float>(),
                                       lse_all.data<float>(), lse_all.numel() / n,
                                       target_logit.data<float>(), grad_scale, *rows,
                                       loss_sum.data<double>(), Native(ctx)));
}

void ShardArgmax(const ExecContext& ctx, const Tensor& logits, int64_t vocab_begin,
                 const Tensor& max, const Tensor& index) {
  StreamState& st = Enter(ctx, "ShardArgmax");
  RequireF32("ShardArgmax", {&logits, &max, &index});
  const int64_t n = max.numel();
  Note(st, "ShardArgmax", LaunchShardArgmax(logits.data<float>(), n, logits.numel() / n,
                                            vocab_begin, max.data<float>(), index.data<float>(),
                                            Native(ctx)));
}

void CountArgmaxHits(const ExecContext& ctx, const Tensor& max_all, const Tensor& index_all,
                     const Tensor& targets, const Tensor& hits) {
  StreamState& st = Enter(ctx, "CountArgmaxHits");
  RequireF32("CountArgmaxHits", {&max_all, &index_all});
  const int64_t n = targets.numel();
  Note(st, "CountArgmaxHits",
       LaunchCountArgmaxHits(max_all.data<float>(), index_all.data<float>(), max_all.numel() / n,
                             targets.data<int32_t>(), n, hits.data<int64_t>(), Native(ctx)));
}

void AdamW(const ExecContext& ctx, const Tensor& param, const Tensor& grad, const Tensor& m,
           const Tensor& v, const kernels::cpu::AdamWConfig& config, int64_t step,
           float grad_scale, const Tensor& param_bf16) {
  StreamState& st = Enter(ctx, "AdamW");
  RequireF32("AdamW", {&param, &grad, &m, &v});
  AdamWArgs args;
  args.lr = config.lr;
  args.beta1 = config.beta1;
  args.beta2 = config.beta2;
  args.eps = config.eps;
  args.weight_decay = config.weight_decay;
  args.step = step;
  args.grad_scale = grad_scale;
  Note(st, "AdamW",
       LaunchAdamW(param.data<float>(),
                   param_bf16.defined() ? param_bf16.data<__nv_bfloat16>() : nullptr,
                   grad.data<float>(), m.data<float>(), v.data<float>(), param.numel(), args,
                   Native(ctx)));
}

void SumOfSquares(const ExecContext& ctx, const Tensor& x, const Tensor& out) {
  StreamState& st = Enter(ctx, "SumOfSquares");
  RequireF32("SumOfSquares", {&x});
  absl::StatusOr<void*> partial = Scratch(st, NormScratchBytes());
  if (!partial.ok()) return Note(st, "SumOfSquares", partial.status());
  Note(st, "SumOfSquares", LaunchSumOfSquares(x.data<float>(), x.numel(),
                                              static_cast<double*>(*partial), out.data<double>(),
                                              /*accumulate=*/true, Native(ctx)));
}

void Scale(const ExecContext& ctx, const Tensor& x, float factor) {
  StreamState& st = Enter(ctx, "Scale");
  RequireF32("Scale", {&x});
  Note(st, "Scale", LaunchScale(x.data<float>(), x.numel(), factor, Native(ctx)));
}

// ------------------------------------------------------------- Llama blocks

void RmsNorm(const ExecContext& ctx, const Tensor& out, const Tensor& rstd, const Tensor& x,
             const Tensor& weight, float eps) {
  StreamState& st = Enter(ctx, "RmsNorm");
  RequireF32("RmsNorm", {&rstd, &x, &weight});
  const int64_t c = weight.numel(), n = x.numel() / c;
  cudaError_t err;
  if (out.dtype() == DType::kBFloat16) {
    err = LaunchRmsNormForward(out.data<__nv_bfloat16>(), rstd.data<float>(), x.data<float>(),
                               weight.data<float>(), n, c, eps, Native(ctx));
  } else {
    RequireF32("RmsNorm", {&out});
    err = LaunchRmsNormForward(out.data<float>(), rstd.data<float>(), x.data<float>(),
                               weight.data<float>(), n, c, eps, Native(ctx));
  }
  Note(st, "RmsNorm", err);
}

void RmsNormBackward(const ExecContext& ctx, const Tensor& dx, const Tensor& dweight,
                     const Tensor& dout, const Tensor& x, const Tensor& weight,
                     const Tensor& rstd) {
  StreamState& st = Enter(ctx, "RmsNormBackward");
  RequireF32("RmsNormBackward", {&dx, &dweight, &dout, &x, &weight, &rstd});
  const int64_t c = weight.numel(), n = x.numel() / c;
  absl::StatusOr<size_t> bytes = ColumnReduceScratchBytes(n, c, 1);
  absl::StatusOr<void*> scratch = bytes.ok() ? Scratch(st, *bytes) : bytes.status();
  if (!scratch.ok()) return Note(st, "RmsNormBackward", scratch.status());
  Note(st, "RmsNormBackward",
       LaunchRmsNormBackward(dx.data<float>(), dweight.data<float>(), dout.data<float>(),
                             x.data<float>(), weight.data<float>(), rstd.data<float>(), n, c,
                             static_cast<float*>(*scratch), Native(ctx)));
}

void SwiGlu(const ExecContext& ctx, const Tensor& out, const Tensor& gate, const Tensor& up) {
  StreamState& st = Enter(ctx, "SwiGlu");
  RequireF32("SwiGlu", {&out, &gate, &up});
  Note(st, "SwiGlu", LaunchSwiGluForward(out.data<float>(), gate.data<float>(), up.data<float>(),
                                         gate.numel(), Native(ctx)));
}

void SwiGluBackward(const ExecContext& ctx, const Tensor& dgate, const Tensor& dup,
                    const Tensor& dout, const Tensor& gate, const Tensor& up) {
  StreamState& st = Enter(ctx, "SwiGluBackward");
  RequireF32("SwiGluBackward", {&dgate, &dup, &dout, &gate, &up});
  Note(st, "SwiGluBackward",
       LaunchSwiGluBackward(dgate.data<float>(), dup.data<float>(), dout.data<float>(),
                            gate.data<float>(), up.data<float>(), gate.numel(), Native(ctx)));
}

// head_dim of packed [B, T, 3·H·D]; past the kernels' limit, the stream's
// error says so (ops.cc has checked the rest of the shape).
bool RopeHeadDimOk(StreamState& st, const char* op, int64_t head_dim) {
  if (head_dim <= kRopeMaxHeadDim) return true;
  Note(st, op, absl::InvalidArgumentError(absl::StrCat(
                   "head_dim ", head_dim, " is over the CUDA RoPE kernels' limit of ",
                   kRopeMaxHeadDim, "; use a model with smaller heads")));
  return false;
}

RopeGradOut GradOut(const char* op, const Tensor& t) {
  if (t.dtype() == DType::kBFloat16) return RopeGradOut::Bf16(t.data<__nv_bfloat16>());
  RequireF32(op, {&t});
  return RopeGradOut::F32(t.data<float>());
}

void RopePack(const ExecContext& ctx, const Tensor& qkv, const Tensor& q, const Tensor& k,
              const Tensor& v, int heads, int kv_heads, float theta, int64_t position_offset) {
  StreamState& st = Enter(ctx, "RopePack");
  RequireF32("RopePack", {&q, &k, &v});
  const int64_t b = qkv.dim(0), t = qkv.dim(1), d = qkv.dim(2) / (3 * int64_t{heads});
  if (!RopeHeadDimOk(st, "RopePack", d)) return;
  cudaError_t err;
  if (qkv.dtype() == DType::kBFloat16) {
    err = LaunchRopePackForward(qkv.data<__nv_bfloat16>(), q.data<float>(), k.data<float>(),
                                v.data<float>(), b, t, heads, kv_heads, d, theta, Native(ctx),
                                position_offset);
  } else {
    RequireF32("RopePack", {&qkv});
    err = LaunchRopePackForward(qkv.data<float>(), q.data<float>(), k.data<float>(),
                                v.data<float>(), b, t, heads, kv_heads, d, theta, Native(ctx),
                                position_offset);
  }
  Note(st, "RopePack", err);
}

void RopePackBackward(const ExecContext& ctx, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                      const Tensor& dqkv, int heads, int kv_heads, float theta,
                      int64_t position_offset) {
  StreamState& st = Enter(ctx, "RopePackBackward");
  const int64_t b = dqkv.dim(0), t = dqkv.dim(1), d = dqkv.dim(2) / (3 * int64_t{heads});
  if (!RopeHeadDimOk(st, "RopePackBackward", d)) return;
  const RopeGradOut gq = GradOut("RopePackBackward", dq), gk = GradOut("RopePackBackward", dk),
                    gv = GradOut("RopePackBackward", dv);
  cudaError_t err;
  if (dqkv.dtype() == DType::kBFloat16) {
    err = LaunchRopePackBackward(gq, gk, gv, dqkv.data<__nv_bfloat16>(), b, t, heads, kv_heads, d,
                                 theta, Native(ctx), position_offset);
  } else {
    RequireF32("RopePackBackward", {&dqkv});
    err = LaunchRopePackBackward(gq, gk, gv, dqkv.data<float>(), b, t, heads, kv_heads, d, theta,
                                 Native(ctx), position_offset);
  }
  Note(st, "RopePackBackward", err);
}

// ------------------------------------- context-parallel (ring) attention
//
// ops.cc has checked the shapes and dtypes. q is read in place from qkv
// [B,Tq,3C], k and v from kv [B,Tk,2C] (ring_attention.cuh). out, lse,
// delta, dqkv and dkv are fp32; qkv, kv and (backward) dout and out are all
// fp32 or all bf16. fp32 runs the kernels of ring_attention.cuh. bf16 runs a
// fully visible or diagonal block through cuDNN's fused SDPA where the
// stream has cuDNN (ring_sdpa.h: o, or dq and dk|dv, as bf16 temporaries in
// the stream scratch, then widened into out or added into dqkv / dkv), and
// any other block through the fp32 kernels on its inputs widened into the
// stream scratch (exact: the fp32 ops' math on the images). The ops'
// `scratch` is not used on CUDA.

// The block of (qkv, kv); past the kernels' head_dim limit, the stream's
// error says so and nothing is launched.
bool RingBlockOf(StreamState& st, const char* op, const Tensor& qkv, const Tensor& kv, int heads,
                 int64_t q_offset, int64_t k_offset, RingBlock* block) {
  *block = RingBlock{qkv.dim(0), qkv.dim(1), kv.dim(1), qkv.dim(2) / 3,
                     heads, q_offset, k_offset};
  const int64_t head_dim = block->channels / heads;
  if (head_dim <= kRingAttentionMaxHeadDim) return true;
  Note(st, op, absl::InvalidArgumentError(absl::StrCat(
                   "head_dim ", head_dim, " is over the CUDA context-parallel attention kernels' "
                   "limit of ", kRingAttentionMaxHeadDim, "; use a model with smaller heads, or "
                   "cp = 1")));
  return false;
}

RingSdpaBlock SdpaBlockOf(const RingBlock& b) {
  RingSdpaBlock s;
  s.batch = b.batch;
  s.q_len = b.q_len;
  s.k_len = b.k_len;
  s.channels = b.channels;
  s.heads = b.heads;
  s.q_offset = b.q_offset;
  s.k_offset = b.k_offset;
  return s;
}

// The cuDNN path of a bf16 block, or none; a block cuDNN should have taken
// and did not is reported once per process on stderr (the fp32 kernels
// still give the right answer, slower).
RingSdpaChoice ChooseRing(StreamState& st, const RingBlock& block,
                          std::initializer_list<const void*> pointers) {
  const RingSdpaBlock b = SdpaBlockOf(block);
  // CudnnFor only for a block cuDNN takes: the others never need a handle.
  if (!RingSdpaApplies(b).ok()) return ChooseRingSdpa(nullptr, b, pointers);
  RingSdpaChoice c = ChooseRingSdpa(CudnnFor(st, GemmDType::kBF16), b, pointers);
  if (!c.cudnn && !c.expected) {
    static absl::once_flag once;
    absl::call_once(once, [&] {
      std::fprintf(stderr,
                   "baton: a bf16 context-parallel attention block (Tq=%ld Tk=%ld, %ld heads of "
                   "%ld) on cuda:%d runs as the fp32 kernels on widened inputs, not cuDNN: %s\n",
                   static_cast<long>(b.q_len), static_cast<long>(b.k_len),
                   static_cast<long>(b.heads), static_cast<long>(b.channels / b.heads),
                   st.device, c.why_not_cudnn.c_str());
    });
  }
  return c;
}

size_t Bf16Bytes(int64_t rows, int64_t width) {
  return static_cast<size_t>(rows) * static_cast<size_t>(width) * 2;
}
size_t F32Bytes(int64_t rows, int64_t width) {
  return static_cast<size_t>(rows) * static_cast<size_t>(width) * sizeof(float);
}
size_t Aligned256(size_t bytes) { return (bytes + 255) / 256 * 256; }
char* Bytes(void* base, size_t offset) { return static_cast<char*>(base) + offset; }

// The fp32 images of a bf16 block in the stream scratch: qkv's q columns
// (in a [B,Tq,3C] buffer, k and v columns unwritten: the kernels read q only)
// at 0, kv [B,Tk,2C] after it, dout [B,Tq,C] after that (backward).
struct WidenedRing {
  float* qkv = nullptr;
  float* kv = nullptr;
  float* dout = nullptr;
};

absl::StatusOr<WidenedRing> WidenRing(StreamState& st, const RingBlock& b, const Tensor& qkv,
                                      const Tensor& kv, const Tensor* dout, cudaStream_t stream) {
  const int64_t c = b.channels, q_rows = b.batch * b.q_len, k_rows = b.batch * b.k_len;
  const size_t kv_at = Aligned256(F32Bytes(q_rows, 3 * c));
  const size_t dout_at = kv_at + Aligned256(F32Bytes(k_rows, 2 * c));
  const size_t bytes = dout_at + (dout != nullptr ? F32Bytes(q_rows, c) : 0);
  BATON_ASSIGN_OR_RETURN(void* scratch, Scratch(st, bytes));
  WidenedRing w;
  w.qkv = static_cast<float*>(scratch);
  w.kv = reinterpret_cast<float*>(Bytes(scratch, kv_at));
  BATON_CUDA_RETURN_IF_ERROR(LaunchWidenColumns(w.qkv, 3 * c, qkv.data<__nv_bfloat16>(), 3 * c,
                                                q_rows, c, stream));
  BATON_CUDA_RETURN_IF_ERROR(
      LaunchCastBf16ToF32(w.kv, kv.data<__nv_bfloat16>(), k_rows * 2 * c, stream));
  if (dout != nullptr) {
    w.dout = reinterpret_cast<float*>(Bytes(scratch, dout_at));
    BATON_CUDA_RETURN_IF_ERROR(
        LaunchCastBf16ToF32(w.dout, dout->data<__nv_bfloat16>(), q_rows * c, stream));
  }
  return w;
}

absl::Status Bf16BlockAttention(StreamState& st, const Tensor& out, const Tensor& lse,
                                const Tensor& qkv, const Tensor& kv, const RingBlock& b,
                                cudaStream_t stream) {
  const RingSdpaChoice choice =
      ChooseRing(st, b, {qkv.address(), kv.address(), lse.address()});
  if (choice.cudnn) {
    const RingSdpaPlan& plan = choice.plan;
    BATON_ASSIGN_OR_RETURN(
        void* scratch, Scratch(st, RingSdpaForwardScratchBytes(plan, choice.workspace.forward)));
    void* o = scratch;  // bf16 [B,Tq,C]
    BATON_RETURN_IF_ERROR(RingSdpaForward(
        *st.cudnn, plan, o, lse.data<float>(), qkv.address(), kv.address(),
        Bytes(scratch, plan.scratch.forward_workspace), choice.workspace.forward, stream));
    BATON_CUDA_RETURN_IF_ERROR(LaunchCastBf16ToF32(
        out.data<float>(), static_cast<const __nv_bfloat16*>(o), b.batch * b.q_len * b.channels,
        stream));
    return absl::OkStatus();
  }
  BATON_ASSIGN_OR_RETURN(const WidenedRing w, WidenRing(st, b, qkv, kv, nullptr, stream));
  BATON_CUDA_RETURN_IF_ERROR(
      LaunchBlockAttentionForward(out.data<float>(), lse.data<float>(), w.qkv, w.kv, b, stream));
  return absl::OkStatus();
}

absl::Status Bf16BlockAttentionBackward(StreamState& st, const Tensor& dqkv, const Tensor& dkv,
                                        const Tensor& dout, const Tensor& out, const Tensor& qkv,
                                        const Tensor& kv, const Tensor& lse, const Tensor& delta,
                                        const RingBlock& b, cudaStream_t stream) {
  // A block no query row sees adds nothing (ops.h): nothing to widen either.
  if (RingBlockMaskOf(SdpaBlockOf(b)) == RingBlockMask::kInvisible) return absl::OkStatus();
  const int64_t c = b.channels, q_rows = b.batch * b.q_len, k_rows = b.batch * b.k_len;
  const RingSdpaChoice choice = ChooseRing(
      st, b, {qkv.address(), kv.address(), dout.address(), out.address(), lse.address()});
  if (choice.cudnn) {
    const RingSdpaPlan& plan = choice.plan;
    BATON_ASSIGN_OR_RETURN(
        void* scratch,
        Scratch(st, RingSdpaBackwardScratchBytes(plan, choice.workspace.backward)));
    void* dq = scratch;                                  // bf16 [B,Tq,C]
    void* dkv_block = Bytes(scratch, plan.scratch.dkv);  // bf16 [B,Tk,2C]
    BATON_RETURN_IF_ERROR(RingSdpaBackward(
        *st.cudnn, plan, dq, dkv_block, dout.address(), out.address(), qkv.address(),
        kv.address(), lse.data<float>(), Bytes(scratch, plan.scratch.backward_workspace),
        choice.workspace.backward, stream));
    BATON_CUDA_RETURN_IF_ERROR(LaunchAddWidenedColumns(
        dqkv.data<float>(), 3 * c, static_cast<const __nv_bfloat16*>(dq), c, q_rows, c, stream));
    BATON_CUDA_RETURN_IF_ERROR(LaunchAddWidenedColumns(
        dkv.data<float>(), 2 * c, static_cast<const __nv_bfloat16*>(dkv_block), 2 * c, k_rows,
        2 * c, stream));
    return absl::OkStatus();
  }
  BATON_ASSIGN_OR_RETURN(const WidenedRing w, WidenRing(st, b, qkv, kv, &dout, stream));
  BATON_CUDA_RETURN_IF_ERROR(LaunchBlockAttentionBackward(dqkv.data<float>(), dkv.data<float>(),
                                                          w.dout, w.qkv, w.kv, lse.data<float>(),
                                                          delta.data<float>(), b, stream));
  return absl::OkStatus();
}

void KvOfQkv(const ExecContext& ctx, const Tensor& kv, const Tensor& qkv) {
  StreamState& st = Enter(ctx, "KvOfQkv");
  const int64_t rows = qkv.dim(0) * qkv.dim(1), c = qkv.dim(2) / 3;
  if (qkv.dtype() == DType::kBFloat16) {
    Note(st, "KvOfQkv", LaunchKvOfQkv(kv.data<__nv_bfloat16>(), qkv.data<__nv_bfloat16>(), rows,
                                      c, Native(ctx)));
    return;
  }
  RequireF32("KvOfQkv", {&kv, &qkv});
  Note(st, "KvOfQkv", LaunchKvOfQkv(kv.data<float>(), qkv.data<float>(), rows, c, Native(ctx)));
}

void BlockAttention(const ExecContext& ctx, const Tensor& out, const Tensor& lse,
                    const Tensor& qkv, const Tensor& kv, int heads, int64_t q_offset,
                    int64_t k_offset, const Tensor& /*scratch*/) {
  StreamState& st = Enter(ctx, "BlockAttention");
  RequireF32("BlockAttention", {&out, &lse});
  RingBlock block;
  if (!RingBlockOf(st, "BlockAttention", qkv, kv, heads, q_offset, k_offset, &block)) return;
  if (qkv.dtype() == DType::kBFloat16) {
    Note(st, "BlockAttention", Bf16BlockAttention(st, out, lse, qkv, kv, block, Native(ctx)));
    return;
  }
  RequireF32("BlockAttention", {&qkv, &kv});
  Note(st, "BlockAttention",
       LaunchBlockAttentionForward(out.data<float>(), lse.data<float>(), qkv.data<float>(),
                                   kv.data<float>(), block, Native(ctx)));
}

void MergeAttentionBlock(const ExecContext& ctx, const Tensor& out, const Tensor& lse,
                         const Tensor& block_out, const Tensor& block_lse, int heads) {
  StreamState& st = Enter(ctx, "MergeAttentionBlock");
  RequireF32("MergeAttentionBlock", {&out, &lse, &block_out, &block_lse});
  Note(st, "MergeAttentionBlock",
       LaunchMergeAttentionBlock(out.data<float>(), lse.data<float>(), block_out.data<float>(),
                                 block_lse.data<float>(), out.dim(0), out.dim(1), out.dim(2),
                                 heads, Native(ctx)));
}

void AttentionDelta(const ExecContext& ctx, const Tensor& delta, const Tensor& dout,
                    const Tensor& out, int heads) {
  StreamState& st = Enter(ctx, "AttentionDelta");
  RequireF32("AttentionDelta", {&delta, &dout, &out});
  Note(st, "AttentionDelta",
       LaunchAttentionDelta(delta.data<float>(), dout.data<float>(), out.data<float>(), out.dim(0),
                            out.dim(1), out.dim(2), heads, Native(ctx)));
}

// fp32 reads delta; the cuDNN path (bf16) forms it from out and dout itself.
void BlockAttentionBackward(const ExecContext& ctx, const Tensor& dqkv, const Tensor& dkv,
                            const Tensor& dout, const Tensor& out, const Tensor& qkv,
                            const Tensor& kv, const Tensor& lse, const Tensor& delta, int heads,
                            int64_t q_offset, int64_t k_offset, const Tensor& /*scratch*/) {
  StreamState& st = Enter(ctx, "BlockAttentionBackward");
  RequireF32("BlockAttentionBackward", {&dqkv, &dkv, &lse, &delta});
  RingBlock block;
  if (!RingBlockOf(st, "BlockAttentionBackward", qkv, kv, heads, q_offset, k_offset, &block)) {
    return;
  }
  if (qkv.dtype() == DType::kBFloat16) {
    Note(st, "BlockAttentionBackward",
         Bf16BlockAttentionBackward(st, dqkv, dkv, dout, out, qkv, kv, lse, delta, block,
                                    Native(ctx)));
    return;
  }
  RequireF32("BlockAttentionBackward", {&dout, &qkv, &kv});
  Note(st, "BlockAttentionBackward",
       LaunchBlockAttentionBackward(dqkv.data<float>(), dkv.data<float>(), dout.data<float>(),
                                    qkv.data<float>(), kv.data<float>(), lse.data<float>(),
                                    delta.data<float>(), block, Native(ctx)));
}

void QkvGradOfKv(const ExecContext& ctx, const Tensor& dqkv, const Tensor& dkv) {
  StreamState& st = Enter(ctx, "QkvGradOfKv");
  RequireF32("QkvGradOfKv", {&dqkv, &dkv});
  Note(st, "QkvGradOfKv", LaunchQkvGradOfKv(dqkv.data<float>(), dkv.data<float>(),
                                            dqkv.dim(0) * dqkv.dim(1), dqkv.dim(2) / 3,
                                            Native(ctx)));
}

// ------------------------------------------------ Mixture-of-Experts routing
//
// fp32 data, int32 indices, int64 counts; ops.cc has checked the shapes and
// dtypes: expert [N,K] gives N and K, the router rows [N,E] or the expert
// buffers [E,Cap,H] give E, Cap and H (moe.cuh).

void RouterTopK(const ExecContext& ctx, const Tensor& probs, const Tensor& expert,
                const Tensor& gate, const Tensor& logits, bool renormalize) {
  StreamState& st = Enter(ctx, "RouterTopK");
  RequireF32("RouterTopK", {&probs, &gate, &logits});
  Note(st, "RouterTopK",
       LaunchRouterTopK(probs.data<float>(), expert.data<int32_t>(), gate.data<float>(),
                        logits.data<float>(), expert.dim(0), logits.dim(1), expert.dim(1),
                        renormalize, Native(ctx)));
}

void RouterTopKBackward(const ExecContext& ctx, const Tensor& dlogits, const Tensor& dgate,
                        const Tensor& expert, const Tensor& gate, const Tensor& probs,
                        bool renormalize) {
  StreamState& st = Enter(ctx, "RouterTopKBackward");
  RequireF32("RouterTopKBackward", {&dlogits, &dgate, &gate, &probs});
  Note(st, "RouterTopKBackward",
       LaunchRouterTopKBackward(dlogits.data<float>(), dgate.data<float>(), expert.data<int32_t>(),
                                gate.data<float>(), probs.data<float>(), expert.dim(0),
                                dlogits.dim(1), expert.dim(1), renormalize, Native(ctx)));
}

void PlanDispatch(const ExecContext& ctx, const Tensor& slot, const Tensor& counts,
                  const Tensor& expert, int64_t capacity) {
  StreamState& st = Enter(ctx, "PlanDispatch");
  Note(st, "PlanDispatch",
       LaunchPlanDispatch(slot.data<int32_t>(), counts.data<int64_t>(), expert.data<int32_t>(),
                          expert.dim(0), counts.dim(0), expert.dim(1), capacity, Native(ctx)));
}

void ExpertTokenCounts(const ExecContext& ctx, const Tensor& routed, const Tensor& expert) {
  StreamState& st = Enter(ctx, "ExpertTokenCounts");
  Note(st, "ExpertTokenCounts",
       LaunchExpertTokenCounts(routed.data<int64_t>(), expert.data<int32_t>(), expert.dim(0),
                               routed.dim(0), expert.dim(1), Native(ctx)));
}

void Permute(const ExecContext& ctx, const Tensor& expert_in, const Tensor& x,
             const Tensor& expert, const Tensor& slot) {
  StreamState& st = Enter(ctx, "Permute");
  RequireF32("Permute", {&expert_in, &x});
  Note(st, "Permute",
       LaunchPermute(expert_in.data<float>(), x.data<float>(), expert.data<int32_t>(),
                     slot.data<int32_t>(), expert.dim(0), expert_in.dim(0), expert.dim(1),
                     expert_in.dim(2), expert_in.dim(1), Native(ctx)));
}

void PermuteBackward(const ExecContext& ctx, const Tensor& dx, const Tensor& dexpert_in,
                     const Tensor& expert, const Tensor& slot) {
  StreamState& st = Enter(ctx, "PermuteBackward");
  RequireF32("PermuteBackward", {&dx, &dexpert_in});
  Note(st, "PermuteBackward",
       LaunchPermuteBackward(dx.data<float>(), dexpert_in.data<float>(), expert.data<int32_t>(),
                             slot.data<int32_t>(), expert.dim(0), dexpert_in.dim(0),
                             expert.dim(1), dexpert_in.dim(2), dexpert_in.dim(1), Native(ctx)));
}

void Combine(const ExecContext& ctx, const Tensor& y, const Tensor& expert_out, const Tensor& gate,
             const Tensor& expert, const Tensor& slot) {
  StreamState& st = Enter(ctx, "Combine");
  RequireF32("Combine", {&y, &expert_out, &gate});
  Note(st, "Combine",
       LaunchCombine(y.data<float>(), expert_out.data<float>(), gate.data<float>(),
                     expert.data<int32_t>(), slot.data<int32_t>(), expert.dim(0),
                     expert_out.dim(0), expert.dim(1), expert_out.dim(2), expert_out.dim(1),
                     Native(ctx)));
}

void CombineBackward(const ExecContext& ctx, const Tensor& dexpert_out, const Tensor& dgate,
                     const Tensor& dy, const Tensor& expert_out, const Tensor& gate,
                     const Tensor& expert, const Tensor& slot) {
  StreamState& st = Enter(ctx, "CombineBackward");
  RequireF32("CombineBackward", {&dexpert_out, &dgate, &dy, &expert_out, &gate});
  Note(st, "CombineBackward",
       LaunchCombineBackward(dexpert_out.data<float>(), dgate.data<float>(), dy.data<float>(),
                             expert_out.data<float>(), gate.data<float>(), expert.data<int32_t>(),
                             slot.data<int32_t>(), expert.dim(0), expert_out.dim(0),
                             expert.dim(1), expert_out.dim(2), expert_out.dim(1), Native(ctx)));
}

// c_e and the per-expert loss terms live in the stream's scratch (2·E
// doubles); if it cannot grow, the stream's error says so and nothing runs.
void LoadBalancingLoss(const ExecContext& ctx, const Tensor& loss, const Tensor& dlogits_aux,
                       const Tensor& probs, const Tensor& expert, float coef, float grad_scale) {
  StreamState& st = Enter(ctx, "LoadBalancingLoss");
  RequireF32("LoadBalancingLoss", {&loss, &dlogits_aux, &probs});
  const int64_t experts = probs.dim(1);
  absl::StatusOr<void*> scratch = Scratch(st, LoadBalancingLossScratchBytes(experts));
  if (!scratch.ok()) return Note(st, "LoadBalancingLoss", scratch.status());
  Note(st, "LoadBalancingLoss",
       LaunchLoadBalancingLoss(loss.data<float>(), dlogits_aux.data<float>(), probs.data<float>(),
                               expert.data<int32_t>(), expert.dim(0), experts, expert.dim(1), coef,
                               grad_scale, static_cast<double*>(*scratch), Native(ctx)));
}

const kernels::Backend kCuda = {
    "cuda",
    kernels::DeviceType::kCuda,
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
    FusedAttention,
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

BATON_REGISTER_BACKEND(kCuda);

}  // namespace

const kernels::Backend& CudaBackend() { return kCuda; }

absl::StatusOr<CudaStreamInfo> GetCudaStreamInfo(const kernels::Stream& stream) {
  if (stream.device().type != kernels::DeviceType::kCuda) {
    return absl::InvalidArgumentError("not a CUDA stream");
  }
  StreamState* state = FindState(static_cast<cudaStream_t>(stream.native()));
  if (state == nullptr) return absl::NotFoundError("stream unknown to the CUDA backend");
  CudaStreamInfo info;
  if (state->gemm != nullptr) {
    info.gemm_cache_hits = state->gemm->cache_hits();
    info.gemm_cache_misses = state->gemm->cache_misses();
  }
  info.scratch_bytes = state->scratch_bytes;
  return info;
}

}  // namespace baton::cuda
