#include "common/path_confinement.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "gtest/gtest.h"

namespace baton {
namespace {

std::string MakeTempDir() {
  std::string tmpl = std::string(std::getenv("TEST_TMPDIR") ? std::getenv("TEST_TMPDIR") : "/tmp") + "/confineXXXXXX";
  EXPECT_NE(mkdtemp(tmpl.data()), nullptr);
  return *RealPath(tmpl);
}

TEST(PathConfinementTest, WritesGoOnlyUnderTheRoots) {
  const std::string base = MakeTempDir();
  const std::string out = base + "/out", other = base + "/other";
  ASSERT_EQ(mkdir(out.c_str(), 0755), 0);
  ASSERT_EQ(mkdir(other.c_str(), 0755), 0);
  ASSERT_EQ(mkdir((out + "/existing").c_str(), 0755), 0);
  ASSERT_EQ(symlink(other.c_str(), (out + "/escape").c_str()), 0);
  const std::vector<std::string> roots = {out};

  // Inside, existing or to be created (several levels deep).
  EXPECT_EQ(*ConfineWritePath(out + "/existing", roots, "output_dir", "dir"), out + "/existing");
  EXPECT_EQ(*ConfineWritePath(out + "/final/step-1", roots, "output_dir", "dir"), out + "/final/step-1");
  EXPECT_EQ(*ConfineWritePath(out, roots, "output_dir", "dir"), out);
  EXPECT_EQ(*ConfineWritePath(out + "/existing/../new", roots, "output_dir", "dir"), out + "/new");

  struct Case {
    std::string path;
    absl::StatusCode code;
  };
  for (const Case& c : std::vector<Case>{
           {other + "/w", absl::StatusCode::kPermissionDenied},               // another directory
           {out + "/../other/w", absl::StatusCode::kPermissionDenied},        // ".." out of it
           {out + "/new/../../other", absl::StatusCode::kPermissionDenied},   // ".." below a new part
           {out + "/escape/w", absl::StatusCode::kPermissionDenied},          // a symlink out of it
           {out + "/escape", absl::StatusCode::kPermissionDenied},
           {base + "/outside", absl::StatusCode::kPermissionDenied},          // a sibling prefix
           {"/etc", absl::StatusCode::kPermissionDenied},
           {"", absl::StatusCode::kPermissionDenied},
       }) {
    absl::StatusOr<std::string> r = ConfineWritePath(c.path, roots, "output_dir", "the weights directory");
    EXPECT_EQ(r.status().code(), c.code) << c.path << ": " << r.status();
    EXPECT_NE(r.status().message().find("--output_dir"), std::string::npos) << r.status();
    EXPECT_NE(r.status().message().find("the weights directory"), std::string::npos) << r.status();
  }
  // "outX" is not under "out".
  ASSERT_EQ(mkdir((base + "/outX").c_str(), 0755), 0);
  EXPECT_FALSE(ConfineWritePath(base + "/outX/w", roots, "output_dir", "dir").ok());
  // A second root admits its own paths.
  EXPECT_TRUE(ConfineWritePath(other + "/w", {out, other}, "output_dir", "dir").ok());
  // No root: nothing is written, and the message says how to allow it.
  absl::StatusOr<std::string> none = ConfineWritePath(out + "/w", {}, "output_dir", "dir");
  EXPECT_EQ(none.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(none.status().message().find("start it with --output_dir=DIR"), std::string::npos) << none.status();
}

TEST(PathConfinementTest, RelativePathsAreTakenFromTheWorkingDirectory) {
  const std::string base = MakeTempDir();
  ASSERT_EQ(chdir(base.c_str()), 0);
  EXPECT_EQ(*CanonicalPathForWrite("a/b"), base + "/a/b");
  EXPECT_TRUE(ConfineWritePath("a/b", {base}, "output_dir", "dir").ok());
  EXPECT_FALSE(ConfineWritePath("../x", {base}, "output_dir", "dir").ok());
}

TEST(PathConfinementTest, IsUnderComparesWholeComponents) {
  EXPECT_TRUE(IsUnder("/a/b", "/a"));
  EXPECT_TRUE(IsUnder("/a", "/a"));
  EXPECT_TRUE(IsUnder("/x", "/"));
  EXPECT_FALSE(IsUnder("/ab", "/a"));
  EXPECT_FALSE(IsUnder("/", "/a"));
}

}  // namespace
}  // namespace baton
