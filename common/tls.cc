#include "common/tls.h"

#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
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


}  // namespace zeroshard
