#include "common/tls_files.h"

#include <arpa/inet.h>

#include <cstdlib>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace zeroshard {

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
