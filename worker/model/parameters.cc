#include "worker/model/parameters.h"

#include <cmath>
#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace baton::model {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

uint64_t Fnv1a(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ULL;
  return h;
}

// A uniform double in (0, 1) from 53 random bits.
double Uniform(uint64_t bits) {
  return (static_cast<double>(bits >> 11) + 0.5) / 9007199254740992.0;
}

}  // namespace

ShardSpec ShardSpec::Rows(int64_t rows, int64_t cols) { return ShardSpec{1, rows, cols, false, 0}; }
ShardSpec ShardSpec::QkvRows(int64_t c, int64_t cols) { return ShardSpec{3, c, cols, false, 0}; }
ShardSpec ShardSpec::Columns(int64_t rows, int64_t cols) {
  return ShardSpec{rows, cols, 1, false, 1};
}
ShardSpec ShardSpec::Replicated(int64_t numel) { return ShardSpec{1, numel, 1, true, 0}; }

int64_t LocalElements(const ShardSpec& s, int size) {
  return s.outer * (s.replicated ? s.split : s.split / size) * s.inner;
}

namespace {

// Copies shard `rank` between full and local; to_local picks the direction.
void CopyShard(const ShardSpec& s, int rank, int size, float* full, float* local, bool to_local) {
  const int64_t parts = s.replicated ? 1 : size;
  const int64_t piece = s.split / parts;
  const int64_t begin = s.replicated ? 0 : rank * piece;
  const size_t run = sizeof(float) * piece * s.inner;
  for (int64_t o = 0; o < s.outer; ++o) {
    float* f = full + (o * s.split + begin) * s.inner;
    float* l = local + o * piece * s.inner;
    if (to_local) {
      std::memcpy(l, f, run);
    } else {
      std::memcpy(f, l, run);
    }
  }
}

}  // namespace

void ExtractShard(const ShardSpec& shard, int rank, int size, const float* full, float* local) {
  CopyShard(shard, rank, size, const_cast<float*>(full), local, /*to_local=*/true);
}

void InsertShard(const ShardSpec& shard, int rank, int size, const float* local, float* full) {
  CopyShard(shard, rank, size, full, const_cast<float*>(local), /*to_local=*/false);
}

void FillNormal(uint64_t seed, const std::string& name, float std, float* out, int64_t n) {
  const uint64_t key = SplitMix64(seed ^ Fnv1a(name));
  for (int64_t i = 0; i < n; ++i) {
    // Box–Muller on two counter-derived uniforms.
    const double u1 = Uniform(SplitMix64(key + 2 * static_cast<uint64_t>(i)));
    const double u2 = Uniform(SplitMix64(key + 2 * static_cast<uint64_t>(i) + 1));
    const double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
    out[i] = static_cast<float>(z * std);
  }
}

namespace {

// Runs `copy` (host <-> device) on a stream of its own and waits for it.
absl::Status CopyAndWait(kernels::Device device, const kernels::Tensor& dst,
                         const kernels::Tensor& src) {
  absl::StatusOr<std::unique_ptr<kernels::Stream>> stream = kernels::Stream::Create(device);
  if (!stream.ok()) return stream.status();
  kernels::Copy(kernels::ExecContext::On(stream->get()), dst, src);
  return (*stream)->Synchronize();
}

}  // namespace

absl::StatusOr<std::vector<float>> ParameterStore::ToHost(const kernels::Tensor& t) {
  std::vector<float> out(t.numel());
  kernels::Tensor host = kernels::Tensor::View(out.data(), {t.numel()});
  if (t.device().is_cpu()) {
    std::memcpy(out.data(), t.f32(), t.bytes());
  } else {
    BATON_RETURN_IF_ERROR_CTX(CopyAndWait(t.device(), host, t), "copying ", t.numel(), " values from ",
                              kernels::DeviceToString(t.device()), " to the host");
  }
  return out;
}

DpShard DpShard::Of(int64_t elements, int rank, int size) {
  DpShard shard;
  shard.elements = elements;
  if (size <= 1) {
    shard.count = elements;
    return shard;
  }
  constexpr int64_t kAlign = 16;  // elements: 64 bytes of fp32
  const int64_t per_rank = (elements + size - 1) / size;
  shard.rank = rank;
  shard.size = size;
  shard.count = (per_rank + kAlign - 1) / kAlign * kAlign;
  shard.begin = rank * shard.count;
  return shard;
}

