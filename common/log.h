// Minimal structured logging to stderr: one line per message, with UTC time,
// severity and component, e.g.
//   2026-11-29T12:00:00.123Z I coordinator] worker w1 ready (incarnation 3)
// BATON_LOG(INFO) << ...;  BATON_LOG(WARNING) << ...;  BATON_LOG(ERROR) << ...;
#ifndef BATON_COMMON_LOG_H_
#define BATON_COMMON_LOG_H_

#include <sstream>
#include <string>

#include "absl/strings/string_view.h"

namespace baton {

enum class LogSeverity { kInfo, kWarning, kError };

// Sets the component name printed on every line (default: "baton").
void SetLogComponent(absl::string_view component);

class LogMessage {
 public:
  LogMessage(LogSeverity severity, const char* file, int line);
  ~LogMessage();
  std::ostream& stream() { return stream_; }

 private:
  LogSeverity severity_;
  std::ostringstream stream_;
};

}  // namespace baton

#define BATON_LOG_SEVERITY_INFO ::baton::LogSeverity::kInfo
#define BATON_LOG_SEVERITY_WARNING ::baton::LogSeverity::kWarning
#define BATON_LOG_SEVERITY_ERROR ::baton::LogSeverity::kError
#define BATON_LOG(severity) \
  ::baton::LogMessage(BATON_LOG_SEVERITY_##severity, __FILE__, __LINE__).stream()

#endif  // BATON_COMMON_LOG_H_
