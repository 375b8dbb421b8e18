#include "common/tls_files.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <cstdlib>
#include <fstream>

#include "absl/strings/match.h"
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
  // A unix socket (common/job_spec.h) is this machine's only.
  if (absl::StartsWith(address, "unix:")) return true;
  absl::string_view host = address;
  if (absl::ConsumePrefix(&host, "[")) {
    const size_t end = host.find(']');
    if (end == absl::string_view::npos) return false;
    const absl::string_view rest = host.substr(end + 1);
    if (!rest.empty() && rest[0] != ':') return false;
    in6_addr v6;
    if (::inet_pton(AF_INET6, std::string(host.substr(0, end)).c_str(), &v6) != 1) return false;
    if (IN6_IS_ADDR_LOOPBACK(&v6)) return true;
    return IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127;
  }
  const size_t colon = host.rfind(':');
  if (colon != absl::string_view::npos) host = host.substr(0, colon);
  if (host == "localhost") return true;
  in_addr v4;
  return ::inet_pton(AF_INET, std::string(host).c_str(), &v4) == 1 &&
         (ntohl(v4.s_addr) >> 24) == 127;
}

absl::Status CheckPlaintextAddress(absl::string_view address, bool tls, bool insecure,
                                   absl::string_view field, absl::string_view tls_fix,
                                   absl::string_view insecure_fix) {
  if (tls || insecure || IsLoopbackAddress(address)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      field, ": ", address, " is not a loopback address, and plaintext would show the token ",
      "and every call's data to anyone on the way: give ", tls_fix,
      " for mutual TLS (docs/security.md), or ", insecure_fix, " to send plaintext anyway"));
}

bool InsecureOrEnvironment(bool insecure) {
  if (insecure) return true;
  const char* v = std::getenv(kInsecureEnvironment);
  return v != nullptr && std::string(v) == "1";
}

}  // namespace zeroshard
