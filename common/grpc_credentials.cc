#include "common/grpc_credentials.h"

#include <sys/stat.h>

#include <grpcpp/support/client_interceptor.h>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
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

}  // namespace

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
                                           const std::string& join_token, grpc::ChannelArguments args) {
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  if (tls.enabled) {
    grpc::SslCredentialsOptions options;
    options.pem_root_certs = tls.ca_pem;
    options.pem_private_key = tls.key_pem;
    options.pem_cert_chain = tls.cert_pem;
    creds = grpc::SslCredentials(options);
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

absl::StatusOr<std::string> ReadJoinTokenFile(const std::string& path, std::string* warning) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat("--join_token_file='", path, "' is not a readable file"));
  }
  if (st.st_size > 4096) {
    return absl::InvalidArgumentError(absl::StrCat("--join_token_file='", path, "' is larger than 4 KiB"));
  }
  absl::StatusOr<std::string> text = ReadFile(path);
  if (!text.ok()) return absl::InvalidArgumentError(absl::StrCat("--join_token_file: ", text.status().message()));
  std::string token(absl::StripAsciiWhitespace(text->substr(0, text->find('\n'))));
  if (token.size() < 16 || token.size() > 1024) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--join_token_file='", path, "': the token (first line) must be 16..1024 characters, e.g. the output of "
        "`openssl rand -hex 32`"));
  }
  for (char c : token) {
    if (!absl::ascii_isgraph(static_cast<unsigned char>(c))) {
      return absl::InvalidArgumentError(
          absl::StrCat("--join_token_file='", path, "': the token must be printable ASCII without spaces"));
    }
  }
  if (warning != nullptr && (st.st_mode & 077) != 0) {
    *warning = absl::StrFormat("--join_token_file='%s' is readable by group or others (mode %03o); chmod 600 it", path,
                               st.st_mode & 0777);
  }
  return token;
}

bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  // The length is not secret; the bytes are.
  if (a.size() != b.size()) return false;
  volatile unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace baton
