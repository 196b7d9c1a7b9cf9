// baton-coordinator: registers workers, holds their leases, serves the
// rendezvous KV and admin RPCs, and exposes /metrics, /healthz, /readyz.
//
// Exit codes: 0 after SIGTERM/SIGINT, 1 when it cannot serve, 2 for bad flags
// or an invalid --job (the message names the field and the fix).
#include <signal.h>

#include <atomic>
#include <cstdio>
#include <map>
#include <optional>
#include <memory>
#include <string>
#include <thread>

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/clock.h"
#include "common/grpc_credentials.h"
#include "common/grpc_transport.h"
#include "common/join_token.h"
#include "common/log.h"
#include "common/shutdown_signal.h"
#include "common/ops_server.h"
#include "common/sd_notify.h"
#include "common/version.h"
#include "coordinator/grpc/coordinator_service.h"
#include "coordinator/grpc/rpc_authorization.h"
#include "coordinator/job_runner.h"
#include "coordinator/job_spec.h"
#include "coordinator/kv_store.h"
#include "coordinator/worker_registry.h"
#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/registry.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:7070", "gRPC address HOST:PORT (port 0 picks a free one)");
ABSL_FLAG(std::string, health_listen, "",
          "plaintext gRPC address serving only grpc.health.v1, mirroring the main port's health (for "
          "Kubernetes gRPC probes, which cannot present a client certificate); empty: none");
ABSL_FLAG(std::string, http_listen, "127.0.0.1:0", "HTTP address for /metrics /healthz /readyz");
ABSL_FLAG(std::string, port_file, "", "write {\"grpc\": N, \"http\": M} here once serving");
ABSL_FLAG(std::string, job, "", "JobSpec file (textproto, or JSON starting with '{'); validated at start");
ABSL_FLAG(int64_t, lease_ms, 3000, "a worker silent this long is marked lost");
ABSL_FLAG(int64_t, heartbeat_ms, 500, "heartbeat period asked of workers (< lease_ms)");
ABSL_FLAG(std::string, out, "", "with --job: write summary.json, steps.jsonl, trace.json and final/ weights here");
ABSL_FLAG(int64_t, max_workers, 4096,
          "worker names this coordinator holds at once (live or recently lost); a job needs pp*tp*cp*dp of them");
ABSL_FLAG(int64_t, ready_timeout_s, 60, "with --job: report missing workers as the job error after this long");
ABSL_FLAG(std::string, resume, "",
          "with --job: resume from this checkpoint directory (or the newest complete one under a checkpoint.dir); "
          "a checkpoint that does not fit the job is refused before training");
