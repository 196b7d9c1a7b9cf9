#include "kernels/cuda/cudnn_attention.h"

#include <cudnn_frontend.h>
#include <dlfcn.h>

#include <algorithm>
#include <exception>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/open_library.h"

// The frontend, built with NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING, reaches
// cuDNN through this handle (dlsym); LoadCudnn sets it.
namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;
}  // namespace cudnn_frontend

namespace baton::cuda {
namespace {

namespace fe = cudnn_frontend;

// Tensor uids of the graphs' variant packs.
enum : int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV };

struct Loaded {
  absl::Status status;
};

Loaded& LoadOnce() {
  static Loaded* loaded = [] {
    auto* l = new Loaded();  // never destroyed: handles may outlive static destructors
    const std::string name = absl::StrCat("libcudnn.so.", CUDNN_MAJOR);
    std::string error;
    void* handle = OpenCudaLibrary(name, &error);
    if (handle == nullptr) {
      l->status = absl::UnavailableError(absl::StrCat(
          "cannot load ", name, " (cuDNN, for fused bf16 attention): ", error, "; install cuDNN ",
          CUDNN_MAJOR, " for CUDA ", CUDART_VERSION / 1000,
          " or add its directory to LD_LIBRARY_PATH (attention then runs as GEMMs + softmax)"));
      return l;
    }
    if (dlsym(handle, "cudnnGetVersion") == nullptr) {
      l->status = absl::UnavailableError(absl::StrCat(name, " has no cudnnGetVersion"));
      return l;
    }
    fe::cudnn_dlhandle = handle;
    return l;
  }();
  return *loaded;
}

// The shape, for errors.
std::string Describe(const SdpaPlan& plan) {
  const AttentionShard& s = plan.shard;
  return absl::StrCat("B=", s.batch, " T=", s.seq, " H'=", s.heads, " hd=", s.head_dim);
}
std::string Describe(const RingSdpaPlan& plan) {
  const RingSdpaBlock& b = plan.block;
  return absl::StrCat("context-parallel block B=", b.batch, " Tq=", b.q_len, " Tk=", b.k_len,
                      " H'=", b.heads, " hd=", plan.head_dim,
                      plan.causal ? ", causal" : ", unmasked");
}

// The frontend's error with what was being done and the shape.
template <typename Plan>
absl::Status FeStatus(fe::error_t e, const char* what, const Plan& plan) {
  if (e.is_good()) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat("cuDNN ", what, " (", Describe(plan), "): ", e.get_message()));
}

std::vector<int64_t> Vec(const std::array<int64_t, 4>& a) { return {a.begin(), a.end()}; }

std::shared_ptr<fe::graph::Tensor_attributes> Input(fe::graph::Graph& g, const char* name,
                                                    int64_t uid, const SdpaTensor& t) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim(Vec(t.dim))
                      .set_stride(Vec(t.stride)));
}

void Output(const std::shared_ptr<fe::graph::Tensor_attributes>& t, int64_t uid,
            const SdpaTensor& layout) {
  t->set_output(true).set_uid(uid).set_dim(Vec(layout.dim)).set_stride(Vec(layout.stride));
}

void SetTypes(fe::graph::Graph& g) {
  g.set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
}

// validate → operation graph → heuristics (mode A, fallback) without
// non-deterministic engines → support check → the first plan that builds.
template <typename Plan>
absl::StatusOr<int64_t> Finish(fe::graph::Graph& g, cudnnHandle_t handle, const Plan& plan,
                               const char* what) {
  BATON_RETURN_IF_ERROR(FeStatus(g.validate(), what, plan));
  BATON_RETURN_IF_ERROR(FeStatus(g.build_operation_graph(handle), what, plan));
  BATON_RETURN_IF_ERROR(FeStatus(
      g.create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}), what, plan));
  g.deselect_numeric_notes({fe::NumericalNote_t::NONDETERMINISTIC});
  BATON_RETURN_IF_ERROR(FeStatus(g.check_support(handle), what, plan));
  BATON_RETURN_IF_ERROR(
      FeStatus(g.build_plans(handle, fe::BuildPlanPolicy_t::HEURISTICS_CHOICE), what, plan));
  int64_t ws = 0;
  BATON_RETURN_IF_ERROR(FeStatus(g.get_workspace_size(ws), what, plan));
  if (ws < 0) return absl::InternalError(absl::StrCat("cuDNN ", what, ": negative workspace"));
  return ws;
}

char* At(void* base, int64_t elements) { return static_cast<char*>(base) + elements * 2; }
char* At(const void* base, int64_t elements) {
  return const_cast<char*>(static_cast<const char*>(base)) + elements * 2;
}