absl::Status ParameterStore::ShardOverDp(int dp_rank, int dp_size) {
  if (grads_.defined()) {
    return absl::FailedPreconditionError("ShardOverDp: the parameters are placed already; shard them before Place");
  }
  if (dp_size < 1 || dp_rank < 0 || dp_rank >= dp_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("ShardOverDp: data-parallel rank ", dp_rank, " is outside a group of ", dp_size));
  }
  dp_shard_ = DpShard::Of(values_.numel(), dp_rank, dp_size);
  return absl::OkStatus();
}

kernels::Tensor ParameterStore::shard_values() const {
  if (!padded_values_.defined()) return kernels::Tensor();
  return padded_values_.Rows(dp_shard_.begin, dp_shard_.begin + dp_shard_.count);
}

ParameterStore::MemoryBytes ParameterStore::memory_bytes() const {
  auto bytes = [](const kernels::Tensor& t) { return t.defined() ? static_cast<int64_t>(t.bytes()) : int64_t{0}; };
  MemoryBytes m;
  m.weights = (dp_shard_.sharded() ? bytes(padded_values_) : bytes(values_)) + bytes(values_bf16_);
  m.grads = (dp_shard_.sharded() ? bytes(padded_grads_) : bytes(grads_)) + bytes(shard_grads_);
  m.optimizer = bytes(adam_m_) + bytes(adam_v_);
  return m;
}

absl::Status ParameterStore::Place(kernels::Device device) {
  if (grads_.defined()) {
    if (device == values_.device()) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat("the parameters are on ", kernels::DeviceToString(values_.device()),
                                                      " already; they cannot move to ",
                                                      kernels::DeviceToString(device)));
  }
  const int64_t total = values_.numel();
  const bool sharded = dp_shard_.sharded();
  // Sharded: values and gradients padded to the DP group's whole shards, the
  // moments of this rank's shard only.
  const int64_t flat = sharded ? dp_shard_.padded() : total;
  const int64_t moments = sharded ? dp_shard_.count : total;
  auto bytes = [](int64_t n) { return absl::StrCat(" (", n * 4, " bytes)"); };
  kernels::Tensor values = values_;
  kernels::Tensor padded_values;
  if (device != values_.device() || sharded) {
    absl::StatusOr<kernels::Tensor> placed = kernels::ZerosOn(device, {flat});
    if (!placed.ok()) return WithContext(placed.status(), absl::StrCat("the parameter values", bytes(flat)));
    if (sharded) padded_values = *placed;
    values = placed->Rows(0, total);
    BATON_RETURN_IF_ERROR(CopyAndWait(device, values, values_));
  }
  kernels::Tensor zeroed[4];  // gradients, AdamW first and second moments, the shard's gradients
  const char* what[4] = {"the gradients", "the AdamW first moments", "the AdamW second moments",
                         "the data-parallel shard's gradients"};
  const int64_t counts[4] = {flat, moments, moments, sharded ? dp_shard_.count : 0};
  for (int i = 0; i < 4; ++i) {
    if (counts[i] == 0 && i == 3) continue;
    absl::StatusOr<kernels::Tensor> placed = kernels::ZerosOn(device, {counts[i]});
    if (!placed.ok()) return WithContext(placed.status(), absl::StrCat(what[i], bytes(counts[i])));
    zeroed[i] = *std::move(placed);
  }
  values_ = std::move(values);
  if (sharded) {
    padded_values_ = std::move(padded_values);
    padded_grads_ = zeroed[0];
    grads_ = zeroed[0].Rows(0, total);
    shard_grads_ = std::move(zeroed[3]);
  } else {
    grads_ = std::move(zeroed[0]);
  }
  adam_m_ = std::move(zeroed[1]);
  adam_v_ = std::move(zeroed[2]);
  BindViews();
  return absl::OkStatus();
}

absl::StatusOr<ParameterStore> ParameterStore::Create(std::vector<ParameterSpec> specs, int tp_rank, int tp_size) {
  int64_t total = 0;
  for (const ParameterSpec& spec : specs) total += LocalElements(spec.shard, tp_size);
  absl::StatusOr<kernels::Tensor> values = kernels::ZerosOn(kernels::Device::Cpu(), {total});
  if (!values.ok()) {
    return WithContext(values.status(), absl::StrCat("the parameter values (", total * 4, " bytes)"));
  }
  return ParameterStore(std::move(specs), *std::move(values), tp_rank, tp_size);
}

