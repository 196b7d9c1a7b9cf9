#include "kernels/cuda/plan.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"

namespace baton::cuda {
namespace {


absl::StatusOr<size_t> BoundedBytes(int64_t count, size_t elem, absl::string_view what) {
  if (count <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": count must be positive, got ", count));
  }
  if (static_cast<uint64_t>(count) > kMaxScratchBytes / elem) {
    return absl::ResourceExhaustedError(absl::StrCat(
        what, ": ", count, " elements of ", elem, " bytes exceed the ", kMaxScratchBytes >> 30,
        " GiB scratch bound; check the shapes"));
  }
  return static_cast<size_t>(count) * elem;
}

}  // namespace

absl::StatusOr<LtGemm> MapRowMajorGemm(const RowMajorGemm& g) {
  if (g.m <= 0 || g.n <= 0 || g.k <= 0 || g.batch <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("GEMM sizes must be positive: m=", g.m, " n=",
                                                   g.n, " k=", g.k, " batch=", g.batch));
  }
  // Row-major stored widths: A is [m,k] (or [k,m] transposed), B [k,n] (or [n,k]).
  const int64_t a_width = g.trans_a ? g.m : g.k;
  const int64_t b_width = g.trans_b ? g.k : g.n;
  if (g.lda < a_width || g.ldb < b_width || g.ldc < g.n) {
    return absl::InvalidArgumentError(absl::StrCat(
        "GEMM leading dimensions too small: lda=", g.lda, " (needs >= ", a_width, "), ldb=",
        g.ldb, " (needs >= ", b_width, "), ldc=", g.ldc, " (needs >= ", g.n, ")"));
  }
  if (g.batch > 1 && (g.stride_a < 0 || g.stride_b < 0 || g.stride_c <= 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "batched GEMM strides: outputs must not alias (stride_c=", g.stride_c,
        ") and input strides must be >= 0 (", g.stride_a, ", ", g.stride_b, ")"));
  }
  LtGemm lt;
  lt.trans_a = g.trans_b;
  lt.trans_b = g.trans_a;
  lt.m = g.n;
  lt.n = g.m;
  lt.k = g.k;
  lt.lda = g.ldb;
  lt.ldb = g.lda;
  lt.ldc = g.ldc;
  // Column-major stored shapes: rows are the leading (contiguous) dimension.
  lt.a_rows = lt.trans_a ? lt.k : lt.m;
  lt.a_cols = lt.trans_a ? lt.m : lt.k;
  lt.b_rows = lt.trans_b ? lt.n : lt.k;
  lt.b_cols = lt.trans_b ? lt.k : lt.n;
  lt.c_rows = lt.m;
  lt.c_cols = lt.n;
  lt.batch = g.batch;
  lt.stride_a = g.stride_b;
  lt.stride_b = g.stride_a;
  lt.stride_c = g.stride_c;
  return lt;
}

RowMajorGemm LinearForwardGemm(int64_t rows, int64_t in_features, int64_t out_features) {
  RowMajorGemm g;
  g.trans_a = false;
  g.trans_b = true;
  g.m = rows;
  g.n = out_features;
  g.k = in_features;
  g.lda = in_features;
  g.ldb = in_features;
  g.ldc = out_features;
  return g;
}

RowMajorGemm LinearBackwardInputGemm(int64_t rows, int64_t in_features, int64_t out_features) {
  RowMajorGemm g;
  g.m = rows;
  g.n = in_features;
  g.k = out_features;
  g.lda = out_features;
  g.ldb = in_features;
  g.ldc = in_features;
  return g;
}

RowMajorGemm LinearBackwardWeightGemm(int64_t rows, int64_t in_features, int64_t out_features) {
  RowMajorGemm g;
  g.trans_a = true;
  g.m = out_features;
  g.n = in_features;
  g.k = rows;
  g.lda = out_features;
  g.ldb = in_features;
  g.ldc = in_features;
  return g;
}

absl::StatusOr<AttentionShard> ShardAttention(int64_t batch, int64_t seq, int64_t channels,
                                              int64_t heads, int64_t tp) {
  if (batch <= 0 || seq <= 0 || channels <= 0 || heads <= 0 || tp <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attention sizes must be positive: batch=", batch, " seq=", seq, " channels=", channels,
        " heads=", heads, " tp=", tp));
  }
  if (channels % heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("channels (", channels, ") must be a multiple of heads (", heads, ")"));
  }
  if (heads % tp != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "heads (", heads, ") must be a multiple of the tensor-parallel degree (", tp,
        "): each rank computes whole heads"));
  }
  AttentionShard s;
  s.batch = batch;
  s.seq = seq;
  s.heads = heads / tp;
  s.head_dim = channels / heads;
  s.channels = s.heads * s.head_dim;
  return s;
}

