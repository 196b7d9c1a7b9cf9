#include "worker/comm/communicator_factory.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
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

bool SplitsParentCommunicator(Backend backend) {
#ifdef BATON_WITH_CUDA
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0)
  static_assert(kNoColor == NCCL_SPLIT_NOCOLOR);
  return backend == Backend::kNccl;
#endif
#endif
  (void)backend;
  return false;
}

absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> CreateJobCommunicators(
    Store& store, const JobCommSpec& spec) {
  BATON_ASSIGN_OR_RETURN(const std::vector<GroupRound> rounds, PlanJobGroups(spec.layout, spec.rank));
  std::vector<std::unique_ptr<Communicator>> comms;
  if (rounds.empty()) return comms;
#ifdef BATON_WITH_CUDA
  if (SplitsParentCommunicator(spec.backend)) {
    if (spec.device < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "job gen ", spec.generation, ": the NCCL backend needs a CUDA device (spec.device)"));
    }
    PrefixStore scoped(&store, GroupKeyPrefix("job", spec.generation));
    NcclOptions parent;
    parent.rank = JobRank(spec.layout, spec.rank);
    parent.size = JobSize(spec.layout);
    parent.device = spec.device;
    parent.label = absl::StrCat("job gen ", spec.generation);
    parent.rendezvous_timeout = spec.rendezvous_timeout;
    parent.op_timeout = spec.op_timeout;
    std::vector<NcclCommunicator::Split> splits;
    for (const GroupRound& round : rounds) {
      NcclCommunicator::Split split;
      split.color = round.color;
      split.key = round.key;
      split.options.rank = round.key;
      split.options.size = round.size;
      split.options.device = spec.device;
      split.options.label =
          round.color == kNoColor
              ? absl::StrCat(GroupKindName(round.kind), " split gen ", spec.generation, " (in no group)")
              : absl::StrCat(round.group, " gen ", spec.generation);
      split.options.rendezvous_timeout = spec.rendezvous_timeout;
      split.options.op_timeout = spec.op_timeout;
      splits.push_back(std::move(split));
    }
    absl::StatusOr<std::vector<std::unique_ptr<NcclCommunicator>>> children =
        NcclCommunicator::CreateSplit(scoped, parent, splits);
    if (!children.ok()) {
      return absl::Status(children.status().code(),
                          absl::StrCat("rendezvous of the job's NCCL communicators: ",
                                       children.status().message()));
    }
    for (std::unique_ptr<NcclCommunicator>& child : *children) comms.push_back(std::move(child));
    return comms;
  }
#endif
  for (const GroupRound& round : rounds) {
    if (round.color == kNoColor) {
      comms.push_back(nullptr);
      continue;
    }
    CommunicatorSpec group;
    group.group = round.group;
    group.generation = spec.generation;
    group.rank = round.key;
    group.size = round.size;
    group.backend = spec.backend;
    group.rendezvous_timeout = spec.rendezvous_timeout;
    group.op_timeout = spec.op_timeout;
    group.hostname = spec.hostname;
    group.device = spec.device;
    absl::StatusOr<std::unique_ptr<Communicator>> c = CreateCommunicator(store, group);
    if (!c.ok()) {
      return absl::Status(c.status().code(), absl::StrCat("rendezvous of group ", round.group, ": ",
                                                          c.status().message()));
    }
    comms.push_back(std::move(*c));
  }
  return comms;
}

}  // namespace baton::comm
