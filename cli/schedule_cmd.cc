#include "cli/schedule_cmd.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <set>

#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "cli/args.h"
#include "coordinator/schedule/builders.h"
#include "coordinator/schedule/grid.h"
#include "coordinator/schedule/ir.h"
#include "coordinator/schedule/lowering.h"
#include "coordinator/schedule/pytorch_csv.h"
#include "coordinator/schedule/report.h"
#include "coordinator/schedule/simulator.h"
#include "coordinator/schedule/validator.h"

namespace baton::cli {
namespace {

using schedule::CostModel;
using schedule::Schedule;

constexpr int kOk = 0;
constexpr int kInvalid = 1;
constexpr int kBadInput = 2;

constexpr char kUsage[] =
    "usage: batonctl schedule <command> [flags]\n"
    "  show      (--schedule=KIND --pp=P --microbatches=M [--virtual=V] | --file=PATH)\n"
    "            [--format=grid|json|csv|csv_comms]  print the schedule\n"
    "  simulate  (--schedule=KIND --pp=P --microbatches=M [--virtual=V] | --file=PATH)\n"
    "            [--forward=1 --backward_input=1 --backward_weight=1 --overlapped=F+B]\n"
    "            [--stage_multipliers=X,Y,...] [--comm_latency=0 --comm_bandwidth=inf\n"
    "            --activation_bytes=0] [--blocking_sends] --format=text|json|chrome|csv|csv_comms\n"
    "            (csv: PyTorch's compute-only CSV; csv_comms: with its sends and receives)\n"
    "  validate  --file=PATH (a PyTorch pipelining CSV or a JSON array of programs)\n"
    "KIND is one of gpipe, 1f1b, interleaved, zb-h1, zb-v, dualpipe-v (zb-v and\n"
    "dualpipe-v take --virtual=2). --csv_naming=auto|current|legacy reads a CSV's\n"
    "B/W/BW as PyTorch's current (I, W, B = full) or older (B then W, BW = full) names.\n";

// A bad-input error (exit 2) carrying its message.
absl::Status Bad(absl::string_view message) { return absl::InvalidArgumentError(message); }

const std::set<std::string> kSourceFlags = {"schedule", "pp", "microbatches", "virtual", "file", "csv_naming"};
const std::set<std::string> kCostFlags = {"forward",          "backward_input", "backward_weight",
                                          "comm_latency",     "comm_bandwidth", "activation_bytes",
                                          "stage_multipliers", "overlapped"};

std::set<std::string> Union(std::set<std::string> a, const std::set<std::string>& b) {
  a.insert(b.begin(), b.end());
  return a;
}

// Schedule files are small: a regular file of at most kMaxFileBytes.
constexpr size_t kMaxFileBytes = 64 << 20;

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return Bad(absl::StrCat("cannot read --file=", path, ": ", std::strerror(errno)));
  struct stat st;
  if (fstat(fileno(f), &st) != 0 || !S_ISREG(st.st_mode)) {
    std::fclose(f);
    return Bad(absl::StrCat("--file=", path, " is not a regular file"));
  }
  std::string text;
  char buffer[1 << 16];
  size_t n = 0;
  while (text.size() <= kMaxFileBytes && (n = std::fread(buffer, 1, sizeof(buffer), f)) > 0) {
    text.append(buffer, n);
  }
  std::fclose(f);
  if (text.size() > kMaxFileBytes) {
    return Bad(absl::StrCat("--file=", path, " is larger than ", kMaxFileBytes, " bytes"));
  }
  return text;
}

// A schedule from a file: JSON programs (starts with '[') or PyTorch CSV.
absl::StatusOr<Schedule> LoadFile(const std::string& path, schedule::CsvNaming naming) {
  auto text = ReadFile(path);
  if (!text.ok()) return text.status();
  const absl::string_view body = absl::StripLeadingAsciiWhitespace(*text);
  auto parsed = !body.empty() && body.front() == '[' ? schedule::FromProgramsJson(body)
                                                     : schedule::FromPytorchCsv(body, naming);
  if (!parsed.ok()) return Bad(absl::StrCat("--file=", path, ": ", parsed.status().message()));
  return parsed;
}

// An integer flag in [min, kMaxSize]; `def` < 0 makes it required.
constexpr int64_t kMaxSize = 1 << 16;
absl::StatusOr<int> IntFlag(const Args& args, const std::string& name, int def, int min) {
  if (def < 0 && !args.Has(name)) return Bad(absl::StrCat("--", name, " is required"));
  auto v = args.GetInt(name, def);
  if (!v.ok()) return v.status();
  if (*v < min) {
    return Bad(absl::StrCat("--", name, " must be at least ", min, " (got ", *v, ")",
                            name == "pp" ? "; set it to the number of pipeline ranks" : ""));
  }
  if (*v > kMaxSize) {
    return Bad(absl::StrCat("--", name, " must be at most ", kMaxSize, " (got ", *v, ")"));
  }
  return static_cast<int>(*v);
}

// The compute-only schedule named by --schedule/--pp/--microbatches/--virtual,
// or read from --file.
absl::StatusOr<Schedule> LoadSchedule(const Args& args) {
  const bool has_file = args.Has("file"), has_kind = args.Has("schedule");
  if (has_file && has_kind) return Bad("give either --schedule or --file, not both");
  auto naming = schedule::ParseCsvNaming(args.GetString("csv_naming", "auto"));
  if (!naming.ok()) return Bad(absl::StrCat("--csv_naming: ", naming.status().message()));
  if (has_file) return LoadFile(args.GetString("file", ""), *naming);
  if (!has_kind) {
    return Bad(absl::StrCat("give --schedule=KIND (one of ", absl::StrJoin(schedule::ScheduleKinds(), ", "),
                            ") with --pp and --microbatches, or --file=PATH"));
  }
  schedule::ScheduleSpec spec;
  spec.kind = args.GetString("schedule", "");
  const auto& kinds = schedule::ScheduleKinds();
  if (std::find(kinds.begin(), kinds.end(), spec.kind) == kinds.end()) {
    return Bad(absl::StrCat("unknown --schedule=", spec.kind, "; choose one of ",
                            absl::StrJoin(kinds, ", ")));
  }
  auto pp = IntFlag(args, "pp", -1, 1);
  if (!pp.ok()) return pp.status();
  auto m = IntFlag(args, "microbatches", -1, 1);
  if (!m.ok()) return m.status();
  auto v = IntFlag(args, "virtual", 1, 1);
  if (!v.ok()) return v.status();
  spec.num_ranks = *pp;
  spec.microbatches = *m;
  // A V has two chunks per rank: zb-v and dualpipe-v default to --virtual=2.
  spec.virtual_stages = schedule::IsVShaped(spec.kind) && !args.Has("virtual") ? 2 : *v;
  const int64_t cells = int64_t{*pp} * *m * spec.virtual_stages;
  if (cells > schedule::kMaxScheduleCells) {
    return Bad(absl::StrCat("--pp=", *pp, " x --microbatches=", *m, " x --virtual=", spec.virtual_stages, " = ", cells,
                            " (stage, microbatch) cells; at most ", schedule::kMaxScheduleCells,
                            " are supported: lower --microbatches to at most ",
                            std::max<int64_t>(1, schedule::kMaxScheduleCells / (int64_t{*pp} * spec.virtual_stages))));
  }
  if (spec.kind != "interleaved" && !schedule::IsVShaped(spec.kind) && spec.virtual_stages != 1) {
    return Bad(absl::StrCat("--virtual=", spec.virtual_stages,
                            " needs --schedule=interleaved (or zb-v, dualpipe-v with 2); drop --virtual for ",
                            spec.kind));
  }
  if (spec.kind == "interleaved" && spec.microbatches % spec.num_ranks != 0) {
    const int fix = (spec.microbatches / spec.num_ranks + 1) * spec.num_ranks;
    return Bad(absl::StrCat("--microbatches=", spec.microbatches,
                            " does not fit interleaved with --pp=", spec.num_ranks,
                            ": it needs a multiple of ", spec.num_ranks,
                            "; use --microbatches=", fix));
  }
  return schedule::BuildSchedule(spec);
}

absl::StatusOr<CostModel> LoadCosts(const Args& args) {
  CostModel c;
  const std::pair<const char*, double*> fields[] = {{"forward", &c.forward},
                                                    {"backward_input", &c.backward_input},
                                                    {"backward_weight", &c.backward_weight},
                                                    {"comm_latency", &c.comm_latency},
                                                    {"activation_bytes", &c.activation_bytes}};
  for (const auto& [name, field] : fields) {
    auto v = args.GetDouble(name, *field);
    if (!v.ok()) return v.status();
    if (!(*v >= 0) || !std::isfinite(*v)) {
      return Bad(absl::StrCat("--", name, " must be a finite number >= 0 (got ",
                              args.GetString(name, ""), ")"));
    }
    *field = *v;
  }
  auto bandwidth = args.GetDouble("comm_bandwidth", c.comm_bandwidth);
  if (!bandwidth.ok()) return bandwidth.status();
  if (!(*bandwidth > 0)) {
    return Bad(absl::StrCat("--comm_bandwidth must be > 0 (got ",
                            args.GetString("comm_bandwidth", ""),
                            "); use inf for free "
                            "communication"));
  }
  c.comm_bandwidth = *bandwidth;
  if (args.Has("overlapped")) {
    auto overlapped = args.GetDouble("overlapped", 0);
    if (!overlapped.ok()) return overlapped.status();
    if (!(*overlapped >= 0) || !std::isfinite(*overlapped)) {
      return Bad(absl::StrCat("--overlapped must be a finite number >= 0 (got ", args.GetString("overlapped", ""),
                              "): the cost of an overlapped F&B pair"));
    }
    c.overlapped = *overlapped;
  }
  if (args.Has("stage_multipliers")) {
    for (absl::string_view word : absl::StrSplit(args.GetString("stage_multipliers", ""), ',')) {
      double f;
      if (!absl::SimpleAtod(word, &f) || !(f >= 0) || !std::isfinite(f)) {
        return Bad(absl::StrCat("--stage_multipliers: '", word,
                                "' is not a number >= 0; give "
                                "one factor per stage, comma-separated"));
      }
      c.stage_multipliers.push_back(f);
    }
  }
  c.blocking_sends = args.GetBool("blocking_sends");
  return c;
}

// Lowers a compute-only schedule; a lowered one (from JSON) is kept.
absl::StatusOr<Schedule> Lowered(const Schedule& s, const CostModel& costs) {
  if (schedule::HasCommunication(s)) return s;
  return schedule::Lower(s, costs);
}

// Maps a failure to its exit code, printing it.
int Fail(const absl::Status& status, std::ostream& err) {
  err << "error: " << status.message() << "\n";
  return status.code() == absl::StatusCode::kInvalidArgument ? kBadInput : kInvalid;
}

int Invalid(const absl::Status& status, std::ostream& err) {
  err << "invalid schedule: " << status.message();
  if (!status.message().empty() && status.message().back() != '\n') err << "\n";
  return kInvalid;
}

int Show(const Args& args, std::ostream& out, std::ostream& err) {
  auto s = LoadSchedule(args);
  if (!s.ok()) return Fail(s.status(), err);
  const std::string format = args.GetString("format", "grid");
  if (format == "csv") {
    out << schedule::ToPytorchCsv(*s);
    return kOk;
  }
  if (format != "grid" && format != "json" && format != "csv_comms") {
    return Fail(Bad(absl::StrCat("--format=", format, " is not one of grid, json, csv, csv_comms")), err);
  }
  if (absl::Status st = schedule::Validate(*s); !st.ok()) return Invalid(st, err);
  if (format == "json" || format == "csv_comms") {
    auto lowered = Lowered(*s, CostModel());
    if (!lowered.ok()) return Fail(lowered.status(), err);
    out << (format == "json" ? schedule::ToProgramsJson(*lowered) : schedule::ToPytorchCsv(*lowered, true));
    return kOk;
  }
  auto grid = schedule::RenderTimeGrid(*s);
  if (!grid.ok()) return Fail(grid.status(), err);
  out << (s->kind.empty() ? "imported" : s->kind) << ": p=" << s->num_ranks
      << " v=" << s->virtual_stages << " m=" << s->microbatches
      << " (one slot per action, . = idle";
  bool overlaps = false;
  for (const auto& program : s->ranks) {
    for (const schedule::Action& a : program) overlaps |= a.overlap_with_next;
  }
  if (overlaps) out << ", X& Y = X and Y overlapped";
  out << ")\n";
  if (!s->stage_ranks.empty()) {
    // Which rank holds which stage, when not looped.
    out << schedule::PlacementName(*s) << " placement:";
    for (int r = 0; r < s->num_ranks; ++r) {
      out << (r == 0 ? " " : "; ") << "rank " << r << " holds "
          << absl::StrJoin(schedule::StagesOfRank(s->stage_ranks, s->num_ranks, s->num_stages(), r), ",");
    }
    out << "\n";
  }
  out << *grid;
  return kOk;
}

int Simulate(const Args& args, std::ostream& out, std::ostream& err) {
  const std::string format = args.GetString("format", "text");
  if (format != "text" && format != "json" && format != "chrome" && format != "csv" && format != "csv_comms") {
    return Fail(Bad(absl::StrCat("--format=", format, " is not one of text, json, chrome, csv, csv_comms")), err);
  }
  auto s = LoadSchedule(args);
  if (!s.ok()) return Fail(s.status(), err);
  auto costs = LoadCosts(args);
  if (!costs.ok()) return Fail(costs.status(), err);
  if (absl::Status st = costs->Check(s->num_stages()); !st.ok()) return Fail(st, err);
  if (absl::Status st = schedule::Validate(*s); !st.ok()) return Invalid(st, err);
  auto lowered = Lowered(*s, *costs);
  if (!lowered.ok()) return Fail(lowered.status(), err);
  if (absl::Status st = schedule::Validate(*lowered); !st.ok()) return Invalid(st, err);
  if (format == "csv" || format == "csv_comms") {
    out << schedule::ToPytorchCsv(*lowered, format == "csv_comms");
    return kOk;
  }
  auto sim = schedule::Simulate(*lowered, *costs);
  if (!sim.ok()) return Fail(sim.status(), err);
  if (format == "json") {
    out << schedule::FormatSimulationJson(*sim);
  } else if (format == "chrome") {
    out << schedule::FormatChromeTrace(*lowered, *sim);
  } else {
    out << schedule::FormatSimulationText(*lowered, *sim);
  }
  return kOk;
}

int ValidateCmd(const Args& args, std::ostream& out, std::ostream& err) {
  auto s = LoadSchedule(args);
  if (!s.ok()) return Fail(s.status(), err);
  if (absl::Status st = schedule::Validate(*s); !st.ok()) return Invalid(st, err);
  size_t actions = 0;
  for (const auto& program : s->ranks) actions += program.size();
  out << "valid: " << (s->kind.empty() ? "imported" : s->kind) << " schedule, p=" << s->num_ranks
      << " v=" << s->virtual_stages << " m=" << s->microbatches << ", " << actions << " actions"
      << (schedule::HasCommunication(*s) ? " (lowered)" : " (compute only)") << "\n";
  return kOk;
}

}  // namespace

