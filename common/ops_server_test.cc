#include "common/ops_server.h"

#include <atomic>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "common/http_get.h"
#include "gtest/gtest.h"
#include "prometheus/counter.h"

namespace baton {
namespace {

TEST(OpsServerTest, ServesMetricsHealthAndReadiness) {
  auto registry = std::make_shared<prometheus::Registry>();
  auto& counter = prometheus::BuildCounter().Name("baton_test_events_total").Help("test").Register(*registry).Add({});
  counter.Increment(3);
  std::atomic<bool> ready{false};
  int scrapes = 0;
  auto server = OpsServer::Start(
      "127.0.0.1:0", registry,
      [&]() { return ready ? absl::OkStatus() : absl::UnavailableError("coordinator unreachable"); },
      [&]() { ++scrapes; });
  ASSERT_TRUE(server.ok()) << server.status();
  int port = (*server)->port();
  ASSERT_GT(port, 0);

  auto metrics = HttpGet("127.0.0.1", port, "/metrics");
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_EQ(metrics->code, 200);
  EXPECT_NE(metrics->body.find("baton_test_events_total 3"), std::string::npos) << metrics->body;
  EXPECT_EQ(scrapes, 1);

  auto health = HttpGet("127.0.0.1", port, "/healthz");
  ASSERT_TRUE(health.ok());
  EXPECT_EQ(health->code, 200);

  auto notready = HttpGet("127.0.0.1", port, "/readyz");
  ASSERT_TRUE(notready.ok());
  EXPECT_EQ(notready->code, 503);
  EXPECT_NE(notready->body.find("coordinator unreachable"), std::string::npos);
  ready = true;
  auto isready = HttpGet("127.0.0.1", port, "/readyz");
  ASSERT_TRUE(isready.ok());
  EXPECT_EQ(isready->code, 200);
}

TEST(OpsServerTest, BadListenAddressesAreRejectedWithTheFlagNamed) {
  auto registry = std::make_shared<prometheus::Registry>();
  for (const char* bad : {"nonsense", "127.0.0.1:", "127.0.0.1:70000", "127.0.0.1:-1"}) {
    auto server = OpsServer::Start(bad, registry, nullptr);
    ASSERT_FALSE(server.ok()) << bad;
    EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(server.status().message().find("--http_listen"), std::string::npos);
  }
}

TEST(OpsServerTest, UnknownPathsAndMethodsGetClearAnswers) {
  auto registry = std::make_shared<prometheus::Registry>();
  auto server = OpsServer::Start("127.0.0.1:0", registry, nullptr);
  ASSERT_TRUE(server.ok());
  auto missing = HttpGet("127.0.0.1", (*server)->port(), "/nope");
  ASSERT_TRUE(missing.ok());
  EXPECT_EQ(missing->code, 404);
  EXPECT_NE(missing->body.find("/metrics"), std::string::npos);
  // Many scrapes in a row: the server keeps answering.
  for (int i = 0; i < 50; ++i) {
    auto r = HttpGet("127.0.0.1", (*server)->port(), "/metrics");
    ASSERT_TRUE(r.ok()) << i;
    EXPECT_EQ(r->code, 200);
  }
}

TEST(OpsServerTest, PortInUseIsAnErrorNotACrash) {
  auto registry = std::make_shared<prometheus::Registry>();
  auto first = OpsServer::Start("127.0.0.1:0", registry, nullptr);
  ASSERT_TRUE(first.ok());
  auto second = OpsServer::Start("127.0.0.1:" + std::to_string((*first)->port()), registry, nullptr);
  EXPECT_FALSE(second.ok());
}

TEST(OpsServerTest, PortFileIsValidJson) {
  std::string path = std::string(getenv("TEST_TMPDIR")) + "/ports.json";
  ASSERT_TRUE(WritePortFile(path, 1234, 5678).ok());
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  EXPECT_EQ(s.str(), "{\"grpc\": 1234, \"http\": 5678}\n");
}

}  // namespace
}  // namespace baton
