// How baton's gRPC channels are secured: one place for the coordinator, the
// worker and batonctl (docs/security.md).
//
// - mTLS: every daemon and client presents a certificate signed by the
//   cluster CA (--tls_cert, --tls_key, --tls_ca) and verifies its peer's
//   against that CA. A client also checks that the server's certificate names
//   the address it dialled (DNS or IP SAN).
// - Roles: a certificate carries its role as a URI SAN "baton://role/<role>"
//   (worker, operator, coordinator). The coordinator authorises each RPC by
//   the role of the verified client certificate.
// - Join token: workers also send a shared secret (--join_token_file) as call
//   metadata on every RPC, so a certificate of the same CA alone cannot join.
// - Without TLS, gRPC listens and dials on loopback only unless --insecure.
#ifndef BATON_COMMON_GRPC_CREDENTIALS_H_
#define BATON_COMMON_GRPC_CREDENTIALS_H_

#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>
#include <grpcpp/security/auth_context.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace baton {

// URI SAN prefix that names a certificate's role, e.g. "baton://role/worker".
inline constexpr char kRoleUriPrefix[] = "baton://role/";
inline constexpr char kRoleWorker[] = "worker";
inline constexpr char kRoleOperator[] = "operator";
inline constexpr char kRoleCoordinator[] = "coordinator";
// Call metadata that carries the join token.
inline constexpr char kJoinTokenMetadata[] = "baton-join-token";

// The PEM contents of --tls_cert, --tls_key and --tls_ca (empty = no TLS).
struct TlsConfig {
  bool enabled = false;
  std::string cert_pem, key_pem, ca_pem;
};

// All three paths or none; each must be a readable PEM file. INVALID_ARGUMENT
// names the flag and what to fix.
absl::StatusOr<TlsConfig> LoadTlsConfig(const std::string& cert_path, const std::string& key_path,
                                        const std::string& ca_path);

// Server side: with TLS, requires and verifies a client certificate signed by
// the CA; without, plaintext.
std::shared_ptr<grpc::ServerCredentials> MakeServerCredentials(const TlsConfig& tls);

// A channel to `target` with `tls` (client certificate + CA), `args`, and the
// join token (when non-empty) attached to every call as metadata. With TLS
// the server must present a certificate of the CA that names the host of
// `target` (DNS or IP SAN) and carries the role URI of `server_role`;
// otherwise the handshake fails (calls end UNAVAILABLE).
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& target, const TlsConfig& tls,
                                           const std::string& join_token,
                                           grpc::ChannelArguments args = grpc::ChannelArguments(),
                                           const std::string& server_role = kRoleCoordinator);

// The host part of "HOST:PORT" ("[::1]:80" -> "::1").
std::string HostOf(const std::string& target);

// "127.0.0.1", "::1", "[::1]", "localhost" and 127.0.0.0/8.
bool IsLoopbackHost(const std::string& host);

// Plaintext is only for loopback: a `flag` value ("HOST:PORT") whose host is
// not loopback is refused unless `tls` or `insecure`.
absl::Status CheckPlaintextAddress(const std::string& address, const std::string& flag, bool tls, bool insecure);

// Roles named by the URI SANs of the peer's verified certificate (empty
// without TLS or without a role URI).
std::vector<std::string> PeerRoles(const grpc::AuthContext& auth);

// Equality without a data-dependent early exit (for secrets).
bool ConstantTimeEquals(absl::string_view a, absl::string_view b);

}  // namespace baton

#endif  // BATON_COMMON_GRPC_CREDENTIALS_H_
