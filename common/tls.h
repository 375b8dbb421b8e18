#pragma once

// Mutual TLS for zeroshard's gRPC channels: every side presents a
// certificate signed by the deployment's CA and checks the other's. A daemon
// with TLS requires client certificates; a client with TLS checks the
// daemon's certificate against the CA (the daemon's address must be in its
// subjectAltName: IP:10.0.0.5 or DNS:node0).
//
// Files are PEM. Reading them blocks on disk; nothing here keeps state.

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"

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

// Server credentials: mutual TLS requiring and verifying client
// certificates, or insecure ones when `files` is not enabled.
// InvalidArgument (as ValidateTlsFiles) for unreadable files.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsFiles& files, absl::string_view prefix);

// Channel credentials: TLS presenting `files.cert` and verifying the server
// against `files.ca`, or insecure ones when `files` is not enabled.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const TlsFiles& files, absl::string_view prefix);

// True for addresses only this host can reach: 127.0.0.0/8, [::1],
// localhost (HOST:PORT or HOST alone).
bool IsLoopbackAddress(absl::string_view address);

}  // namespace zeroshard
