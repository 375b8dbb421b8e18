#include "common/tls.h"

#include <arpa/inet.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "grpcpp/security/server_credentials.h"

namespace zeroshard {
namespace {

// At most this much of a PEM file is read (a certificate chain is a few KiB).
constexpr std::streamsize kMaxPemBytes = 1 << 20;

absl::StatusOr<std::string> ReadPem(const std::string& path, absl::string_view field) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": cannot read \"", path, "\""));
  }
  std::string text(static_cast<size_t>(kMaxPemBytes) + 1, '\0');
  in.read(text.data(), kMaxPemBytes + 1);
  text.resize(static_cast<size_t>(in.gcount()));
  if (text.size() > static_cast<size_t>(kMaxPemBytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": \"", path, "\" is larger than ", kMaxPemBytes, " bytes"));
  }
  if (!absl::StrContains(text, "-----BEGIN ")) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": \"", path, "\" holds no PEM block (-----BEGIN ...)"));
  }
  return text;
}

struct Pems {
  std::string cert, key, ca;
};

absl::StatusOr<Pems> ReadAll(const TlsFiles& f, absl::string_view prefix) {
  if (absl::Status s = ValidateTlsFiles(f, prefix); !s.ok()) return s;
  Pems p;
  absl::StatusOr<std::string> cert = ReadPem(f.cert, absl::StrCat(prefix, "tls_cert"));
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadPem(f.key, absl::StrCat(prefix, "tls_key"));
  if (!key.ok()) return key.status();
  absl::StatusOr<std::string> ca = ReadPem(f.ca, absl::StrCat(prefix, "tls_ca"));
  if (!ca.ok()) return ca.status();
  p.cert = *std::move(cert);
  p.key = *std::move(key);
  p.ca = *std::move(ca);
  return p;
}

}  // namespace

TlsFiles TlsFilesFromEnvironment(TlsFiles files) {
  auto from_env = [](std::string& field, const char* name) {
    if (!field.empty()) return;
    if (const char* v = std::getenv(name); v != nullptr) field = v;
  };
  from_env(files.cert, "ZS_TLS_CERT");
  from_env(files.key, "ZS_TLS_KEY");
  from_env(files.ca, "ZS_TLS_CA");
  return files;
}

absl::Status ValidateTlsFiles(const TlsFiles& f, absl::string_view prefix) {
  if (!f.enabled()) return absl::OkStatus();
  const struct {
    const std::string& value;
    const char* name;
  } fields[] = {{f.cert, "tls_cert"}, {f.key, "tls_key"}, {f.ca, "tls_ca"}};
  for (const auto& field : fields) {
    if (field.value.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          prefix, field.name, ": mutual TLS needs a certificate, its key and the CA bundle; ",
          "this one is missing (or leave all three empty for plaintext)"));
    }
  }
  for (const auto& field : fields) {
    std::ifstream in(field.value);
    if (!in) {
      return absl::InvalidArgumentError(
          absl::StrCat(prefix, field.name, ": cannot read \"", field.value, "\""));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsFiles& files, absl::string_view prefix) {
  if (!files.enabled()) return grpc::InsecureServerCredentials();
  absl::StatusOr<Pems> p = ReadAll(files, prefix);
  if (!p.ok()) return p.status();
  grpc::SslServerCredentialsOptions o(
      GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  o.pem_root_certs = p->ca;
  o.pem_key_cert_pairs.push_back({p->key, p->cert});
  return grpc::SslServerCredentials(o);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const TlsFiles& files, absl::string_view prefix) {
  if (!files.enabled()) return grpc::InsecureChannelCredentials();
  absl::StatusOr<Pems> p = ReadAll(files, prefix);
  if (!p.ok()) return p.status();
  grpc::SslCredentialsOptions o;
  o.pem_root_certs = p->ca;
  o.pem_private_key = p->key;
  o.pem_cert_chain = p->cert;
  return grpc::SslCredentials(o);
}

bool IsLoopbackAddress(absl::string_view address) {
  absl::string_view host = address;
  if (absl::ConsumePrefix(&host, "[")) {
    const size_t end = host.find(']');
    if (end == absl::string_view::npos) return false;
    return host.substr(0, end) == "::1";
  }
  const size_t colon = host.rfind(':');
  if (colon != absl::string_view::npos) host = host.substr(0, colon);
  if (host == "localhost") return true;
  in_addr v4;
  return ::inet_pton(AF_INET, std::string(host).c_str(), &v4) == 1 &&
         (ntohl(v4.s_addr) >> 24) == 127;
}

}  // namespace zeroshard