ParameterStore::ParameterStore(std::vector<ParameterSpec> specs, kernels::Tensor values, int tp_rank, int tp_size)
    : values_(std::move(values)), tp_rank_(tp_rank), tp_size_(tp_size) {
  dp_shard_ = DpShard::Of(values_.numel(), 0, 1);
  for (ParameterSpec& spec : specs) {
    Parameter p;
    p.spec = std::move(spec);
    params_.push_back(std::move(p));
  }
  BindViews();
}

void ParameterStore::BindViews() {
  int64_t offset = 0;
  for (Parameter& p : params_) {
    // The local shape: the full shape with the split dimension divided.
    kernels::Shape local = p.spec.full_shape;
    if (!p.spec.shard.replicated) local[p.spec.shard.dim] /= tp_size_;
    const int64_t n = kernels::NumElements(local);
    auto view = [&](const kernels::Tensor& flat) {
      return flat.defined() ? flat.Rows(offset, offset + n).Reshaped(local) : kernels::Tensor();
    };
    p.offset = offset;
    p.value = view(values_);
    p.grad = view(grads_);
    p.adam_m = dp_shard_.sharded() ? kernels::Tensor() : view(adam_m_);
    p.adam_v = dp_shard_.sharded() ? kernels::Tensor() : view(adam_v_);
    offset += n;
  }
}

void ParameterStore::Initialize(uint64_t seed) {
  std::vector<float> full;
  for (Parameter& p : params_) {
    const int64_t n = kernels::NumElements(p.spec.full_shape);
    full.assign(n, 0.0f);
    switch (p.spec.init) {
      case InitKind::kNormal:
        FillNormal(seed, p.spec.name, p.spec.init_std, full.data(), n);
        break;
      case InitKind::kOnes:
        full.assign(n, 1.0f);
        break;
      case InitKind::kZeros:
        break;
    }
    ExtractShard(p.spec.shard, tp_rank_, tp_size_, full.data(), p.value.f32());
  }
}

absl::Status ParameterStore::SetFull(const std::string& name, absl::Span<const float> full) {
  Parameter* p = Find(name);
  if (p == nullptr) return absl::NotFoundError(absl::StrCat("no parameter named ", name));
  const int64_t want = kernels::NumElements(p->spec.full_shape);
  if (static_cast<int64_t>(full.size()) != want) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": got ", full.size(), " values for shape ",
                     kernels::ShapeToString(p->spec.full_shape), " (", want, ")"));
  }
  if (p->value.device().is_cpu()) {
    ExtractShard(p->spec.shard, tp_rank_, tp_size_, full.data(), p->value.f32());
    return absl::OkStatus();
  }
  std::vector<float> local(p->value.numel());
  ExtractShard(p->spec.shard, tp_rank_, tp_size_, full.data(), local.data());
  return CopyAndWait(p->value.device(), p->value,
                     kernels::Tensor::View(local.data(), p->value.shape()));
}

absl::Status ParameterStore::AllocateBf16Copies(const kernels::ExecContext& ctx) {
  int64_t total = 0;
  for (const Parameter& p : params_) {
    if (p.spec.gemm_weight) total += p.value.numel();
  }
  absl::StatusOr<kernels::Tensor> copies =
      kernels::ZerosOn(device(), {total}, kernels::DType::kBFloat16);
  if (!copies.ok()) return copies.status();
  values_bf16_ = *std::move(copies);
  int64_t offset = 0;
  for (Parameter& p : params_) {
    if (!p.spec.gemm_weight) continue;
    const int64_t n = p.value.numel();
    p.value_bf16 = values_bf16_.Rows(offset, offset + n).Reshaped(p.value.shape());
    offset += n;
  }
  RefreshBf16Copies(ctx);
  return absl::OkStatus();
}

void ParameterStore::RefreshBf16Copies(const kernels::ExecContext& ctx) {
  for (const Parameter& p : params_) {
    if (p.value_bf16.defined()) kernels::Cast(ctx, p.value_bf16, p.value);
  }
}

Parameter* ParameterStore::Find(const std::string& name) {
  for (Parameter& p : params_) {
    if (p.spec.name == name) return &p;
  }
  return nullptr;
}

}  // namespace baton::model
