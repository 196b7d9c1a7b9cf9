// HttpGet: a tiny blocking HTTP/1.1 GET over loopback TCP, for tests and
// tools that scrape our own /metrics, /healthz and /readyz.
#ifndef BATON_COMMON_HTTP_GET_H_
#define BATON_COMMON_HTTP_GET_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace baton {

struct HttpResponse {
  int code = 0;
  std::string body;
};

absl::StatusOr<HttpResponse> HttpGet(const std::string& host, int port, const std::string& path,
                                     absl::Duration timeout = absl::Seconds(5));

}  // namespace baton

#endif  // BATON_COMMON_HTTP_GET_H_
