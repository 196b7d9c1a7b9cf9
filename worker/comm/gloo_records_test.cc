// What Gloo's rendezvous writes to the store (and so to the coordinator's
// KV): every byte of an address record is defined, i.e. the sockaddr_storage
// padding after the address is zero, not whatever was on the stack.
#include <netinet/in.h>
#include <sys/socket.h>

#include <cstring>
#include <map>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "worker/comm/communicator_factory.h"
#include "worker/comm/store.h"

namespace baton::comm {
namespace {

// Records every value set, then forwards to an in-memory store.
class RecordingStore : public Store {
 public:
  absl::Status Set(absl::string_view key, absl::string_view value) override {
    {
      absl::MutexLock lock(&mu_);
      values_[std::string(key)] = std::string(value);
    }
    return base_.Set(key, value);
  }
  absl::StatusOr<std::string> Get(absl::string_view key, absl::Duration timeout) override {
    return base_.Get(key, timeout);
  }
  absl::Status Wait(absl::Span<const std::string> keys, absl::Duration timeout) override {
    return base_.Wait(keys, timeout);
  }
  absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta) override { return base_.Add(key, delta); }

  std::map<std::string, std::string> values() {
    absl::MutexLock lock(&mu_);
    return values_;
  }

 private:
  InMemoryStore base_;
  absl::Mutex mu_;
  std::map<std::string, std::string> values_ ABSL_GUARDED_BY(mu_);
};

TEST(GlooRecordsTest, AddressRecordsHoldOnlyDefinedBytes) {
  RecordingStore store;
  constexpr int kSize = 3;
  std::vector<std::thread> ranks;
  std::vector<absl::Status> results(kSize);
  std::vector<std::unique_ptr<Communicator>> comms(kSize);
  for (int r = 0; r < kSize; ++r) {
    ranks.emplace_back([&, r] {
      CommunicatorSpec spec;
      spec.group = "dp0";
      spec.generation = 1;
      spec.rank = r;
      spec.size = kSize;
      spec.rendezvous_timeout = absl::Seconds(30);
      auto c = CreateCommunicator(store, spec);
      results[r] = c.status();
      if (c.ok()) comms[r] = *std::move(c);
    });
  }
  for (auto& t : ranks) t.join();
  for (int r = 0; r < kSize; ++r) ASSERT_TRUE(results[r].ok()) << results[r];

  // Gloo's tcp::Address record: a sockaddr_storage and a sequence number.
  constexpr size_t kRecord = sizeof(sockaddr_storage) + sizeof(ssize_t);
  int records = 0;
  for (const auto& [key, value] : store.values()) {
    if (key.find("/gloo/") == std::string::npos || value.size() % kRecord != 0 || value.empty()) continue;
    for (size_t off = 0; off < value.size(); off += kRecord) {
      sockaddr_storage ss;
      std::memcpy(&ss, value.data() + off, sizeof(ss));
      ASSERT_TRUE(ss.ss_family == AF_INET || ss.ss_family == AF_INET6) << key;
      const size_t used = ss.ss_family == AF_INET ? offsetof(sockaddr_in, sin_zero) : sizeof(sockaddr_in6);
      for (size_t i = used; i < sizeof(ss); ++i) {
        ASSERT_EQ(value[off + i], 0) << key << ": byte " << i << " of the record after the address is not zero";
      }
      ++records;
    }
  }
  EXPECT_EQ(records, kSize * (kSize - 1)) << "one record per pair";
}

}  // namespace
}  // namespace baton::comm
