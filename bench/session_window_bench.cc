// session_window_bench: how long big Session messages (snapshots, relayed
// copies, fetched states: fragments of 3 MiB) take to cross one gRPC hop at
// a given round trip, with baton's transport settings (common/
// grpc_transport.h: no bandwidth-delay probe) against gRPC's defaults (the
// probe on, so the flow-control windows grow with the measured
// bandwidth-delay product).
//
//   bazel run -c opt //bench:session_window_bench -- --mib=48 --delay_ms=5
//
// A server (the Coordinator service's Session, as the coordinator serves
// it) and a client (as the worker's channel) talk through a proxy on
// loopback that holds every byte for --delay_ms in each direction (a round
// trip of 2 x delay_ms; bandwidth is not limited). The client sends --mib
// MiB as 3 MiB snapshot messages and the server answers once it has read
// them all (up: the coordinator's receive side); then the server sends as
// many (down: the worker's receive side). Rounds alternate the two
// settings; the medians, MiB per round trip and the ratio (baton / gRPC
// default) are printed.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "baton/v1/coordinator.grpc.pb.h"
#include "common/grpc_transport.h"
#include "grpcpp/grpcpp.h"

ABSL_FLAG(int, mib, 48, "MiB sent each way per round");
ABSL_FLAG(double, delay_ms, 5, "one-way delay of the proxy (round trip: twice this)");
ABSL_FLAG(int, rounds, 3, "rounds; each runs both settings");

