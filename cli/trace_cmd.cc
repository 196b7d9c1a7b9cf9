#include "cli/trace_cmd.h"

#include <grpcpp/grpcpp.h>

#include <chrono>

#include "baton/v1/coordinator.grpc.pb.h"
#include "cli/args.h"
#include "cli/dial.h"
#include "common/file_io.h"

namespace baton::cli {

int RunTraceCommand(const std::vector<std::string>& argv, std::ostream& out, std::ostream& err) {
  absl::StatusOr<Args> args = Args::Parse(argv, WithTlsFlags({"coordinator", "steps", "out", "timeout_ms"}), {"insecure"});
  if (!args.ok()) {
    err << "batonctl trace: " << args.status().message() << "\n";
    return 2;
  }
  const std::string target = args->GetString("coordinator", "");
  const std::string path = args->GetString("out", "");
  absl::StatusOr<int64_t> steps = args->GetInt("steps", 1);
  absl::StatusOr<int64_t> timeout_ms = args->GetInt("timeout_ms", 5000);
  if (target.empty() || path.empty() || !steps.ok() || *steps < 1 || *steps > 1000 || !timeout_ms.ok() ||
      *timeout_ms <= 0 || !args->positionals().empty()) {
    err << "batonctl trace: needs --coordinator=HOST:PORT, --out=FILE, --steps between 1 and 1000 and a "
           "positive --timeout_ms\n";
    return 2;
  }
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = DialCoordinator(*args, target);
  if (!channel.ok()) {
    err << "batonctl trace: " << channel.status().message() << "\n";
    return 2;
  }
  auto stub = v1::Coordinator::NewStub(*channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(*timeout_ms));
  ctx.set_wait_for_ready(true);  // keep trying to connect until the deadline
  v1::GetTraceRequest request;
  request.set_steps(static_cast<int32_t>(*steps));
  v1::GetTraceResponse response;
  grpc::Status s = stub->GetTrace(&ctx, request, &response);
  if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED || s.error_code() == grpc::StatusCode::UNAVAILABLE) {
    err << "batonctl trace: cannot reach the coordinator at " << target << " within " << *timeout_ms << " ms ("
        << s.error_message() << "); is it running, and is --coordinator right?\n";
    return 1;
  }
  if (s.error_code() == grpc::StatusCode::UNIMPLEMENTED) {
    err << "batonctl trace: the coordinator at " << target << " does not serve traces; upgrade it\n";
    return 1;
  }
  if (!s.ok()) {
    err << "batonctl trace: the coordinator refused: " << s.error_message() << "\n";
    return 1;
  }
  if (absl::Status w = WriteFileAtomically(path, response.chrome_trace_json()); !w.ok()) {
    err << "batonctl trace: " << w.message() << "\n";
    return 1;
  }
  out << "wrote " << response.chrome_trace_json().size() << " bytes to " << path
      << "; open it in ui.perfetto.dev or chrome://tracing\n";
  return 0;
}

}  // namespace baton::cli
