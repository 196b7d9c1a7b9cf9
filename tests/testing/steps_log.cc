#include "tests/testing/steps_log.h"

#include <fstream>

#include "common/json.h"

namespace baton::testing {

StepLosses ReadStepLosses(const std::string& path) {
  StepLosses losses;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    auto v = JsonValue::Parse(line);
    if (!v.ok() || v->Find("step") == nullptr || v->Find("loss") == nullptr) continue;
    losses.values.push_back(v->Find("loss")->number());
    const size_t at = line.find("\"loss\": ");
    losses.text.push_back(line.substr(at, line.find(',', at) - at));
  }
  return losses;
}

}  // namespace baton::testing
