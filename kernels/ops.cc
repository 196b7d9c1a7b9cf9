#include "kernels/ops.h"

#include <cstdio>
#include <cstdlib>
#include <initializer_list>

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

[[noreturn]] void Fail(const char* op, const char* what) {
  std::fprintf(stderr, "baton::kernels::%s: %s\n", op, what);
  std::abort();
}

void Require(bool ok, const char* op, const char* what) {
  if (!ok) Fail(op, what);
}

// Only the CPU backend is linked; every defined tensor must live there.
void RequireCpu(const char* op, std::initializer_list<const Tensor*> tensors) {
  for (const Tensor* t : tensors) {
    if (t->defined() && !t->device().is_cpu()) {
      Fail(op, "tensor on a CUDA device, but no CUDA kernel backend is linked");
    }
  }
}

float* F32OrNull(const Tensor& t) { return t.defined() ? t.f32() : nullptr; }

}  // namespace

void Embedding(const Tensor& out, const Tensor& tokens, const Tensor& wte, int64_t vocab_begin,
               const Tensor& wpe) {
  RequireCpu("Embedding", {&out, &tokens, &wte, &wpe});
  const int64_t b = tokens.dim(0), t = tokens.dim(1), c = wte.dim(1);
  Require(out.numel() == b * t * c && (!wpe.defined() || (wpe.dim(0) >= t && wpe.dim(1) == c)),
          "Embedding", "shape mismatch");
  cpu::EmbeddingForward(out.f32(), tokens.i32(), wte.f32(), vocab_begin, wte.dim(0), F32OrNull(wpe),
                        b, t, c);
}

void EmbeddingBackward(const Tensor& dwte, int64_t vocab_begin, const Tensor& dwpe,
                       const Tensor& dout, const Tensor& tokens) {
  RequireCpu("EmbeddingBackward", {&dwte, &dwpe, &dout, &tokens});
  const int64_t b = tokens.dim(0), t = tokens.dim(1);
  const int64_t c = dout.numel() / (b * t);
  Require(dout.numel() == b * t * c, "EmbeddingBackward", "shape mismatch");
  cpu::EmbeddingBackward(F32OrNull(dwte), vocab_begin, dwte.defined() ? dwte.dim(0) : 0,
                         F32OrNull(dwpe), dout.f32(), tokens.i32(), b, t, c);
}

void LayerNorm(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& x,
               const Tensor& weight, const Tensor& bias) {
  RequireCpu("LayerNorm", {&out, &mean, &rstd, &x, &weight, &bias});
  const int64_t c = weight.numel(), n = x.numel() / c;
  Require(out.numel() == x.numel() && mean.numel() == n && rstd.numel() == n && bias.numel() == c,
          "LayerNorm", "shape mismatch");
  cpu::LayerNormForward(out.f32(), mean.f32(), rstd.f32(), x.f32(), weight.f32(), bias.f32(), n, c);
}

void LayerNormBackward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                       const Tensor& dout, const Tensor& x, const Tensor& weight,
                       const Tensor& mean, const Tensor& rstd) {
  RequireCpu("LayerNormBackward", {&dx, &dweight, &dbias, &dout, &x, &weight, &mean, &rstd});
  const int64_t c = weight.numel(), n = x.numel() / c;
  Require(dx.numel() == x.numel() && dout.numel() == x.numel() && dweight.numel() == c &&
              dbias.numel() == c && mean.numel() == n,
          "LayerNormBackward", "shape mismatch");
  cpu::LayerNormBackward(dx.f32(), dweight.f32(), dbias.f32(), dout.f32(), x.f32(), weight.f32(),
                         mean.f32(), rstd.f32(), n, c);
}

void Linear(const Tensor& out, const Tensor& x, const Tensor& weight, const Tensor& bias) {
  RequireCpu("Linear", {&out, &x, &weight, &bias});
  const int64_t o = weight.dim(0), i = weight.dim(1), n = x.numel() / i;
  Require(x.numel() == n * i && out.numel() == n * o && (!bias.defined() || bias.numel() == o),
          "Linear", "shape mismatch");
  cpu::MatmulForward(out.f32(), x.f32(), weight.f32(), F32OrNull(bias), n, i, o);
}