absl::Status CheckWorkspace(int64_t need, size_t have, const char* what) {
  if (static_cast<size_t>(need) <= have) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("cuDNN ", what, " needs a ", need,
                                                 "-byte workspace; given ", have,
                                                 " (size it with Prepare)"));
}

// Runs `graph` on `stream` with the variant pack `pack`.
template <typename Plan>
absl::Status Execute(fe::graph::Graph& graph, cudnnHandle_t handle,
                     std::unordered_map<int64_t, void*>& pack, void* workspace,
                     cudaStream_t stream, const char* what, const Plan& plan) {
  try {
    const cudnnStatus_t s = fe::detail::set_stream(handle, stream);
    if (s != CUDNN_STATUS_SUCCESS) {
      return absl::InternalError(
          absl::StrCat("cudnnSetStream: ", fe::detail::get_error_string(s)));
    }
    return FeStatus(graph.execute(handle, pack, workspace), what, plan);
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("cuDNN ", what, ": ", e.what()));
  }
}

// The variant pack's pointer for `t` in the bf16 buffer `base`.
void* At(const void* base, const SdpaTensor& t) { return At(base, t.offset); }

// The graphs cached under `key`, built by `build` on first use; a failed
// build is cached too, and its status returned every time. `what` names the
// key in errors.
template <typename Cache, typename Key, typename Build>
auto FindOrBuild(Cache& cache, const Key& key, const std::string& what, Build build)
    -> absl::StatusOr<typename Cache::mapped_type::element_type*> {
  using Graphs = typename Cache::mapped_type::element_type;
  auto it = cache.find(key);
  if (it != cache.end()) {
    if (!it->second->status.ok()) return it->second->status;
    return it->second.get();
  }
  auto graphs = std::make_unique<Graphs>();
  absl::Status s;
  try {
    s = build(*graphs);
  } catch (const std::exception& e) {
    s = absl::InternalError(absl::StrCat("cuDNN SDPA graphs for ", what, ": ", e.what()));
  }
  graphs->status = s;
  Graphs* g = graphs.get();
  cache.emplace(key, std::move(graphs));
  if (!s.ok()) return s;
  return g;
}

}  // namespace

struct CudnnAttention::Graphs {
  absl::Status status;  // not OK: cuDNN cannot run this shape (cached verdict)
  fe::graph::Graph forward, backward;
  int64_t forward_workspace = 0, backward_workspace = 0;
  // Variant packs (uid → pointer), kept so that a step assigns pointers to
  // existing entries instead of building a map on the heap each call.
  std::unordered_map<int64_t, void*> forward_pack, backward_pack;
};

absl::Status LoadCudnn() { return LoadOnce().status; }

absl::Status ProbeCudnnAttention(int device) {
  int major = 0, minor = 0;
  cudaError_t err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  }
  if (err != cudaSuccess) {
    cudaGetLastError();  // not sticky; keep it from the next launch check
    return absl::UnavailableError(absl::StrCat("cuda:", device, "'s compute capability: ",
                                               cudaGetErrorName(err), ": ", cudaGetErrorString(err)));
  }
  if (major < kSdpaMinComputeCapabilityMajor) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cuDNN's fused attention needs compute capability ", kSdpaMinComputeCapabilityMajor,
        ".0 or newer; cuda:", device, " is ", major, ".", minor));
  }
  return LoadCudnn();
}

absl::StatusOr<std::unique_ptr<CudnnAttention>> CudnnAttention::Create(int device) {
  BATON_RETURN_IF_ERROR(LoadCudnn());
  cudnnHandle_t handle = nullptr;
  cudnnStatus_t s = CUDNN_STATUS_SUCCESS;
  try {
    s = fe::detail::create_handle(&handle);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("cudnnCreate on cuda:", device, ": ", e.what()));
  }
  if (s != CUDNN_STATUS_SUCCESS) {
    return absl::UnavailableError(absl::StrCat("cudnnCreate on cuda:", device, ": ",
                                               fe::detail::get_error_string(s)));
  }
  return std::unique_ptr<CudnnAttention>(new CudnnAttention(handle, device));
}

CudnnAttention::CudnnAttention(cudnnContext* handle, int device)
    : handle_(handle), device_(device) {}

CudnnAttention::~CudnnAttention() {
  cache_.clear();
  ring_cache_.clear();
  if (handle_ != nullptr) (void)fe::detail::destroy_handle(handle_);
}

