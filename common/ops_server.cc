#include "common/ops_server.h"

#include <civetweb.h>

#include <cstdio>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "prometheus/text_serializer.h"

namespace baton {
namespace {

void Reply(::mg_connection* conn, int code, const char* content_type, const std::string& body) {
  const char* reason = code == 200 ? "OK" : code == 503 ? "Service Unavailable" : "Error";
  mg_printf(conn,
            "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
            "Cache-Control: no-store\r\nConnection: close\r\n\r\n",
            code, reason, content_type, body.size());
  mg_write(conn, body.data(), body.size());
}

}  // namespace

absl::Status ParseHostPort(const std::string& value, const std::string& flag, std::string* host,
                           int* port) {
  size_t colon = value.rfind(':');
  if (colon == std::string::npos || colon + 1 == value.size()) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, "='", value,
                                                   "' must be HOST:PORT, e.g. 127.0.0.1:0"));
  }
  *host = value.substr(0, colon);
  if (!absl::SimpleAtoi(value.substr(colon + 1), port) || *port < 0 || *port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, "='", value, "': port must be 0..65535 (0 picks a free port)"));
  }
  if (host->empty()) *host = "0.0.0.0";
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<OpsServer>> OpsServer::Start(const std::string& listen,
                                                             std::shared_ptr<prometheus::Registry> registry,
                                                             ReadinessProbe readiness,
                                                             ScrapeHook before_scrape) {
  std::string host;
  int port = 0;
  if (absl::Status s = ParseHostPort(listen, "http_listen", &host, &port); !s.ok()) return s;
  std::string ports = host.front() == '[' ? listen : absl::StrCat(host, ":", port);
  static const bool initialized = (mg_init_library(0), true);
  (void)initialized;
  std::unique_ptr<OpsServer> server(new OpsServer());
  server->registry_ = std::move(registry);
  server->readiness_ = std::move(readiness);
  server->before_scrape_ = std::move(before_scrape);
  const char* options[] = {"listening_ports", ports.c_str(), "num_threads", "4", nullptr};
  struct mg_callbacks callbacks = {};
  struct mg_init_data init = {};
  init.callbacks = &callbacks;
  init.user_data = server.get();
  init.configuration_options = options;
  char error_text[256] = {};
  struct mg_error_data error = {};
  error.text = error_text;
  error.text_buffer_size = sizeof(error_text);
  server->ctx_ = mg_start2(&init, &error);
  if (server->ctx_ == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot serve HTTP on ", listen, ": ", error_text,
                                               "; pick another --http_listen"));
  }
  struct mg_server_port bound[4];
  int n = mg_get_server_ports(server->ctx_, 4, bound);
  if (n < 1) return absl::InternalError("HTTP server started but reports no port");
  server->port_ = bound[0].port;
  mg_set_request_handler(server->ctx_, "/metrics$", &OpsServer::HandleMetrics, server.get());
  mg_set_request_handler(server->ctx_, "/healthz$", &OpsServer::HandleHealthz, server.get());
  mg_set_request_handler(server->ctx_, "/readyz$", &OpsServer::HandleReadyz, server.get());
  return server;
}

OpsServer::~OpsServer() {
  if (ctx_ != nullptr) mg_stop(ctx_);
}

int OpsServer::HandleMetrics(::mg_connection* conn, void* self) {
  auto* server = static_cast<OpsServer*>(self);
  if (server->before_scrape_) server->before_scrape_();
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, server->registry_->Collect());
  Reply(conn, 200, "text/plain; version=0.0.4; charset=utf-8", out.str());
  return 200;
}

int OpsServer::HandleHealthz(::mg_connection* conn, void*) {
  Reply(conn, 200, "text/plain", "ok\n");
  return 200;
}

int OpsServer::HandleReadyz(::mg_connection* conn, void* self) {
  auto* server = static_cast<OpsServer*>(self);
  absl::Status ready = server->readiness_ ? server->readiness_() : absl::OkStatus();
  if (ready.ok()) {
    Reply(conn, 200, "text/plain", "ready\n");
    return 200;
  }
  Reply(conn, 503, "text/plain", absl::StrCat("not ready: ", ready.message(), "\n"));
  return 503;
}

absl::Status WritePortFile(const std::string& path, int grpc_port, int http_port) {
  std::string tmp = absl::StrCat(path, ".tmp");
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << "{\"grpc\": " << grpc_port << ", \"http\": " << http_port << "}\n";
    if (!out.good()) return absl::UnavailableError(absl::StrCat("cannot write --port_file ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot rename ", tmp, " to ", path));
  }
  return absl::OkStatus();
}

}  // namespace baton
