#include "worker/stage_model.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace baton {

absl::StatusOr<std::vector<NamedShard>> StageModel::HostShards(std::vector<float>* storage) {
  std::vector<NamedShard> shards = Shards();
  bool on_host = true;
  int64_t total = 0;
  for (const NamedShard& s : shards) {
    if (!s.value.defined()) continue;
    on_host = on_host && s.value.device().is_cpu();
    total += s.value.numel();
  }
  if (on_host) return shards;
  // CaptureState() copies the flat parameter buffer to the host on the
  // chunk's stream and waits; Shards() lists the same tensors in its order.
  ChunkState state = CaptureState();
  if (state.optimizer_step < 0) {
    return absl::UnavailableError("copying the chunk's parameters to the host failed (see the worker log)");
  }
  if (static_cast<int64_t>(state.values.size()) != total) {
    return absl::InternalError(absl::StrCat("the chunk's state holds ", state.values.size(),
                                            " values but its Shards() hold ", total));
  }
  *storage = std::move(state.values);
  int64_t offset = 0;
  for (NamedShard& s : shards) {
    if (!s.value.defined()) continue;
    if (s.value.dtype() != kernels::DType::kFloat32) {
      return absl::InternalError(absl::StrCat("shard ", s.name, " is not float32"));
    }
    kernels::Tensor host = kernels::Tensor::View(storage->data() + offset, s.value.shape());
    offset += s.value.numel();
    s.value = std::move(host);
  }
  return shards;
}

}  // namespace baton
