// The CPU backend: today's kernels/cpu behind the Backend table. Every op
// runs inline on the calling thread, so its stream is empty and events just
// note the host clock. Results are exactly those of the kernels/cpu functions.
//
// bf16 (backend.h §6): the reference for what the CUDA backend computes with
// bf16 tensors. bf16 operands are widened to float (exact), every product
// accumulates in fp32 through the same kernels/cpu functions as fp32, and a
// bf16 output is the fp32 result rounded once to nearest even (bfloat16.h).
// Attention rounds P and dS to bf16 where the CUDA path stores them
// (kernels/cpu/attention.h). Ops the CUDA backend runs in fp32 only
// (LayerNormBackward, GELU, residual, losses, ...) take fp32 here too. With
// only float32 tensors every op runs exactly the code it ran before bf16.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <vector>

#include "absl/time/clock.h"
#include "kernels/backend.h"
#include "kernels/bfloat16.h"
#include "kernels/cpu/adamw.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/block_attention.h"
#include "kernels/cpu/cross_entropy.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/gelu.h"
#include "kernels/cpu/grad_norm.h"
#include "kernels/cpu/layernorm.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/moe.h"
#include "kernels/cpu/residual.h"
#include "kernels/cpu/rmsnorm.h"
#include "kernels/cpu/rope.h"
#include "kernels/cpu/swiglu.h"

