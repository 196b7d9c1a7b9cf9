// Flag parsing for batonctl subcommands: `--name=value`, `--name value` and
// boolean `--name`. Unknown flags and malformed values are errors that name
// the flag, so every subcommand rejects typos the same way (exit code 2).
#ifndef BATON_CLI_ARGS_H_
#define BATON_CLI_ARGS_H_

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace baton::cli {

class Args {
 public:
  // `known` lists accepted flag names (without "--"); `booleans` those that
  // take no value. Non-flag words are kept in order as positionals().
  static absl::StatusOr<Args> Parse(const std::vector<std::string>& argv,
                                    const std::set<std::string>& known,
                                    const std::set<std::string>& booleans = {});

  bool Has(const std::string& name) const { return values_.count(name) > 0; }
  std::string GetString(const std::string& name, const std::string& def) const;
  absl::StatusOr<int64_t> GetInt(const std::string& name, int64_t def) const;
  absl::StatusOr<double> GetDouble(const std::string& name, double def) const;
  bool GetBool(const std::string& name) const;
  const std::vector<std::string>& positionals() const { return positionals_; }

 private:
  std::map<std::string, std::string> values_;
  std::vector<std::string> positionals_;
};

}  // namespace baton::cli

#endif  // BATON_CLI_ARGS_H_
