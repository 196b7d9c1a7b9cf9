// ring_attention_bench: context parallelism's ring attention between
// processes on loopback (real Gloo), one transformer block per rank.
//
//   bazel run -c opt //bench:ring_attention_bench -- [--seq=8192] [--d_model=256] [--reps=3] [--cp=1,2,4]
//       [--precision=fp32|bf16]
//
// For each cp in --cp the driver serves the rendezvous KV and re-executes
// itself once per rank. A rank builds a one-block GPT stage (d_model, 4
// heads, vocabulary 64, model.seq_len = --seq) holding its cp view of one
// sequence (two chunks of seq / (2 cp) tokens; cp = 1: the whole sequence
// and ordinary attention), then runs --reps timed steps (Forward,
// BackwardInput, BackwardWeight) after one warm-up, and measures in the same
// process:
//   step       the median wall time of a step;
//   exposed    the ring's transfer time that compute did not hide, from
//              timestamps on the machine's one clock: every receive's wait
//              counts from when both the receiver waited and the sender had
//              posted the matching send (a wait for a late sender is that
//              rank's imbalance, not transfer) until it completed, summed
//              over a step (the cp group is wrapped in a recording
//              communicator);
//   waited     what the ring's waits took in all, imbalance included (a
//              TimedCommunicator, what comm_cp_seconds reports);
//   ring alone the median time of the same transfers with no compute
//              between them (each step's 2 (cp - 1) key/value and cp
//              gradient hops, a send to the next rank and a receive from the
//              previous one, of the same bytes, back to back);
//   hidden     1 - exposed / ring alone, over all ranks and timed steps:
//              the share of the ring's transfer time that compute covered;
//   bytes      what the ring sent per step and rank (the cp group's
//              p2p_bytes_sent, what comm_cp_bytes reports): under
//              --precision=bf16 the key/value blocks travel in bf16, their
//              gradient accumulators in fp32.
// Rank files go to a temporary directory; the driver prints one Markdown
// row per cp, with the step time against cp = 1 measured in the same run.
// With more ranks than cores the ranks share cores, so step-time ratios
// there say how the machine copes, not how cp scales.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <map>
#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "kernels/cpu/gemm.h"
#include "worker/comm/communicator_factory.h"
#include "worker/comm/coordinator_store.h"
#include "worker/comm/fake_coordinator_kv.h"
#include "worker/comm/forwarding_communicator.h"
#include "worker/comm/timed_communicator.h"
#include "worker/model/context_parallel.h"
#include "worker/model/gpt_config.h"
#include "worker/model/gpt_stage.h"

namespace baton {
namespace {

constexpr absl::Duration kWait = absl::Seconds(300);

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "ring_attention_bench: %s\n", what.c_str());
  std::exit(1);
}

