#pragma once

// The files of zeroshard's mutual TLS (common/tls.h makes gRPC credentials
// of them), and which addresses only this host can reach. No gRPC here: the
// bulk transports' options carry these.

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace zeroshard {

struct TlsFiles {
  std::string cert;  // this side's certificate (chain), PEM
  std::string key;   // its private key, PEM
  std::string ca;    // the CA bundle that signs the peers' certificates, PEM
  // All three empty: plaintext (loopback and tests only; see the daemon's
  // --insecure).
  bool enabled() const { return !cert.empty() || !key.empty() || !ca.empty(); }
};

// `files`, with each empty field taken from the environment: ZS_TLS_CERT,
// ZS_TLS_KEY, ZS_TLS_CA.
TlsFiles TlsFilesFromEnvironment(TlsFiles files);

// OK for none or all three set and readable; InvalidArgument naming the
// field as `prefix` + its name ("--tls_key: ...") otherwise.
absl::Status ValidateTlsFiles(const TlsFiles& files, absl::string_view prefix);

// True for addresses only this host can reach: 127.0.0.0/8, [::1],
// localhost (HOST:PORT or HOST alone).
bool IsLoopbackAddress(absl::string_view address);

}  // namespace zeroshard