int RunScheduleCommand(const std::vector<std::string>& args, std::ostream& out, std::ostream& err) {
  using Handler = int (*)(const Args&, std::ostream&, std::ostream&);
  struct Command {
    Handler run;
    std::set<std::string> flags;
    std::set<std::string> booleans;
  };
  const std::map<std::string, Command> commands = {
      {"show", {&Show, Union(kSourceFlags, {"format"}), {}}},
      {"simulate",
       {&Simulate, Union(Union(kSourceFlags, kCostFlags), {"format"}), {"blocking_sends"}}},
      {"validate", {&ValidateCmd, kSourceFlags, {}}},
  };
  if (args.empty() || !commands.count(args[0])) {
    if (!args.empty()) err << "error: unknown schedule command '" << args[0] << "'\n";
    err << kUsage;
    return kBadInput;
  }
  const Command& command = commands.at(args[0]);
  auto parsed = Args::Parse(std::vector<std::string>(args.begin() + 1, args.end()), command.flags,
                            command.booleans);
  if (!parsed.ok()) return Fail(parsed.status(), err);
  if (!parsed->positionals().empty()) {
    return Fail(Bad(absl::StrCat("unexpected argument '", parsed->positionals()[0],
                                 "'; flags look like --name=value")),
                err);
  }
  return command.run(*parsed, out, err);
}

}  // namespace baton::cli