absl::StatusOr<CudnnAttention::Graphs*> CudnnAttention::Find(const SdpaPlan& plan) {
  const SdpaKey key = MakeSdpaKey(plan.shard, device_);
  auto build = [&](Graphs& graphs) -> absl::Status {
    {
      fe::graph::Graph& g = graphs.forward;
      SetTypes(g);
      auto q = Input(g, "Q", kQ, plan.q);
      auto k = Input(g, "K", kK, plan.k);
      auto v = Input(g, "V", kV, plan.v);
      auto [o, stats] = g.sdpa(q, k, v,
                               fe::graph::SDPA_attributes()
                                   .set_name("causal_sdpa")
                                   .set_generate_stats(true)
                                   .set_causal_mask(true)
                                   .set_attn_scale(plan.scale));
      Output(o, kO, plan.o);
      Output(stats, kStats, plan.stats);
      stats->set_data_type(fe::DataType_t::FLOAT);
      BATON_ASSIGN_OR_RETURN(graphs.forward_workspace, Finish(g, handle_, plan, "SDPA forward"));
    }
    {
      fe::graph::Graph& g = graphs.backward;
      SetTypes(g);
      auto q = Input(g, "Q", kQ, plan.q);
      auto k = Input(g, "K", kK, plan.k);
      auto v = Input(g, "V", kV, plan.v);
      auto o = Input(g, "O", kO, plan.o);
      auto d_o = Input(g, "dO", kDO, plan.o);
      auto stats = Input(g, "Stats", kStats, plan.stats);
      stats->set_data_type(fe::DataType_t::FLOAT);
      auto [dq, dk, dv] = g.sdpa_backward(q, k, v, o, d_o, stats,
                                          fe::graph::SDPA_backward_attributes()
                                              .set_name("causal_sdpa_backward")
                                              .set_causal_mask(true)
                                              .set_attn_scale(plan.scale)
                                              .set_deterministic_algorithm(true));
      Output(dq, kDQ, plan.q);
      Output(dk, kDK, plan.k);
      Output(dv, kDV, plan.v);
      BATON_ASSIGN_OR_RETURN(graphs.backward_workspace,
                             Finish(g, handle_, plan, "SDPA backward"));
    }
    const size_t ws = static_cast<size_t>(
        std::max(graphs.forward_workspace, graphs.backward_workspace));
    return CheckSdpaWorkspace(ws, plan.shard);
  };
  return FindOrBuild(cache_, key, SdpaKeyToString(key), build);
}

absl::StatusOr<size_t> CudnnAttention::Prepare(const SdpaPlan& plan) {
  BATON_ASSIGN_OR_RETURN(Graphs * g, Find(plan));
  return static_cast<size_t>(std::max(g->forward_workspace, g->backward_workspace));
}

absl::Status CudnnAttention::Forward(const SdpaPlan& plan, void* out, float* stats,
                                     const void* qkv, void* workspace, size_t workspace_bytes,
                                     cudaStream_t stream) {
  BATON_ASSIGN_OR_RETURN(Graphs * g, Find(plan));
  BATON_RETURN_IF_ERROR(CheckWorkspace(g->forward_workspace, workspace_bytes, "SDPA forward"));
  std::unordered_map<int64_t, void*>& pack = g->forward_pack;
  pack[kQ] = At(qkv, plan.q.offset);
  pack[kK] = At(qkv, plan.k.offset);
  pack[kV] = At(qkv, plan.v.offset);
  pack[kO] = At(out, plan.o.offset);
  pack[kStats] = stats;
  return Execute(g->forward, handle_, pack, workspace, stream, "SDPA forward", plan);
}

absl::Status CudnnAttention::Backward(const SdpaPlan& plan, void* dqkv, const void* dout,
                                      const void* qkv, const void* out, const float* stats,
                                      void* workspace, size_t workspace_bytes,
                                      cudaStream_t stream) {
  BATON_ASSIGN_OR_RETURN(Graphs * g, Find(plan));
  BATON_RETURN_IF_ERROR(CheckWorkspace(g->backward_workspace, workspace_bytes, "SDPA backward"));
  std::unordered_map<int64_t, void*>& pack = g->backward_pack;
  pack[kQ] = At(qkv, plan.q.offset);
  pack[kK] = At(qkv, plan.k.offset);
  pack[kV] = At(qkv, plan.v.offset);
  pack[kO] = At(out, plan.o.offset);
  pack[kDO] = At(dout, plan.o.offset);
  pack[kStats] = const_cast<float*>(stats);
  pack[kDQ] = At(dqkv, plan.q.offset);
  pack[kDK] = At(dqkv, plan.k.offset);
  pack[kDV] = At(dqkv, plan.v.offset);
  return Execute(g->backward, handle_, pack, workspace, stream, "SDPA backward", plan);
}

// ------------------------------------- context-parallel (ring) blocks