void Check(const absl::Status& s) {
  if (!s.ok()) Die(s.ToString());
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// Forwards to `inner` and records, per point-to-point op, when it was
// posted and when its Wait started and ended (one thread posts and waits).
class RecordingCommunicator : public comm::ForwardingCommunicator {
 public:
  struct Op {
    bool send = false;
    uint64_t tag = 0;
    int64_t posted_ns = 0, wait_ns = 0, done_ns = 0;
  };
  explicit RecordingCommunicator(comm::Communicator* inner) : ForwardingCommunicator(inner) {}
  std::shared_ptr<comm::Work> Send(comm::Buffer buf, int peer, uint64_t tag) override {
    return Record(true, tag, inner()->Send(buf, peer, tag));
  }
  std::shared_ptr<comm::Work> Recv(comm::Buffer buf, int peer, uint64_t tag) override {
    return Record(false, tag, inner()->Recv(buf, peer, tag));
  }
  std::vector<Op>& ops() { return ops_; }

 private:
  class RecordedWork : public comm::Work {
   public:
    RecordedWork(std::shared_ptr<comm::Work> inner, std::vector<Op>* ops, size_t index)
        : inner_(std::move(inner)), ops_(ops), index_(index) {}
    absl::Status Wait(absl::Duration timeout) override {
      (*ops_)[index_].wait_ns = absl::GetCurrentTimeNanos();
      absl::Status s = inner_->Wait(timeout);
      (*ops_)[index_].done_ns = absl::GetCurrentTimeNanos();
      return s;
    }
    bool IsCompleted() override { return inner_->IsCompleted(); }

   private:
    std::shared_ptr<comm::Work> inner_;
    std::vector<Op>* ops_;
    size_t index_;
  };
  std::shared_ptr<comm::Work> Record(bool send, uint64_t tag, std::shared_ptr<comm::Work> work) {
    ops_.push_back(Op{send, tag, absl::GetCurrentTimeNanos(), 0, 0});
    return std::make_shared<RecordedWork>(std::move(work), &ops_, ops_.size() - 1);
  }
  std::vector<Op> ops_;
};

struct Options {
  int64_t seq = 8192, d_model = 256;
  int reps = 3;
  std::vector<int> cps = {1, 2, 4};
  bool bf16 = false;
};

// One rank: writes "step exposed alone bytes" (seconds, medians; bytes per
// step) to `out`.
void RunRank(const std::string& kv, int rank, int cp, const Options& o, const std::string& out) {
  kernels::cpu::SetBlasThreads(1);
  model::GptConfig m;
  m.layers = 1;
  m.d_model = static_cast<int>(o.d_model);
  m.heads = 4;
  m.vocab = 64;
  m.seq_len = static_cast<int>(o.seq);
  absl::StatusOr<model::StageConfig> config = model::MakeStageConfig(m, 0, 1, 0, 1, /*seed=*/1);
  Check(config.status());
  config->cp_rank = rank;
  config->cp_size = cp;
  config->comm_timeout = kWait;
  config->precision = o.bf16 ? kernels::Precision::kBFloat16 : kernels::Precision::kFloat32;
  std::unique_ptr<comm::Communicator> ring;
  std::unique_ptr<RecordingCommunicator> recording;
  std::unique_ptr<comm::TimedCommunicator> timed;
  comm::CoordinatorStore store(comm::ConnectCoordinator(kv), "bench", 1);
  if (cp > 1) {
    comm::CommunicatorSpec spec;
    spec.group = "cp";
    spec.generation = 1;
    spec.rank = rank;
    spec.size = cp;
    spec.rendezvous_timeout = kWait;
    spec.op_timeout = kWait;
    absl::StatusOr<std::unique_ptr<comm::Communicator>> c = comm::CreateCommunicator(store, spec);
    Check(c.status());
    ring = std::move(*c);
    recording = std::make_unique<RecordingCommunicator>(ring.get());
    timed = std::make_unique<comm::TimedCommunicator>(recording.get());
  }
  absl::StatusOr<std::unique_ptr<model::GptStage>> stage = model::GptStage::Create(*config, nullptr, timed.get());
  Check(stage.status());
  // One sequence; this rank's view of it.
  std::mt19937 rng(3);
  std::uniform_int_distribution<int> id(0, m.vocab - 1);
  kernels::Tensor whole = kernels::Tensor::Zeros({1, o.seq}, kernels::DType::kInt32);
  for (int64_t i = 0; i < o.seq; ++i) whole.i32()[i] = id(rng);
  model::StageInputs in;
  if (cp == 1) {
    in.tokens = whole;
  } else {
    in.tokens = kernels::Tensor::Zeros({2, o.seq / (2 * cp)}, kernels::DType::kInt32);
    model::SliceForContextParallel(whole.i32(), 1, o.seq, rank, cp, in.tokens.i32());
  }
  in.targets = in.tokens;
  std::vector<double> steps, exposed;
  int64_t bytes_at_start = 0;
  for (int rep = 0; rep <= o.reps; ++rep) {
    if (rep == 1 && recording) recording->ops().clear();  // the timed steps' ops only
    if (rep == 1 && timed) bytes_at_start = timed->p2p_bytes_sent();
    (*stage)->ZeroGrad();
    const double waited = timed ? timed->waited_seconds() : 0;
    const absl::Time start = absl::Now();
    Check((*stage)->Forward(0, in, kernels::Tensor()));
    Check((*stage)->BackwardInput(0, kernels::Tensor(), kernels::Tensor()));
    Check((*stage)->BackwardWeight(0));
    const double step = absl::ToDoubleSeconds(absl::Now() - start);
    if (rep == 0) continue;  // warm-up: arenas grow, pages fault in
    steps.push_back(step);
    exposed.push_back(timed ? timed->waited_seconds() - waited : 0);
  }
  const double bytes = timed ? static_cast<double>(timed->p2p_bytes_sent() - bytes_at_start) / o.reps : 0;
  // The same transfers with nothing between them: 2 (cp - 1) key/value hops
  // and cp gradient hops of one [2, seq / 2cp, 2 C] block each (key/value
  // blocks in the stage's precision, gradients in fp32).
  std::vector<double> alone;
  if (cp > 1) {
    const int64_t floats = 2 * (o.seq / (2 * cp)) * 2 * o.d_model;
    const int64_t kv_bytes = floats * (o.bf16 ? 2 : 4);
    std::vector<float> send(floats, 1.0f), recv(floats);
    const int hops = 2 * (cp - 1) + cp;
    uint64_t tag = 1;
    for (int rep = 0; rep <= o.reps; ++rep) {
      const absl::Time start = absl::Now();
      for (int h = 0; h < hops; ++h, ++tag) {
        const bool kv_hop = h < 2 * (cp - 1);
        const comm::Buffer in = kv_hop ? comm::Buffer{recv.data(), kv_bytes, comm::DType::kUInt8, -1}
                                       : comm::Buffer::Host(recv.data(), floats);
        const comm::Buffer out = kv_hop ? comm::Buffer{send.data(), kv_bytes, comm::DType::kUInt8, -1}
                                        : comm::Buffer::Host(send.data(), floats);
        auto r = ring->Recv(in, (rank + cp - 1) % cp, tag);
        auto s = ring->Send(out, (rank + 1) % cp, tag);
        Check(s->Wait(kWait));
        Check(r->Wait(kWait));
      }
      if (rep > 0) alone.push_back(absl::ToDoubleSeconds(absl::Now() - start));
    }
    Check(ring->Barrier()->Wait(kWait));
  }
  std::ofstream file(out);
  file << Median(steps) << " " << Median(exposed) << " " << (alone.empty() ? 0.0 : Median(alone)) << " " << bytes
       << "\n";
  if (recording) {
    for (const RecordingCommunicator::Op& op : recording->ops()) {
      file << (op.send ? "send " : "recv ") << op.tag << " " << op.posted_ns << " " << op.wait_ns << " " << op.done_ns
           << "\n";
    }
  }
}

struct RankResult {
  double step = 0, waited = 0, alone = 0, bytes = 0;
  // The timed steps' ring ops: tag -> (posted, wait started, done), ns.
  std::map<uint64_t, std::array<int64_t, 3>> sends, recvs;
};

std::vector<RankResult> RunRanks(const std::string& self, const std::string& kv, int cp, const Options& o,
                                 const std::string& dir) {
  std::vector<pid_t> pids;
  for (int r = 0; r < cp; ++r) {
    pid_t pid = fork();
    if (pid == 0) {
      const std::string args[] = {"rank", kv, absl::StrCat(r), absl::StrCat(cp), absl::StrCat(o.seq),
                                  absl::StrCat(o.d_model), absl::StrCat(o.reps), absl::StrCat(dir, "/rank", r),
                                  o.bf16 ? "bf16" : "fp32"};
      execl(self.c_str(), self.c_str(), args[0].c_str(), args[1].c_str(), args[2].c_str(), args[3].c_str(),
            args[4].c_str(), args[5].c_str(), args[6].c_str(), args[7].c_str(), args[8].c_str(),
            static_cast<char*>(nullptr));
      _exit(127);
    }
    pids.push_back(pid);
  }
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) Die(absl::StrCat("a cp ", cp, " rank failed"));
  }
  std::vector<RankResult> results;
  for (int r = 0; r < cp; ++r) {
    std::ifstream in(absl::StrCat(dir, "/rank", r));
    RankResult x;
    if (!(in >> x.step >> x.waited >> x.alone >> x.bytes)) Die(absl::StrCat("rank ", r, " of cp ", cp, " wrote no result"));
    std::string kind;
    uint64_t tag = 0;
    std::array<int64_t, 3> t{};
    while (in >> kind >> tag >> t[0] >> t[1] >> t[2]) (kind == "send" ? x.sends : x.recvs)[tag] = t;
    results.push_back(std::move(x));
  }
  return results;
}

