#include "common/grpc_credentials.h"

#include <sys/stat.h>

#include <cstdlib>
#include <fstream>

#include "gtest/gtest.h"

namespace baton {
namespace {

std::string Write(const std::string& name, const std::string& text, mode_t mode = 0600) {
  std::string path = std::string(std::getenv("TEST_TMPDIR")) + "/" + name;
  std::ofstream(path) << text;
  chmod(path.c_str(), mode);
  return path;
}

TEST(GrpcCredentialsTest, PlaintextOnlyOnLoopbackUnlessInsecure) {
  for (const char* ok : {"127.0.0.1:7070", "localhost:1", "[::1]:80", "127.1.2.3:0"}) {
    EXPECT_TRUE(CheckPlaintextAddress(ok, "listen", false, false).ok()) << ok;
  }
  for (const char* bad : {"0.0.0.0:7070", ":7070", "10.0.0.1:7070", "[::]:7070", "coordinator:7070", "127.0.0.256:1"}) {
    absl::Status s = CheckPlaintextAddress(bad, "listen", false, false);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("--insecure"), std::string::npos) << s;
    EXPECT_NE(s.message().find("--listen"), std::string::npos) << s;
    EXPECT_TRUE(CheckPlaintextAddress(bad, "listen", true, false).ok()) << bad;
    EXPECT_TRUE(CheckPlaintextAddress(bad, "listen", false, true).ok()) << bad;
  }
}

TEST(GrpcCredentialsTest, TlsFlagsComeTogetherAndMustBePem) {
  auto none = LoadTlsConfig("", "", "");
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->enabled);
  auto partial = LoadTlsConfig("/a", "", "");
  EXPECT_EQ(partial.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(partial.status().message().find("go together"), std::string::npos);
  const std::string pem = Write("x.pem", "-----BEGIN CERTIFICATE-----\nAA==\n-----END CERTIFICATE-----\n");
  const std::string junk = Write("junk.pem", "hello");
  auto missing = LoadTlsConfig(pem, pem, "/nonexistent/ca.pem");
  EXPECT_NE(missing.status().message().find("--tls_ca"), std::string::npos) << missing.status();
  auto not_pem = LoadTlsConfig(pem, junk, pem);
  EXPECT_NE(not_pem.status().message().find("--tls_key"), std::string::npos) << not_pem.status();
  auto all = LoadTlsConfig(pem, pem, pem);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_TRUE(all->enabled);
}

TEST(GrpcCredentialsTest, ConstantTimeEquals) {
  EXPECT_TRUE(ConstantTimeEquals("abcdef", "abcdef"));
  EXPECT_FALSE(ConstantTimeEquals("abcdef", "abcdeg"));
  EXPECT_FALSE(ConstantTimeEquals("abcdef", "abcde"));
  EXPECT_TRUE(ConstantTimeEquals("", ""));
}

TEST(GrpcCredentialsTest, HostOfATarget) {
  EXPECT_EQ(HostOf("127.0.0.1:7070"), "127.0.0.1");
  EXPECT_EQ(HostOf("coordinator.baton.svc:7070"), "coordinator.baton.svc");
  EXPECT_EQ(HostOf("[::1]:7070"), "::1");
  EXPECT_EQ(HostOf("localhost"), "localhost");
}

}  // namespace
}  // namespace baton
