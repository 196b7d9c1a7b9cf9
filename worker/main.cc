// baton-worker: a long-running worker daemon. Registers with the coordinator,
// keeps its session alive (re-registering after any loss, never exiting on
// its own), serves gRPC health and /metrics, /healthz, /readyz.
//
// Exit codes: 0 after SIGTERM/SIGINT, 1 when it cannot serve, 2 for bad flags.
// `baton-worker generate CKPT ...` instead samples tokens from a checkpoint
// and exits (worker/generate.h, docs/generate.md).
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "common/grpc_credentials.h"
#include "common/grpc_transport.h"
#include "common/join_token.h"
#include "common/log.h"
#include "common/shutdown_signal.h"
#include "common/ops_server.h"
#include "common/sd_notify.h"
#include "common/version.h"
#include "common/worker_identity.h"
#include "kernels/cpu/gemm.h"
#include "kernels/device.h"
#include "prometheus/gauge.h"
#include "prometheus/registry.h"
#include "worker/agent.h"
#include "worker/generate.h"
#include "worker/host_memory.h"
#include "worker/worker_job.h"

ABSL_FLAG(std::string, coordinator, "", "coordinator gRPC address HOST:PORT (required)");
ABSL_FLAG(std::string, name, "", "stable worker name (default: hostname); re-registering replaces the old one");
ABSL_FLAG(std::string, data_dir, "", "job data files (data.text_file, data.tokens_file) are read only from under "
          "this directory (\"\" = none: synthetic data only)");
ABSL_FLAG(std::vector<std::string>, output_dir, {},
          "weights and checkpoints the coordinator asks for are written only under this directory (a "
          "comma-separated list for several; symlinks and '..' resolved). Empty (the default): this worker saves "
          "nothing, and a job that asks it to fails naming the path");
ABSL_FLAG(std::string, device, "cpu", "\"cpu\" or \"cuda:N\"");
ABSL_FLAG(std::string, host, "",
          "the machine this worker runs on, as the planner sees it (default: the hostname): a TP group is placed "
          "on one host, and CPU workers of one host share its memory. In a container set it to the node's name "
          "(Kubernetes: spec.nodeName) so TP groups stay within a node");
ABSL_FLAG(std::string, listen, "127.0.0.1:0", "gRPC address for health and reflection (port 0 picks one)");
ABSL_FLAG(std::string, health_listen, "",
          "plaintext gRPC address serving only grpc.health.v1, mirroring the main port's health (for "
          "Kubernetes gRPC probes, which cannot present a client certificate); empty: none");
ABSL_FLAG(std::string, http_listen, "127.0.0.1:0", "HTTP address for /metrics /healthz /readyz");
ABSL_FLAG(std::string, port_file, "", "write {\"grpc\": N, \"http\": M} here once serving");
ABSL_FLAG(std::string, comm_host, "127.0.0.1", "address other workers reach this one at for activations (Gloo)");
ABSL_FLAG(int64_t, op_timeout_s, 300, "a communication op that takes longer fails the step (no hang)");
ABSL_FLAG(int32_t, port_offset, 0,
          "added to the non-zero ports of --listen and --http_listen: one worker per GPU N on a host runs with "
          "--port_offset=N (deploy/systemd/baton-worker@.service)");
ABSL_FLAG(std::string, tls_cert, "", "PEM certificate of this worker, role URI baton://role/worker (mTLS; with "
                                     "--tls_key and --tls_ca)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_ca, "", "PEM CA bundle that signed the coordinator's certificate");
ABSL_FLAG(std::string, join_token_file, "", "file holding the coordinator's join token (one line; docs/security.md)");
ABSL_FLAG(bool, insecure, false,
          "allow plaintext gRPC to or on a non-loopback address (anyone on the path controls this worker)");
ABSL_FLAG(bool, reflection, false, "serve gRPC server reflection");
ABSL_FLAG(int64_t, keepalive_ms, 15000,
          "gRPC keepalive: ping the coordinator after this long and drop the connection when a ping goes "
          "unanswered for as long again");
ABSL_FLAG(int32_t, blas_threads, 1, "OpenBLAS threads for this worker's matrix products (set explicitly: "
                                    "several workers share a host)");

namespace baton {
namespace {

int Fail(int code, const std::string& message) {
  std::fprintf(stderr, "baton-worker: %s\n", message.c_str());
  return code;
}

// `listen` (HOST:PORT) with `offset` added to a non-zero port; INVALID_ARGUMENT
// naming the flag when the result is not a port.
absl::StatusOr<std::string> OffsetListen(const std::string& listen, const std::string& flag, int offset) {
  std::string host;
  int port = 0;
  if (absl::Status s = ParseHostPort(listen, flag, &host, &port); !s.ok()) return s;
  if (port == 0 || offset == 0) return listen;
  if (offset < 0 || port + offset > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, "='", listen, "' with --port_offset=", offset,
                                                   " gives port ", port + offset, ", outside 1..65535"));
  }
  if (host.find(':') != std::string::npos) host = absl::StrCat("[", host, "]");
  return absl::StrCat(host, ":", port + offset);
}

std::string Hostname() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "localhost";
  return buf;
}