int Main(int argc, char** argv) {
  Options o;
  if (argc == 10 && std::string(argv[1]) == "rank") {
    o.bf16 = std::string(argv[9]) == "bf16";
    int rank = 0, cp = 0;
    if (!absl::SimpleAtoi(argv[3], &rank) || !absl::SimpleAtoi(argv[4], &cp) || !absl::SimpleAtoi(argv[5], &o.seq) ||
        !absl::SimpleAtoi(argv[6], &o.d_model) || !absl::SimpleAtoi(argv[7], &o.reps)) {
      Die("bad rank arguments");
    }
    RunRank(argv[2], rank, cp, o, argv[8]);
    return 0;
  }
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&](const char* flag) -> std::string {
      return arg.rfind(flag, 0) == 0 ? arg.substr(std::string(flag).size()) : std::string("\x01");
    };
    std::string v;
    if ((v = value("--seq=")) != "\x01") {
      if (!absl::SimpleAtoi(v, &o.seq) || o.seq < 8 || o.seq > 65536) Die("--seq: want 8..65536 tokens");
    } else if ((v = value("--d_model=")) != "\x01") {
      if (!absl::SimpleAtoi(v, &o.d_model) || o.d_model < 4 || o.d_model > 4096 || o.d_model % 4 != 0) {
        Die("--d_model: want a multiple of 4 in 4..4096");
      }
    } else if ((v = value("--reps=")) != "\x01") {
      if (!absl::SimpleAtoi(v, &o.reps) || o.reps < 1 || o.reps > 100) Die("--reps: want 1..100");
    } else if ((v = value("--precision=")) != "\x01") {
      if (v != "fp32" && v != "bf16") Die("--precision: want fp32 or bf16");
      o.bf16 = v == "bf16";
    } else if ((v = value("--cp=")) != "\x01") {
      o.cps.clear();
      for (absl::string_view item : absl::StrSplit(v, ',', absl::SkipEmpty())) {
        int cp = 0;
        if (!absl::SimpleAtoi(item, &cp) || cp < 1 || cp > 16) Die("--cp: want degrees in 1..16, e.g. 1,2,4");
        o.cps.push_back(cp);
      }
      if (o.cps.empty()) Die("--cp: want at least one degree");
    } else {
      Die(absl::StrCat("unknown flag ", arg, " (flags: --seq=N --d_model=N --reps=N --cp=1,2,4 --precision=fp32|bf16)"));
    }
  }
  for (int cp : o.cps) {
    if (o.seq % (2 * cp) != 0) Die(absl::StrCat("--seq ", o.seq, " does not split into 2 * cp = ", 2 * cp, " chunks"));
  }
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) Die("readlink /proc/self/exe");
  self[n] = '\0';
  char dir_template[] = "/tmp/ring_attention_bench.XXXXXX";
  if (mkdtemp(dir_template) == nullptr) Die("mkdtemp");
  std::printf("ring_attention_bench: one GPT block (d_model %lld, 4 heads, %s), one sequence of %lld tokens, %d "
              "timed steps per rank; %ld CPUs online\n\n",
              static_cast<long long>(o.d_model), o.bf16 ? "bf16" : "fp32", static_cast<long long>(o.seq), o.reps,
              sysconf(_SC_NPROCESSORS_ONLN));
  std::printf("| cp | tokens per rank | step (median over ranks) | vs cp 1 | ring alone (per step) | exposed (per step) "
              "| hidden | waited (per step, imbalance included) | ring MiB (per step and rank) |\n"
              "|---|---|---|---|---|---|---|---|---|\n");
  std::fflush(stdout);
  double base = 0;
  for (int cp : o.cps) {
    // Each degree gets its own rendezvous namespace: a fresh KV server.
    auto kv = comm::FakeCoordinatorKvServer::Start();
    Check(kv.status());
    const std::vector<RankResult> results = RunRanks(self, (*kv)->address(), cp, o, dir_template);
    std::vector<double> steps;
    double alone = 0, waited = 0, exposed_ns = 0, bytes = 0;
    for (int r = 0; r < cp; ++r) {
      const RankResult& x = results[r];
      steps.push_back(x.step);
      alone += x.alone / cp;
      waited += x.waited / cp;
      bytes += x.bytes / cp;
      // Each receive against the matching send of the previous rank.
      const RankResult& sender = results[(r + cp - 1) % cp];
      for (const auto& [tag, t] : x.recvs) {
        auto s = sender.sends.find(tag);
        if (s == sender.sends.end()) Die(absl::StrCat("cp ", cp, " rank ", r, ": no send for the receive of tag ", tag));
        exposed_ns += std::max<int64_t>(0, t[2] - std::max(t[1], s->second[0]));
      }
    }
    const double exposed = exposed_ns * 1e-9 / cp / o.reps;  // per rank and step
    const double hidden = alone > 0 ? std::clamp(1.0 - exposed / alone, 0.0, 1.0) : 0.0;
    const double step = Median(steps);
    if (cp == 1) base = step;
    const std::string vs = base > 0 ? absl::StrFormat("%.2f", step / base) : "–";
    if (cp == 1) {
      std::printf("| 1 | %lld | %.1f ms | 1.00 | – | – | – | – | – |\n", static_cast<long long>(o.seq), step * 1e3);
    } else {
      std::printf("| %d | %lld | %.1f ms | %s | %.2f ms | %.2f ms | %.1f%% | %.2f ms | %.2f |\n", cp,
                  static_cast<long long>(o.seq / cp), step * 1e3, vs.c_str(), alone * 1e3, exposed * 1e3,
                  100 * hidden, waited * 1e3, bytes / (1 << 20));
    }
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace
}  // namespace baton

int main(int argc, char** argv) { return baton::Main(argc, argv); }
