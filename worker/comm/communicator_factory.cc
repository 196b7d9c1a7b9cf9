#include "worker/comm/communicator_factory.h"

#include "absl/strings/str_cat.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/comm/rendezvous.h"
#ifdef BATON_WITH_CUDA
#include "worker/comm/device_staging_communicator.h"
#include "worker/comm/nccl_communicator.h"
#endif

namespace baton::comm {

absl::StatusOr<std::unique_ptr<Communicator>> CreateCommunicator(
    Store& store, const CommunicatorSpec& spec) {
  PrefixStore scoped(&store, GroupKeyPrefix(spec.group, spec.generation));
  const std::string label = absl::StrCat(spec.group, " gen ", spec.generation);
  switch (spec.backend) {
    case Backend::kGloo: {
      GlooOptions options;
      options.rank = spec.rank;
      options.size = spec.size;
      options.label = label;
      options.hostname = spec.hostname;
      options.rendezvous_timeout = spec.rendezvous_timeout;
      options.op_timeout = spec.op_timeout;
#ifndef BATON_WITH_CUDA
      if (spec.device >= 0) {
        return absl::UnimplementedError(absl::StrCat(
            label, ": this build has no CUDA; cannot stage tensors of device ", spec.device));
      }
#endif
      absl::StatusOr<std::unique_ptr<GlooCommunicator>> comm =
          GlooCommunicator::Create(scoped, options);
      if (!comm.ok()) return comm.status();
#ifdef BATON_WITH_CUDA
      if (spec.device >= 0) {
        return std::unique_ptr<Communicator>(new DeviceStagingCommunicator(std::move(*comm)));
      }
#endif
      return std::unique_ptr<Communicator>(std::move(*comm));
    }
    case Backend::kNccl: {
#ifdef BATON_WITH_CUDA
      if (spec.device < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(label, ": the NCCL backend needs a CUDA device (spec.device)"));
      }
      NcclOptions options;
      options.rank = spec.rank;
      options.size = spec.size;
      options.label = label;
      options.device = spec.device;
      options.rendezvous_timeout = spec.rendezvous_timeout;
      options.op_timeout = spec.op_timeout;
      absl::StatusOr<std::unique_ptr<NcclCommunicator>> comm =
          NcclCommunicator::Create(scoped, options);
      if (!comm.ok()) return comm.status();
      return std::unique_ptr<Communicator>(std::move(*comm));
#else
      return absl::UnimplementedError(
          absl::StrCat(label, ": this build has no CUDA/NCCL; use the Gloo backend"));
#endif
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(label, ": unknown backend"));
}

}  // namespace baton::comm
