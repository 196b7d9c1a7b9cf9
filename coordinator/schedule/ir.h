// The pipeline schedule IR: for every pipeline rank an ordered list of actions
// (compute, point-to-point communication, gradient reduction, optimizer step),
// and its conversion to and from the baton.v1.Program messages that ship it.
//
// Stages are model chunks. With p ranks and v virtual stages per rank there are
// S = p * v stages. Where each stage lives is the schedule's placement
// (Schedule::stage_ranks): looped by default (rank r holds stages r, r + p,
// r + 2p, ...), or V-shaped (rank r holds r and 2p - 1 - r, then zigzag for
// more chunks: ZB-V, DualPipe-V), or any table an imported CSV gives. Every
// rank holds v stages. A stage's neighbour on the same rank (the tip of a V)
// gets its input without the network.
//
// Execution model that builders, lowering, validator and simulator share:
//  - A rank runs its actions strictly in order.
//  - Compute actions F/B/I/W never block once reached; their inputs must have
//    arrived by an earlier RECV (or an earlier action on the same rank).
//  - A maximal run of consecutive SEND_*/RECV_* actions is posted as one batch
//    (like torch's batch_isend_irecv or an NCCL group) and the rank waits for
//    the whole batch. A send completes only once the peer has posted the
//    matching receive (rendezvous), and messages between two ranks are matched
//    in posting order, per direction (as NCCL does).
//  - Activations of (stage, mb) are stored from F until B, or until W when the
//    backward is split into I and W.
//  - An F marked overlap_with_next and the action after it (a B or I of
//    another microbatch on the same rank) form one overlapped pair (PyTorch's
//    OVERLAP_F_B, DualPipe's F&B): it starts once the inputs of both halves
//    are there and costs CostModel::overlapped (default F + B); no
//    communication runs between the halves.
#ifndef BATON_COORDINATOR_SCHEDULE_IR_H_
#define BATON_COORDINATOR_SCHEDULE_IR_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "baton/v1/program.pb.h"

namespace baton::schedule {

enum class ActionKind {
  kForward,         // F(stage, mb)
  kBackward,        // B(stage, mb) = I + W
  kBackwardInput,   // I(stage, mb): gradient w.r.t. the stage input
  kBackwardWeight,  // W(stage, mb): gradient w.r.t. the stage weights
  kSendF,           // send activations produced by (stage, mb) to peer
  kRecvF,           // receive the activations (stage, mb) consumes from peer
  kSendB,           // send input-gradients produced by (stage, mb) to peer
  kRecvB,           // receive the output-gradients (stage, mb) consumes
  kReduceGrads,     // data-parallel gradient all-reduce
  kOptimizerStep,
};

struct Action {
  ActionKind kind = ActionKind::kForward;
  int stage = 0;
  int microbatch = 0;
  int peer = 0;  // pipeline rank of the peer; meaningful for SEND_*/RECV_* only
  // On an F: it and the next action form an overlapped pair (see above).
  bool overlap_with_next = false;

  bool operator==(const Action& o) const {
    return kind == o.kind && stage == o.stage && microbatch == o.microbatch && peer == o.peer &&
           overlap_with_next == o.overlap_with_next;
  }
  bool operator!=(const Action& o) const { return !(*this == o); }
};

struct Schedule {
  std::string kind;  // builder name ("gpipe", "1f1b", ...); empty when imported
  int num_ranks = 0;
  int virtual_stages = 1;
  int microbatches = 0;
  std::vector<std::vector<Action>> ranks;  // ranks[r] = program of rank r
  // stage_ranks[s] = the rank holding stage s; empty = looped (s % num_ranks).
  std::vector<int> stage_ranks;

  int num_stages() const { return num_ranks * virtual_stages; }
  int RankOf(int stage) const {
    return stage_ranks.empty() ? stage % num_ranks : stage_ranks[static_cast<size_t>(stage)];
  }
  bool operator==(const Schedule& o) const {
    return kind == o.kind && num_ranks == o.num_ranks && virtual_stages == o.virtual_stages &&
           microbatches == o.microbatches && ranks == o.ranks && stage_ranks == o.stage_ranks;
  }
};

// The V placement of p ranks with v chunks each (v even): stage s of round
// k = s / p sits on rank s % p when k is even and p - 1 - s % p when odd, so
// rank r holds r and 2p - 1 - r when v = 2 (ZB-V, DualPipe-V).
std::vector<int> VPlacement(int num_ranks, int virtual_stages);
// The stages rank r holds under `stage_ranks` (empty: looped), ascending.
std::vector<int> StagesOfRank(const std::vector<int>& stage_ranks, int num_ranks, int num_stages,
                              int rank);
// InvalidArgument unless `stage_ranks` is empty or has one rank in
// [0, num_ranks) per stage with every rank holding num_stages / num_ranks
// stages; the message names the first offending stage.
absl::Status CheckPlacement(const std::vector<int>& stage_ranks, int num_ranks, int num_stages);
// InvalidArgument unless every F marked overlap_with_next is followed on its
// rank by a B or I (of another microbatch), and only F's are marked; on
// failure *rank and *index say where.
absl::Status CheckOverlapPairs(const Schedule& schedule, int* rank, int* index);
// "looped", "V" or "table".
std::string PlacementName(const Schedule& schedule);

// A schedule holds at most this many (stage, microbatch) cells (p * v * m),
// so that neither a hostile file nor a job spec nor `batonctl schedule`
// flags can make the builders, lowering, validator or simulator allocate
// without bound (about 1 KiB per cell at the peak, through simulation).
inline constexpr int64_t kMaxScheduleCells = int64_t{1} << 18;

bool IsCompute(ActionKind kind);        // F, B, I, W
bool IsCommunication(ActionKind kind);  // SEND_*/RECV_*
// True when the schedule contains any SEND/RECV (it has been lowered).
bool HasCommunication(const Schedule& schedule);

// The same schedule with only its compute actions (F, B, I, W) kept.
Schedule ComputeOnly(const Schedule& schedule);

// "F", "B", "I", "W", "SEND_F", ..., "REDUCE_GRADS", "OPTIMIZER_STEP".
const char* KindName(ActionKind kind);
// "F(1,3)", "SEND_F(1,3)->2", "RECV_B(0,3)<-1", "REDUCE_GRADS".
std::string ActionToString(const Action& action);
// Short grid label: "F3", or "5F3" (stage first) when v > 1. An overlapped
// F ends in "&" ("0F7&"): the next action runs with it.
std::string CellLabel(const Action& action, int virtual_stages);

// One Program per rank, in rank order; each carries the placement.
std::vector<v1::Program> ToPrograms(const Schedule& schedule);
// Accepts the programs in any order; they must agree on sizes and placement
// and cover every rank once.
absl::StatusOr<Schedule> FromPrograms(const std::vector<v1::Program>& programs);

// A JSON array of Program messages (proto3 JSON mapping), one per rank.
std::string ToProgramsJson(const Schedule& schedule);
absl::StatusOr<Schedule> FromProgramsJson(absl::string_view json);

}  // namespace baton::schedule

#endif  // BATON_COORDINATOR_SCHEDULE_IR_H_
