#include "worker/data/shard_paths.h"

#include <dirent.h>
#include <glob.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/path_confinement.h"

namespace baton::data {
namespace {

class Expander {
 public:
  Expander(std::string root, const std::string& data_dir, const std::string& spec, TokenFormat format,
           const std::string& field)
      : root_(std::move(root)),
        data_dir_(data_dir),
        format_(format),
        what_(absl::StrCat(field, " = \"", spec, "\"")) {}

  // `file` (absolute, not necessarily canonical) must resolve to a regular
  // file under the root; returns its canonical path.
  absl::StatusOr<std::string> Confine(const std::string& file) const {
    absl::StatusOr<std::string> real = RealPath(file);
    if (!real.ok()) {
      return absl::NotFoundError(absl::StrCat(what_, ": \"", file, "\": cannot open under --data_dir=", data_dir_,
                                              ": ", real.status().message()));
    }
    if (!IsUnder(*real, root_)) {
      return absl::PermissionDeniedError(absl::StrCat(what_, ": \"", file, "\" resolves to ", *real,
                                                      ", outside this worker's --data_dir=", root_,
                                                      "; put the file under it"));
    }
    struct stat st;
    if (stat(real->c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
      return absl::InvalidArgumentError(
          absl::StrCat(what_, ": \"", file, "\" is not a regular file; name shard files (or narrow the pattern)"));
    }
    return *real;
  }

  // One shard from a name the glob or directory gave (absolute).
  absl::Status Add(const std::string& file) {
    if (format_ != TokenFormat::kMegatron) {
      absl::StatusOr<std::string> real = Confine(file);
      if (!real.ok()) return real.status();
      results_.push_back(*real);
    } else {
      if (!absl::EndsWith(file, ".idx") && !absl::EndsWith(file, ".bin")) return absl::OkStatus();
      const std::string prefix = file.substr(0, file.size() - 4);
      if (!prefixes_.insert(prefix).second) return absl::OkStatus();
      if (absl::Status s = AddPrefix(prefix); !s.ok()) return s;
    }
    if (static_cast<int>(results_.size()) > kMaxTokenShards) {
      return absl::InvalidArgumentError(absl::StrCat(what_, " names more than ", kMaxTokenShards,
                                                     " shards, the most one job maps: merge shards"));
    }
    return absl::OkStatus();
  }

  // A Megatron prefix: its files, where they exist, lie under the root (a
  // missing one is NOT_FOUND when TokenShard opens it).
  absl::Status AddPrefix(const std::string& prefix) {
    for (const char* ext : {".idx", ".bin"}) {
      const std::string file = prefix + ext;
      struct stat st;
      if (lstat(file.c_str(), &st) != 0) continue;
      if (absl::StatusOr<std::string> real = Confine(file); !real.ok()) return real.status();
    }
    results_.push_back(prefix);
    return absl::OkStatus();
  }

  absl::Status Glob(const std::string& pattern) {
    glob_t g;
    std::memset(&g, 0, sizeof(g));
    const int rc = glob(pattern.c_str(), 0, nullptr, &g);
    if (rc == GLOB_NOMATCH) {
      globfree(&g);
      return absl::NotFoundError(absl::StrCat(what_, ": the pattern matches no file under --data_dir=", data_dir_,
                                              "; check the pattern and that the shards were copied there"));
    }
    if (rc != 0) {
      globfree(&g);
      return absl::InvalidArgumentError(absl::StrCat(what_, ": cannot expand the pattern (glob error ", rc, ")"));
    }
    std::vector<std::string> matches(g.gl_pathv, g.gl_pathv + g.gl_pathc);
    globfree(&g);
    std::sort(matches.begin(), matches.end());  // bytewise, whatever the locale
    for (const std::string& m : matches) {
      if (absl::Status s = Add(m); !s.ok()) return s;
    }
    return Done("the pattern matches no .idx or .bin file");
  }

  absl::Status Directory(const std::string& dir) {
    DIR* d = opendir(dir.c_str());
    if (d == nullptr) {
      return absl::NotFoundError(absl::StrCat(what_, ": cannot list ", dir, ": ", std::strerror(errno)));
    }
    const char* ext = format_ == TokenFormat::kMegatron ? ".idx" : ".bin";
    std::vector<std::string> names;
    bool too_many = false;
    while (dirent* e = readdir(d)) {
      const std::string name = e->d_name;
      if (name.empty() || name[0] == '.' || !absl::EndsWith(name, ext)) continue;
      if (static_cast<int>(names.size()) == kMaxTokenShards) {
        too_many = true;
        break;
      }
      names.push_back(name);
    }
    closedir(d);
    if (too_many) {
      return absl::InvalidArgumentError(absl::StrCat(what_, ": the directory holds more than ", kMaxTokenShards,
                                                     " *", ext, " shards, the most one job maps: merge shards"));
    }
    std::sort(names.begin(), names.end());
    for (const std::string& name : names) {
      if (absl::Status s = Add(absl::StrCat(dir, "/", name)); !s.ok()) return s;
    }
    return Done(absl::StrCat("the directory holds no *", ext, " shard; put shards named *", ext,
                             " in it, or give a glob"));
  }

  absl::Status Done(const std::string& if_empty) const {
    if (!results_.empty()) return absl::OkStatus();
    return absl::NotFoundError(absl::StrCat(what_, ": ", if_empty));
  }

  std::vector<std::string> TakeResults() { return std::move(results_); }

 private:
  const std::string root_;
  const std::string data_dir_;
  const TokenFormat format_;
  const std::string what_;  // `field = "spec"`, the start of every message
  std::vector<std::string> results_;
  std::set<std::string> prefixes_;
};

bool IsDirectory(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool Exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ExpandTokenShards(const std::string& data_dir, const std::string& spec,
                                                           TokenFormat format, const std::string& field) {
  if (data_dir.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        field, " = \"", spec, "\": this worker reads no data files; start it with --data_dir=DIR and put the "
        "shards under DIR"));
  }
  if (spec.empty()) return absl::InvalidArgumentError(absl::StrCat(field, " is empty: give a file path"));
  absl::StatusOr<std::string> root = RealPath(data_dir);
  if (!root.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("--data_dir=", data_dir, " cannot be resolved: ", root.status().message()));
  }
  const std::string joined = spec.front() == '/' ? spec : absl::StrCat(*root, "/", spec);
  Expander expander(*root, data_dir, spec, format, field);
  absl::Status status;
  if (spec.find_first_of("*?[") != std::string::npos) {
    status = expander.Glob(joined);
  } else if (IsDirectory(joined)) {
    // The directory itself must lie under the root too.
    absl::StatusOr<std::string> real = RealPath(joined);
    if (!real.ok() || !IsUnder(*real, *root)) {
      return absl::PermissionDeniedError(absl::StrCat(field, " = \"", spec, "\" resolves to ",
                                                      real.ok() ? *real : joined, ", outside this worker's --data_dir=",
                                                      *root, "; put the shards under it"));
    }
    status = expander.Directory(*real);
  } else if (format != TokenFormat::kMegatron) {
    status = expander.Add(joined);
  } else {
    std::string prefix = joined;
    if (!Exists(prefix + ".idx") && (absl::EndsWith(prefix, ".idx") || absl::EndsWith(prefix, ".bin"))) {
      prefix.resize(prefix.size() - 4);
    }
    status = expander.AddPrefix(prefix);
  }
  if (!status.ok()) return status;
  return expander.TakeResults();
}

}  // namespace baton::data