AttentionPlan PlanAttention(const AttentionShard& s) {
  AttentionPlan p;
  p.shard = s;
  const int64_t t = s.seq, hd = s.head_dim, c = s.channels, h = s.heads;
  p.scale = 1.0f / std::sqrt(static_cast<float>(hd));
  p.qkv_row_stride = 3 * c;
  p.qkv_batch_stride = t * 3 * c;
  p.q_offset = 0;
  p.k_offset = c;
  p.v_offset = 2 * c;
  p.out_batch_stride = t * c;
  p.att_head_stride = t * t;
  p.att_batch_stride = h * t * t;

  auto gemm = [&](bool ta, bool tb, int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb,
                  int64_t ldc, int64_t sa, int64_t sb, int64_t sc) {
    RowMajorGemm g;
    g.trans_a = ta;
    g.trans_b = tb;
    g.m = m;
    g.n = n;
    g.k = k;
    g.lda = lda;
    g.ldb = ldb;
    g.ldc = ldc;
    g.batch = h;
    g.stride_a = sa;
    g.stride_b = sb;
    g.stride_c = sc;
    return g;
  };
  const int64_t ld = 3 * c;
  p.scores = gemm(false, true, t, t, hd, ld, ld, t, hd, hd, t * t);      // q · kᵀ
  p.context = gemm(false, false, t, hd, t, t, ld, c, t * t, hd, hd);     // P · v
  p.grad_probs = gemm(false, true, t, t, hd, c, ld, t, hd, hd, t * t);   // do · vᵀ
  p.grad_v = gemm(true, false, t, hd, t, t, c, ld, t * t, hd, hd);       // Pᵀ · do
  p.grad_q = gemm(false, false, t, hd, t, t, ld, ld, t * t, hd, hd);     // dS · k
  p.grad_k = gemm(true, false, t, hd, t, t, ld, ld, t * t, hd, hd);      // dSᵀ · q
  return p;
}

absl::StatusOr<size_t> AttentionBackwardScratchBytes(const AttentionShard& s) {
  if (s.seq > (int64_t{1} << 20) || s.heads > (int64_t{1} << 16)) {
    return absl::InvalidArgumentError(
        absl::StrCat("attention shape out of range: seq=", s.seq, " heads=", s.heads));
  }
  return BoundedBytes(s.heads * s.seq * s.seq, sizeof(float), "attention backward scratch");
}

absl::StatusOr<size_t> EmbeddingBackwardScratchBytes(int64_t tokens) {
  if (tokens > (int64_t{1} << 30)) {
    return absl::InvalidArgumentError(absl::StrCat("too many tokens: ", tokens));
  }
  return BoundedBytes(2 * tokens, sizeof(int32_t), "embedding backward scratch");
}

absl::StatusOr<size_t> ColumnReduceScratchBytes(int64_t rows, int64_t cols, int outputs) {
  if (rows <= 0 || cols <= 0 || outputs <= 0 || cols > (int64_t{1} << 30)) {
    return absl::InvalidArgumentError(absl::StrCat("column reduce of [", rows, ", ", cols,
                                                   "] x ", outputs, ": sizes out of range"));
  }
  const ColumnReducePlan p = PlanColumnReduce(rows, cols);
  return BoundedBytes(int64_t{p.chunks} * cols * outputs, sizeof(float), "column reduce scratch");
}

absl::StatusOr<size_t> RowLossScratchBytes(int64_t rows) {
  if (rows > (int64_t{1} << 31)) {
    return absl::InvalidArgumentError(absl::StrCat("too many rows: ", rows));
  }
  return BoundedBytes(rows + 1, sizeof(double), "row loss scratch");
}

bool GemmKey::operator==(const GemmKey& o) const {
  const LtGemm& a = shape;
  const LtGemm& b = o.shape;
  return a.trans_a == b.trans_a && a.trans_b == b.trans_b && a.m == b.m && a.n == b.n &&
         a.k == b.k && a.lda == b.lda && a.ldb == b.ldb && a.ldc == b.ldc && a.batch == b.batch &&
         a.stride_a == b.stride_a && a.stride_b == b.stride_b && a.stride_c == b.stride_c &&
         ab_type == o.ab_type && c_type == o.c_type && epilogue == o.epilogue &&
         accumulate == o.accumulate && alignment == o.alignment && aux_ld == o.aux_ld &&
         aux_type == o.aux_type && bias_type == o.bias_type;
}

uint16_t CommonAlignment(std::initializer_list<uintptr_t> addresses) {
  uint16_t align = 256;
  for (uintptr_t a : addresses) {
    if (a == 0) continue;
    while (align > 1 && a % align != 0) align /= 2;
  }
  return align;
}