// What the worker registers of the memory it computes in: the GPU's memory,
// UUID and fused-attention capability for cuda:N (0, none and false when the
// GPU cannot be asked: the planner then skips the memory check, and a job on
// it fails Configure naming the
// cause), the host's RAM (or the container's memory limit, when lower)
// otherwise.
void DescribeDevice(const std::string& device, WorkerAgent::Options* options) {
  absl::StatusOr<kernels::Device> parsed = kernels::ParseDevice(device);
  if (parsed.ok() && parsed->type == kernels::DeviceType::kCuda) {
    absl::StatusOr<kernels::CudaDeviceInfo> info = kernels::DescribeCudaDevice(parsed->index);
    if (!info.ok()) {
      BATON_LOG(WARNING) << info.status().message() << "; registering its memory as unknown";
      return;
    }
    options->memory_bytes = info->memory_bytes;
    options->device_uuid = info->uuid;
    options->fused_attention_bf16 = info->fused_attention_bf16;
    BATON_LOG(INFO) << device << " is " << info->name << " " << info->uuid << " with "
                    << absl::StrFormat("%.1f GiB", info->memory_bytes / 1073741824.0) << "; bf16 attention "
                    << (info->fused_attention_bf16 ? "runs fused (cuDNN SDPA: keeps softmax stats, not P)"
                                                   : absl::StrCat("keeps P: ", info->fused_attention_why_not));
    return;
  }
  options->memory_bytes = UsableHostMemory(static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE),
                                           DefaultCgroupMemoryLimitFiles());
}

