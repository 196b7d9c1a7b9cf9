#include "common/join_token.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "absl/status/status.h"
#include "gtest/gtest.h"

namespace baton {
namespace {

class JoinTokenTest : public ::testing::Test {
 protected:
  std::string Write(const std::string& name, const std::string& text, mode_t mode = 0600) {
    const std::string path = Path(name);
    std::ofstream(path, std::ios::binary) << text;
    chmod(path.c_str(), mode);
    return path;
  }
  std::string Path(const std::string& name) { return std::string(getenv("TEST_TMPDIR")) + "/" + name; }

  // The error of reading `path`: INVALID_ARGUMENT, naming the flag and the file.
  std::string Error(const std::string& path) {
    absl::StatusOr<std::string> token = ReadJoinTokenFile(path);
    EXPECT_FALSE(token.ok()) << path << " was accepted as '" << *token << "'";
    if (token.ok()) return "";
    EXPECT_EQ(token.status().code(), absl::StatusCode::kInvalidArgument) << token.status();
    EXPECT_NE(token.status().message().find("--join_token_file='" + path + "'"), std::string::npos)
        << token.status();
    return std::string(token.status().message());
  }
};

constexpr char kToken[] = "0123456789abcdef0123456789abcdef";

TEST_F(JoinTokenTest, TheTokenIsTheFileWithoutSurroundingWhitespace) {
  std::string warning;
  for (const std::string& text : {std::string(kToken), std::string(kToken) + "\n", std::string(kToken) + "\r\n",
                                  "  " + std::string(kToken) + " \n\n"}) {
    absl::StatusOr<std::string> token = ReadJoinTokenFile(Write("ok", text), &warning);
    ASSERT_TRUE(token.ok()) << token.status();
    EXPECT_EQ(*token, kToken);
    EXPECT_TRUE(warning.empty()) << warning;
  }
  // The bounds of the token's length are both accepted.
  EXPECT_EQ(*ReadJoinTokenFile(Write("min", std::string(16, 'a') + "\n")), std::string(16, 'a'));
  EXPECT_EQ(*ReadJoinTokenFile(Write("max", std::string(1024, 'b') + "\n")), std::string(1024, 'b'));
}

TEST_F(JoinTokenTest, AFileOthersCanReadIsAcceptedWithAWarning) {
  std::string warning;
  absl::StatusOr<std::string> token = ReadJoinTokenFile(Write("shared", kToken, 0644), &warning);
  ASSERT_TRUE(token.ok()) << token.status();
  EXPECT_EQ(*token, kToken);
  EXPECT_NE(warning.find("chmod 600"), std::string::npos) << warning;
  EXPECT_NE(warning.find("644"), std::string::npos) << warning;
}

TEST_F(JoinTokenTest, MissingAndNonRegularFilesAreRefused) {
  EXPECT_NE(Error(Path("absent")).find("does not exist"), std::string::npos);
  EXPECT_NE(Error(std::string(getenv("TEST_TMPDIR"))).find("not a regular file"), std::string::npos);
  // A device would be read forever; a FIFO would block the open.
  EXPECT_NE(Error("/dev/zero").find("not a regular file"), std::string::npos);
  const std::string fifo = Path("fifo");
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_NE(Error(fifo).find("not a regular file"), std::string::npos);
}

TEST_F(JoinTokenTest, EmptyAndOversizedFilesAreRefused) {
  EXPECT_NE(Error(Write("empty", "")).find("is empty"), std::string::npos);
  EXPECT_NE(Error(Write("blank", " \n\n")).find("is empty"), std::string::npos);
  EXPECT_NE(Error(Write("huge", std::string(1 << 20, 'a'))).find("1048576 bytes"), std::string::npos);
  EXPECT_NE(Error(Write("4097", std::string(4097, 'a'))).find("4097 bytes"), std::string::npos);
}

TEST_F(JoinTokenTest, BadTokensAreRefused) {
  EXPECT_NE(Error(Write("short", "short\n")).find("5-character token"), std::string::npos);
  EXPECT_NE(Error(Write("long", std::string(1025, 'a'))).find("1025-character token"), std::string::npos);
  EXPECT_NE(Error(Write("space", "has a space in the token\n")).find("printable"), std::string::npos);
  EXPECT_NE(Error(Write("control", std::string(kToken) + "\x01" + "x")).find("printable"), std::string::npos);
  // A key or certificate given by mistake: its first line would pass as a token.
  EXPECT_NE(Error(Write("pem", "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC\n"
                               "-----END PRIVATE KEY-----\n"))
                .find("more than one line"),
            std::string::npos);
}

TEST_F(JoinTokenTest, TheFlagIsOptional) {
  absl::StatusOr<std::string> none = LoadJoinTokenFlag("");
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(*none, "");
  EXPECT_EQ(*LoadJoinTokenFlag(Write("flag", std::string(kToken) + "\n")), kToken);
  EXPECT_EQ(LoadJoinTokenFlag(Path("absent")).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace baton
