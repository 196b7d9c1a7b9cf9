#include "kernels/cuda/gemm.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cublaslt_loader.h"
#include "kernels/cuda/cuda_status.h"

namespace baton::cuda {
namespace {

absl::Status LtStatus(cublasStatus_t s, const char* expr, const GemmKey* key) {
  if (s == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(expr, " failed: ", cublasLtGetStatusName(s), ": ",
                                          cublasLtGetStatusString(s),
                                          key != nullptr ? " for " + GemmKeyToString(*key) : ""));
}

#define BATON_LT_RETURN_IF_ERROR(expr, key)                      \
  do {                                                           \
    absl::Status baton_lt_status_ = LtStatus((expr), #expr, key); \
    if (!baton_lt_status_.ok()) return baton_lt_status_;         \
  } while (0)

cudaDataType_t CudaType(GemmDType t) { return t == GemmDType::kBF16 ? CUDA_R_16BF : CUDA_R_32F; }

cublasLtEpilogue_t LtEpilogue(GemmEpilogue e) {
  switch (e) {
    case GemmEpilogue::kBias:
      return CUBLASLT_EPILOGUE_BIAS;
    case GemmEpilogue::kGeluAux:
      return CUBLASLT_EPILOGUE_GELU_AUX;
    case GemmEpilogue::kGeluAuxBias:
      return CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    case GemmEpilogue::kDGelu:
      return CUBLASLT_EPILOGUE_DGELU;
    case GemmEpilogue::kNone:
      break;
  }
  return CUBLASLT_EPILOGUE_DEFAULT;
}

// Descriptors of one call, destroyed with it.
struct Descriptors {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~Descriptors() {
    if (pref != nullptr) cublasLtMatmulPreferenceDestroy(pref);
    if (c != nullptr) cublasLtMatrixLayoutDestroy(c);
    if (b != nullptr) cublasLtMatrixLayoutDestroy(b);
    if (a != nullptr) cublasLtMatrixLayoutDestroy(a);
    if (op != nullptr) cublasLtMatmulDescDestroy(op);
  }
};

absl::Status MakeLayout(cublasLtMatrixLayout_t* layout, cudaDataType_t type, int64_t rows,
                        int64_t cols, int64_t ld, int64_t batch, int64_t stride,
                        const GemmKey* key) {
  BATON_LT_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(layout, type, static_cast<uint64_t>(rows),
                                                      static_cast<uint64_t>(cols), ld),
                           key);
  if (batch > 1) {
    const int32_t count = static_cast<int32_t>(batch);
    BATON_LT_RETURN_IF_ERROR(cublasLtMatrixLayoutSetAttribute(*layout,
                                                              CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                                                              &count, sizeof(count)),
                             key);
    BATON_LT_RETURN_IF_ERROR(
        cublasLtMatrixLayoutSetAttribute(*layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                         &stride, sizeof(stride)),
        key);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<CublasLtGemm>> CublasLtGemm::CreateWithWorkspace(
    void* workspace, size_t workspace_bytes) {
  if (absl::Status loaded = LoadCublasLt(); !loaded.ok()) return loaded;
  cublasLtHandle_t handle = nullptr;
  BATON_LT_RETURN_IF_ERROR(cublasLtCreate(&handle), nullptr);
  auto gemm = std::unique_ptr<CublasLtGemm>(new CublasLtGemm(handle, workspace, workspace_bytes));
  gemm->owns_workspace_ = false;
  return gemm;
}

absl::StatusOr<std::unique_ptr<CublasLtGemm>> CublasLtGemm::Create(size_t workspace_bytes) {
  if (absl::Status loaded = LoadCublasLt(); !loaded.ok()) return loaded;
  cublasLtHandle_t handle = nullptr;
  BATON_LT_RETURN_IF_ERROR(cublasLtCreate(&handle), nullptr);
  void* workspace = nullptr;
  if (workspace_bytes > 0) {
    cudaError_t err = cudaMalloc(&workspace, workspace_bytes);
    if (err != cudaSuccess) {
      cublasLtDestroy(handle);
      return CudaStatus(err, "cudaMalloc(cuBLASLt workspace)", __FILE__, __LINE__);
    }
  }
  return std::unique_ptr<CublasLtGemm>(new CublasLtGemm(handle, workspace, workspace_bytes));
}

CublasLtGemm::~CublasLtGemm() {
  if (owns_workspace_ && workspace_ != nullptr) cudaFree(workspace_);
  cublasLtDestroy(handle_);
}

absl::Status CublasLtGemm::Run(const GemmArgs& args, cudaStream_t stream) {
  absl::StatusOr<GemmKey> key_or = MakeGemmKey(args);
  if (!key_or.ok()) return key_or.status();
  const GemmKey& key = *key_or;
  const LtGemm& lt = key.shape;
  if (cache_.IsUnsupported(key)) {
    return absl::UnimplementedError(
        absl::StrCat("cuBLASLt has no algorithm for ", GemmKeyToString(key)));
  }

  Descriptors d;
  BATON_LT_RETURN_IF_ERROR(cublasLtMatmulDescCreate(&d.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), &key);
  const cublasOperation_t ta = lt.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t tb = lt.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  BATON_LT_RETURN_IF_ERROR(
      cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)), &key);
  BATON_LT_RETURN_IF_ERROR(
      cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)), &key);
  const cublasLtEpilogue_t epilogue = LtEpilogue(args.epilogue);
  BATON_LT_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_EPILOGUE,
                                                          &epilogue, sizeof(epilogue)),
                           &key);
  if (args.bias != nullptr) {
    BATON_LT_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                            &args.bias, sizeof(args.bias)),
                             &key);
    const int32_t bias_type = CudaType(args.bias_type);
    BATON_LT_RETURN_IF_ERROR(
        cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type,
                                       sizeof(bias_type)),
        &key);
  }
  if (args.aux != nullptr) {
    BATON_LT_RETURN_IF_ERROR(
        cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &args.aux,
                                       sizeof(args.aux)),
        &key);
    const int64_t aux_ld = args.aux_ld;
    BATON_LT_RETURN_IF_ERROR(
        cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld,
                                       sizeof(aux_ld)),
        &key);
    const int32_t aux_type = CudaType(args.aux_type);
    BATON_LT_RETURN_IF_ERROR(
        cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE,
                                       &aux_type, sizeof(aux_type)),
        &key);
  }

  // cuBLASLt's A is the caller's B and vice versa (plan.h).
  const cudaDataType_t ab = CudaType(args.ab_type);
  absl::Status s = MakeLayout(&d.a, ab, lt.a_rows, lt.a_cols, lt.lda, lt.batch, lt.stride_a, &key);
  if (s.ok()) s = MakeLayout(&d.b, ab, lt.b_rows, lt.b_cols, lt.ldb, lt.batch, lt.stride_b, &key);
  if (s.ok()) {
    s = MakeLayout(&d.c, CudaType(args.c_type), lt.c_rows, lt.c_cols, lt.ldc, lt.batch,
                   lt.stride_c, &key);
  }
  if (!s.ok()) return s;

  const cublasLtMatmulAlgo_t* algo = cache_.Find(key);
  cublasLtMatmulAlgo_t chosen;
  if (algo == nullptr) {
    BATON_LT_RETURN_IF_ERROR(cublasLtMatmulPreferenceCreate(&d.pref), &key);
    const uint64_t ws = workspace_bytes_;
    BATON_LT_RETURN_IF_ERROR(
        cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                             sizeof(ws)),
        &key);
    // The operands' real alignment (plan.h GemmKey), not cuBLASLt's default 256.
    const uint32_t align = key.alignment;
    for (cublasLtMatmulPreferenceAttributes_t attr :
         {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
      BATON_LT_RETURN_IF_ERROR(
          cublasLtMatmulPreferenceSetAttribute(d.pref, attr, &align, sizeof(align)), &key);
    }
    const uint32_t schemes = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    BATON_LT_RETURN_IF_ERROR(
        cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                             &schemes, sizeof(schemes)),
        &key);
    cublasLtMatmulHeuristicResult_t result = {};
    int found = 0;
    const cublasStatus_t heuristic = cublasLtMatmulAlgoGetHeuristic(
        handle_, d.op, d.a, d.b, d.c, d.c, d.pref, 1, &result, &found);
    // No algorithm for this combination (e.g. a bias type other than the
    // output's): UNIMPLEMENTED, remembered, so that a caller with another
    // form of the problem (plan.h WithFp32BiasOutput) takes it every time.
    if (heuristic == CUBLAS_STATUS_NOT_SUPPORTED || heuristic == CUBLAS_STATUS_INVALID_VALUE ||
        (heuristic == CUBLAS_STATUS_SUCCESS && found == 0)) {
      cache_.MarkUnsupported(key);
      const std::string status = heuristic == CUBLAS_STATUS_SUCCESS
                                     ? ""
                                     : absl::StrCat(" (", cublasLtGetStatusName(heuristic), ")");
      return absl::UnimplementedError(
          absl::StrCat("cuBLASLt has no algorithm for ", GemmKeyToString(key), status));
    }
    BATON_LT_RETURN_IF_ERROR(heuristic, &key);
    absl::Status inserted = cache_.Insert(key, result.algo);
    if (!inserted.ok()) return inserted;
    chosen = result.algo;
    algo = &chosen;
  }
  // C and D are the same buffer: D = α·op(A)op(B) + β·C in place.
  BATON_LT_RETURN_IF_ERROR(cublasLtMatmul(handle_, d.op, &args.alpha, args.b, d.a, args.a, d.b,
                                          &args.beta, args.c, d.c, args.c, d.c, algo, workspace_,
                                          workspace_bytes_, stream),
                           &key);
  return absl::OkStatus();
}

}  // namespace baton::cuda
