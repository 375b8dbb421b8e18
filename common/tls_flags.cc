#include "common/tls_flags.h"

#include <string>

#include "absl/flags/flag.h"

ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate (chain) this process presents; with --tls_key and --tls_ca every gRPC "
          "connection is mutual TLS (a daemon then requires client certificates signed by "
          "--tls_ca). Default: $ZS_TLS_CERT.");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert. Default: $ZS_TLS_KEY.");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA bundle that signs the peers' certificates (the daemons' for a client, the "
          "clients' for a daemon). Default: $ZS_TLS_CA.");

namespace zeroshard {

TlsFiles TlsFilesFromFlags() {
  return TlsFilesFromEnvironment(
      {absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key), absl::GetFlag(FLAGS_tls_ca)});
}

}  // namespace zeroshard
