// Host-side planning for the CUDA kernels: everything about a launch that can
// be decided without a GPU, kept free of CUDA headers so that CI tests it on
// the CPU (kernels/cuda/plan_test.cc).
//
//   Launch shapes   grid/block for elementwise, warp-per-row, block-per-row
//                   and column-reduction kernels; fixed grids wherever the
//                   grid shape decides a reduction order (determinism).
//   GEMM mapping    a row-major C[M,N] = α op(A)[M,K] · op(B)[K,N] + β C is
//                   the column-major Cᵀ[N,M] = α op(B)ᵀ · op(A)ᵀ + β Cᵀ: a
//                   row-major matrix with row stride ld is its own transpose in
//                   column-major with leading dimension ld. So cuBLASLt gets
//                   A_lt = B, B_lt = A, m = N, n = M, k = K, transa = trans_b,
//                   transb = trans_a, and the same leading dimensions.
//   Attention       the per-head GEMMs of causal attention over a (possibly
//                   tensor-parallel) shard of qkv [B,T,3C'] with C' = C/tp,
//                   heads' = heads/tp: strided-batched over the heads of one
//                   batch row.
//   Workspaces      scratch bytes each op needs, bounded before allocation.
//   Algorithm cache the key that identifies one cuBLASLt problem.
#ifndef BATON_KERNELS_CUDA_PLAN_H_
#define BATON_KERNELS_CUDA_PLAN_H_

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/bfloat16.h"
#include "kernels/cuda/launch_math.h"