int Main() {
  const std::string coordinator = absl::GetFlag(FLAGS_coordinator);
  if (coordinator.empty()) return Fail(2, "--coordinator=HOST:PORT is required");
  std::string host;
  int port = 0;
  if (absl::Status s = ParseHostPort(coordinator, "coordinator", &host, &port); !s.ok() || port == 0) {
    return Fail(2, absl::StrCat("--coordinator='", coordinator, "' must be HOST:PORT with a non-zero port"));
  }
  const std::string device = absl::GetFlag(FLAGS_device);
  if (!IsValidDevice(device)) {
    return Fail(2, absl::StrCat("--device='", device, "' must be \"cpu\" or \"cuda:N\" (e.g. cuda:0)"));
  }
  if (absl::GetFlag(FLAGS_blas_threads) < 1) return Fail(2, "--blas_threads must be >= 1");
  if (absl::GetFlag(FLAGS_port_offset) < 0) return Fail(2, "--port_offset must be >= 0 (the GPU index)");
  absl::StatusOr<std::string> listen =
      OffsetListen(absl::GetFlag(FLAGS_listen), "listen", absl::GetFlag(FLAGS_port_offset));
  if (!listen.ok()) return Fail(2, std::string(listen.status().message()));
  absl::StatusOr<std::string> http_listen =
      OffsetListen(absl::GetFlag(FLAGS_http_listen), "http_listen", absl::GetFlag(FLAGS_port_offset));
  if (!http_listen.ok()) return Fail(2, std::string(http_listen.status().message()));
  absl::StatusOr<std::string> health_listen = absl::GetFlag(FLAGS_health_listen).empty()
      ? absl::StatusOr<std::string>("")
      : OffsetListen(absl::GetFlag(FLAGS_health_listen), "health_listen", absl::GetFlag(FLAGS_port_offset));
  if (!health_listen.ok()) return Fail(2, std::string(health_listen.status().message()));
  if (absl::GetFlag(FLAGS_keepalive_ms) < 1000) return Fail(2, "--keepalive_ms must be >= 1000");
  const std::string worker_host = absl::GetFlag(FLAGS_host).empty() ? Hostname() : absl::GetFlag(FLAGS_host);
  if (absl::Status s = ValidateHostName(worker_host); !s.ok()) {
    return Fail(2, absl::StrCat("--host", absl::GetFlag(FLAGS_host).empty() ? " (default: the hostname)" : "", ": ",
                                s.message(), "; give --host=NAME"));
  }
  if (!absl::GetFlag(FLAGS_name).empty()) {
    if (absl::Status s = ValidateWorkerName(absl::GetFlag(FLAGS_name)); !s.ok()) {
      return Fail(2, absl::StrCat("--name: ", s.message()));
    }
  }
  absl::StatusOr<TlsConfig> tls =
      LoadTlsConfig(absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key), absl::GetFlag(FLAGS_tls_ca));
  if (!tls.ok()) return Fail(2, std::string(tls.status().message()));
  const bool insecure = absl::GetFlag(FLAGS_insecure) && !tls->enabled;
  for (const auto& [flag, address] : {std::pair<std::string, std::string>{"listen", absl::GetFlag(FLAGS_listen)},
                                      {"coordinator", coordinator}}) {
    if (absl::Status s = CheckPlaintextAddress(address, flag, tls->enabled, insecure); !s.ok()) {
      return Fail(2, std::string(s.message()));
    }
  }
  absl::StatusOr<std::string> join_token = LoadJoinTokenFlag(absl::GetFlag(FLAGS_join_token_file));
  if (!join_token.ok()) return Fail(2, std::string(join_token.status().message()));
  kernels::cpu::SetBlasThreads(absl::GetFlag(FLAGS_blas_threads));
  std::string name = absl::GetFlag(FLAGS_name).empty() ? Hostname() : absl::GetFlag(FLAGS_name);
  if (absl::Status s = ValidateWorkerName(name); !s.ok()) {
    return Fail(2, absl::StrCat("the hostname is not a valid worker name (", s.message(), "); give --name"));
  }
  SetLogComponent(absl::StrCat("worker ", name));
  std::string listen_host;
  int listen_port = 0;
  const bool beyond_loopback =
      insecure && (!IsLoopbackHost(host) ||
                   (ParseHostPort(absl::GetFlag(FLAGS_listen), "listen", &listen_host, &listen_port).ok() &&
                    !IsLoopbackHost(listen_host)));
  if (beyond_loopback) {
    BATON_LOG(WARNING) << "*** INSECURE: plaintext gRPC beyond loopback (--insecure): anyone on the path can "
                          "impersonate the coordinator to this worker. Use --tls_cert/--tls_key/--tls_ca "
                          "(docs/security.md) ***";
  }

  InstallShutdownSignalHandlers();
  // A peer that dies mid-send must not kill this worker: writes to its broken
  // sockets fail with EPIPE instead (Gloo's transport would otherwise raise SIGPIPE).
  signal(SIGPIPE, SIG_IGN);

  grpc::EnableDefaultHealthCheckService(true);
  if (absl::GetFlag(FLAGS_reflection)) grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int grpc_port = 0;
  builder.AddListeningPort(*listen, MakeServerCredentials(*tls), &grpc_port);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || grpc_port == 0) {
    return Fail(1, absl::StrCat("cannot serve gRPC on ", *listen, "; pick another --listen"));
  }
  // grpc.health.v1 reflects readiness (service ""): NOT_SERVING until a
  // session with the coordinator is open, and whenever it is not (the main
  // loop below). Service "liveness" is SERVING while the process serves.
  // Health only, in plaintext, for probes (--health_listen): the same statuses.
  std::unique_ptr<grpc::Server> health_server;
  if (!health_listen->empty()) {
    grpc::ServerBuilder health_builder;
    int health_port = 0;
    health_builder.AddListeningPort(*health_listen, grpc::InsecureServerCredentials(), &health_port);
    health_server = health_builder.BuildAndStart();
    if (health_server == nullptr || health_port == 0) {
      return Fail(1, absl::StrCat("cannot serve gRPC health on ", *health_listen, "; pick another --health_listen"));
    }
  }
  auto set_health = [&](const std::string& service, bool serving) {
    server->GetHealthCheckService()->SetServingStatus(service, serving);
    if (health_server) health_server->GetHealthCheckService()->SetServingStatus(service, serving);
  };
  set_health("", false);
  set_health("liveness", true);

  auto metrics = std::make_shared<prometheus::Registry>();
  prometheus::BuildGauge()
      .Name("baton_build_info")
      .Help("baton build; the value is always 1")
      .Register(*metrics)
      .Add({{"version", kVersion}, {"component", "worker"}})
      .Set(1);
  prometheus::BuildGauge()
      .Name("baton_insecure")
      .Help("1 when gRPC runs in plaintext beyond loopback (--insecure), else 0")
      .Register(*metrics)
      .Add({})
      .Set(beyond_loopback ? 1 : 0);

  WorkerAgent::Options options;
  options.coordinator = coordinator;
  options.name = name;
  options.host = worker_host;
  options.device = device;
  DescribeDevice(device, &options);
  std::unique_ptr<WorkerAgent> agent;
  auto ops = OpsServer::Start(*http_listen, metrics, [&agent]() {
    return agent ? agent->Readiness() : absl::UnavailableError("starting");
  });
  if (!ops.ok()) return Fail(1, std::string(ops.status().message()));
  options.http_port = (*ops)->port();
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  // Keepalive: a coordinator that is gone (host down, partition) ends the
  // connection instead of leaving the session hanging.
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, static_cast<int>(absl::GetFlag(FLAGS_keepalive_ms)));
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, static_cast<int>(absl::GetFlag(FLAGS_keepalive_ms)));
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  // No bandwidth-delay probing (a PING after each message received, which
  // the coordinator must answer), as the coordinator (common/grpc_transport.h).
  SetTransportArgs(&args);
  auto channel = MakeChannel(coordinator, *tls, *join_token, args);
  WorkerJob::Options job_options;
  job_options.name = name;
  job_options.comm_host = absl::GetFlag(FLAGS_comm_host);
  job_options.device = device;
  job_options.data_dir = absl::GetFlag(FLAGS_data_dir);
  job_options.output_dirs = absl::GetFlag(FLAGS_output_dir);
  job_options.op_timeout = absl::Seconds(absl::GetFlag(FLAGS_op_timeout_s));
  std::unique_ptr<WorkerJob> job;
  options.describe = [&job](v1::RegisterRequest* r) {  // job adoption (owner: recovery)
    if (job) job->Describe(r->mutable_held());
  };
  agent = std::make_unique<WorkerAgent>(
      options, channel, *metrics, [&job](const v1::CoordinatorMessage& m) { job->Handle(m); },
      [&job]() { job->SessionLost(); });
  job = std::make_unique<WorkerJob>(job_options, v1::Coordinator::NewStub(channel), agent.get(), *metrics);

  if (!absl::GetFlag(FLAGS_port_file).empty()) {
    if (absl::Status s = WritePortFile(absl::GetFlag(FLAGS_port_file), grpc_port, (*ops)->port()); !s.ok()) {
      return Fail(1, std::string(s.message()));
    }
  }
  BATON_LOG(INFO) << "baton-worker " << kVersion << " (" << device << ") gRPC port " << grpc_port
                  << ", HTTP port " << (*ops)->port() << "; coordinator " << coordinator;
  std::thread session([&]() { agent->Run(); });

  // Main loop: health and systemd state follow the session; the watchdog is
  // fed only while the agent answers (a wedged agent stops feeding it).
  const absl::Duration watchdog = WatchdogPeriod();
  absl::Time last_fed = absl::InfinitePast();
  bool was_ready = false, notified_ready = false;
  int sig = 0;
  while ((sig = WaitForShutdownSignalFor(20)) == 0) {
    const absl::Status readiness = agent->Readiness();
    if (readiness.ok() != was_ready) {
      was_ready = readiness.ok();
      set_health("", was_ready);
      std::string state = absl::StrCat("STATUS=", was_ready ? "registered with " : "cannot reach ", coordinator,
                                       was_ready ? absl::StrCat(" as ", name) : absl::StrCat(": ", readiness.message()));
      if (was_ready && !notified_ready) {
        state = absl::StrCat("READY=1\n", state);
        notified_ready = true;
      }
      if (absl::Status s = SdNotify(state); !s.ok()) BATON_LOG(WARNING) << s.message();
    }
    if (watchdog > absl::ZeroDuration() && absl::Now() - last_fed >= watchdog) {
      (void)SdNotify("WATCHDOG=1");
      last_fed = absl::Now();
    }
  }
  (void)SdNotify("STOPPING=1");
  BATON_LOG(INFO) << "received " << (sig == SIGTERM ? "SIGTERM" : "SIGINT") << "; leaving";
  server->GetHealthCheckService()->SetServingStatus(false);
  if (health_server) health_server->GetHealthCheckService()->SetServingStatus(false);
  agent->Stop(absl::Seconds(2));
  session.join();
  job.reset();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  if (health_server) health_server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  BATON_LOG(INFO) << "stopped";
  return 0;
}

}  // namespace
}  // namespace baton

int main(int argc, char** argv) {
  // `baton-worker generate ...` is a one-shot command with its own flags
  // (worker/generate.h), parsed before and apart from the daemon's.
  if (argc >= 2 && std::string(argv[1]) == "generate") {
    return baton::generate::RunGenerate(std::vector<std::string>(argv + 2, argv + argc), std::cout, std::cerr);
  }
  // --help lists this file's flags (absl matches flag files to the program's
  // name by default, which main.cc never matches).
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) { return absl::EndsWith(file, "worker/main.cc"); };
  absl::SetFlagsUsageConfig(usage);
  absl::SetProgramUsageMessage("baton worker: baton-worker --coordinator=HOST:PORT [--name=NAME] [--device=cpu]");
  absl::ParseCommandLine(argc, argv);
#ifdef NDEBUG
  // As the coordinator: Debian's Abseil checks lock order on every
  // Mutex::Lock; release builds (scripts/package.sh, -c opt) skip it, debug
  // builds and the tests keep it.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
#endif
  return baton::Main();
}
