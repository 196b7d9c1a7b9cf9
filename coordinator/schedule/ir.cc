#include "coordinator/schedule/ir.h"

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace baton::schedule {
namespace {

v1::Action::Kind ToProtoKind(ActionKind kind) {
  switch (kind) {
    case ActionKind::kForward:
      return v1::Action::FORWARD;
    case ActionKind::kBackward:
      return v1::Action::BACKWARD;
    case ActionKind::kBackwardInput:
      return v1::Action::BACKWARD_INPUT;
    case ActionKind::kBackwardWeight:
      return v1::Action::BACKWARD_WEIGHT;
    case ActionKind::kSendF:
      return v1::Action::SEND_F;
    case ActionKind::kRecvF:
      return v1::Action::RECV_F;
    case ActionKind::kSendB:
      return v1::Action::SEND_B;
    case ActionKind::kRecvB:
      return v1::Action::RECV_B;
    case ActionKind::kReduceGrads:
      return v1::Action::REDUCE_GRADS;
    case ActionKind::kOptimizerStep:
      return v1::Action::OPTIMIZER_STEP;
  }
  return v1::Action::KIND_UNSPECIFIED;
}

absl::StatusOr<ActionKind> FromProtoKind(v1::Action::Kind kind) {
  switch (kind) {
    case v1::Action::FORWARD:
      return ActionKind::kForward;
    case v1::Action::BACKWARD:
      return ActionKind::kBackward;
    case v1::Action::BACKWARD_INPUT:
      return ActionKind::kBackwardInput;
    case v1::Action::BACKWARD_WEIGHT:
      return ActionKind::kBackwardWeight;
    case v1::Action::SEND_F:
      return ActionKind::kSendF;
    case v1::Action::RECV_F:
      return ActionKind::kRecvF;
    case v1::Action::SEND_B:
      return ActionKind::kSendB;
    case v1::Action::RECV_B:
      return ActionKind::kRecvB;
    case v1::Action::REDUCE_GRADS:
      return ActionKind::kReduceGrads;
    case v1::Action::OPTIMIZER_STEP:
      return ActionKind::kOptimizerStep;
    default:
      break;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("action kind ", static_cast<int>(kind), " is not a schedule action"));
}

}  // namespace

bool IsCompute(ActionKind kind) {
  return kind == ActionKind::kForward || kind == ActionKind::kBackward ||
         kind == ActionKind::kBackwardInput || kind == ActionKind::kBackwardWeight;
}

bool IsCommunication(ActionKind kind) {
  return kind == ActionKind::kSendF || kind == ActionKind::kRecvF || kind == ActionKind::kSendB ||
         kind == ActionKind::kRecvB;
}

bool HasCommunication(const Schedule& schedule) {
  for (const auto& program : schedule.ranks) {
    for (const Action& a : program) {
      if (IsCommunication(a.kind)) return true;
    }
  }
  return false;
}

Schedule ComputeOnly(const Schedule& schedule) {
  Schedule out = schedule;
  for (auto& program : out.ranks) {
    program.erase(std::remove_if(program.begin(), program.end(),
                                 [](const Action& a) { return !IsCompute(a.kind); }),
                  program.end());
  }
  return out;
}

const char* KindName(ActionKind kind) {
  switch (kind) {
    case ActionKind::kForward:
      return "F";
    case ActionKind::kBackward:
      return "B";
    case ActionKind::kBackwardInput:
      return "I";
    case ActionKind::kBackwardWeight:
      return "W";
    case ActionKind::kSendF:
      return "SEND_F";
    case ActionKind::kRecvF:
      return "RECV_F";
    case ActionKind::kSendB:
      return "SEND_B";
    case ActionKind::kRecvB:
      return "RECV_B";
    case ActionKind::kReduceGrads:
      return "REDUCE_GRADS";
    case ActionKind::kOptimizerStep:
      return "OPTIMIZER_STEP";
  }
  return "?";
}

std::vector<int> VPlacement(int num_ranks, int virtual_stages) {
  std::vector<int> ranks;
  for (int s = 0; s < num_ranks * virtual_stages; ++s) {
    const int k = s / num_ranks, i = s % num_ranks;
    ranks.push_back(k % 2 == 0 ? i : num_ranks - 1 - i);
  }
  return ranks;
}

std::vector<int> StagesOfRank(const std::vector<int>& stage_ranks, int num_ranks, int num_stages, int rank) {
  std::vector<int> stages;
  for (int s = 0; s < num_stages; ++s) {
    if ((stage_ranks.empty() ? s % num_ranks : stage_ranks[static_cast<size_t>(s)]) == rank) stages.push_back(s);
  }
  return stages;
}

absl::Status CheckPlacement(const std::vector<int>& stage_ranks, int num_ranks, int num_stages) {
  if (stage_ranks.empty()) return absl::OkStatus();
  if (num_ranks < 1 || num_stages % num_ranks != 0 || static_cast<int>(stage_ranks.size()) != num_stages) {
    return absl::InvalidArgumentError(absl::StrCat("the placement lists ", stage_ranks.size(), " stages for ",
                                                   num_stages, " stages on ", num_ranks,
                                                   " ranks; give the rank of every stage once"));
  }
  std::vector<int> held(num_ranks, 0);
  for (int s = 0; s < num_stages; ++s) {
    const int r = stage_ranks[static_cast<size_t>(s)];
    if (r < 0 || r >= num_ranks) {
      return absl::InvalidArgumentError(
          absl::StrCat("the placement puts stage ", s, " on rank ", r, ", outside ranks 0..", num_ranks - 1));
    }
    if (++held[r] > num_stages / num_ranks) {
      return absl::InvalidArgumentError(absl::StrCat("the placement puts stage ", s, " on rank ", r,
                                                     ", which already holds ", num_stages / num_ranks,
                                                     " stages; every rank holds num_stages / num_ranks = ",
                                                     num_stages / num_ranks));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckOverlapPairs(const Schedule& schedule, int* rank, int* index) {
  for (size_t r = 0; r < schedule.ranks.size(); ++r) {
    const std::vector<Action>& program = schedule.ranks[r];
    for (size_t i = 0; i < program.size(); ++i) {
      const Action& a = program[i];
      if (!a.overlap_with_next) continue;
      *rank = static_cast<int>(r);
      *index = static_cast<int>(i);
      if (a.kind != ActionKind::kForward) {
        return absl::InvalidArgumentError(absl::StrCat(ActionToString(a), " on rank ", r, " (action ", i,
                                                       ") is marked overlapped; only an F overlaps the "
                                                       "backward after it"));
      }
      const Action* next = i + 1 < program.size() ? &program[i + 1] : nullptr;
      if (next == nullptr ||
          (next->kind != ActionKind::kBackward && next->kind != ActionKind::kBackwardInput)) {
        return absl::InvalidArgumentError(absl::StrCat(
            ActionToString(a), " on rank ", r, " (action ", i, ") overlaps ",
            next == nullptr ? "nothing" : ActionToString(*next),
            "; the second half of an overlapped pair is a B or I of another microbatch"));
      }
      if (next->microbatch == a.microbatch) {
        return absl::InvalidArgumentError(absl::StrCat(ActionToString(a), " on rank ", r, " (action ", i,
                                                       ") overlaps ", ActionToString(*next),
                                                       " of the same microbatch; pair two microbatches"));
      }
    }
  }
  return absl::OkStatus();
}

std::string PlacementName(const Schedule& schedule) {
  if (schedule.stage_ranks.empty()) return "looped";
  if (schedule.stage_ranks == VPlacement(schedule.num_ranks, schedule.virtual_stages)) return "V";
  bool looped = true;
  for (int s = 0; s < schedule.num_stages(); ++s) looped &= schedule.RankOf(s) == s % schedule.num_ranks;
  return looped ? "looped" : "table";
}

std::string ActionToString(const Action& a) {
  if (a.kind == ActionKind::kReduceGrads || a.kind == ActionKind::kOptimizerStep) {
    return KindName(a.kind);
  }
  std::string s = absl::StrCat(KindName(a.kind), "(", a.stage, ",", a.microbatch, ")");
  if (a.overlap_with_next) absl::StrAppend(&s, "&");
  if (a.kind == ActionKind::kSendF || a.kind == ActionKind::kSendB) {
    absl::StrAppend(&s, "->", a.peer);
  } else if (a.kind == ActionKind::kRecvF || a.kind == ActionKind::kRecvB) {
    absl::StrAppend(&s, "<-", a.peer);
  }
  return s;
}

std::string CellLabel(const Action& a, int virtual_stages) {
  if (!IsCompute(a.kind)) return ActionToString(a);
  const char* pair = a.overlap_with_next ? "&" : "";
  if (virtual_stages > 1) return absl::StrCat(a.stage, KindName(a.kind), a.microbatch, pair);
  return absl::StrCat(KindName(a.kind), a.microbatch, pair);
}

std::vector<v1::Program> ToPrograms(const Schedule& schedule) {
  std::vector<v1::Program> programs;
  programs.reserve(schedule.ranks.size());
  for (size_t r = 0; r < schedule.ranks.size(); ++r) {
    v1::Program& p = programs.emplace_back();
    p.set_schedule(schedule.kind);
    p.set_rank(static_cast<int>(r));
    p.set_num_ranks(schedule.num_ranks);
    p.set_num_stages(schedule.num_stages());
    p.set_microbatches(schedule.microbatches);
    for (int rank : schedule.stage_ranks) p.add_stage_ranks(rank);
    p.mutable_actions()->Reserve(static_cast<int>(schedule.ranks[r].size()));
    for (const Action& a : schedule.ranks[r]) {
      v1::Action* pa = p.add_actions();
      pa->set_kind(ToProtoKind(a.kind));
      pa->set_stage(a.stage);
      pa->set_microbatch(a.microbatch);
      pa->set_peer(a.peer);
      pa->set_overlap_with_next(a.overlap_with_next);
    }
  }
  return programs;
}

absl::StatusOr<Schedule> FromPrograms(const std::vector<v1::Program>& programs) {
  if (programs.empty()) return absl::InvalidArgumentError("no programs: expected one per rank");
  const v1::Program& first = programs.front();
  Schedule s;
  s.kind = first.schedule();
  s.num_ranks = first.num_ranks();
  s.microbatches = first.microbatches();
  if (s.num_ranks < 1 || s.microbatches < 1 || first.num_stages() < 1 ||
      first.num_stages() % s.num_ranks != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "program sizes are inconsistent: num_ranks=", s.num_ranks,
        " num_stages=", first.num_stages(), " microbatches=", s.microbatches,
        "; num_ranks and microbatches must be >= 1 and num_stages a multiple of num_ranks"));
  }
  s.virtual_stages = first.num_stages() / s.num_ranks;
  if (int64_t{first.num_stages()} * s.microbatches > kMaxScheduleCells) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_stages * microbatches = ", int64_t{first.num_stages()} * s.microbatches,
                     " is more than the ", kMaxScheduleCells, " supported"));
  }
  if (static_cast<int>(programs.size()) != s.num_ranks) {
    return absl::InvalidArgumentError(absl::StrCat("got ", programs.size(),
                                                   " programs for num_ranks=", s.num_ranks,
                                                   "; supply exactly one program per rank"));
  }
  s.stage_ranks.assign(first.stage_ranks().begin(), first.stage_ranks().end());
  if (absl::Status placement = CheckPlacement(s.stage_ranks, s.num_ranks, first.num_stages()); !placement.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("program of rank ", first.rank(), ": ", placement.message()));
  }
  s.ranks.resize(s.num_ranks);
  std::vector<bool> seen(s.num_ranks, false);
  for (const v1::Program& p : programs) {
    if (p.schedule() != s.kind || p.num_ranks() != s.num_ranks ||
        p.num_stages() != first.num_stages() || p.microbatches() != s.microbatches ||
        !std::equal(p.stage_ranks().begin(), p.stage_ranks().end(), s.stage_ranks.begin(), s.stage_ranks.end())) {
      return absl::InvalidArgumentError(
          absl::StrCat("the program of rank ", p.rank(), " disagrees with rank ", first.rank(),
                       " on schedule, num_ranks, num_stages, microbatches or stage_ranks"));
    }
    if (p.rank() < 0 || p.rank() >= s.num_ranks || seen[p.rank()]) {
      return absl::InvalidArgumentError(
          absl::StrCat("program rank ", p.rank(), " is out of range or repeated; ranks must be 0..",
                       s.num_ranks - 1, " once each"));
    }
    seen[p.rank()] = true;
    std::vector<Action>& out = s.ranks[p.rank()];
    out.reserve(p.actions_size());
    for (const v1::Action& pa : p.actions()) {
      auto kind = FromProtoKind(pa.kind());
      if (!kind.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("rank ", p.rank(), " action ", out.size(), ": ", kind.status().message()));
      }
      out.push_back(Action{*kind, pa.stage(), pa.microbatch(), pa.peer(), pa.overlap_with_next()});
    }
  }
  return s;
}

std::string ToProgramsJson(const Schedule& schedule) {
  std::vector<std::string> parts;
  for (const v1::Program& p : ToPrograms(schedule)) {
    std::string json;
    // Serializing a well-formed message cannot fail.
    (void)google::protobuf::util::MessageToJsonString(p, &json);
    parts.push_back(std::move(json));
  }
  return absl::StrCat("[\n", absl::StrJoin(parts, ",\n"), "\n]\n");
}

absl::StatusOr<Schedule> FromProgramsJson(absl::string_view json) {
  google::protobuf::ListValue list;
  auto st = google::protobuf::util::JsonStringToMessage(
      google::protobuf::StringPiece(json.data(), json.size()), &list);
  if (!st.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("not a JSON array of programs: ", st.ToString()));
  }
  std::vector<v1::Program> programs;
  for (int i = 0; i < list.values_size(); ++i) {
    std::string element;
    (void)google::protobuf::util::MessageToJsonString(list.values(i), &element);
    v1::Program& p = programs.emplace_back();
    st = google::protobuf::util::JsonStringToMessage(element, &p);
    if (!st.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("program #", i, " is not a baton.v1.Program: ", st.ToString()));
    }
  }
  return FromPrograms(programs);
}

}  // namespace baton::schedule