ABSL_FLAG(std::string, tls_cert, "", "PEM certificate of this coordinator (mTLS; with --tls_key and --tls_ca)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_ca, "", "PEM CA bundle that signed every worker and operator certificate");
ABSL_FLAG(std::string, join_token_file, "",
          "file holding the token workers must present to join (one line; never pass a token on the command "
          "line)");
ABSL_FLAG(bool, insecure, false,
          "allow plaintext gRPC on a non-loopback --listen (anyone who reaches it controls the job)");
ABSL_FLAG(bool, reflection, false, "serve gRPC server reflection");
ABSL_FLAG(int64_t, report_groups_min_ranks, 64,
          "with --job: run the job's steps in report groups (docs/protocol.md) from this many ranks up, where every "
          "rank's worker supports them (groups of about 16 ranks, whole pipeline columns)");

namespace baton {
namespace {

int Fail(int code, const std::string& message) {
  std::fprintf(stderr, "baton-coordinator: %s\n", message.c_str());
  return code;
}

int Main() {
  SetLogComponent("coordinator");
  const absl::Duration lease = absl::Milliseconds(absl::GetFlag(FLAGS_lease_ms));
  const absl::Duration heartbeat = absl::Milliseconds(absl::GetFlag(FLAGS_heartbeat_ms));
  if (heartbeat <= absl::ZeroDuration() || lease <= heartbeat) {
    return Fail(2, absl::StrCat("--heartbeat_ms=", absl::GetFlag(FLAGS_heartbeat_ms), " and --lease_ms=",
                                absl::GetFlag(FLAGS_lease_ms),
                                " must satisfy 0 < heartbeat_ms < lease_ms (e.g. 500 and 3000)"));
  }
  const int64_t max_workers = absl::GetFlag(FLAGS_max_workers);
  if (max_workers < 1 || max_workers > 2 * JobLimits::kMaxWorkers) {
    return Fail(2, absl::StrCat("--max_workers=", max_workers, " must be in 1..", 2 * JobLimits::kMaxWorkers));
  }
  const int64_t report_groups_min_ranks = absl::GetFlag(FLAGS_report_groups_min_ranks);
  if (report_groups_min_ranks < 1 || report_groups_min_ranks > JobLimits::kMaxWorkers + 1) {
    return Fail(2, absl::StrCat("--report_groups_min_ranks=", report_groups_min_ranks, " must be in 1..",
                                JobLimits::kMaxWorkers + 1, " (", JobLimits::kMaxWorkers + 1,
                                ": never)"));
  }
  std::string host;
  int port = 0;
  if (absl::Status s = ParseHostPort(absl::GetFlag(FLAGS_listen), "listen", &host, &port); !s.ok()) {
    return Fail(2, std::string(s.message()));
  }
  std::string http_host;  // not `host`: that one decides whether gRPC is beyond loopback
  int http_port = 0;
  if (absl::Status s = ParseHostPort(absl::GetFlag(FLAGS_http_listen), "http_listen", &http_host, &http_port);
      !s.ok()) {
    return Fail(2, std::string(s.message()));
  }
  absl::StatusOr<TlsConfig> tls =
      LoadTlsConfig(absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key), absl::GetFlag(FLAGS_tls_ca));
  if (!tls.ok()) return Fail(2, std::string(tls.status().message()));
  const bool insecure = absl::GetFlag(FLAGS_insecure) && !tls->enabled;
  if (absl::Status s = CheckPlaintextAddress(absl::GetFlag(FLAGS_listen), "listen", tls->enabled, insecure);
      !s.ok()) {
    return Fail(2, std::string(s.message()));
  }
  absl::StatusOr<std::string> join_token = LoadJoinTokenFlag(absl::GetFlag(FLAGS_join_token_file));
  if (!join_token.ok()) return Fail(2, std::string(join_token.status().message()));
  if (insecure && !IsLoopbackHost(host)) {
    BATON_LOG(WARNING) << "*** INSECURE: serving plaintext gRPC on " << absl::GetFlag(FLAGS_listen)
                       << " (--insecure): anyone who can reach it can join the job, read the rendezvous "
                          "addresses and stop workers. Use --tls_cert/--tls_key/--tls_ca (docs/security.md) ***";
  }
  std::optional<v1::JobSpec> job;
  if (!absl::GetFlag(FLAGS_job).empty()) {
    absl::StatusOr<v1::JobSpec> loaded = LoadJobSpec(absl::GetFlag(FLAGS_job));
    if (!loaded.ok()) return Fail(2, std::string(loaded.status().message()));
    job = *loaded;
    if (DimsOf(*job).world_size() > max_workers) {
      return Fail(2, absl::StrCat("job '", job->name(), "' needs ", DimsOf(*job).cp > 1 ? "pp*tp*cp*dp" : "pp*tp*dp",
                                  " = ", DimsOf(*job).world_size(),
                                  " workers; this coordinator holds at most ", max_workers,
                                  " (--max_workers): raise --max_workers"));
    }
    BATON_LOG(INFO) << "job '" << job->name() << "' is valid";
  } else if (!absl::GetFlag(FLAGS_out).empty()) {
    return Fail(2, "--out needs --job");
  }

  InstallShutdownSignalHandlers();

  WorkerRegistry::Limits registry_limits;
  registry_limits.max_workers = static_cast<int>(max_workers);
  WorkerRegistry registry(RealClock::Get(), lease, absl::ToUnixMicros(absl::Now()), registry_limits);
  KvStore kv;
  auto metrics = std::make_shared<prometheus::Registry>();
  std::unique_ptr<JobRunner> runner;
  if (job) {
    JobRunner::Options job_options;
    job_options.out_dir = absl::GetFlag(FLAGS_out);
    job_options.ready_timeout = absl::Seconds(absl::GetFlag(FLAGS_ready_timeout_s));
    job_options.resume_dir = absl::GetFlag(FLAGS_resume);
    job_options.report_groups_min_ranks = static_cast<int>(report_groups_min_ranks);
    runner = std::make_unique<JobRunner>(*job, &registry, &kv, job_options, *metrics);
  }
  CoordinatorService::Options options;
  options.heartbeat = heartbeat;
  options.job_name = job ? job->name() : "";
  options.job = runner.get();
  options.metrics = metrics.get();
  CoordinatorService service(&registry, &kv, options);
  RpcAuthorizer::Options authz;
  authz.tls = tls->enabled;
  authz.join_token = *join_token;
  authz.on_refused = [&service](const std::string& method, const std::string& reason) {
    service.CountRefusedRpc(method, reason);
  };
  bool authorized = false;
  std::shared_ptr<grpc::ServerCredentials> server_creds = MakeAuthorizedServerCredentials(
      *tls, insecure && !IsLoopbackHost(host), std::make_shared<const RpcAuthorizer>(std::move(authz)), &authorized);
  if (!authorized) {
    BATON_LOG(WARNING) << "*** INSECURE: no RPC is authorized (roles, join token) on a plaintext listener beyond "
                          "loopback ***";
  }

  grpc::EnableDefaultHealthCheckService(true);
  if (absl::GetFlag(FLAGS_reflection)) grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int grpc_port = 0;
  builder.AddListeningPort(absl::GetFlag(FLAGS_listen), server_creds, &grpc_port);
  // Workers ping the coordinator (keepalive) to notice when it stops
  // answering; allow their pings.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 1000);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  // Bounded: each open unary RPC of the synchronous server holds a thread
  // (registrations, pending KV waits; Session streams run on the callback
  // API and hold none); beyond this, new RPCs are RESOURCE_EXHAUSTED.
  grpc::ResourceQuota quota("baton-coordinator");
  quota.SetMaxThreads(2048);
  builder.SetResourceQuota(quota);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, 256);
  // No bandwidth-delay probing: it sends a PING after the data the
  // coordinator receives and reads its ack, a fifth of the coordinator's CPU
  // per step at 1,024 workers (docs/BENCHMARKS.md); big session messages
  // cross slower for it on a long round trip (common/grpc_transport.h,
  // docs/protocol.md "Snapshots").
  SetTransportArgs(&builder);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || grpc_port == 0) {
    return Fail(1, absl::StrCat("cannot serve gRPC on ", absl::GetFlag(FLAGS_listen),
                                ": address in use or not available; pick another --listen"));
  }

  // Health only, in plaintext, for probes: the same statuses as `server`.
  std::unique_ptr<grpc::Server> health_server;
  if (!absl::GetFlag(FLAGS_health_listen).empty()) {
    grpc::ServerBuilder health_builder;
    int health_port = 0;
    health_builder.AddListeningPort(absl::GetFlag(FLAGS_health_listen), grpc::InsecureServerCredentials(),
                                    &health_port);
    health_server = health_builder.BuildAndStart();
    if (health_server == nullptr || health_port == 0) {
      return Fail(1, absl::StrCat("cannot serve gRPC health on ", absl::GetFlag(FLAGS_health_listen),
                                  "; pick another --health_listen"));
    }
    BATON_LOG(INFO) << "gRPC health (plaintext, for probes) on port " << health_port;
  }

  prometheus::BuildGauge()
      .Name("baton_build_info")
      .Help("baton build; the value is always 1")
      .Register(*metrics)
      .Add({{"version", kVersion}, {"component", "coordinator"}})
      .Set(1);
  prometheus::BuildGauge()
      .Name("baton_insecure")
      .Help("1 when gRPC is served in plaintext beyond loopback (--insecure), else 0")
      .Register(*metrics)
      .Add({})
      .Set(insecure && !IsLoopbackHost(host) ? 1 : 0);
  prometheus::Gauge& tls_gauge = prometheus::BuildGauge()
                                     .Name("baton_tls")
                                     .Help("1 when gRPC is served with mutual TLS, else 0")
                                     .Register(*metrics)
                                     .Add({});
  tls_gauge.Set(tls->enabled ? 1 : 0);
  prometheus::Counter& lease_extensions =
      prometheus::BuildCounter()
          .Name("baton_lease_extensions_total")
          .Help("Times the coordinator found itself paused longer than the lease and extended every lease "
                "instead of marking the workers lost")
          .Register(*metrics)
          .Add({});
  auto& workers_family =
      prometheus::BuildGauge().Name("baton_workers").Help("Registered workers by state").Register(*metrics);
  std::map<v1::WorkerState, prometheus::Gauge*> by_state;
  for (v1::WorkerState s : {v1::JOINING, v1::READY, v1::LOST, v1::DRAINING, v1::LEFT}) {
    by_state[s] = &workers_family.Add({{"state", absl::AsciiStrToLower(v1::WorkerState_Name(s))}});
  }
  auto refresh = [&]() {
    std::map<v1::WorkerState, int> counts = registry.CountByState();
    for (auto& [state, gauge] : by_state) gauge->Set(counts[state]);
  };
  std::atomic<bool> serving{true};
  auto ops = OpsServer::Start(
      absl::GetFlag(FLAGS_http_listen), metrics,
      [&]() { return serving ? absl::OkStatus() : absl::UnavailableError("shutting down"); }, refresh);
  if (!ops.ok()) return Fail(1, std::string(ops.status().message()));

  if (!absl::GetFlag(FLAGS_port_file).empty()) {
    if (absl::Status s = WritePortFile(absl::GetFlag(FLAGS_port_file), grpc_port, (*ops)->port()); !s.ok()) {
      return Fail(1, std::string(s.message()));
    }
  }
  BATON_LOG(INFO) << "baton-coordinator " << kVersion << " serving gRPC on port " << grpc_port << ", HTTP on port "
                  << (*ops)->port() << "; lease " << lease << ", heartbeat " << heartbeat;

  if (runner) runner->Start();
  // systemd (Type=notify): serving; the sweeper below feeds the watchdog.
  if (absl::Status s = SdNotify(absl::StrCat("READY=1\nSTATUS=serving gRPC on port ", grpc_port, ", HTTP on port ",
                                             (*ops)->port()));
      !s.ok()) {
    BATON_LOG(WARNING) << s.message();
  }
  const absl::Duration watchdog = WatchdogPeriod();
  absl::Notification stop_sweeper;
  std::thread sweeper([&]() {
    const absl::Duration period = std::max(absl::Milliseconds(20), std::min(lease / 10, absl::Milliseconds(100)));
    absl::Time last_fed = absl::InfinitePast();
    while (!stop_sweeper.WaitForNotificationWithTimeout(period)) {
      absl::Duration stalled = absl::ZeroDuration();
      std::vector<WorkerRegistry::Expired> lost = registry.ExpireLeases(&stalled);
      if (stalled > absl::ZeroDuration()) {
        lease_extensions.Increment();
        BATON_LOG(WARNING) << "the coordinator was paused for " << stalled << " (longer than the lease " << lease
                           << "); extended every lease instead of marking workers lost";
      }
      for (auto& expired : lost) {
        BATON_LOG(WARNING) << "worker '" << expired.name << "' lost: no heartbeat within the lease";
        if (expired.session) expired.session->Close(absl::DeadlineExceededError("lease expired"));
        if (runner) runner->OnWorkerLost(expired.name, "no heartbeat within its lease", /*hung=*/true);
      }
      // Fed only while leases are being swept: a wedged registry stops it.
      if (watchdog > absl::ZeroDuration() && absl::Now() - last_fed >= watchdog) {
        (void)SdNotify("WATCHDOG=1");
        last_fed = absl::Now();
      }
    }
  });

  const int sig = WaitForShutdownSignal();
  BATON_LOG(INFO) << "received " << (sig == SIGTERM ? "SIGTERM" : "SIGINT") << "; shutting down";
  serving = false;
  (void)SdNotify("STOPPING=1");
  server->GetHealthCheckService()->SetServingStatus(false);
  if (health_server) health_server->GetHealthCheckService()->SetServingStatus(false);
  if (runner) runner->Stop();
  for (auto& session : registry.Sessions()) {
    session->Close(absl::UnavailableError("coordinator shutting down"));
  }
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  if (health_server) health_server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  stop_sweeper.Notify();
  sweeper.join();
  BATON_LOG(INFO) << "stopped";
  return 0;
}

}  // namespace
}  // namespace baton

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("baton coordinator: baton-coordinator --listen=HOST:PORT [--job=FILE] ...");
  absl::ParseCommandLine(argc, argv);
#ifdef NDEBUG
  // Debian's Abseil checks lock order on every Mutex::Lock (a graph of lock
  // ids): ~3% of the coordinator's CPU under 1024 workers (perf). Release
  // builds skip it; debug builds and the tests keep it.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
#endif
  return baton::Main();
}