void LinearBackwardInput(const Tensor& dx, const Tensor& dout, const Tensor& weight,
                         bool accumulate) {
  RequireCpu("LinearBackwardInput", {&dx, &dout, &weight});
  const int64_t o = weight.dim(0), i = weight.dim(1), n = dout.numel() / o;
  Require(dout.numel() == n * o && dx.numel() == n * i, "LinearBackwardInput", "shape mismatch");
  cpu::MatmulBackwardInput(dx.f32(), dout.f32(), weight.f32(), n, i, o, accumulate);
}

void LinearBackwardWeight(const Tensor& dweight, const Tensor& dout, const Tensor& x) {
  RequireCpu("LinearBackwardWeight", {&dweight, &dout, &x});
  const int64_t o = dweight.dim(0), i = dweight.dim(1), n = x.numel() / i;
  Require(x.numel() == n * i && dout.numel() == n * o, "LinearBackwardWeight", "shape mismatch");
  cpu::MatmulBackwardWeight(dweight.f32(), dout.f32(), x.f32(), n, i, o);
}

void AddBias(const Tensor& out, const Tensor& bias) {
  RequireCpu("AddBias", {&out, &bias});
  const int64_t o = bias.numel(), n = out.numel() / o;
  Require(out.numel() == n * o, "AddBias", "shape mismatch");
  cpu::AddBias(out.f32(), bias.f32(), n, o);
}

void BiasBackward(const Tensor& dbias, const Tensor& dout) {
  RequireCpu("BiasBackward", {&dbias, &dout});
  const int64_t o = dbias.numel(), n = dout.numel() / o;
  Require(dout.numel() == n * o, "BiasBackward", "shape mismatch");
  cpu::BiasBackward(dbias.f32(), dout.f32(), n, o);
}

void Gelu(const Tensor& out, const Tensor& x) {
  RequireCpu("Gelu", {&out, &x});
  Require(out.numel() == x.numel(), "Gelu", "shape mismatch");
  cpu::GeluForward(out.f32(), x.f32(), x.numel());
}

void GeluBackward(const Tensor& dx, const Tensor& x, const Tensor& dout) {
  RequireCpu("GeluBackward", {&dx, &x, &dout});
  Require(dx.numel() == x.numel() && dout.numel() == x.numel(), "GeluBackward", "shape mismatch");
  cpu::GeluBackward(dx.f32(), x.f32(), dout.f32(), x.numel());
}

void Attention(const Tensor& out, const Tensor& att, const Tensor& qkv, int heads) {
  RequireCpu("Attention", {&out, &att, &qkv});
  const int64_t b = qkv.dim(0), t = qkv.dim(1), c = qkv.dim(2) / 3;
  Require(qkv.ndim() == 3 && c % heads == 0 && out.numel() == b * t * c &&
              att.numel() == b * heads * t * t,
          "Attention", "shape mismatch");
  cpu::AttentionForward(out.f32(), att.f32(), qkv.f32(), b, t, c, heads);
}

void AttentionBackward(const Tensor& dqkv, const Tensor& scratch, const Tensor& dout,
                       const Tensor& qkv, const Tensor& att, int heads) {
  RequireCpu("AttentionBackward", {&dqkv, &scratch, &dout, &qkv, &att});
  const int64_t b = qkv.dim(0), t = qkv.dim(1), c = qkv.dim(2) / 3;
  Require(qkv.ndim() == 3 && dqkv.numel() == qkv.numel() && dout.numel() == b * t * c &&
              att.numel() == b * heads * t * t && scratch.numel() >= t * t,
          "AttentionBackward", "shape mismatch");
  cpu::AttentionBackward(dqkv.f32(), scratch.f32(), dout.f32(), qkv.f32(), att.f32(), b, t, c,
                         heads);
}

void Residual(const Tensor& out, const Tensor& a, const Tensor& b) {
  RequireCpu("Residual", {&out, &a, &b});
  Require(out.numel() == a.numel() && b.numel() == a.numel(), "Residual", "shape mismatch");
  cpu::ResidualForward(out.f32(), a.f32(), b.f32(), a.numel());
}

void ResidualBackward(const Tensor& da, const Tensor& db, const Tensor& dout) {
  RequireCpu("ResidualBackward", {&da, &db, &dout});
  Require((!da.defined() || da.numel() == dout.numel()) &&
              (!db.defined() || db.numel() == dout.numel()),
          "ResidualBackward", "shape mismatch");
  cpu::ResidualBackward(F32OrNull(da), F32OrNull(db), dout.f32(), dout.numel());
}

