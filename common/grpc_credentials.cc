#include "common/grpc_credentials.h"

#include <sys/stat.h>

#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_certificate_verifier.h>
#include <grpcpp/security/tls_credentials_options.h>
#include <grpcpp/support/client_interceptor.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/file_io.h"

namespace baton {
namespace {

constexpr size_t kMaxPemBytes = 1 << 20;

absl::StatusOr<std::string> ReadPem(const std::string& path, const std::string& flag) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, "='", path, "' is not a readable file"));
  }
  if (static_cast<size_t>(st.st_size) > kMaxPemBytes) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, "='", path, "' is larger than 1 MiB; not a PEM file"));
  }
  absl::StatusOr<std::string> pem = ReadFile(path);
  if (!pem.ok()) return absl::InvalidArgumentError(absl::StrCat("--", flag, ": ", pem.status().message()));
  if (!absl::StrContains(*pem, "-----BEGIN ")) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, "='", path, "' holds no PEM block (-----BEGIN ...)"));
  }
  return pem;
}

// Adds the join token to the initial metadata of every call.
class JoinTokenInterceptor : public grpc::experimental::Interceptor {
 public:
  explicit JoinTokenInterceptor(const std::string* token) : token_(token) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->emplace(kJoinTokenMetadata, *token_);
    }
    methods->Proceed();
  }

 private:
  const std::string* token_;
};

class JoinTokenInterceptorFactory : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit JoinTokenInterceptorFactory(std::string token) : token_(std::move(token)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(grpc::experimental::ClientRpcInfo*) override {
    return new JoinTokenInterceptor(&token_);
  }

 private:
  const std::string token_;
};

// Checks, after the TLS library verified the chain against the CA, that the
// server's certificate names the host we dialled and carries the expected
// role URI, so a worker's certificate cannot pose as the coordinator.
class ServerIdentityVerifier : public grpc::experimental::ExternalCertificateVerifier {
 public:
  ServerIdentityVerifier(std::string host, std::string role) : host_(std::move(host)), role_(std::move(role)) {}

  bool Verify(grpc::experimental::TlsCustomVerificationCheckRequest* request,
              std::function<void(grpc::Status)> /*callback*/, grpc::Status* sync_status) override {
    *sync_status = Check(*request);
    return true;  // synchronous
  }
  void Cancel(grpc::experimental::TlsCustomVerificationCheckRequest*) override {}

 private:
  static std::string Str(const grpc::string_ref& r) { return std::string(r.data(), r.size()); }

  grpc::Status Check(const grpc::experimental::TlsCustomVerificationCheckRequest& request) const {
    const std::string host = absl::AsciiStrToLower(host_);
    bool named = false;
    for (const grpc::string_ref& ip : request.ip_names()) named |= Str(ip) == host;
    for (const grpc::string_ref& dns : request.dns_names()) {
      const std::string name = absl::AsciiStrToLower(Str(dns));
      if (name == host) named = true;
      // "*.example.com" covers exactly one label: "a.example.com".
      if (absl::StartsWith(name, "*.") && absl::EndsWith(host, name.substr(1))) {
        const std::string label = host.substr(0, host.size() - (name.size() - 1));
        named |= !label.empty() && label.find('.') == std::string::npos;
      }
    }
    if (!named) {
      return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                          absl::StrCat("the server's certificate does not name '", host_,
                                       "' (DNS or IP subject alternative name)"));
    }
    const std::string want = absl::StrCat(kRoleUriPrefix, role_);
    for (const grpc::string_ref& uri : request.uri_names()) {
      if (Str(uri) == want) return grpc::Status::OK;
    }
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        absl::StrCat("the server's certificate lacks the role URI ", want));
  }

  const std::string host_;
  const std::string role_;
};

}  // namespace

std::string HostOf(const std::string& target) {
  if (!target.empty() && target.front() == '[') {
    const size_t close = target.find(']');
    return close == std::string::npos ? target : target.substr(1, close - 1);
  }
  const size_t colon = target.find(':');
  if (colon == std::string::npos || target.find(':', colon + 1) != std::string::npos) return target;
  return target.substr(0, colon);
}

