#include "cli/status_cmd.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cstdio>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "baton/v1/coordinator.grpc.pb.h"
#include "cli/args.h"
#include "cli/dial.h"
#include "common/json.h"

namespace baton::cli {
namespace {

std::string StateName(v1::WorkerState s) { return absl::AsciiStrToLower(v1::WorkerState_Name(s)); }

}  // namespace

// Every field the text output shows, for scripts and probes. One field per
// line here so that additions merge cleanly.
std::string StatusJson(const std::string& target, const v1::GetStatusResponse& status) {
  std::vector<std::string> stages;
  for (const v1::StageStatus& st : status.stages()) {
    std::vector<std::string> workers;
    for (const std::string& w : st.workers()) workers.push_back(JsonQuote(w));
    const bool last = st.pp_rank() + 1 == status.stages_size();
    stages.push_back(absl::StrCat(
        "{\"stage\":", st.pp_rank(),
        ",\"step\":", st.step(),
        ",\"loss\":", last ? JsonNumber(st.loss()) : "null",  // the last stage computes the loss
        ",\"bubble_ratio\":", JsonNumber(st.bubble_ratio()),
        ",\"comm_ratio\":", JsonNumber(st.comm_ratio()),
        ",\"tokens_per_second\":", JsonNumber(st.tokens_per_second()),
        ",\"weights_bytes\":", st.weights_bytes(),
        ",\"grads_bytes\":", st.grads_bytes(),
        ",\"optimizer_bytes\":", st.optimizer_bytes(),
        ",\"activation_bytes\":", st.activation_bytes(),
        ",\"moe_dropped_ratio\":", st.has_moe_dropped_ratio() ? JsonNumber(st.moe_dropped_ratio()) : "null",  // MoE only
        ",\"workers\":[", absl::StrJoin(workers, ","), "]}"));
  }
  std::vector<std::string> workers;
  for (const v1::WorkerInfo& w : status.workers()) {
    workers.push_back(absl::StrCat(
        "{\"name\":", JsonQuote(w.name()),
        ",\"state\":", JsonQuote(StateName(w.state())),
        ",\"device\":", JsonQuote(w.device()),
        ",\"device_uuid\":", JsonQuote(w.device_uuid()),
        ",\"fused_attention_bf16\":", w.fused_attention_bf16() ? "true" : "false",
        ",\"memory_bytes\":", w.memory_bytes(),
        ",\"host\":", JsonQuote(w.host()),
        ",\"last_heartbeat_age_seconds\":", absl::StrFormat("%.3f", w.last_heartbeat_age_seconds()), "}"));
  }
  return absl::StrCat(
      "{\"coordinator\":", JsonQuote(target),
      ",\"version\":", JsonQuote(status.version()),
      ",\"job\":", JsonQuote(status.job()),
      ",\"job_state\":", JsonQuote(status.job_state()),
      ",\"generation\":", status.generation(),
      ",\"job_error\":", JsonQuote(status.job_error()),
      ",\"step\":", status.step(),
      ",\"epoch\":", status.epoch(),
      ",\"total_steps\":", status.total_steps(),
      ",\"loss\":", JsonNumber(status.loss()),
      ",\"accuracy\":", JsonNumber(status.accuracy()),
      ",\"tokens_per_second\":", JsonNumber(status.tokens_per_second()),
      ",\"bubble_ratio\":", JsonNumber(status.bubble_ratio()),
      ",\"expected_bubble_ratio\":", JsonNumber(status.expected_bubble_ratio()),
      ",\"comm_ratio\":", JsonNumber(status.comm_ratio()),
      // Recovery (owner: recovery): what the last recovery did, and how many.
      ",\"recovery\":", JsonQuote(status.recovery()),
      ",\"recoveries\":", status.recoveries(),
      // The last evaluation (train.eval_every_steps); eval_step 0: none yet.
      ",\"eval_step\":", status.eval_step(),
      ",\"eval_loss\":", status.eval_step() > 0 ? JsonNumber(status.eval_loss()) : "null",
      ",\"eval_perplexity\":", status.eval_step() > 0 ? JsonNumber(status.eval_perplexity()) : "null",
      ",\"stages\":[", absl::StrJoin(stages, ","), "]",
      ",\"workers\":[", absl::StrJoin(workers, ","), "]}");
}

std::string StagesTable(const v1::GetStatusResponse& status) {
  // The MoE column only for a job with experts (the coordinator sets the
  // ratio on every stage of an MoE job, on none of a dense one).
  const bool moe = std::any_of(status.stages().begin(), status.stages().end(),
                               [](const v1::StageStatus& st) { return st.has_moe_dropped_ratio(); });
  std::string out = absl::StrFormat("%-6s %-7s %-9s %-8s %-8s %-10s %-24s %-8s %s", "STAGE", "STEP", "LOSS", "BUBBLE",
                                    "COMM", "TOK/S", "STATE W/G/OPT MiB", "ACT MiB", moe ? "MOE DROP " : "");
  absl::StrAppend(&out, "WORKERS\n");
  for (const v1::StageStatus& st : status.stages()) {
    absl::StrAppend(
        &out,
        absl::StrFormat("%-6d %-7d %-9s %-8s %-8s %-10.0f %-24s %-8.1f ", st.pp_rank(), st.step(),
                        st.pp_rank() + 1 == status.stages_size() ? absl::StrFormat("%.4f", st.loss()) : "-",
                        absl::StrFormat("%.1f%%", 100 * st.bubble_ratio()),
                        absl::StrFormat("%.1f%%", 100 * st.comm_ratio()), st.tokens_per_second(),
                        absl::StrFormat("%.1f/%.1f/%.1f", st.weights_bytes() / 1048576.0,
                                        st.grads_bytes() / 1048576.0, st.optimizer_bytes() / 1048576.0),
                        st.activation_bytes() / 1048576.0));
    if (moe) {
      absl::StrAppend(&out, absl::StrFormat("%-8s ", st.has_moe_dropped_ratio()
                                                         ? absl::StrFormat("%.1f%%", 100 * st.moe_dropped_ratio())
                                                         : "-"));
    }
    absl::StrAppend(&out, absl::StrJoin(st.workers(), ","), "\n");
  }
  return out;
}

int RunStatusCommand(const std::vector<std::string>& argv, std::ostream& out, std::ostream& err) {
  absl::StatusOr<Args> args = Args::Parse(argv, WithTlsFlags({"coordinator", "timeout_ms"}), {"json", "insecure"});
  if (!args.ok()) {
    err << "batonctl status: " << args.status().message() << "\n";
    return 2;
  }
  const std::string target = args->GetString("coordinator", "");
  absl::StatusOr<int64_t> timeout_ms = args->GetInt("timeout_ms", 5000);
  if (target.empty() || !timeout_ms.ok() || *timeout_ms <= 0) {
    err << "batonctl status: needs --coordinator=HOST:PORT and a positive --timeout_ms\n";
    return 2;
  }
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = DialCoordinator(*args, target);
  if (!channel.ok()) {
    err << "batonctl status: " << channel.status().message() << "\n";
    return 2;
  }
  auto stub = v1::Coordinator::NewStub(*channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(*timeout_ms));
  ctx.set_wait_for_ready(true);  // keep trying to connect until the deadline
  v1::GetStatusResponse status;
  grpc::Status s = stub->GetStatus(&ctx, {}, &status);
  if (s.error_code() == grpc::StatusCode::PERMISSION_DENIED || s.error_code() == grpc::StatusCode::UNAUTHENTICATED) {
    err << "batonctl status: the coordinator at " << target << " refused: " << s.error_message() << "\n";
    return 1;
  }
  if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    // wait_for_ready hides why the channel never became ready (refused
    // connection, failed TLS handshake): one quick call without it says.
    grpc::ClientContext probe;
    probe.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
    v1::GetStatusResponse ignored;
    grpc::Status why = stub->GetStatus(&probe, {}, &ignored);
    if (why.error_code() == grpc::StatusCode::UNAVAILABLE) s = why;
  }
  if (!s.ok()) {
    err << "batonctl status: cannot reach the coordinator at " << target << " within " << *timeout_ms
        << " ms (" << s.error_message() << "); is it running, is --coordinator right, and (if it requires TLS) are --tls_cert/--tls_key an operator certificate signed by its CA and --tls_ca that CA (docs/security.md)?\n";
    return 1;
  }
  if (args->GetBool("json")) {
    out << StatusJson(target, status) << "\n";
    return 0;
  }
  out << "coordinator " << target << " (baton " << status.version() << ")";
  if (!status.job().empty()) {
    out << ", job " << status.job() << " (" << status.job_state() << ") generation " << status.generation();
  }
  out << "\n";
  if (!status.job_error().empty()) out << "job error: " << status.job_error() << "\n";
  if (!status.recovery().empty()) out << (status.job_state() == "recovering" ? "recovering: " : "last recovery: ")
                                      << status.recovery() << "\n";
  if (status.step() > 0) {
    out << absl::StrFormat(
        "step %d/%d  loss %.4f  acc %.1f%%  tok/s %.0f  bubble %.1f%% (expected %.1f%%)  comm %.1f%%\n",
        status.step(), status.total_steps(), status.loss(), 100 * status.accuracy(), status.tokens_per_second(),
        100 * status.bubble_ratio(), 100 * status.expected_bubble_ratio(), 100 * status.comm_ratio());
    if (status.eval_step() > 0) {
      out << absl::StrFormat("eval after step %d: loss %.4f  perplexity %.2f\n", status.eval_step(),
                             status.eval_loss(), status.eval_perplexity());
    }
    out << StagesTable(status);
  }
  out << absl::StrFormat("%-20s %-9s %-8s %-20s %s\n", "WORKER", "STATE", "DEVICE", "HOST", "LAST HEARTBEAT");
  for (const v1::WorkerInfo& w : status.workers()) {
    out << absl::StrFormat("%-20s %-9s %-8s %-20s %.1fs ago\n", w.name(), StateName(w.state()), w.device(),
                           w.host(), w.last_heartbeat_age_seconds());
  }
  if (status.workers().empty()) out << "(no workers registered)\n";
  return 0;
}

}  // namespace baton::cli
