// One rank of gloo_multiprocess_test in its own process: rendezvous through
// the coordinator KV at <kv address>, then run <mode>:
//   allreduce  all-reduce a known pattern and exit 0 iff the sum is right
//   stream     send 16 MiB messages with tags 0, 1, ... to rank 0 until killed
//   idle       post nothing and wait to be killed (the test stops it with
//              SIGSTOP so that nothing reads its socket)
// Usage: comm_test_peer <kv address> <job> <generation> <group> <rank> <size> <mode>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "worker/comm/communicator_factory.h"
#include "worker/comm/coordinator_store.h"
#include "worker/comm/fake_coordinator_kv.h"

namespace baton::comm {
namespace {

float Value(int rank, int64_t i) { return static_cast<float>((rank + 1) * 100 + i % 13); }

int Main(int argc, char** argv) {
  int64_t generation = 0;
  int rank = 0, size = 0;
  if (argc != 8 || !absl::SimpleAtoi(argv[3], &generation) || !absl::SimpleAtoi(argv[5], &rank) ||
      !absl::SimpleAtoi(argv[6], &size)) {
    std::fprintf(stderr, "usage: %s <kv address> <job> <generation> <group> <rank> <size> <mode>\n",
                 argv[0]);
    return 2;
  }
  const std::string mode = argv[7];
  CoordinatorStore store(ConnectCoordinator(argv[1]), argv[2], generation);
  CommunicatorSpec spec;
  spec.group = argv[4];
  spec.generation = generation;
  spec.rank = rank;
  spec.size = size;
  spec.rendezvous_timeout = absl::Seconds(20);
  auto comm = CreateCommunicator(store, spec);
  if (!comm.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", rank, comm.status().ToString().c_str());
    return 3;
  }
  if (mode == "allreduce") {
    const int64_t count = 4099;
    std::vector<float> x(count);
    for (int64_t i = 0; i < count; ++i) x[i] = Value(rank, i);
    absl::Status s = (*comm)->AllReduceSum(Buffer::Host(x.data(), count))->Wait(absl::Seconds(20));
    if (!s.ok()) {
      std::fprintf(stderr, "rank %d: %s\n", rank, s.ToString().c_str());
      return 4;
    }
    for (int64_t i = 0; i < count; ++i) {
      float want = 0;
      for (int r = 0; r < size; ++r) want += Value(r, i);
      if (x[i] != want) {
        std::fprintf(stderr, "rank %d: element %ld is %f, want %f\n", rank, static_cast<long>(i),
                     x[i], want);
        return 5;
      }
    }
    return 0;
  }
  if (mode == "stream") {
    std::vector<uint8_t> chunk(16 << 20, 0x5a);
    for (uint64_t tag = 0;; ++tag) {
      absl::Status s = (*comm)
                           ->Send(Buffer{chunk.data(), static_cast<int64_t>(chunk.size()),
                                         DType::kUInt8, -1},
                                  0, tag)
                           ->Wait(absl::Seconds(20));
      if (!s.ok()) return 6;
    }
  }
  if (mode == "idle") {
    for (;;) pause();
  }
  std::fprintf(stderr, "unknown mode %s\n", mode.c_str());
  return 2;
}

}  // namespace
}  // namespace baton::comm

int main(int argc, char** argv) { return baton::comm::Main(argc, argv); }