absl::StatusOr<TlsConfig> LoadTlsConfig(const std::string& cert_path, const std::string& key_path,
                                        const std::string& ca_path) {
  TlsConfig tls;
  const int given = !cert_path.empty() + !key_path.empty() + !ca_path.empty();
  if (given == 0) return tls;
  if (given != 3) {
    return absl::InvalidArgumentError(
        "--tls_cert, --tls_key and --tls_ca go together: give all three (this process's certificate, its private "
        "key, and the cluster CA that signed every baton certificate) or none");
  }
  absl::StatusOr<std::string> cert = ReadPem(cert_path, "tls_cert");
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadPem(key_path, "tls_key");
  if (!key.ok()) return key.status();
  absl::StatusOr<std::string> ca = ReadPem(ca_path, "tls_ca");
  if (!ca.ok()) return ca.status();
  tls.enabled = true;
  tls.cert_pem = *std::move(cert);
  tls.key_pem = *std::move(key);
  tls.ca_pem = *std::move(ca);
  return tls;
}

std::shared_ptr<grpc::ServerCredentials> MakeServerCredentials(const TlsConfig& tls) {
  if (!tls.enabled) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions options(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  options.pem_root_certs = tls.ca_pem;
  options.pem_key_cert_pairs.push_back({tls.key_pem, tls.cert_pem});
  return grpc::SslServerCredentials(options);
}

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& target, const TlsConfig& tls,
                                           const std::string& join_token, grpc::ChannelArguments args,
                                           const std::string& server_role) {
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  if (tls.enabled) {
    namespace gx = grpc::experimental;
    gx::TlsChannelCredentialsOptions options;
    options.set_certificate_provider(std::make_shared<gx::StaticDataCertificateProvider>(
        tls.ca_pem, std::vector<gx::IdentityKeyCertPair>{{tls.key_pem, tls.cert_pem}}));
    options.watch_root_certs();
    options.watch_identity_key_cert_pairs();
    options.set_verify_server_certs(true);
    // Our verifier checks the host name (and the role) itself.
    options.set_check_call_host(false);
    options.set_certificate_verifier(
        gx::ExternalCertificateVerifier::Create<ServerIdentityVerifier>(HostOf(target), server_role));
    creds = gx::TlsCredentials(options);
  }
  if (join_token.empty()) return grpc::CreateCustomChannel(target, creds, args);
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(std::make_unique<JoinTokenInterceptorFactory>(join_token));
  return grpc::experimental::CreateCustomChannelWithInterceptors(target, creds, args, std::move(interceptors));
}

bool IsLoopbackHost(const std::string& raw) {
  std::string host = absl::AsciiStrToLower(raw);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  if (host == "localhost" || host == "::1") return true;
  std::vector<std::string> octets = absl::StrSplit(host, '.');
  if (octets.size() != 4 || octets[0] != "127") return false;
  for (const std::string& o : octets) {
    int v;
    if (o.empty() || o.size() > 3 || !absl::SimpleAtoi(o, &v) || v < 0 || v > 255) return false;
  }
  return true;
}

absl::Status CheckPlaintextAddress(const std::string& address, const std::string& flag, bool tls, bool insecure) {
  if (tls || insecure) return absl::OkStatus();
  const size_t colon = address.rfind(':');
  const std::string host = colon == std::string::npos ? address : address.substr(0, colon);
  if (IsLoopbackHost(host)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "--", flag, "='", address,
      "' is not a loopback address and TLS is off: anyone who reaches it could control the job. Give "
      "--tls_cert, --tls_key and --tls_ca (docs/security.md), use 127.0.0.1, or pass --insecure to accept "
      "the risk on a network you trust"));
}

std::vector<std::string> PeerRoles(const grpc::AuthContext& auth) {
  std::vector<std::string> roles;
  if (!auth.IsPeerAuthenticated()) return roles;
  for (const char* property : {GRPC_PEER_URI_PROPERTY_NAME, GRPC_X509_SAN_PROPERTY_NAME}) {
    for (const grpc::string_ref& value : auth.FindPropertyValues(property)) {
      absl::string_view v(value.data(), value.size());
      if (absl::ConsumePrefix(&v, kRoleUriPrefix) && !v.empty()) roles.emplace_back(v);
    }
  }
  return roles;
}

bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  // The length is not secret; the bytes are.
  if (a.size() != b.size()) return false;
  volatile unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace baton
