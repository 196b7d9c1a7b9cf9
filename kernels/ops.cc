#include "kernels/ops.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <string>

#include "kernels/cpu/moe.h"

namespace baton::kernels {
namespace {

[[noreturn]] void Fail(const char* op, const std::string& what) {
  std::fprintf(stderr, "baton::kernels::%s: %s\n", op, what.c_str());
  std::abort();
}

void Require(bool ok, const char* op, const char* what) {
  if (!ok) Fail(op, what);
}

// Every defined tensor must live on the context's device; returns its backend.
const Backend& On(const ExecContext& ctx, const char* op,
                  std::initializer_list<const Tensor*> tensors) {
  if (ctx.backend == nullptr || ctx.backend->type != ctx.device.type) {
    Fail(op, "execution context without the backend of its device");
  }
  for (const Tensor* t : tensors) {
    if (t->defined() && t->device() != ctx.device) {
      Fail(op, "tensor on " + DeviceToString(t->device()) + ", but the op runs on " +
                   DeviceToString(ctx.device));
    }
  }
  return *ctx.backend;
}

// The row count of a per-row op (the numel of its per-row tensor), which
// the op divides by: an empty batch is a caller's error, named, not a
// division by zero.
int64_t RowsOf(const Tensor& per_row, const char* op) {
  Require(per_row.numel() > 0, op, "no rows (an empty batch)");
  return per_row.numel();
}

void RequireScalar(const Tensor& t, DType dtype, const char* op) {
  Require(t.numel() == 1 && t.dtype() == dtype, op, "accumulator must be a one-element tensor "
                                                    "of float64 (loss, sums) or int64 (hits)");
}

// Each of `tensors` is defined and float32, or (with `bf16_ok`) bfloat16;
// `what` names them and the dtypes they may have.
void RequireFloat(const char* op, std::initializer_list<const Tensor*> tensors, bool bf16_ok,
                  const char* what) {
  for (const Tensor* t : tensors) {
    Require(t->defined() &&
                (t->dtype() == DType::kFloat32 || (bf16_ok && t->dtype() == DType::kBFloat16)),
            op, what);
  }
}

// RopePack's and RopePackBackward's shapes: packed [B, T, 3·H·D] with
// H = heads, D even; q-like [B·T, H·D] and k-like, v-like [B·T, KV·D].
void RequireRopeShapes(const char* op, const Tensor& packed, const Tensor& q, const Tensor& k,
                       const Tensor& v, int heads, int kv_heads, float theta) {
  Require(heads > 0 && kv_heads > 0 && heads % kv_heads == 0, op,
          "heads must be a positive multiple of kv_heads");
  Require(theta > 0.0f, op, "rope_theta must be positive");
  Require(packed.ndim() == 3 && packed.dim(2) > 0 && packed.dim(2) % (3 * int64_t{heads}) == 0, op,
          "shape mismatch: qkv must be [batch, seq, 3 * heads * head_dim]");
  const int64_t rows = packed.dim(0) * packed.dim(1), d = packed.dim(2) / (3 * int64_t{heads});
  Require(d % 2 == 0, op, "head_dim must be even");
  Require(q.numel() == rows * heads * d && k.numel() == rows * kv_heads * d &&
              v.numel() == rows * kv_heads * d,
          op,
          "shape mismatch: q must be [batch * seq, heads * head_dim], k and v "
          "[batch * seq, kv_heads * head_dim]");
}

}  // namespace

// ---- On an execution context ----

void Copy(const ExecContext& ctx, const Tensor& dst, const Tensor& src) {
  Require(dst.bytes() == src.bytes(), "Copy", "byte counts differ");
  for (const Tensor* t : {&dst, &src}) {
    if (!t->device().is_cpu() && t->device() != ctx.device) {
      Fail("Copy", "tensor on " + DeviceToString(t->device()) + ", but the copy runs on " +
                       DeviceToString(ctx.device));
    }
  }
  On(ctx, "Copy", {}).copy(ctx, dst, src);
}

void FillZero(const ExecContext& ctx, const Tensor& dst) {
  On(ctx, "FillZero", {&dst}).fill_zero(ctx, dst);
}

void Cast(const ExecContext& ctx, const Tensor& dst, const Tensor& src) {
  Require(dst.numel() == src.numel(), "Cast", "element counts differ");
  On(ctx, "Cast", {&dst, &src}).cast(ctx, dst, src);
}

void StampTime(const ExecContext& ctx, const Tensor& out, int64_t offset_us) {
  Require(out.dtype() == DType::kInt64 && out.numel() == 1, "StampTime", "want an int64 [1] tensor");
  On(ctx, "StampTime", {&out}).stamp_time(ctx, out, offset_us);
}

void Embedding(const ExecContext& ctx, const Tensor& out, const Tensor& tokens, const Tensor& wte,
               int64_t vocab_begin, const Tensor& wpe) {
  const Backend& be = On(ctx, "Embedding", {&out, &tokens, &wte, &wpe});
  const int64_t b = tokens.dim(0), t = tokens.dim(1), c = wte.dim(1);
  Require(out.numel() == b * t * c && (!wpe.defined() || (wpe.dim(0) >= t && wpe.dim(1) == c)),
          "Embedding", "shape mismatch");
  be.embedding(ctx, out, tokens, wte, vocab_begin, wpe);
}

void EmbeddingBackward(const ExecContext& ctx, const Tensor& dwte, int64_t vocab_begin,
                       const Tensor& dwpe, const Tensor& dout, const Tensor& tokens) {
  const Backend& be = On(ctx, "EmbeddingBackward", {&dwte, &dwpe, &dout, &tokens});
  const int64_t b = tokens.dim(0), t = tokens.dim(1);
  const int64_t c = dout.numel() / (b * t);
  Require(dout.numel() == b * t * c &&
              (!dwpe.defined() || (dwpe.ndim() == 2 && dwpe.dim(0) >= t && dwpe.dim(1) == c)),
          "EmbeddingBackward", "shape mismatch");
  be.embedding_backward(ctx, dwte, vocab_begin, dwpe, dout, tokens);
}

void LayerNorm(const ExecContext& ctx, const Tensor& out, const Tensor& mean, const Tensor& rstd,
               const Tensor& x, const Tensor& weight, const Tensor& bias) {
  const Backend& be = On(ctx, "LayerNorm", {&out, &mean, &rstd, &x, &weight, &bias});
  const int64_t c = weight.numel(), n = x.numel() / c;
  Require(out.numel() == x.numel() && mean.numel() == n && rstd.numel() == n && bias.numel() == c,
          "LayerNorm", "shape mismatch");
  be.layernorm(ctx, out, mean, rstd, x, weight, bias);
}

void LayerNormBackward(const ExecContext& ctx, const Tensor& dx, const Tensor& dweight,
                       const Tensor& dbias, const Tensor& dout, const Tensor& x,
                       const Tensor& weight, const Tensor& mean, const Tensor& rstd) {
  const Backend& be =
      On(ctx, "LayerNormBackward", {&dx, &dweight, &dbias, &dout, &x, &weight, &mean, &rstd});
  const int64_t c = weight.numel(), n = x.numel() / c;
  Require(dx.numel() == x.numel() && dout.numel() == x.numel() && dweight.numel() == c &&
              dbias.numel() == c && mean.numel() == n,
          "LayerNormBackward", "shape mismatch");
  be.layernorm_backward(ctx, dx, dweight, dbias, dout, x, weight, mean, rstd);
}

void Linear(const ExecContext& ctx, const Tensor& out, const Tensor& x, const Tensor& weight,
            const Tensor& bias) {
  const Backend& be = On(ctx, "Linear", {&out, &x, &weight, &bias});
  const int64_t o = weight.dim(0), i = weight.dim(1), n = x.numel() / i;
  Require(x.numel() == n * i && out.numel() == n * o && (!bias.defined() || bias.numel() == o),
          "Linear", "shape mismatch");
  be.linear(ctx, out, x, weight, bias);
}

void LinearBackwardInput(const ExecContext& ctx, const Tensor& dx, const Tensor& dout,
                         const Tensor& weight, bool accumulate) {
  const Backend& be = On(ctx, "LinearBackwardInput", {&dx, &dout, &weight});
  const int64_t o = weight.dim(0), i = weight.dim(1), n = dout.numel() / o;
  Require(dout.numel() == n * o && dx.numel() == n * i, "LinearBackwardInput", "shape mismatch");
  be.linear_backward_input(ctx, dx, dout, weight, accumulate);
}

void LinearBackwardWeight(const ExecContext& ctx, const Tensor& dweight, const Tensor& dout,
                          const Tensor& x) {
  const Backend& be = On(ctx, "LinearBackwardWeight", {&dweight, &dout, &x});
  const int64_t o = dweight.dim(0), i = dweight.dim(1), n = x.numel() / i;
  Require(x.numel() == n * i && dout.numel() == n * o, "LinearBackwardWeight", "shape mismatch");
  be.linear_backward_weight(ctx, dweight, dout, x);
}

void AddBias(const ExecContext& ctx, const Tensor& out, const Tensor& bias) {
  const Backend& be = On(ctx, "AddBias", {&out, &bias});
  const int64_t o = bias.numel(), n = out.numel() / o;
  Require(out.numel() == n * o, "AddBias", "shape mismatch");
  be.add_bias(ctx, out, bias);
}

void BiasBackward(const ExecContext& ctx, const Tensor& dbias, const Tensor& dout) {
  const Backend& be = On(ctx, "BiasBackward", {&dbias, &dout});
  const int64_t o = dbias.numel(), n = dout.numel() / o;
  Require(dout.numel() == n * o, "BiasBackward", "shape mismatch");
  be.bias_backward(ctx, dbias, dout);
}

void Gelu(const ExecContext& ctx, const Tensor& out, const Tensor& x) {
  const Backend& be = On(ctx, "Gelu", {&out, &x});
  Require(out.numel() == x.numel(), "Gelu", "shape mismatch");
  be.gelu(ctx, out, x);
}

void GeluBackward(const ExecContext& ctx, const Tensor& dx, const Tensor& x, const Tensor& dout) {
  const Backend& be = On(ctx, "GeluBackward", {&dx, &x, &dout});
  Require(dx.numel() == x.numel() && dout.numel() == x.numel(), "GeluBackward", "shape mismatch");
  be.gelu_backward(ctx, dx, x, dout);
}

AttentionBuffers AttentionBuffersFor(const ExecContext& ctx, int64_t batch, int64_t seq,
                                     int64_t channels, int heads, DType dtype) {
  const Backend& be = On(ctx, "AttentionBuffersFor", {});
  Require(batch > 0 && seq > 0 && heads > 0 && channels % heads == 0, "AttentionBuffersFor",
          "shape mismatch");
  return be.attention_buffers(ctx, batch, seq, channels, heads, dtype);
}

namespace {

// att as AttentionBuffersFor sizes it for qkv; the buffers.
AttentionBuffers RequireSaved(const ExecContext& ctx, const Backend& be, const char* op,
                              const Tensor& qkv, const Tensor& att, int heads) {
  Require(qkv.ndim() == 3 && heads > 0 && (qkv.dim(2) / 3) % heads == 0, op, "shape mismatch");
  AttentionBuffers buffers =
      be.attention_buffers(ctx, qkv.dim(0), qkv.dim(1), qkv.dim(2) / 3, heads, qkv.dtype());
  Require(att.dtype() == buffers.saved_dtype && att.numel() >= NumElements(buffers.saved), op,
          "att is smaller than AttentionBuffersFor's saved buffer, or of another dtype");
  return buffers;
}

}  // namespace

void Attention(const ExecContext& ctx, const Tensor& out, const Tensor& att, const Tensor& qkv,
               int heads) {
  const Backend& be = On(ctx, "Attention", {&out, &att, &qkv});
  RequireSaved(ctx, be, "Attention", qkv, att, heads);
  const int64_t b = qkv.dim(0), t = qkv.dim(1), c = qkv.dim(2) / 3;
  Require(out.numel() == b * t * c, "Attention", "shape mismatch");
  be.attention(ctx, out, att, qkv, heads);
}

void AttentionBackward(const ExecContext& ctx, const Tensor& dqkv, const Tensor& scratch,
                       const Tensor& dout, const Tensor& qkv, const Tensor& att, int heads) {
  const Backend& be = On(ctx, "AttentionBackward", {&dqkv, &scratch, &dout, &qkv, &att});
  const AttentionBuffers buffers = RequireSaved(ctx, be, "AttentionBackward", qkv, att, heads);
  const int64_t b = qkv.dim(0), t = qkv.dim(1), c = qkv.dim(2) / 3;
  Require(dqkv.numel() == qkv.numel() && dout.numel() == b * t * c &&
              scratch.numel() >= buffers.backward_scratch,
          "AttentionBackward", "shape mismatch");
  be.attention_backward(ctx, dqkv, scratch, dout, qkv, att, heads);
}

void Residual(const ExecContext& ctx, const Tensor& out, const Tensor& a, const Tensor& b) {
  const Backend& be = On(ctx, "Residual", {&out, &a, &b});
  Require(out.numel() == a.numel() && b.numel() == a.numel(), "Residual", "shape mismatch");
  be.residual(ctx, out, a, b);
}

void ResidualBackward(const ExecContext& ctx, const Tensor& da, const Tensor& db,
                      const Tensor& dout) {
  const Backend& be = On(ctx, "ResidualBackward", {&da, &db, &dout});
  Require((!da.defined() || da.numel() == dout.numel()) &&
              (!db.defined() || db.numel() == dout.numel()),
          "ResidualBackward", "shape mismatch");
  be.residual_backward(ctx, da, db, dout);
}

void SoftmaxCrossEntropy(const ExecContext& ctx, const Tensor& logits_to_grad,
                         const Tensor& targets, float grad_scale, const Tensor& loss_sum) {
  const Backend& be = On(ctx, "SoftmaxCrossEntropy", {&logits_to_grad, &targets, &loss_sum});
  const int64_t n = RowsOf(targets, "SoftmaxCrossEntropy"), v = logits_to_grad.numel() / n;
  Require(logits_to_grad.numel() == n * v, "SoftmaxCrossEntropy", "shape mismatch");
  RequireScalar(loss_sum, DType::kFloat64, "SoftmaxCrossEntropy");
  be.softmax_cross_entropy(ctx, logits_to_grad, targets, grad_scale, loss_sum);
}

void ShardedCrossEntropyStats(const ExecContext& ctx, const Tensor& logits_to_exp,
                              const Tensor& targets, int64_t vocab_begin, const Tensor& row_max,
                              const Tensor& lse, const Tensor& target_logit) {
  const Backend& be = On(ctx, "ShardedCrossEntropyStats",
                         {&logits_to_exp, &targets, &row_max, &lse, &target_logit});
  const int64_t n = RowsOf(targets, "ShardedCrossEntropyStats"), v = logits_to_exp.numel() / n;
  Require(logits_to_exp.numel() == n * v && row_max.numel() == n && lse.numel() == n &&
              target_logit.numel() == n,
          "ShardedCrossEntropyStats", "shape mismatch");
  be.sharded_cross_entropy_stats(ctx, logits_to_exp, targets, vocab_begin, row_max, lse,
                                 target_logit);
}

void ShardedCrossEntropyFinish(const ExecContext& ctx, const Tensor& exp_to_grad,
                               const Tensor& targets, int64_t vocab_begin, const Tensor& row_max,
                               const Tensor& lse_all, const Tensor& target_logit, float grad_scale,
                               const Tensor& loss_sum) {
  const Backend& be =
      On(ctx, "ShardedCrossEntropyFinish",
         {&exp_to_grad, &targets, &row_max, &lse_all, &target_logit, &loss_sum});
  const int64_t n = RowsOf(targets, "ShardedCrossEntropyFinish"), v = exp_to_grad.numel() / n,
                shards = lse_all.numel() / n;
  Require(exp_to_grad.numel() == n * v && row_max.numel() == n && lse_all.numel() == n * shards &&
              target_logit.numel() == n,
          "ShardedCrossEntropyFinish", "shape mismatch");
  RequireScalar(loss_sum, DType::kFloat64, "ShardedCrossEntropyFinish");
  be.sharded_cross_entropy_finish(ctx, exp_to_grad, targets, vocab_begin, row_max, lse_all,
                                  target_logit, grad_scale, loss_sum);
}

void ShardArgmax(const ExecContext& ctx, const Tensor& logits, int64_t vocab_begin,
                 const Tensor& max, const Tensor& index) {
  const Backend& be = On(ctx, "ShardArgmax", {&logits, &max, &index});
  const int64_t n = RowsOf(max, "ShardArgmax"), v = logits.numel() / n;
  Require(logits.numel() == n * v && index.numel() == n, "ShardArgmax", "shape mismatch");
  Require(vocab_begin + v <= kMaxArgmaxVocab, "ShardArgmax",
          "vocabulary indices past 2^24 do not fit a float exactly");
  be.shard_argmax(ctx, logits, vocab_begin, max, index);
}

void CountArgmaxHits(const ExecContext& ctx, const Tensor& max_all, const Tensor& index_all,
                     const Tensor& targets, const Tensor& hits) {
  const Backend& be = On(ctx, "CountArgmaxHits", {&max_all, &index_all, &targets, &hits});
  const int64_t n = RowsOf(targets, "CountArgmaxHits"), shards = max_all.numel() / n;
  Require(max_all.numel() == n * shards && index_all.numel() == n * shards, "CountArgmaxHits",
          "shape mismatch");
  RequireScalar(hits, DType::kInt64, "CountArgmaxHits");
  be.count_argmax_hits(ctx, max_all, index_all, targets, hits);
}

void AdamW(const ExecContext& ctx, const Tensor& param, const Tensor& grad, const Tensor& m,
           const Tensor& v, const AdamWConfig& config, int64_t step, float grad_scale,
           const Tensor& param_bf16) {
  const Backend& be = On(ctx, "AdamW", {&param, &grad, &m, &v, &param_bf16});
  Require(grad.numel() == param.numel() && m.numel() == param.numel() &&
              v.numel() == param.numel() && step >= 1,
          "AdamW", "shape mismatch or step < 1");
  Require(!param_bf16.defined() ||
              (param_bf16.numel() == param.numel() && param_bf16.dtype() == DType::kBFloat16),
          "AdamW", "the bf16 copy must be bf16 of the parameter's size");
  be.adamw(ctx, param, grad, m, v, config, step, grad_scale, param_bf16);
}

void SumOfSquares(const ExecContext& ctx, const Tensor& x, const Tensor& sum) {
  const Backend& be = On(ctx, "SumOfSquares", {&x, &sum});
  RequireScalar(sum, DType::kFloat64, "SumOfSquares");
  be.sum_of_squares(ctx, x, sum);
}

void Scale(const ExecContext& ctx, const Tensor& x, float factor) {
  On(ctx, "Scale", {&x}).scale(ctx, x, factor);
}

void RmsNorm(const ExecContext& ctx, const Tensor& out, const Tensor& rstd, const Tensor& x,
             const Tensor& weight, float eps) {
  const Backend& be = On(ctx, "RmsNorm", {&out, &rstd, &x, &weight});
  RequireFloat("RmsNorm", {&x, &weight, &rstd}, false, "x, weight and rstd must be float32");
  RequireFloat("RmsNorm", {&out}, true, "out must be float32 or bfloat16");
  const int64_t c = weight.numel();
  Require(c > 0 && x.numel() % c == 0 && out.numel() == x.numel() && rstd.numel() == x.numel() / c,
          "RmsNorm", "shape mismatch");
  be.rms_norm(ctx, out, rstd, x, weight, eps);
}

void RmsNormBackward(const ExecContext& ctx, const Tensor& dx, const Tensor& dweight,
                     const Tensor& dout, const Tensor& x, const Tensor& weight,
                     const Tensor& rstd) {
  const Backend& be = On(ctx, "RmsNormBackward", {&dx, &dweight, &dout, &x, &weight, &rstd});
  RequireFloat("RmsNormBackward", {&dx, &dweight, &dout, &x, &weight, &rstd}, false,
               "every tensor must be float32");
  const int64_t c = weight.numel();
  Require(c > 0 && x.numel() % c == 0 && dx.numel() == x.numel() && dout.numel() == x.numel() &&
              dweight.numel() == c && rstd.numel() == x.numel() / c,
          "RmsNormBackward", "shape mismatch");
  be.rms_norm_backward(ctx, dx, dweight, dout, x, weight, rstd);
}

void SwiGlu(const ExecContext& ctx, const Tensor& out, const Tensor& gate, const Tensor& up) {
  const Backend& be = On(ctx, "SwiGlu", {&out, &gate, &up});
  RequireFloat("SwiGlu", {&out, &gate, &up}, false, "every tensor must be float32");
  Require(out.numel() == gate.numel() && up.numel() == gate.numel(), "SwiGlu", "shape mismatch");
  be.swiglu(ctx, out, gate, up);
}

void SwiGluBackward(const ExecContext& ctx, const Tensor& dgate, const Tensor& dup,
                    const Tensor& dout, const Tensor& gate, const Tensor& up) {
  const Backend& be = On(ctx, "SwiGluBackward", {&dgate, &dup, &dout, &gate, &up});
  RequireFloat("SwiGluBackward", {&dgate, &dup, &dout, &gate, &up}, false,
               "every tensor must be float32");
  Require(dgate.numel() == gate.numel() && dup.numel() == gate.numel() &&
              dout.numel() == gate.numel() && up.numel() == gate.numel(),
          "SwiGluBackward", "shape mismatch");
  be.swiglu_backward(ctx, dgate, dup, dout, gate, up);
}

void RopePack(const ExecContext& ctx, const Tensor& qkv, const Tensor& q, const Tensor& k,
              const Tensor& v, int heads, int kv_heads, float theta, int64_t position_offset) {
  const Backend& be = On(ctx, "RopePack", {&qkv, &q, &k, &v});
  RequireFloat("RopePack", {&q, &k, &v}, false, "q, k and v must be float32");
  RequireFloat("RopePack", {&qkv}, true, "qkv must be float32 or bfloat16");
  RequireRopeShapes("RopePack", qkv, q, k, v, heads, kv_heads, theta);
  Require(position_offset >= 0, "RopePack", "position_offset must be >= 0");
  be.rope_pack(ctx, qkv, q, k, v, heads, kv_heads, theta, position_offset);
}

void RopePackBackward(const ExecContext& ctx, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                      const Tensor& dqkv, int heads, int kv_heads, float theta,
                      int64_t position_offset) {
  const Backend& be = On(ctx, "RopePackBackward", {&dq, &dk, &dv, &dqkv});
  RequireFloat("RopePackBackward", {&dq, &dk, &dv, &dqkv}, true,
               "dqkv, dq, dk and dv must be float32 or bfloat16");
  RequireRopeShapes("RopePackBackward", dqkv, dq, dk, dv, heads, kv_heads, theta);
  Require(position_offset >= 0, "RopePackBackward", "position_offset must be >= 0");
  be.rope_pack_backward(ctx, dq, dk, dv, dqkv, heads, kv_heads, theta, position_offset);
}

// ---- Context-parallel attention ----

int64_t BlockAttentionScratch(int64_t q_len, int64_t k_len) { return q_len * k_len; }
int64_t BlockAttentionBackwardScratch(int64_t q_len, int64_t k_len) { return 2 * q_len * k_len; }

namespace {

// The backend's entry `fn`, or an abort naming `op` where the backend has
// none (backend.h §1: the context-parallel and MoE entries may be null).
// `family` names the ops, `setting` the job setting that needs them.
template <typename Fn>
Fn OptionalEntry(const Backend& be, Fn fn, const char* op, const char* family, const char* setting) {
  if (fn == nullptr) {
    const std::string name = be.name;
    Fail(op, std::string(family) + " has no " + (name == "cuda" ? "CUDA" : name) +
                 " kernel yet; run jobs with " + setting + " on workers whose device has one (the CPU), or without " +
                 setting);
  }
  return fn;
}

template <typename Fn>
Fn CpEntry(const Backend& be, Fn fn, const char* op) {
  return OptionalEntry(be, fn, op, "context-parallel attention", "parallel.cp > 1");
}

// Packed qkv [B,Tq,3C] with heads | C; returns C.
int64_t RequireQkv(const char* op, const Tensor& qkv, int heads) {
  Require(qkv.ndim() == 3 && qkv.dim(0) > 0 && qkv.dim(1) > 0 && qkv.dim(2) > 0 &&
              qkv.dim(2) % 3 == 0 && heads > 0 && (qkv.dim(2) / 3) % heads == 0,
          op, "shape mismatch: qkv must be [batch, seq, 3 * channels] with heads dividing channels");
  return qkv.dim(2) / 3;
}

// A key/value block kv [B,Tk,2C] of qkv's batch and channels.
void RequireKv(const char* op, const Tensor& kv, const Tensor& qkv, int64_t c) {
  Require(kv.ndim() == 3 && kv.dim(0) == qkv.dim(0) && kv.dim(1) > 0 && kv.dim(2) == 2 * c, op,
          "shape mismatch: kv must be [batch, k_len, 2 * channels] of qkv's batch and channels");
}

// out-like [B,Tq,C] with heads | C, and lse-like tensors [B,heads,Tq].
void RequireOutAndLse(const char* op, const Tensor& out, std::initializer_list<const Tensor*> lse,
                      int heads) {
  Require(out.ndim() == 3 && out.dim(0) > 0 && out.dim(1) > 0 && out.dim(2) > 0 && heads > 0 &&
              out.dim(2) % heads == 0,
          op, "shape mismatch: out must be [batch, q_len, channels] with heads dividing channels");
  for (const Tensor* l : lse) {
    Require(l->numel() == out.dim(0) * heads * out.dim(1), op,
            "shape mismatch: lse and delta must be [batch, heads, q_len]");
  }
}

}  // namespace

// The ring's inputs: all float32, or all bf16 (ops.h).
void RequireRingInputs(const char* op, std::initializer_list<const Tensor*> tensors) {
  RequireFloat(op, tensors, true, "qkv, kv, dout and out must be float32 or bfloat16");
  for (const Tensor* t : tensors) {
    Require(t->dtype() == (*tensors.begin())->dtype(), op,
            "qkv, kv, dout and out must share one dtype (all float32 or all bfloat16)");
  }
}

void KvOfQkv(const ExecContext& ctx, const Tensor& kv, const Tensor& qkv) {
  const Backend& be = On(ctx, "KvOfQkv", {&kv, &qkv});
  RequireRingInputs("KvOfQkv", {&kv, &qkv});
  const int64_t c = RequireQkv("KvOfQkv", qkv, 1);
  RequireKv("KvOfQkv", kv, qkv, c);
  Require(kv.dim(1) == qkv.dim(1), "KvOfQkv", "shape mismatch: kv and qkv differ in seq");
  CpEntry(be, be.kv_of_qkv, "KvOfQkv")(ctx, kv, qkv);
}

void BlockAttention(const ExecContext& ctx, const Tensor& out, const Tensor& lse,
                    const Tensor& qkv, const Tensor& kv, int heads, int64_t q_offset,
                    int64_t k_offset, const Tensor& scratch) {
  const char* op = "BlockAttention";
  const Backend& be = On(ctx, op, {&out, &lse, &qkv, &kv, &scratch});
  RequireFloat(op, {&out, &lse, &scratch}, false, "out, lse and scratch must be float32");
  RequireRingInputs(op, {&qkv, &kv});
  const int64_t c = RequireQkv(op, qkv, heads);
  RequireKv(op, kv, qkv, c);
  const int64_t b = qkv.dim(0), tq = qkv.dim(1), tk = kv.dim(1);
  Require(out.numel() == b * tq * c && lse.numel() == b * heads * tq, op,
          "shape mismatch: out must be [batch, q_len, channels], lse [batch, heads, q_len]");
  Require(q_offset >= 0 && k_offset >= 0, op, "offsets must be >= 0");
  Require(scratch.numel() >= BlockAttentionScratch(tq, tk), op,
          "scratch is smaller than BlockAttentionScratch(q_len, k_len)");
  CpEntry(be, be.block_attention, op)(ctx, out, lse, qkv, kv, heads, q_offset, k_offset, scratch);
}

void MergeAttentionBlock(const ExecContext& ctx, const Tensor& out, const Tensor& lse,
                         const Tensor& block_out, const Tensor& block_lse, int heads) {
  const char* op = "MergeAttentionBlock";
  const Backend& be = On(ctx, op, {&out, &lse, &block_out, &block_lse});
  RequireFloat(op, {&out, &lse, &block_out, &block_lse}, false, "every tensor must be float32");
  RequireOutAndLse(op, out, {&lse, &block_lse}, heads);
  Require(block_out.numel() == out.numel(), op, "shape mismatch: block_out differs from out");
  CpEntry(be, be.merge_attention_block, op)(ctx, out, lse, block_out, block_lse, heads);
}

void AttentionDelta(const ExecContext& ctx, const Tensor& delta, const Tensor& dout,
                    const Tensor& out, int heads) {
  const char* op = "AttentionDelta";
  const Backend& be = On(ctx, op, {&delta, &dout, &out});
  RequireFloat(op, {&delta, &dout, &out}, false, "every tensor must be float32");
  RequireOutAndLse(op, out, {&delta}, heads);
  Require(dout.numel() == out.numel(), op, "shape mismatch: dout differs from out");
  CpEntry(be, be.attention_delta, op)(ctx, delta, dout, out, heads);
}

void BlockAttentionBackward(const ExecContext& ctx, const Tensor& dqkv, const Tensor& dkv,
                            const Tensor& dout, const Tensor& out, const Tensor& qkv,
                            const Tensor& kv, const Tensor& lse, const Tensor& delta, int heads,
                            int64_t q_offset, int64_t k_offset, const Tensor& scratch) {
  const char* op = "BlockAttentionBackward";
  const Backend& be =
      On(ctx, op, {&dqkv, &dkv, &dout, &out, &qkv, &kv, &lse, &delta, &scratch});
  RequireFloat(op, {&dqkv, &dkv, &lse, &delta, &scratch}, false,
               "dqkv, dkv, lse, delta and scratch must be float32");
  RequireRingInputs(op, {&dout, &out, &qkv, &kv});
  const int64_t c = RequireQkv(op, qkv, heads);
  RequireKv(op, kv, qkv, c);
  const int64_t b = qkv.dim(0), tq = qkv.dim(1), tk = kv.dim(1);
  Require(dqkv.numel() == qkv.numel() && dkv.numel() == kv.numel(), op,
          "shape mismatch: dqkv must be qkv's shape, dkv kv's");
  Require(dout.numel() == b * tq * c && out.numel() == dout.numel() &&
              lse.numel() == b * heads * tq && delta.numel() == b * heads * tq,
          op,
          "shape mismatch: dout and out must be [batch, q_len, channels], lse and delta "
          "[batch, heads, q_len]");
  Require(q_offset >= 0 && k_offset >= 0, op, "offsets must be >= 0");
  Require(scratch.numel() >= BlockAttentionBackwardScratch(tq, tk), op,
          "scratch is smaller than BlockAttentionBackwardScratch(q_len, k_len)");
  CpEntry(be, be.block_attention_backward, op)(ctx, dqkv, dkv, dout, out, qkv, kv, lse, delta,
                                               heads, q_offset, k_offset, scratch);
}

void QkvGradOfKv(const ExecContext& ctx, const Tensor& dqkv, const Tensor& dkv) {
  const Backend& be = On(ctx, "QkvGradOfKv", {&dqkv, &dkv});
  RequireFloat("QkvGradOfKv", {&dqkv, &dkv}, false, "dqkv and dkv must be float32");
  const int64_t c = RequireQkv("QkvGradOfKv", dqkv, 1);
  RequireKv("QkvGradOfKv", dkv, dqkv, c);
  Require(dkv.dim(1) == dqkv.dim(1), "QkvGradOfKv", "shape mismatch: dkv and dqkv differ in seq");
  CpEntry(be, be.qkv_grad_of_kv, "QkvGradOfKv")(ctx, dqkv, dkv);
}

// ---- Mixture-of-Experts routing ----

namespace {

constexpr int64_t kMaxCapacity = std::numeric_limits<int32_t>::max();  // slots are int32

template <typename Fn>
Fn MoeEntry(const Backend& be, Fn fn, const char* op) {
  return OptionalEntry(be, fn, op, "Mixture-of-Experts routing", "model.moe");
}

void RequireDType(const char* op, std::initializer_list<const Tensor*> tensors, DType dtype,
                  const char* what) {
  for (const Tensor* t : tensors) Require(t->defined() && t->dtype() == dtype, op, what);
}

// N tokens, top-k K.
struct MoeChoices {
  int64_t tokens;
  int64_t k;
};

// expert int32 [N,K] (N, K >= 1), each of `slots` int32 [N,K] and each of
// `gates` fp32 [N,K].
MoeChoices RequireChoices(const char* op, const Tensor& expert,
                          std::initializer_list<const Tensor*> slots,
                          std::initializer_list<const Tensor*> gates) {
  RequireDType(op, {&expert}, DType::kInt32, "expert must be int32");
  Require(expert.ndim() == 2 && expert.dim(0) > 0 && expert.dim(1) > 0, op,
          "shape mismatch: expert must be [tokens, top_k] with tokens, top_k >= 1");
  RequireDType(op, slots, DType::kInt32, "slot must be int32");
  for (const Tensor* s : slots) {
    Require(s->shape() == expert.shape(), op, "shape mismatch: slot must be [tokens, top_k]");
  }
  RequireFloat(op, gates, false, "gate and dgate must be float32");
  for (const Tensor* g : gates) {
    Require(g->shape() == expert.shape(), op,
            "shape mismatch: gate and dgate must be [tokens, top_k]");
  }
  return {expert.dim(0), expert.dim(1)};
}

// Per-token rows fp32 [N,E], all of one E >= K (logits, probs and their
// gradients).
void RequireRouterRows(const char* op, const MoeChoices& c,
                       std::initializer_list<const Tensor*> rows) {
  RequireFloat(op, rows, false, "logits, probs and their gradients must be float32");
  const int64_t experts = (*rows.begin())->ndim() == 2 ? (*rows.begin())->dim(1) : 0;
  for (const Tensor* r : rows) {
    Require(r->ndim() == 2 && r->dim(0) == c.tokens && r->dim(1) == experts && experts >= c.k, op,
            "shape mismatch: logits, probs and their gradients must be [tokens, experts] with "
            "top_k <= experts");
  }
}

// A per-expert int64 [E] vector (counts, routed) with E >= K.
void RequireExpertCounts(const char* op, const MoeChoices& c, const Tensor& counts) {
  RequireDType(op, {&counts}, DType::kInt64, "counts and routed must be int64");
  Require(counts.ndim() == 1 && counts.dim(0) >= c.k, op,
          "shape mismatch: counts and routed must be [experts] with top_k <= experts");
}

// Expert buffers fp32 [E,Cap,H] of one shape, E >= K, Cap < 2^31, H >= 1,
// and token rows fp32 of N·H elements, H the last dimension (x, y and their
// gradients).
void RequireBuffers(const char* op, const MoeChoices& c,
                    std::initializer_list<const Tensor*> buffers,
                    std::initializer_list<const Tensor*> token_rows) {
  RequireFloat(op, buffers, false, "expert buffers must be float32");
  RequireFloat(op, token_rows, false, "x, y and their gradients must be float32");
  const Tensor& first = **buffers.begin();
  Require(first.ndim() == 3 && first.dim(0) >= c.k && first.dim(1) <= kMaxCapacity &&
              first.dim(2) > 0,
          op,
          "shape mismatch: expert buffers must be [experts, capacity, hidden] with top_k <= "
          "experts, capacity < 2^31 and hidden >= 1");
  for (const Tensor* b : buffers) {
    Require(b->shape() == first.shape(), op, "shape mismatch: expert buffers differ in shape");
  }
  for (const Tensor* x : token_rows) {
    Require(x->ndim() >= 1 && x->dim(-1) == first.dim(2) && x->numel() == c.tokens * first.dim(2),
            op,
            "shape mismatch: x, y and their gradients must be [tokens, hidden] (or [batch, seq, "
            "hidden]) of the expert buffers' hidden");
  }
}

}  // namespace

int64_t MoeExpertCapacity(int64_t tokens, int64_t experts, int64_t k, double capacity_factor) {
  const char* op = "MoeExpertCapacity";
  Require(tokens >= 0 && k >= 1 && k <= experts, op, "want tokens >= 0 and 1 <= top_k <= experts");
  Require(std::isfinite(capacity_factor) && capacity_factor >= 0.0, op,
          "capacity_factor must be finite and >= 0");
  const int64_t capacity = cpu::ExpertCapacity(tokens, experts, k, capacity_factor);
  Require(capacity <= kMaxCapacity, op,
          "capacity past 2^31 - 1 rows per expert does not fit the int32 slots; lower "
          "capacity_factor or the microbatch's tokens");
  return capacity;
}

void RouterTopK(const ExecContext& ctx, const Tensor& probs, const Tensor& expert,
                const Tensor& gate, const Tensor& logits, bool renormalize) {
  const char* op = "RouterTopK";
  const Backend& be = On(ctx, op, {&probs, &expert, &gate, &logits});
  const MoeChoices c = RequireChoices(op, expert, {}, {&gate});
  RequireRouterRows(op, c, {&logits, &probs});
  MoeEntry(be, be.router_top_k, op)(ctx, probs, expert, gate, logits, renormalize);
}

void RouterTopKBackward(const ExecContext& ctx, const Tensor& dlogits, const Tensor& dgate,
                        const Tensor& expert, const Tensor& gate, const Tensor& probs,
                        bool renormalize) {
  const char* op = "RouterTopKBackward";
  const Backend& be = On(ctx, op, {&dlogits, &dgate, &expert, &gate, &probs});
  const MoeChoices c = RequireChoices(op, expert, {}, {&dgate, &gate});
  RequireRouterRows(op, c, {&dlogits, &probs});
  MoeEntry(be, be.router_top_k_backward, op)(ctx, dlogits, dgate, expert, gate, probs, renormalize);
}

void PlanDispatch(const ExecContext& ctx, const Tensor& slot, const Tensor& counts,
                  const Tensor& expert, int64_t capacity) {
  const char* op = "PlanDispatch";
  const Backend& be = On(ctx, op, {&slot, &counts, &expert});
  const MoeChoices c = RequireChoices(op, expert, {&slot}, {});
  RequireExpertCounts(op, c, counts);
  Require(capacity >= 0 && capacity <= kMaxCapacity, op,
          "capacity must be in [0, 2^31) (see MoeExpertCapacity)");
  MoeEntry(be, be.plan_dispatch, op)(ctx, slot, counts, expert, capacity);
}

void ExpertTokenCounts(const ExecContext& ctx, const Tensor& routed, const Tensor& expert) {
  const char* op = "ExpertTokenCounts";
  const Backend& be = On(ctx, op, {&routed, &expert});
  const MoeChoices c = RequireChoices(op, expert, {}, {});
  RequireExpertCounts(op, c, routed);
  MoeEntry(be, be.expert_token_counts, op)(ctx, routed, expert);
}

void Permute(const ExecContext& ctx, const Tensor& expert_in, const Tensor& x, const Tensor& expert,
             const Tensor& slot) {
  const char* op = "Permute";
  const Backend& be = On(ctx, op, {&expert_in, &x, &expert, &slot});
  const MoeChoices c = RequireChoices(op, expert, {&slot}, {});
  RequireBuffers(op, c, {&expert_in}, {&x});
  MoeEntry(be, be.permute, op)(ctx, expert_in, x, expert, slot);
}

void PermuteBackward(const ExecContext& ctx, const Tensor& dx, const Tensor& dexpert_in,
                     const Tensor& expert, const Tensor& slot) {
  const char* op = "PermuteBackward";
  const Backend& be = On(ctx, op, {&dx, &dexpert_in, &expert, &slot});
  const MoeChoices c = RequireChoices(op, expert, {&slot}, {});
  RequireBuffers(op, c, {&dexpert_in}, {&dx});
  MoeEntry(be, be.permute_backward, op)(ctx, dx, dexpert_in, expert, slot);
}

void Combine(const ExecContext& ctx, const Tensor& y, const Tensor& expert_out, const Tensor& gate,
             const Tensor& expert, const Tensor& slot) {
  const char* op = "Combine";
  const Backend& be = On(ctx, op, {&y, &expert_out, &gate, &expert, &slot});
  const MoeChoices c = RequireChoices(op, expert, {&slot}, {&gate});
  RequireBuffers(op, c, {&expert_out}, {&y});
  MoeEntry(be, be.combine, op)(ctx, y, expert_out, gate, expert, slot);
}

void CombineBackward(const ExecContext& ctx, const Tensor& dexpert_out, const Tensor& dgate,
                     const Tensor& dy, const Tensor& expert_out, const Tensor& gate,
                     const Tensor& expert, const Tensor& slot) {
  const char* op = "CombineBackward";
  const Backend& be = On(ctx, op, {&dexpert_out, &dgate, &dy, &expert_out, &gate, &expert, &slot});
  const MoeChoices c = RequireChoices(op, expert, {&slot}, {&dgate, &gate});
  RequireBuffers(op, c, {&dexpert_out, &expert_out}, {&dy});
  MoeEntry(be, be.combine_backward, op)(ctx, dexpert_out, dgate, dy, expert_out, gate, expert,
                                        slot);
}

void LoadBalancingLoss(const ExecContext& ctx, const Tensor& loss, const Tensor& dlogits_aux,
                       const Tensor& probs, const Tensor& expert, float coef, float grad_scale) {
  const char* op = "LoadBalancingLoss";
  const Backend& be = On(ctx, op, {&loss, &dlogits_aux, &probs, &expert});
  const MoeChoices c = RequireChoices(op, expert, {}, {});
  RequireRouterRows(op, c, {&dlogits_aux, &probs});
  Require(loss.defined() && loss.numel() == 1 && loss.dtype() == DType::kFloat32, op,
          "loss must be a one-element float32 accumulator");
  MoeEntry(be, be.load_balancing_loss, op)(ctx, loss, dlogits_aux, probs, expert, coef, grad_scale);
}

// ---- On the CPU ----

namespace {

const ExecContext& H() { return ExecContext::Host(); }

// A host float64 / int64 accumulator starting at zero.
struct HostScalar {
  explicit HostScalar(DType dtype) : t(Tensor::View(storage, {1}, dtype)) {}
  alignas(8) unsigned char storage[8] = {};  // 0.0 as a double, 0 as an int64
  Tensor t;
  double f64() const {
    double v;
    std::memcpy(&v, storage, sizeof(v));
    return v;
  }
  int64_t i64() const {
    int64_t v;
    std::memcpy(&v, storage, sizeof(v));
    return v;
  }
};

}  // namespace

void Embedding(const Tensor& out, const Tensor& tokens, const Tensor& wte, int64_t vocab_begin,
               const Tensor& wpe) {
  Embedding(H(), out, tokens, wte, vocab_begin, wpe);
}
void EmbeddingBackward(const Tensor& dwte, int64_t vocab_begin, const Tensor& dwpe,
                       const Tensor& dout, const Tensor& tokens) {
  EmbeddingBackward(H(), dwte, vocab_begin, dwpe, dout, tokens);
}
void LayerNorm(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& x,
               const Tensor& weight, const Tensor& bias) {
  LayerNorm(H(), out, mean, rstd, x, weight, bias);
}
void LayerNormBackward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                       const Tensor& dout, const Tensor& x, const Tensor& weight,
                       const Tensor& mean, const Tensor& rstd) {
  LayerNormBackward(H(), dx, dweight, dbias, dout, x, weight, mean, rstd);
}
void Linear(const Tensor& out, const Tensor& x, const Tensor& weight, const Tensor& bias) {
  Linear(H(), out, x, weight, bias);
}
void LinearBackwardInput(const Tensor& dx, const Tensor& dout, const Tensor& weight,
                         bool accumulate) {
  LinearBackwardInput(H(), dx, dout, weight, accumulate);
}
void LinearBackwardWeight(const Tensor& dweight, const Tensor& dout, const Tensor& x) {
  LinearBackwardWeight(H(), dweight, dout, x);
}
void AddBias(const Tensor& out, const Tensor& bias) { AddBias(H(), out, bias); }
void BiasBackward(const Tensor& dbias, const Tensor& dout) { BiasBackward(H(), dbias, dout); }
void Gelu(const Tensor& out, const Tensor& x) { Gelu(H(), out, x); }
void GeluBackward(const Tensor& dx, const Tensor& x, const Tensor& dout) {
  GeluBackward(H(), dx, x, dout);
}
void Attention(const Tensor& out, const Tensor& att, const Tensor& qkv, int heads) {
  Attention(H(), out, att, qkv, heads);
}
void AttentionBackward(const Tensor& dqkv, const Tensor& scratch, const Tensor& dout,
                       const Tensor& qkv, const Tensor& att, int heads) {
  AttentionBackward(H(), dqkv, scratch, dout, qkv, att, heads);
}
void Residual(const Tensor& out, const Tensor& a, const Tensor& b) { Residual(H(), out, a, b); }
void ResidualBackward(const Tensor& da, const Tensor& db, const Tensor& dout) {
  ResidualBackward(H(), da, db, dout);
}