double SoftmaxCrossEntropy(const Tensor& logits_to_grad, const Tensor& targets, float grad_scale) {
  RequireCpu("SoftmaxCrossEntropy", {&logits_to_grad, &targets});
  const int64_t n = targets.numel(), v = logits_to_grad.numel() / n;
  Require(logits_to_grad.numel() == n * v, "SoftmaxCrossEntropy", "shape mismatch");
  return cpu::SoftmaxCrossEntropy(logits_to_grad.f32(), targets.i32(), n, v, grad_scale);
}

void ShardedCrossEntropyStats(const Tensor& logits_to_exp, const Tensor& targets,
                              int64_t vocab_begin, const Tensor& row_max, const Tensor& lse,
                              const Tensor& target_logit) {
  RequireCpu("ShardedCrossEntropyStats", {&logits_to_exp, &targets, &row_max, &lse, &target_logit});
  const int64_t n = targets.numel(), v = logits_to_exp.numel() / n;
  Require(logits_to_exp.numel() == n * v && row_max.numel() == n && lse.numel() == n &&
              target_logit.numel() == n,
          "ShardedCrossEntropyStats", "shape mismatch");
  cpu::ShardedCrossEntropyStats(logits_to_exp.f32(), targets.i32(), n, vocab_begin, v,
                                row_max.f32(), lse.f32(), target_logit.f32());
}

double ShardedCrossEntropyFinish(const Tensor& exp_to_grad, const Tensor& targets,
                                 int64_t vocab_begin, const Tensor& row_max, const Tensor& lse_all,
                                 const Tensor& target_logit, float grad_scale) {
  RequireCpu("ShardedCrossEntropyFinish",
             {&exp_to_grad, &targets, &row_max, &lse_all, &target_logit});
  const int64_t n = targets.numel(), v = exp_to_grad.numel() / n, shards = lse_all.numel() / n;
  Require(exp_to_grad.numel() == n * v && row_max.numel() == n && lse_all.numel() == n * shards &&
              target_logit.numel() == n,
          "ShardedCrossEntropyFinish", "shape mismatch");
  return cpu::ShardedCrossEntropyFinish(exp_to_grad.f32(), targets.i32(), n, vocab_begin, v,
                                        row_max.f32(), lse_all.f32(), shards, target_logit.f32(),
                                        grad_scale);
}

void ShardArgmax(const Tensor& logits, int64_t vocab_begin, const Tensor& max,
                 const Tensor& index) {
  RequireCpu("ShardArgmax", {&logits, &max, &index});
  const int64_t n = max.numel(), v = logits.numel() / n;
  Require(logits.numel() == n * v && index.numel() == n, "ShardArgmax", "shape mismatch");
  Require(vocab_begin + v <= kMaxArgmaxVocab, "ShardArgmax",
          "vocabulary indices past 2^24 do not fit a float exactly");
  cpu::ShardArgmax(logits.f32(), n, v, vocab_begin, max.f32(), index.f32());
}

int64_t CountArgmaxHits(const Tensor& max_all, const Tensor& index_all, const Tensor& targets) {
  RequireCpu("CountArgmaxHits", {&max_all, &index_all, &targets});
  const int64_t n = targets.numel(), shards = max_all.numel() / n;
  Require(max_all.numel() == n * shards && index_all.numel() == n * shards, "CountArgmaxHits",
          "shape mismatch");
  return cpu::CountArgmaxHits(max_all.f32(), index_all.f32(), shards, targets.i32(), n);
}

void AdamW(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
           const AdamWConfig& config, int64_t step, float grad_scale) {
  RequireCpu("AdamW", {&param, &grad, &m, &v});
  Require(grad.numel() == param.numel() && m.numel() == param.numel() &&
              v.numel() == param.numel() && step >= 1,
          "AdamW", "shape mismatch or step < 1");
  cpu::AdamWUpdate(param.f32(), grad.f32(), m.f32(), v.f32(), param.numel(), config, step,
                   grad_scale);
}

double SumOfSquares(const Tensor& x) {
  RequireCpu("SumOfSquares", {&x});
  return cpu::SumOfSquares(x.f32(), x.numel());
}

void Scale(const Tensor& x, float factor) {
  RequireCpu("Scale", {&x});
  cpu::Scale(x.f32(), x.numel(), factor);
}

}  // namespace baton::kernels