namespace baton::cuda {

// Launch shapes: kernels/cuda/launch_math.h (shared with the .cu files).

// ------------------------------------------------------------ GEMM mapping

// A row-major (PyTorch/CPU convention) GEMM, optionally strided-batched.
struct RowMajorGemm {
  bool trans_a = false;
  bool trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  int64_t lda = 0, ldb = 0, ldc = 0;
  int64_t batch = 1;
  int64_t stride_a = 0, stride_b = 0, stride_c = 0;  // elements between batch items
};

// The same problem as cuBLASLt sees it (column-major). `a_rows × a_cols` is
// the stored shape of the matrix given as cuBLASLt's A (before its op), etc.
struct LtGemm {
  bool trans_a = false;
  bool trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  int64_t lda = 0, ldb = 0, ldc = 0;
  int64_t a_rows = 0, a_cols = 0;
  int64_t b_rows = 0, b_cols = 0;
  int64_t c_rows = 0, c_cols = 0;
  int64_t batch = 1;
  int64_t stride_a = 0, stride_b = 0, stride_c = 0;
  // The row-major operands are swapped: cuBLASLt's A pointer is the caller's B.
  bool operands_swapped = true;
};

// Checks the row-major problem (positive sizes, leading dimensions wide
// enough, batch strides that keep items apart) and maps it.
absl::StatusOr<LtGemm> MapRowMajorGemm(const RowMajorGemm& g);

// The GEMMs of kernels/cpu/matmul.cc (weight [out, in], PyTorch's layout):
//   forward          out[N,O]  = x[N,I] · Wᵀ
//   backward input   dx[N,I]   = dy[N,O] · W
//   backward weight  dW[O,I]  += dyᵀ · x
RowMajorGemm LinearForwardGemm(int64_t rows, int64_t in_features, int64_t out_features);
RowMajorGemm LinearBackwardInputGemm(int64_t rows, int64_t in_features, int64_t out_features);
RowMajorGemm LinearBackwardWeightGemm(int64_t rows, int64_t in_features, int64_t out_features);

// A bias epilogue adds one value per row of the column-major result, i.e.
// per column of the row-major one: its length is LtGemm::m.
inline int64_t BiasLength(const LtGemm& lt) { return lt.m; }

// ---------------------------------------------------------------- attention

// This rank's share of attention under tensor parallelism: heads split over
// `tp` ranks, each holding a qkv [B,T,3C'] with q | k | v thirds of width
// C' = C/tp (the column-parallel QKV projection's output on that rank).
struct AttentionShard {
  int64_t batch = 0, seq = 0;
  int64_t channels = 0;  // C' (local)
  int64_t heads = 0;     // heads' (local)
  int64_t head_dim = 0;
};
absl::StatusOr<AttentionShard> ShardAttention(int64_t batch, int64_t seq, int64_t channels,
                                              int64_t heads, int64_t tp);

// Element offsets within one batch row b of qkv / out / att, and the per-head
// GEMMs, strided-batched over the shard's heads (head h's q starts h·hd after
// head 0's; k is C' further, v 2C'). Offsets are added to the base pointers for
// batch row b: qkv + b·qkv_batch_stride, etc.
struct AttentionPlan {
  AttentionShard shard;
  float scale = 0;  // 1/√hd
  int64_t qkv_row_stride = 0;    // 3C'
  int64_t qkv_batch_stride = 0;  // T·3C'
  int64_t q_offset = 0, k_offset = 0, v_offset = 0;
  int64_t out_batch_stride = 0;  // T·C'
  int64_t att_batch_stride = 0;  // heads'·T·T
  int64_t att_head_stride = 0;   // T·T
  // Forward:  S = q kᵀ · scale (into att),  o = P v
  RowMajorGemm scores, context;
  // Backward: dP = do vᵀ, dv = Pᵀ do, dq = dS k, dk = dSᵀ q
  RowMajorGemm grad_probs, grad_v, grad_q, grad_k;
};
AttentionPlan PlanAttention(const AttentionShard& shard);

// -------------------------------------------------------------- workspaces

inline constexpr size_t kLtWorkspaceBytes = size_t{32} << 20;  // cuBLASLt on Hopper
// Refuse any single scratch request above this (a shape bug, not a model).
inline constexpr size_t kMaxScratchBytes = size_t{64} << 30;

// Backward attention holds dP/dS for one batch row: heads'·T·T floats.
absl::StatusOr<size_t> AttentionBackwardScratchBytes(const AttentionShard& shard);
// Deterministic embedding backward: next-occurrence links and chain heads,
// two int32 per token.
absl::StatusOr<size_t> EmbeddingBackwardScratchBytes(int64_t tokens);
// Column-reduction partials [chunks, cols] floats, for each of `outputs`
// reduced vectors (LayerNorm: dweight and dbias → 2).
absl::StatusOr<size_t> ColumnReduceScratchBytes(int64_t rows, int64_t cols, int outputs);
// One double per row (cross-entropy losses) plus one for their sum.
absl::StatusOr<size_t> RowLossScratchBytes(int64_t rows);
// kNormBlocks doubles.
inline size_t NormScratchBytes() { return kNormBlocks * sizeof(double); }

// ------------------------------------------------------- algorithm cache key

enum class GemmDType : uint8_t { kF32 = 0, kBF16 = 1 };

// The epilogues the model uses (cuBLASLt's GELU is GPT-2's tanh form).
enum class GemmEpilogue : uint8_t {
  kNone = 0,
  kBias = 1,         // D = AB + bias
  kGeluAux = 2,      // aux = AB, D = gelu(aux)
  kGeluAuxBias = 3,  // aux = AB + bias, D = gelu(aux)
  kDGelu = 4,        // D = AB ⊙ gelu'(aux)
};

// Everything cuBLASLt's heuristic looks at: shape, types, epilogue, whether
// β ≠ 0 and the operands' alignment in bytes (a power of two up to 256, the
// smallest over the pointers and, when batched, the batch strides; cuBLASLt
// is told it through its MIN_ALIGNMENT preferences, whose default of 256 would
// let the heuristic pick a kernel that misreads less aligned operands: the
// operands). Equal keys may share an algorithm; different keys never do.
struct GemmKey {
  LtGemm shape;
  GemmDType ab_type = GemmDType::kF32;
  GemmDType c_type = GemmDType::kF32;
  GemmEpilogue epilogue = GemmEpilogue::kNone;
  bool accumulate = false;
  uint16_t alignment = 256;
  int64_t aux_ld = 0;
  GemmDType aux_type = GemmDType::kF32;
  GemmDType bias_type = GemmDType::kF32;

