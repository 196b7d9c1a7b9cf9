// The CPU backend: today's kernels/cpu behind the Backend table. Every op
// runs inline on the calling thread, so its stream is empty and events just
// note the host clock. Results are exactly those of the kernels/cpu functions.
#include <cstdlib>
#include <cstring>

#include "absl/time/clock.h"
#include "kernels/backend.h"
#include "kernels/cpu/adamw.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/cross_entropy.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/gelu.h"
#include "kernels/cpu/grad_norm.h"
#include "kernels/cpu/layernorm.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/residual.h"

namespace baton::kernels {
namespace {

float* F32OrNull(const Tensor& t) { return t.defined() ? t.f32() : nullptr; }

absl::Status Probe(int index) {
  if (index != 0) return absl::InvalidArgumentError("the CPU device has index 0 only");
  return absl::OkStatus();
}

absl::StatusOr<void*> Allocate(int, size_t bytes) {
  void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (p == nullptr) return absl::ResourceExhaustedError("out of host memory");
  return p;
}

void Free(int, void* p) { std::free(p); }

absl::StatusOr<void*> CreateStream(int) { return nullptr; }
void DestroyStream(int, void*) {}
absl::Status SynchronizeStream(void*) { return absl::OkStatus(); }

// An event is the host time at which it was recorded (all earlier work has
// already run).
absl::StatusOr<void*> CreateEvent(int) { return static_cast<void*>(new absl::Time()); }
void DestroyEvent(int, void* e) { delete static_cast<absl::Time*>(e); }
absl::Status RecordEvent(void* e, void*) {
  *static_cast<absl::Time*>(e) = absl::Now();
  return absl::OkStatus();
}
absl::Status StreamWaitEvent(void*, void*) { return absl::OkStatus(); }
absl::Status SynchronizeEvent(void*) { return absl::OkStatus(); }
absl::StatusOr<double> EventSeconds(void* start, void* end) {
  return absl::ToDoubleSeconds(*static_cast<absl::Time*>(end) - *static_cast<absl::Time*>(start));
}
// Work runs inline: so does a host function.
absl::Status LaunchHostFunc(void*, void (*fn)(void*), void* arg) {
  fn(arg);
  return absl::OkStatus();
}

void Copy(const ExecContext&, const Tensor& dst, const Tensor& src) {
  std::memcpy(dst.raw(), src.raw(), src.bytes());
}

void FillZero(const ExecContext&, const Tensor& dst) { std::memset(dst.raw(), 0, dst.bytes()); }

void Cast(const ExecContext&, const Tensor&, const Tensor&) {
  std::fprintf(stderr, "baton::kernels::Cast: the CPU backend has no bfloat16 kernels\n");
  std::abort();
}

void Embedding(const ExecContext&, const Tensor& out, const Tensor& tokens, const Tensor& wte,
               int64_t vocab_begin, const Tensor& wpe) {
  cpu::EmbeddingForward(out.f32(), tokens.i32(), wte.f32(), vocab_begin, wte.dim(0), F32OrNull(wpe),
                        tokens.dim(0), tokens.dim(1), wte.dim(1));
}

void EmbeddingBackward(const ExecContext&, const Tensor& dwte, int64_t vocab_begin,
                       const Tensor& dwpe, const Tensor& dout, const Tensor& tokens) {
  const int64_t b = tokens.dim(0), t = tokens.dim(1);
  cpu::EmbeddingBackward(F32OrNull(dwte), vocab_begin, dwte.defined() ? dwte.dim(0) : 0,
                         F32OrNull(dwpe), dout.f32(), tokens.i32(), b, t, dout.numel() / (b * t));
}

void LayerNorm(const ExecContext&, const Tensor& out, const Tensor& mean, const Tensor& rstd,
               const Tensor& x, const Tensor& weight, const Tensor& bias) {
  const int64_t c = weight.numel();
  cpu::LayerNormForward(out.f32(), mean.f32(), rstd.f32(), x.f32(), weight.f32(), bias.f32(),
                        x.numel() / c, c);
}

void LayerNormBackward(const ExecContext&, const Tensor& dx, const Tensor& dweight,
                       const Tensor& dbias, const Tensor& dout, const Tensor& x,
                       const Tensor& weight, const Tensor& mean, const Tensor& rstd) {
  const int64_t c = weight.numel();
  cpu::LayerNormBackward(dx.f32(), dweight.f32(), dbias.f32(), dout.f32(), x.f32(), weight.f32(),
                         mean.f32(), rstd.f32(), x.numel() / c, c);
}

void Linear(const ExecContext&, const Tensor& out, const Tensor& x, const Tensor& weight,
            const Tensor& bias) {
  const int64_t o = weight.dim(0), i = weight.dim(1);
  cpu::MatmulForward(out.f32(), x.f32(), weight.f32(), F32OrNull(bias), x.numel() / i, i, o);
}

void LinearBackwardInput(const ExecContext&, const Tensor& dx, const Tensor& dout,
                         const Tensor& weight, bool accumulate) {
  const int64_t o = weight.dim(0), i = weight.dim(1);
  cpu::MatmulBackwardInput(dx.f32(), dout.f32(), weight.f32(), dout.numel() / o, i, o, accumulate);
}

void LinearBackwardWeight(const ExecContext&, const Tensor& dweight, const Tensor& dout,
                          const Tensor& x) {
  const int64_t o = dweight.dim(0), i = dweight.dim(1);
  cpu::MatmulBackwardWeight(dweight.f32(), dout.f32(), x.f32(), x.numel() / i, i, o);
}

void AddBias(const ExecContext&, const Tensor& out, const Tensor& bias) {
  const int64_t o = bias.numel();
  cpu::AddBias(out.f32(), bias.f32(), out.numel() / o, o);
}

void BiasBackward(const ExecContext&, const Tensor& dbias, const Tensor& dout) {
  const int64_t o = dbias.numel();
  cpu::BiasBackward(dbias.f32(), dout.f32(), dout.numel() / o, o);
}

void Gelu(const ExecContext&, const Tensor& out, const Tensor& x) {
  cpu::GeluForward(out.f32(), x.f32(), x.numel());
}

void GeluBackward(const ExecContext&, const Tensor& dx, const Tensor& x, const Tensor& dout) {
  cpu::GeluBackward(dx.f32(), x.f32(), dout.f32(), x.numel());
}

void Attention(const ExecContext&, const Tensor& out, const Tensor& att, const Tensor& qkv,
               int heads) {
  cpu::AttentionForward(out.f32(), att.f32(), qkv.f32(), qkv.dim(0), qkv.dim(1), qkv.dim(2) / 3,
                        heads);
}

void AttentionBackward(const ExecContext&, const Tensor& dqkv, const Tensor& scratch,
                       const Tensor& dout, const Tensor& qkv, const Tensor& att, int heads) {
  cpu::AttentionBackward(dqkv.f32(), scratch.f32(), dout.f32(), qkv.f32(), att.f32(), qkv.dim(0),
                         qkv.dim(1), qkv.dim(2) / 3, heads);
}

void Residual(const ExecContext&, const Tensor& out, const Tensor& a, const Tensor& b) {
  cpu::ResidualForward(out.f32(), a.f32(), b.f32(), a.numel());
}

void ResidualBackward(const ExecContext&, const Tensor& da, const Tensor& db, const Tensor& dout) {
  cpu::ResidualBackward(F32OrNull(da), F32OrNull(db), dout.f32(), dout.numel());
}

double* F64(const Tensor& t) { return static_cast<double*>(t.raw()); }
int64_t* I64(const Tensor& t) { return static_cast<int64_t*>(t.raw()); }

void SoftmaxCrossEntropy(const ExecContext&, const Tensor& logits_to_grad, const Tensor& targets,
                         float grad_scale, const Tensor& loss_sum) {
  const int64_t n = targets.numel();
  *F64(loss_sum) += cpu::SoftmaxCrossEntropy(logits_to_grad.f32(), targets.i32(), n,
                                             logits_to_grad.numel() / n, grad_scale);
}

void ShardedCrossEntropyStats(const ExecContext&, const Tensor& logits_to_exp,
                              const Tensor& targets, int64_t vocab_begin, const Tensor& row_max,
                              const Tensor& lse, const Tensor& target_logit) {
  const int64_t n = targets.numel();
  cpu::ShardedCrossEntropyStats(logits_to_exp.f32(), targets.i32(), n, vocab_begin,
                                logits_to_exp.numel() / n, row_max.f32(), lse.f32(),
                                target_logit.f32());
}

void ShardedCrossEntropyFinish(const ExecContext&, const Tensor& exp_to_grad,
                               const Tensor& targets, int64_t vocab_begin, const Tensor& row_max,
                               const Tensor& lse_all, const Tensor& target_logit, float grad_scale,
                               const Tensor& loss_sum) {
  const int64_t n = targets.numel();
  *F64(loss_sum) += cpu::ShardedCrossEntropyFinish(
      exp_to_grad.f32(), targets.i32(), n, vocab_begin, exp_to_grad.numel() / n, row_max.f32(),
      lse_all.f32(), lse_all.numel() / n, target_logit.f32(), grad_scale);
}

void ShardArgmax(const ExecContext&, const Tensor& logits, int64_t vocab_begin, const Tensor& max,
                 const Tensor& index) {
  const int64_t n = max.numel();
  cpu::ShardArgmax(logits.f32(), n, logits.numel() / n, vocab_begin, max.f32(), index.f32());
}

void CountArgmaxHits(const ExecContext&, const Tensor& max_all, const Tensor& index_all,
                     const Tensor& targets, const Tensor& hits) {
  const int64_t n = targets.numel();
  *I64(hits) += cpu::CountArgmaxHits(max_all.f32(), index_all.f32(), max_all.numel() / n,
                                     targets.i32(), n);
}

void AdamW(const ExecContext&, const Tensor& param, const Tensor& grad, const Tensor& m,
           const Tensor& v, const cpu::AdamWConfig& config, int64_t step, float grad_scale,
           const Tensor& param_bf16) {
  if (param_bf16.defined()) {
    std::fprintf(stderr, "baton::kernels::AdamW: the CPU backend has no bfloat16 copy\n");
    std::abort();
  }
  cpu::AdamWUpdate(param.f32(), grad.f32(), m.f32(), v.f32(), param.numel(), config, step,
                   grad_scale);
}

void SumOfSquares(const ExecContext&, const Tensor& x, const Tensor& out) {
  *F64(out) += cpu::SumOfSquares(x.f32(), x.numel());
}

void Scale(const ExecContext&, const Tensor& x, float factor) {
  cpu::Scale(x.f32(), x.numel(), factor);
}

const Backend kCpu = {
    "cpu",
    DeviceType::kCpu,
    Probe,
    Allocate,
    Free,
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
};

}  // namespace

const Backend& CpuBackend() { return kCpu; }

}  // namespace baton::kernels
