#include "cli/dial.h"

#include "common/grpc_credentials.h"

namespace baton::cli {

std::set<std::string> WithTlsFlags(std::set<std::string> flags) {
  for (const char* f : {"tls_cert", "tls_key", "tls_ca"}) flags.insert(f);
  return flags;
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> DialCoordinator(const Args& args, const std::string& target) {
  absl::StatusOr<TlsConfig> tls = LoadTlsConfig(args.GetString("tls_cert", ""), args.GetString("tls_key", ""),
                                                args.GetString("tls_ca", ""));
  if (!tls.ok()) return tls.status();
  if (absl::Status s = CheckPlaintextAddress(target, "coordinator", tls->enabled, args.GetBool("insecure"));
      !s.ok()) {
    return s;
  }
  return MakeChannel(target, *tls, /*join_token=*/"");
}

}  // namespace baton::cli
