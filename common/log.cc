#include "common/log.h"

#include <cstdio>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace baton {
namespace {

absl::Mutex log_mu;
std::string* component ABSL_GUARDED_BY(log_mu) = nullptr;

}  // namespace

void SetLogComponent(absl::string_view name) {
  absl::MutexLock lock(&log_mu);
  delete component;
  component = new std::string(name);
}

LogMessage::LogMessage(LogSeverity severity, const char*, int) : severity_(severity) {}

LogMessage::~LogMessage() {
  const char sev = severity_ == LogSeverity::kInfo ? 'I' : severity_ == LogSeverity::kWarning ? 'W' : 'E';
  std::string time = absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone());
  absl::MutexLock lock(&log_mu);
  std::fprintf(stderr, "%s %c %s] %s\n", time.c_str(), sev,
               component ? component->c_str() : "baton", stream_.str().c_str());
  std::fflush(stderr);
}

}  // namespace baton