namespace baton {
namespace {

constexpr int kMessageBytes = 3 << 20;  // a fragment's payload

// One direction of the proxy: what `from` sends reaches `to` delay later.
void Pump(int from, int to, absl::Duration delay) {
  struct Chunk {
    absl::Time due;
    std::string bytes;
  };
  absl::Mutex mu;
  std::deque<Chunk> line;
  bool closed = false;
  std::thread writer([&] {
    for (;;) {
      Chunk c;
      {
        absl::MutexLock lock(&mu);
        auto ready = [&] { return !line.empty() || closed; };
        mu.Await(absl::Condition(&ready));
        if (line.empty()) break;
        c = std::move(line.front());
        line.pop_front();
      }
      absl::SleepFor(c.due - absl::Now());
      size_t off = 0;
      while (off < c.bytes.size()) {
        const ssize_t n = write(to, c.bytes.data() + off, c.bytes.size() - off);
        if (n <= 0) break;
        off += static_cast<size_t>(n);
      }
    }
    shutdown(to, SHUT_WR);
  });
  std::vector<char> buf(1 << 16);
  for (;;) {
    const ssize_t n = read(from, buf.data(), buf.size());
    absl::MutexLock lock(&mu);
    if (n <= 0) {
      closed = true;
      break;
    }
    line.push_back({absl::Now() + delay, std::string(buf.data(), static_cast<size_t>(n))});
  }
  writer.join();
}

int Listen(int* port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  listen(fd, 16);
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  *port = ntohs(a.sin_port);
  return fd;
}

int Connect(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) return -1;
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

// Accepts connections on `listen_fd` and joins each to `target_port` through
// two delayed pumps (threads detached: the process ends with the bench).
void Proxy(int listen_fd, int target_port, absl::Duration delay) {
  for (;;) {
    const int in = accept(listen_fd, nullptr, nullptr);
    if (in < 0) return;
    const int one = 1;
    setsockopt(in, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    const int out = Connect(target_port);
    if (out < 0) {
      close(in);
      continue;
    }
    std::thread([=] { Pump(in, out, delay); }).detach();
    std::thread([=] { Pump(out, in, delay); }).detach();
  }
}

// The server side: reads `count` messages, acks, then sends `count`.
class Server final : public v1::Coordinator::Service {
 public:
  explicit Server(int count) : count_(count) {}
  grpc::Status Session(grpc::ServerContext*,
                       grpc::ServerReaderWriter<v1::CoordinatorMessage, v1::WorkerMessage>* stream) override {
    v1::WorkerMessage in;
    for (int i = 0; i < count_; ++i) {
      if (!stream->Read(&in)) return grpc::Status(grpc::StatusCode::ABORTED, "short upload");
    }
    v1::CoordinatorMessage ack;
    ack.mutable_ack();
    stream->Write(ack);
    v1::CoordinatorMessage out;
    out.mutable_hold_snapshot()->set_data(std::string(kMessageBytes, 'd'));
    for (int i = 0; i < count_; ++i) stream->Write(out);
    return grpc::Status::OK;
  }

 private:
  const int count_;
};

struct Result {
  double up_s = 0, down_s = 0;
  bool ok = false;  // every message crossed both ways
};

Result RunOnce(bool baton_settings, int count, absl::Duration delay) {
  Server service(count);
  grpc::ServerBuilder builder;
  int server_port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &server_port);
  grpc::ChannelArguments args;
  if (baton_settings) {
    SetTransportArgs(&builder);
    SetTransportArgs(&args);
  }  // else gRPC's defaults
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  int proxy_port = 0;
  const int listen_fd = Listen(&proxy_port);
  std::thread([=] { Proxy(listen_fd, server_port, delay); }).detach();

  auto channel = grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(proxy_port),
                                           grpc::InsecureChannelCredentials(), args);
  auto stub = v1::Coordinator::NewStub(channel);
  grpc::ClientContext ctx;
  auto stream = stub->Session(&ctx);
  v1::WorkerMessage out;
  out.mutable_snapshot()->set_data(std::string(kMessageBytes, 'u'));
  Result r;
  const absl::Time start = absl::Now();
  for (int i = 0; i < count; ++i) stream->Write(out);
  v1::CoordinatorMessage in;
  const bool acked_ok = stream->Read(&in) && in.has_ack();
  const absl::Time acked = absl::Now();
  int got = 0;
  while (acked_ok && got < count && stream->Read(&in)) ++got;
  const absl::Time end = absl::Now();
  stream->WritesDone();
  const grpc::Status status = stream->Finish();
  server->Shutdown();
  shutdown(listen_fd, SHUT_RDWR);
  close(listen_fd);
  r.ok = acked_ok && got == count && status.ok();
  if (!r.ok) {
    std::fprintf(stderr, "round failed: upload %s, %d of %d messages came down, status %s\n",
                 acked_ok ? "acked" : "not acked", got, count, status.error_message().c_str());
  }
  r.up_s = absl::ToDoubleSeconds(acked - start);
  r.down_s = absl::ToDoubleSeconds(end - acked);
  return r;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace
}  // namespace baton

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int mib = std::max(3, absl::GetFlag(FLAGS_mib));
  const int count = mib / 3;
  const absl::Duration delay = absl::Milliseconds(std::max(0.0, absl::GetFlag(FLAGS_delay_ms)));
  std::vector<double> up[2], down[2];
  for (int round = 0; round < std::max(1, absl::GetFlag(FLAGS_rounds)); ++round) {
    for (int s = 0; s < 2; ++s) {
      const baton::Result r = baton::RunOnce(s == 1, count, delay);
      if (!r.ok) return 1;
      up[s].push_back(r.up_s);
      down[s].push_back(r.down_s);
    }
  }
  const double mib_sent = count * 3.0;
  const double round_trip_s = 2e-3 * absl::GetFlag(FLAGS_delay_ms);
  std::printf("%d MiB each way as %d messages of 3 MiB, round trip %.1f ms\n", count * 3, count,
              round_trip_s * 1e3);
  std::printf("%-28s %8s %9s %10s %8s %9s %10s\n", "settings", "up s", "up MiB/s", "MiB/trip", "down s",
              "down MiB/s", "MiB/trip");
  const char* names[2] = {"gRPC default (BDP probe)", "baton (no BDP probe)"};
  for (int s : {0, 1}) {
    const double u = baton::Median(up[s]), d = baton::Median(down[s]);
    std::printf("%-28s %8.3f %9.1f %10.2f %8.3f %9.1f %10.2f\n", names[s], u, mib_sent / u,
                round_trip_s > 0 ? mib_sent / u * round_trip_s : 0.0, d, mib_sent / d,
                round_trip_s > 0 ? mib_sent / d * round_trip_s : 0.0);
  }
  std::printf("ratio baton / gRPC default (time): up %.2f, down %.2f\n", baton::Median(up[1]) / baton::Median(up[0]),
              baton::Median(down[1]) / baton::Median(down[0]));
  return 0;
}
