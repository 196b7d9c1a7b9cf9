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

std::vector<double> ReadStepField(const std::string& path, const std::string& key) {
  std::vector<double> values;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    auto v = JsonValue::Parse(line);
    if (!v.ok() || v->Find("step") == nullptr) continue;
    const JsonValue* x = v->Find(key);
    if (x != nullptr && x->is_number()) values.push_back(x->number());
  }
  return values;
}

std::vector<EvalLine> ReadEvalLines(const std::string& path) {
  std::vector<EvalLine> lines;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    auto v = JsonValue::Parse(line);
    if (!v.ok() || v->Find("eval") == nullptr) continue;
    auto num = [&](const char* key) {
      const JsonValue* x = v->Find(key);
      return x != nullptr && x->is_number() ? x->number() : -1.0;
    };
    EvalLine e;
    e.step = static_cast<int64_t>(num("eval"));
    e.loss = num("loss");
    e.perplexity = num("perplexity");
    e.tokens = static_cast<int64_t>(num("tokens"));
    const size_t at = line.find("\"loss\": ");
    if (at != std::string::npos) e.loss_text = line.substr(at, line.find(',', at) - at);
    lines.push_back(std::move(e));
  }
  return lines;
}

}  // namespace baton::testing