absl::StatusOr<CudnnAttention::Graphs*> CudnnAttention::FindRing(const RingSdpaPlan& plan) {
  const RingSdpaKey key = MakeRingSdpaKey(plan, device_);
  auto build = [&](Graphs& graphs) -> absl::Status {
    {
      fe::graph::Graph& g = graphs.forward;
      SetTypes(g);
      auto q = Input(g, "Q", kQ, plan.q);
      auto k = Input(g, "K", kK, plan.k);
      auto v = Input(g, "V", kV, plan.v);
      fe::graph::SDPA_attributes attributes;
      attributes.set_name("ring_block_sdpa").set_generate_stats(true).set_attn_scale(plan.scale);
      if (plan.causal) attributes.set_causal_mask(true);  // top-left: the diagonal block
      auto [o, stats] = g.sdpa(q, k, v, attributes);
      Output(o, kO, plan.o);
      Output(stats, kStats, plan.stats);
      stats->set_data_type(fe::DataType_t::FLOAT);
      BATON_ASSIGN_OR_RETURN(graphs.forward_workspace,
                             Finish(g, handle_, plan, "ring SDPA forward"));
    }
    {
      fe::graph::Graph& g = graphs.backward;
      SetTypes(g);
      auto q = Input(g, "Q", kQ, plan.q);
      auto k = Input(g, "K", kK, plan.k);
      auto v = Input(g, "V", kV, plan.v);
      auto o = Input(g, "O", kO, plan.o);
      auto d_o = Input(g, "dO", kDO, plan.o);
      auto stats = Input(g, "Stats", kStats, plan.stats);
      stats->set_data_type(fe::DataType_t::FLOAT);
      fe::graph::SDPA_backward_attributes attributes;
      attributes.set_name("ring_block_sdpa_backward")
          .set_attn_scale(plan.scale)
          .set_deterministic_algorithm(true);
      if (plan.causal) attributes.set_causal_mask(true);
      auto [dq, dk, dv] = g.sdpa_backward(q, k, v, o, d_o, stats, attributes);
      Output(dq, kDQ, plan.o);  // the dq temporary: o's layout
      Output(dk, kDK, plan.k);  // the dk|dv temporary: kv's layout
      Output(dv, kDV, plan.v);
      BATON_ASSIGN_OR_RETURN(graphs.backward_workspace,
                             Finish(g, handle_, plan, "ring SDPA backward"));
    }
    return CheckRingSdpaWorkspace(
        static_cast<size_t>(std::max(graphs.forward_workspace, graphs.backward_workspace)),
        plan.block);
  };
  return FindOrBuild(ring_cache_, key, RingSdpaKeyToString(key), build);
}

absl::StatusOr<RingSdpaWorkspace> CudnnAttention::PrepareRing(const RingSdpaPlan& plan) {
  BATON_ASSIGN_OR_RETURN(Graphs * g, FindRing(plan));
  RingSdpaWorkspace w;
  w.forward = static_cast<size_t>(g->forward_workspace);
  w.backward = static_cast<size_t>(g->backward_workspace);
  return w;
}

absl::Status CudnnAttention::RingForward(const RingSdpaPlan& plan, void* out, float* stats,
                                         const void* qkv, const void* kv, void* workspace,
                                         size_t workspace_bytes, cudaStream_t stream) {
  BATON_ASSIGN_OR_RETURN(Graphs * g, FindRing(plan));
  BATON_RETURN_IF_ERROR(
      CheckWorkspace(g->forward_workspace, workspace_bytes, "ring SDPA forward"));
  std::unordered_map<int64_t, void*>& pack = g->forward_pack;
  pack[kQ] = At(qkv, plan.q);
  pack[kK] = At(kv, plan.k);
  pack[kV] = At(kv, plan.v);
  pack[kO] = At(out, plan.o);
  pack[kStats] = stats;
  return Execute(g->forward, handle_, pack, workspace, stream, "ring SDPA forward", plan);
}

absl::Status CudnnAttention::RingBackward(const RingSdpaPlan& plan, void* dq, void* dkv,
                                          const void* dout, const void* out, const void* qkv,
                                          const void* kv, const float* stats, void* workspace,
                                          size_t workspace_bytes, cudaStream_t stream) {
  BATON_ASSIGN_OR_RETURN(Graphs * g, FindRing(plan));
  BATON_RETURN_IF_ERROR(
      CheckWorkspace(g->backward_workspace, workspace_bytes, "ring SDPA backward"));
  std::unordered_map<int64_t, void*>& pack = g->backward_pack;
  pack[kQ] = At(qkv, plan.q);
  pack[kK] = At(kv, plan.k);
  pack[kV] = At(kv, plan.v);
  pack[kO] = At(out, plan.o);
  pack[kDO] = At(dout, plan.o);
  pack[kStats] = const_cast<float*>(stats);
  pack[kDQ] = At(dq, plan.o);
  pack[kDK] = At(dkv, plan.k);
  pack[kDV] = At(dkv, plan.v);
  return Execute(g->backward, handle_, pack, workspace, stream, "ring SDPA backward", plan);
}

}  // namespace baton::cuda
