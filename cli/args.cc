#include "cli/args.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace baton::cli {

absl::StatusOr<Args> Args::Parse(const std::vector<std::string>& argv,
                                 const std::set<std::string>& known,
                                 const std::set<std::string>& booleans) {
  Args args;
  for (size_t i = 0; i < argv.size(); ++i) {
    const std::string& a = argv[i];
    if (a.size() < 3 || a.compare(0, 2, "--") != 0) {
      args.positionals_.push_back(a);
      continue;
    }
    std::string name = a.substr(2), value;
    size_t eq = name.find('=');
    bool has_value = eq != std::string::npos;
    if (has_value) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    }
    if (!known.count(name) && !booleans.count(name)) {
      std::vector<std::string> all(known.begin(), known.end());
      all.insert(all.end(), booleans.begin(), booleans.end());
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name, "; known flags: --",
                                                     absl::StrJoin(all, ", --")));
    }
    if (booleans.count(name)) {
      if (has_value && value != "true" && value != "false") {
        return absl::InvalidArgumentError(
            absl::StrCat("--", name, " takes no value (or =true/=false), got '", value, "'"));
      }
      args.values_[name] = has_value ? value : "true";
      continue;
    }
    if (!has_value) {
      if (i + 1 >= argv.size()) {
        return absl::InvalidArgumentError(absl::StrCat("--", name, " needs a value"));
      }
      value = argv[++i];
    }
    args.values_[name] = value;
  }
  return args;
}

std::string Args::GetString(const std::string& name, const std::string& def) const {
  auto it = values_.find(name);
  return it == values_.end() ? def : it->second;
}

absl::StatusOr<int64_t> Args::GetInt(const std::string& name, int64_t def) const {
  auto it = values_.find(name);
  if (it == values_.end()) return def;
  int64_t v;
  if (!absl::SimpleAtoi(it->second, &v)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", name, " must be an integer, got '", it->second, "'"));
  }
  return v;
}

absl::StatusOr<double> Args::GetDouble(const std::string& name, double def) const {
  auto it = values_.find(name);
  if (it == values_.end()) return def;
  double v;
  if (!absl::SimpleAtod(it->second, &v)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", name, " must be a number, got '", it->second, "'"));
  }
  return v;
}

bool Args::GetBool(const std::string& name) const { return GetString(name, "false") == "true"; }

}  // namespace baton::cli