std::string GemmKeyToString(const GemmKey& k) {
  const LtGemm& s = k.shape;
  return absl::StrCat("lt m=", s.m, " n=", s.n, " k=", s.k, s.trans_a ? " A^T" : "",
                      s.trans_b ? " B^T" : "", " ld=", s.lda, "/", s.ldb, "/", s.ldc,
                      " batch=", s.batch, " ab=", k.ab_type == GemmDType::kBF16 ? "bf16" : "f32",
                      " c=", k.c_type == GemmDType::kBF16 ? "bf16" : "f32",
                      " epilogue=", static_cast<int>(k.epilogue),
                      k.epilogue == GemmEpilogue::kBias || k.epilogue == GemmEpilogue::kGeluAuxBias
                          ? (k.bias_type == GemmDType::kBF16 ? " bias=bf16" : " bias=f32")
                          : "",
                      " beta=", k.accumulate ? 1 : 0, " align=", static_cast<int>(k.alignment));
}

absl::StatusOr<GemmKey> MakeGemmKey(const GemmArgs& args) {
  absl::StatusOr<LtGemm> lt = MapRowMajorGemm(args.shape);
  if (!lt.ok()) return lt.status();
  if (args.a == nullptr || args.b == nullptr || args.c == nullptr) {
    return absl::InvalidArgumentError("GEMM operand A, B or C is null");
  }
  if (args.ab_type == GemmDType::kF32 && args.c_type == GemmDType::kBF16) {
    return absl::InvalidArgumentError(
        "GEMM with fp32 inputs and a bf16 output: cast the inputs to bf16 or keep C in fp32");
  }
  const bool wants_bias = args.epilogue == GemmEpilogue::kBias ||
                          args.epilogue == GemmEpilogue::kGeluAuxBias;
  const bool wants_aux = args.epilogue == GemmEpilogue::kGeluAux ||
                         args.epilogue == GemmEpilogue::kGeluAuxBias ||
                         args.epilogue == GemmEpilogue::kDGelu;
  if (wants_bias != (args.bias != nullptr)) {
    return absl::InvalidArgumentError(wants_bias ? "GEMM bias epilogue without a bias pointer"
                                                 : "GEMM bias pointer given without a bias epilogue");
  }
  if (wants_aux) {
    if (args.aux == nullptr) return absl::InvalidArgumentError("GELU epilogue without an aux buffer");
    if (args.aux_ld < args.shape.n || args.aux_ld % 8 != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "GELU aux leading dimension ", args.aux_ld, " must be >= n (", args.shape.n,
          ") and a multiple of 8 (cuBLASLt)"));
    }
    if (args.shape.batch != 1) {
      return absl::InvalidArgumentError("GELU epilogues are not supported on batched GEMMs here");
    }
  } else if (args.aux != nullptr) {
    return absl::InvalidArgumentError("GEMM aux buffer given without a GELU epilogue");
  }
  GemmKey key;
  key.shape = *lt;
  key.ab_type = args.ab_type;
  key.c_type = args.c_type;
  key.epilogue = args.epilogue;
  key.accumulate = args.beta != 0.0f;
  const uintptr_t ab = args.ab_type == GemmDType::kBF16 ? 2 : 4;
  const uintptr_t cb = args.c_type == GemmDType::kBF16 ? 2 : 4;
  const bool batched = args.shape.batch > 1;
  key.alignment = CommonAlignment(
      {reinterpret_cast<uintptr_t>(args.a), reinterpret_cast<uintptr_t>(args.b),
       reinterpret_cast<uintptr_t>(args.c), reinterpret_cast<uintptr_t>(args.bias),
       reinterpret_cast<uintptr_t>(args.aux),
       batched ? static_cast<uintptr_t>(args.shape.stride_a) * ab : 0,
       batched ? static_cast<uintptr_t>(args.shape.stride_b) * ab : 0,
       batched ? static_cast<uintptr_t>(args.shape.stride_c) * cb : 0});
  key.aux_ld = wants_aux ? args.aux_ld : 0;
  key.aux_type = wants_aux ? args.aux_type : GemmDType::kF32;
  key.bias_type = wants_bias ? args.bias_type : GemmDType::kF32;
  return key;
}

absl::StatusOr<GemmArgs> WithFp32BiasOutput(const GemmArgs& args, void* fp32_out) {
  if (args.epilogue != GemmEpilogue::kBias || args.bias == nullptr ||
      args.bias_type != GemmDType::kF32 || args.c_type != GemmDType::kBF16) {
    return absl::InvalidArgumentError(
        "the fp32-output form is for a bias epilogue with an fp32 bias and a bf16 output");
  }
  if (args.shape.batch != 1 || args.shape.ldc != args.shape.n || args.beta != 0.0f ||
      fp32_out == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the fp32-output form needs one contiguous output that it overwrites (batch=",
        args.shape.batch, ", ldc=", args.shape.ldc, ", n=", args.shape.n, ", beta=", args.beta,
        ") and a buffer for it"));
  }
  GemmArgs g = args;
  g.c_type = GemmDType::kF32;
  g.c = fp32_out;
  return g;
}

}  // namespace baton::cuda