  bool operator==(const GemmKey& o) const;
  template <typename H>
  friend H AbslHashValue(H h, const GemmKey& k) {
    const LtGemm& s = k.shape;
    return H::combine(std::move(h), s.trans_a, s.trans_b, s.m, s.n, s.k, s.lda, s.ldb, s.ldc,
                      s.batch, s.stride_a, s.stride_b, s.stride_c, k.ab_type, k.c_type, k.epilogue,
                      k.accumulate, k.alignment, k.aux_ld, k.aux_type, k.bias_type);
  }
};

// The largest power of two ≤ 256 dividing every value (addresses or byte
// strides; 0 is ignored).
uint16_t CommonAlignment(std::initializer_list<uintptr_t> addresses);

std::string GemmKeyToString(const GemmKey& key);

// A bounded per-shape cache of chosen algorithms (a training step uses a
// few dozen shapes; the bound only stops a shape bug from growing it).
template <typename Algo>
class GemmAlgoCache {
 public:
  static constexpr size_t kMaxEntries = 4096;

  const Algo* Find(const GemmKey& key) {
    auto it = map_.find(key);
    if (it == map_.end()) {
      ++misses_;
      return nullptr;
    }
    ++hits_;
    return &it->second;
  }
  absl::Status Insert(const GemmKey& key, const Algo& algo) {
    if (map_.size() >= kMaxEntries && !map_.contains(key)) {
      return absl::ResourceExhaustedError(
          "cuBLASLt algorithm cache is full (4096 GEMM shapes): a caller builds GEMMs of ever "
          "new shapes; last was " + GemmKeyToString(key));
    }
    map_.insert_or_assign(key, algo);
    return absl::OkStatus();
  }
  size_t size() const { return map_.size(); }
  int64_t hits() const { return hits_; }
  int64_t misses() const { return misses_; }

  // Problems the heuristic found no algorithm for, remembered (up to
  // kMaxEntries) so that a caller with a fallback does not ask again per call.
  void MarkUnsupported(const GemmKey& key) {
    if (unsupported_.size() < kMaxEntries) unsupported_.insert(key);
  }
  bool IsUnsupported(const GemmKey& key) const { return unsupported_.contains(key); }

 private:
  absl::flat_hash_map<GemmKey, Algo> map_;
  absl::flat_hash_set<GemmKey> unsupported_;
  int64_t hits_ = 0;
  int64_t misses_ = 0;
};

// One GEMM as the CUDA backend asks for it (kernels/cuda/gemm.h runs it).
struct GemmArgs {
  RowMajorGemm shape;
  GemmDType ab_type = GemmDType::kF32;
  GemmDType c_type = GemmDType::kF32;
  const void* a = nullptr;
  const void* b = nullptr;
  void* c = nullptr;
  float alpha = 1.0f;
  float beta = 0.0f;
  GemmEpilogue epilogue = GemmEpilogue::kNone;
  const void* bias = nullptr;  // bias_type, length = shape.n (one per output column)
  GemmDType bias_type = GemmDType::kF32;
  void* aux = nullptr;         // [m, aux_ld] row-major, aux_type
  int64_t aux_ld = 0;          // elements; a multiple of 8
  GemmDType aux_type = GemmDType::kF32;
};

// Checks GemmArgs for what cuBLASLt would reject or silently misread (null
// operands, epilogue without its bias/aux, aux_ld not a multiple of 8, fp32
// inputs with bf16 output) and returns the key; host-only.
absl::StatusOr<GemmKey> MakeGemmKey(const GemmArgs& args);

// cuBLASLt documents a bias epilogue's vector as having the output's type
// (int8 and fp8 kernels aside), so a bf16 output with an fp32 bias — the
// model's qkv projection: bf16 activations, fp32 master bias — may have no
// algorithm (CublasLtGemm::Run then says UNIMPLEMENTED). This is the same
// problem with an fp32 output into `fp32_out` (contiguous [m, n]), which
// cuBLASLt supports; casting that to bf16 rounds once, as the fused epilogue
// would (fp32 sum plus bias, one rounding) and as the CPU reference does.
// INVALID_ARGUMENT unless `args` is such a GEMM (bias epilogue with an fp32
// bias, bf16 output, not batched, ldc = n, β = 0).
absl::StatusOr<GemmArgs> WithFp32BiasOutput(const GemmArgs& args, void* fp32_out);


// ----------------------------------------------------------------- bfloat16

// fp32 ↔ bf16 bits (round to nearest even, as __float2bfloat16_rn): the one
// definition in kernels/bfloat16.h, shared with the CPU reference kernels.
using kernels::Bf16BitsToFloat;
using kernels::FloatToBf16Bits;

}  // namespace baton::cuda

#endif  // BATON_KERNELS_CUDA_PLAN_H_