double SoftmaxCrossEntropy(const Tensor& logits_to_grad, const Tensor& targets, float grad_scale) {
  HostScalar loss(DType::kFloat64);
  SoftmaxCrossEntropy(H(), logits_to_grad, targets, grad_scale, loss.t);
  return loss.f64();
}

void ShardedCrossEntropyStats(const Tensor& logits_to_exp, const Tensor& targets,
                              int64_t vocab_begin, const Tensor& row_max, const Tensor& lse,
                              const Tensor& target_logit) {
  ShardedCrossEntropyStats(H(), logits_to_exp, targets, vocab_begin, row_max, lse, target_logit);
}

double ShardedCrossEntropyFinish(const Tensor& exp_to_grad, const Tensor& targets,
                                 int64_t vocab_begin, const Tensor& row_max, const Tensor& lse_all,
                                 const Tensor& target_logit, float grad_scale) {
  HostScalar loss(DType::kFloat64);
  ShardedCrossEntropyFinish(H(), exp_to_grad, targets, vocab_begin, row_max, lse_all, target_logit,
                            grad_scale, loss.t);
  return loss.f64();
}

void ShardArgmax(const Tensor& logits, int64_t vocab_begin, const Tensor& max,
                 const Tensor& index) {
  ShardArgmax(H(), logits, vocab_begin, max, index);
}

int64_t CountArgmaxHits(const Tensor& max_all, const Tensor& index_all, const Tensor& targets) {
  HostScalar hits(DType::kInt64);
  CountArgmaxHits(H(), max_all, index_all, targets, hits.t);
  return hits.i64();
}

void AdamW(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
           const AdamWConfig& config, int64_t step, float grad_scale) {
  AdamW(H(), param, grad, m, v, config, step, grad_scale);
}

double SumOfSquares(const Tensor& x) {
  HostScalar sum(DType::kFloat64);
  SumOfSquares(H(), x, sum.t);
  return sum.f64();
}

void Scale(const Tensor& x, float factor) { Scale(H(), x, factor); }

}  // namespace baton::kernels
