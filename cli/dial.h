// How batonctl commands reach the coordinator: plaintext on loopback, or
// mutual TLS with an operator certificate (--tls_cert, --tls_key, --tls_ca;
// docs/security.md).
#ifndef BATON_CLI_DIAL_H_
#define BATON_CLI_DIAL_H_

#include <memory>
#include <string>
#include <set>

#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"
#include "cli/args.h"

namespace baton::cli {

// The flags DialCoordinator reads; add them to a command's accepted flags.
std::set<std::string> WithTlsFlags(std::set<std::string> flags);

// A channel to `target` with the TLS flags of `args`. INVALID_ARGUMENT (the
// message names the flag) for incomplete or unreadable TLS files, or a
// non-loopback target without TLS (plaintext there needs --insecure).
absl::StatusOr<std::shared_ptr<grpc::Channel>> DialCoordinator(const Args& args, const std::string& target);

}  // namespace baton::cli

#endif  // BATON_CLI_DIAL_H_