namespace baton::kernels {
namespace {

float* F32OrNull(const Tensor& t) { return t.defined() ? t.f32() : nullptr; }

[[noreturn]] void Die(const char* op, const char* what) {
  std::fprintf(stderr, "baton::kernels::%s (cpu): %s\n", op, what);
  std::abort();
}

bool IsBf16(const Tensor& t) { return t.defined() && t.dtype() == DType::kBFloat16; }

bool AnyBf16(std::initializer_list<const Tensor*> tensors) {
  for (const Tensor* t : tensors) {
    if (IsBf16(*t)) return true;
  }
  return false;
}

uint16_t* Bf16(const Tensor& t) { return static_cast<uint16_t*>(t.raw()); }

// The values of `t` (float32 or bf16) as floats: t's own memory for float32,
// else `buffer` holding the widened bf16 values (exact).
const float* Widened(const char* op, const Tensor& t, std::vector<float>& buffer) {
  if (t.dtype() == DType::kFloat32) return t.f32();
  if (t.dtype() != DType::kBFloat16) Die(op, "operands must be float32 or bfloat16");
  const uint16_t* src = Bf16(t);
  buffer.resize(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) buffer[i] = Bf16BitsToFloat(src[i]);
  return buffer.data();
}

// Writes fp32 `values` into `dst`, rounding once to bf16 when dst is bf16.
void Store(const Tensor& dst, const float* values) {
  if (dst.dtype() == DType::kFloat32) {
    if (dst.f32() != values) std::memcpy(dst.f32(), values, dst.bytes());
    return;
  }
  uint16_t* out = Bf16(dst);
  for (int64_t i = 0; i < dst.numel(); ++i) out[i] = FloatToBf16Bits(values[i]);
}

// Where an op writes `dst`'s fp32 result: dst itself for float32, else
// `buffer` (initialised from dst's values when `keep` is set), later
// rounded into dst by Store.
float* Target(const Tensor& dst, bool keep, std::vector<float>& buffer) {
  if (dst.dtype() == DType::kFloat32) return dst.f32();
  if (dst.dtype() != DType::kBFloat16) Die("Target", "output must be float32 or bfloat16");
  if (keep) {
    Widened("Target", dst, buffer);
  } else {
    buffer.assign(static_cast<size_t>(dst.numel()), 0.0f);
  }
  return buffer.data();
}

absl::Status Probe(int index) {
  if (index != 0) return absl::InvalidArgumentError("the CPU device has index 0 only");
  return absl::OkStatus();
}

absl::StatusOr<void*> Allocate(int, size_t bytes) {
  void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (p == nullptr) return OutOfMemoryError("out of host memory");
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

void Cast(const ExecContext&, const Tensor& dst, const Tensor& src) {
  const int64_t n = src.numel();
  if (dst.dtype() == src.dtype()) {
    std::memcpy(dst.raw(), src.raw(), src.bytes());
  } else if (src.dtype() == DType::kFloat32 && dst.dtype() == DType::kBFloat16) {
    const float* x = src.f32();
    uint16_t* y = Bf16(dst);
    for (int64_t i = 0; i < n; ++i) y[i] = FloatToBf16Bits(x[i]);
  } else if (src.dtype() == DType::kBFloat16 && dst.dtype() == DType::kFloat32) {
    const uint16_t* x = Bf16(src);
    float* y = dst.f32();
    for (int64_t i = 0; i < n; ++i) y[i] = Bf16BitsToFloat(x[i]);
  } else {
    Die("Cast", "only float32 <-> bfloat16");
  }
}

void StampTime(const ExecContext&, const Tensor& out, int64_t offset_us) {
  *static_cast<int64_t*>(out.raw()) = absl::ToUnixMicros(absl::Now()) + offset_us;
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
  if (IsBf16(out)) {
    // fp32 statistics and math; the normalised output rounded once to bf16.
    std::vector<float> y;
    float* target = Target(out, false, y);
    cpu::LayerNormForward(target, mean.f32(), rstd.f32(), x.f32(), weight.f32(), bias.f32(),
                          x.numel() / c, c);
    Store(out, target);
    return;
  }
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
  if (AnyBf16({&out, &x, &weight, &bias})) {
    if (x.dtype() != weight.dtype()) Die("Linear", "x and weight must have the same dtype");
    std::vector<float> xf, wf, bf, y;
    float* target = Target(out, false, y);
    cpu::MatmulForward(target, Widened("Linear", x, xf), Widened("Linear", weight, wf),
                       bias.defined() ? Widened("Linear", bias, bf) : nullptr, x.numel() / i, i,
                       o);
    Store(out, target);
    return;
  }
  cpu::MatmulForward(out.f32(), x.f32(), weight.f32(), F32OrNull(bias), x.numel() / i, i, o);
}

void LinearBackwardInput(const ExecContext&, const Tensor& dx, const Tensor& dout,
                         const Tensor& weight, bool accumulate) {
  const int64_t o = weight.dim(0), i = weight.dim(1);
  if (AnyBf16({&dx, &dout, &weight})) {
    if (dout.dtype() != weight.dtype()) {
      Die("LinearBackwardInput", "dout and weight must have the same dtype");
    }
    std::vector<float> df, wf, g;
    float* target = Target(dx, accumulate, g);
    cpu::MatmulBackwardInput(target, Widened("LinearBackwardInput", dout, df),
                             Widened("LinearBackwardInput", weight, wf), dout.numel() / o, i, o,
                             accumulate);
    Store(dx, target);
    return;
  }
  cpu::MatmulBackwardInput(dx.f32(), dout.f32(), weight.f32(), dout.numel() / o, i, o, accumulate);
}

void LinearBackwardWeight(const ExecContext&, const Tensor& dweight, const Tensor& dout,
                          const Tensor& x) {
  const int64_t o = dweight.dim(0), i = dweight.dim(1);
  if (AnyBf16({&dout, &x})) {
    if (dout.dtype() != x.dtype()) Die("LinearBackwardWeight", "dout and x must have the same dtype");
    // Weight gradients stay fp32 (dweight.f32() checks it).
    std::vector<float> df, xf;
    cpu::MatmulBackwardWeight(dweight.f32(), Widened("LinearBackwardWeight", dout, df),
                              Widened("LinearBackwardWeight", x, xf), x.numel() / i, i, o);
    return;
  }
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
  if (AnyBf16({&out, &att, &qkv})) {
    if (out.dtype() != qkv.dtype() || att.dtype() != qkv.dtype()) {
      Die("Attention", "out, att and qkv must have the same dtype");
    }
    std::vector<float> qf, y, p;
    float* o = Target(out, false, y);
    float* a = Target(att, false, p);
    cpu::AttentionForwardBf16Rounded(o, a, Widened("Attention", qkv, qf), qkv.dim(0), qkv.dim(1),
                                     qkv.dim(2) / 3, heads);
    Store(out, o);
    Store(att, a);
    return;
  }
  cpu::AttentionForward(out.f32(), att.f32(), qkv.f32(), qkv.dim(0), qkv.dim(1), qkv.dim(2) / 3,
                        heads);
}

void AttentionBackward(const ExecContext&, const Tensor& dqkv, const Tensor& scratch,
                       const Tensor& dout, const Tensor& qkv, const Tensor& att, int heads) {
  if (AnyBf16({&dqkv, &dout, &qkv, &att})) {
    if (dqkv.dtype() != qkv.dtype() || dout.dtype() != qkv.dtype() || att.dtype() != qkv.dtype()) {
      Die("AttentionBackward", "dqkv, dout, att and qkv must have the same dtype");
    }
    const int64_t t = qkv.dim(1);
    std::vector<float> qf, df, pf, g, ds(static_cast<size_t>(t * t));
    float* d = Target(dqkv, false, g);
    cpu::AttentionBackwardBf16Rounded(d, ds.data(), Widened("AttentionBackward", dout, df),
                                      Widened("AttentionBackward", qkv, qf),
                                      Widened("AttentionBackward", att, pf), qkv.dim(0), t,
                                      qkv.dim(2) / 3, heads);
    Store(dqkv, d);
    return;
  }
  cpu::AttentionBackward(dqkv.f32(), scratch.f32(), dout.f32(), qkv.f32(), att.f32(), qkv.dim(0),
                         qkv.dim(1), qkv.dim(2) / 3, heads);
}

// P [B,H,T,T] (of the tensors' dtype) and the fp32 kernel's T·T floats.
AttentionBuffers AttentionBuffersOf(const ExecContext&, int64_t batch, int64_t seq, int64_t,
                                    int heads, DType dtype) {
  AttentionBuffers b;
  b.saved = {batch, heads, seq, seq};
  b.saved_dtype = dtype;
  b.backward_scratch = seq * seq;
  return b;
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
  cpu::AdamWUpdate(param.f32(), grad.f32(), m.f32(), v.f32(), param.numel(), config, step,
                   grad_scale);
  // The bf16 copy that bf16 GEMMs read: the updated fp32 values, rounded.
  if (param_bf16.defined()) Store(param_bf16, param.f32());
}

void SumOfSquares(const ExecContext&, const Tensor& x, const Tensor& out) {
  *F64(out) += cpu::SumOfSquares(x.f32(), x.numel());
}

void Scale(const ExecContext&, const Tensor& x, float factor) {
  cpu::Scale(x.f32(), x.numel(), factor);
}

// fp32 statistics and math; a bf16 output is the fp32 result rounded once.
void RmsNorm(const ExecContext&, const Tensor& out, const Tensor& rstd, const Tensor& x,
             const Tensor& weight, float eps) {
  const int64_t c = weight.numel();
  std::vector<float> y;
  float* target = Target(out, false, y);
  cpu::RmsNormForward(target, rstd.f32(), x.f32(), weight.f32(), x.numel() / c, c, eps);
  Store(out, target);
}

void RmsNormBackward(const ExecContext&, const Tensor& dx, const Tensor& dweight,
                     const Tensor& dout, const Tensor& x, const Tensor& weight,
                     const Tensor& rstd) {
  const int64_t c = weight.numel();
  cpu::RmsNormBackward(dx.f32(), dweight.f32(), dout.f32(), x.f32(), weight.f32(), rstd.f32(),
                       x.numel() / c, c);
}

void SwiGlu(const ExecContext&, const Tensor& out, const Tensor& gate, const Tensor& up) {
  cpu::SwiGluForward(out.f32(), gate.f32(), up.f32(), gate.numel());
}

void SwiGluBackward(const ExecContext&, const Tensor& dgate, const Tensor& dup, const Tensor& dout,
                    const Tensor& gate, const Tensor& up) {
  cpu::SwiGluBackward(dgate.f32(), dup.f32(), dout.f32(), gate.f32(), up.f32(), gate.numel());
}

// qkv [B, T, 3·H·D]: fp32, or the fp32 result rounded once to bf16.
void RopePack(const ExecContext&, const Tensor& qkv, const Tensor& q, const Tensor& k,
              const Tensor& v, int heads, int kv_heads, float theta, int64_t position_offset) {
  const int64_t head_dim = qkv.dim(2) / (3 * int64_t{heads});
  std::vector<float> packed;
  float* target = Target(qkv, false, packed);
  cpu::RopePackForward(target, q.f32(), k.f32(), v.f32(), qkv.dim(0), qkv.dim(1), heads, kv_heads,
                       head_dim, theta, position_offset);
  Store(qkv, target);
}

// A bf16 dqkv is widened exactly; bf16 gradients are the fp32 ones rounded once.
void RopePackBackward(const ExecContext&, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                      const Tensor& dqkv, int heads, int kv_heads, float theta,
                      int64_t position_offset) {
  const int64_t head_dim = dqkv.dim(2) / (3 * int64_t{heads});
  std::vector<float> g, q_buffer, k_buffer, v_buffer;
  float* q = Target(dq, false, q_buffer);
  float* k = Target(dk, false, k_buffer);
  float* v = Target(dv, false, v_buffer);
  cpu::RopePackBackward(q, k, v, Widened("RopePackBackward", dqkv, g), dqkv.dim(0), dqkv.dim(1),
                        heads, kv_heads, head_dim, theta, position_offset);
  Store(dq, q);
  Store(dk, k);
  Store(dv, v);
}

// Context-parallel attention (fp32; ops.cc has checked the shapes). q is
// the first C columns of qkv's [B,Tq,3C] rows, k and v the halves of kv's
// [B,Tk,2C] rows: the kernels read and write them in place through row
// strides, without copies.
// fp32 or bf16 (both the same dtype; ops.cc checked).
void KvOfQkv(const ExecContext&, const Tensor& kv, const Tensor& qkv) {
  const int64_t rows = qkv.dim(0) * qkv.dim(1), c = qkv.dim(2) / 3;
  const size_t element = qkv.dtype() == DType::kBFloat16 ? sizeof(uint16_t) : sizeof(float);
  const char* src = static_cast<const char*>(qkv.raw());
  char* dst = static_cast<char*>(kv.raw());
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(dst + r * 2 * c * element, src + (r * 3 * c + c) * element, element * 2 * c);
  }
}

// bf16 ring inputs are widened (exactly) and take the fp32 kernels: the bits
// of the fp32 ops on the images (ops.h).
void BlockAttention(const ExecContext&, const Tensor& out, const Tensor& lse, const Tensor& qkv,
                    const Tensor& kv, int heads, int64_t q_offset, int64_t k_offset,
                    const Tensor& scratch) {
  const int64_t c = qkv.dim(2) / 3;
  std::vector<float> qkv_image, kv_image;
  const float* q = Widened("BlockAttention", qkv, qkv_image);
  const float* k = Widened("BlockAttention", kv, kv_image);
  cpu::BlockAttentionForward(out.f32(), lse.f32(), q, k, k + c, qkv.dim(0),
                             qkv.dim(1), kv.dim(1), c, heads, q_offset, k_offset, scratch.f32(),
                             cpu::BlockAttentionStrides{3 * c, 2 * c});
}

void MergeAttentionBlock(const ExecContext&, const Tensor& out, const Tensor& lse,
                         const Tensor& block_out, const Tensor& block_lse, int heads) {
  cpu::MergeAttentionBlock(out.f32(), lse.f32(), block_out.f32(), block_lse.f32(), out.dim(0),
                           out.dim(1), out.dim(2), heads);
}

void AttentionDelta(const ExecContext&, const Tensor& delta, const Tensor& dout, const Tensor& out,
                    int heads) {
  cpu::AttentionDelta(delta.f32(), dout.f32(), out.f32(), out.dim(0), out.dim(1), out.dim(2),
                      heads);
}

// `out` is not read: the fp32 kernels take delta.
void BlockAttentionBackward(const ExecContext&, const Tensor& dqkv, const Tensor& dkv,
                            const Tensor& dout, const Tensor& /*out*/, const Tensor& qkv,
                            const Tensor& kv, const Tensor& lse, const Tensor& delta, int heads,
                            int64_t q_offset, int64_t k_offset, const Tensor& scratch) {
  const int64_t c = qkv.dim(2) / 3;
  std::vector<float> dout_image, qkv_image, kv_image;
  const float* d = Widened("BlockAttentionBackward", dout, dout_image);
  const float* q = Widened("BlockAttentionBackward", qkv, qkv_image);
  const float* k = Widened("BlockAttentionBackward", kv, kv_image);
  cpu::BlockAttentionBackward(dqkv.f32(), dkv.f32(), dkv.f32() + c, d, q,
                              k, k + c, lse.f32(), delta.f32(), qkv.dim(0),
                              qkv.dim(1), kv.dim(1), c, heads, q_offset, k_offset, scratch.f32(),
                              cpu::BlockAttentionStrides{3 * c, 2 * c});
}

void QkvGradOfKv(const ExecContext&, const Tensor& dqkv, const Tensor& dkv) {
  const int64_t rows = dqkv.dim(0) * dqkv.dim(1), c = dqkv.dim(2) / 3;
  const float* src = dkv.f32();
  float* dst = dqkv.f32();
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(dst + r * 3 * c + c, src + r * 2 * c, sizeof(float) * 2 * c);
  }
}

// Mixture-of-Experts routing (fp32, int32 indices; ops.cc has checked the
// shapes): expert [N,K] gives N and K, the router rows [N,E] or the expert
// buffers [E,Cap,H] give E, Cap and H.
void RouterTopK(const ExecContext&, const Tensor& probs, const Tensor& expert, const Tensor& gate,
                const Tensor& logits, bool renormalize) {
  cpu::RouterTopK(probs.f32(), expert.i32(), gate.f32(), logits.f32(), expert.dim(0),
                  logits.dim(1), expert.dim(1), renormalize);
}

void RouterTopKBackward(const ExecContext&, const Tensor& dlogits, const Tensor& dgate,
                        const Tensor& expert, const Tensor& gate, const Tensor& probs,
                        bool renormalize) {
  cpu::RouterTopKBackward(dlogits.f32(), dgate.f32(), expert.i32(), gate.f32(), probs.f32(),
                          expert.dim(0), dlogits.dim(1), expert.dim(1), renormalize);
}

void PlanDispatch(const ExecContext&, const Tensor& slot, const Tensor& counts,
                  const Tensor& expert, int64_t capacity) {
  cpu::PlanDispatch(slot.i32(), I64(counts), expert.i32(), expert.dim(0), counts.dim(0),
                    expert.dim(1), capacity);
}

void ExpertTokenCounts(const ExecContext&, const Tensor& routed, const Tensor& expert) {
  cpu::ExpertTokenCounts(I64(routed), expert.i32(), expert.dim(0), routed.dim(0), expert.dim(1));
}

void Permute(const ExecContext&, const Tensor& expert_in, const Tensor& x, const Tensor& expert,
             const Tensor& slot) {
  cpu::Permute(expert_in.f32(), x.f32(), expert.i32(), slot.i32(), expert.dim(0),
               expert_in.dim(0), expert.dim(1), expert_in.dim(2), expert_in.dim(1));
}

void PermuteBackward(const ExecContext&, const Tensor& dx, const Tensor& dexpert_in,
                     const Tensor& expert, const Tensor& slot) {
  cpu::PermuteBackward(dx.f32(), dexpert_in.f32(), expert.i32(), slot.i32(), expert.dim(0),
                       expert.dim(1), dexpert_in.dim(2), dexpert_in.dim(1));
}

void Combine(const ExecContext&, const Tensor& y, const Tensor& expert_out, const Tensor& gate,
             const Tensor& expert, const Tensor& slot) {
  cpu::Combine(y.f32(), expert_out.f32(), gate.f32(), expert.i32(), slot.i32(), expert.dim(0),
               expert.dim(1), expert_out.dim(2), expert_out.dim(1));
}

void CombineBackward(const ExecContext&, const Tensor& dexpert_out, const Tensor& dgate,
                     const Tensor& dy, const Tensor& expert_out, const Tensor& gate,
                     const Tensor& expert, const Tensor& slot) {
  cpu::CombineBackward(dexpert_out.f32(), dgate.f32(), dy.f32(), expert_out.f32(), gate.f32(),
                       expert.i32(), slot.i32(), expert.dim(0), expert_out.dim(0), expert.dim(1),
                       expert_out.dim(2), expert_out.dim(1));
}

// loss [1] fp32 += the double loss rounded once to float; dlogits_aux is the
// kernel's fp32 gradient times grad_scale (in fp32).
void LoadBalancingLoss(const ExecContext&, const Tensor& loss, const Tensor& dlogits_aux,
                       const Tensor& probs, const Tensor& expert, float coef, float grad_scale) {
  const double value =
      cpu::LoadBalancingLoss(dlogits_aux.f32(), probs.f32(), expert.i32(), expert.dim(0),
                             probs.dim(1), expert.dim(1), coef);
  *loss.f32() += static_cast<float>(value);
  float* d = dlogits_aux.f32();
  for (int64_t i = 0; i < dlogits_aux.numel(); ++i) d[i] *= grad_scale;
}

const Backend kCpu = {
    "cpu",
    DeviceType::kCpu,
    Probe,
    Allocate,
    Free,
    Allocate,  // host memory is all the CPU copies from
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
    nullptr,  // fused_attention: the CPU keeps P
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

}  // namespace

const Backend& CpuBackend() { return kCpu; }

}  // namespace baton::kernels
