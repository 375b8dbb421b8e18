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
#include "common/tls_files.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"

namespace zeroshard {

// Server credentials: mutual TLS requiring and verifying client
// certificates, or insecure ones when `files` is not enabled.
// InvalidArgument (as ValidateTlsFiles) for unreadable files.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsFiles& files, absl::string_view prefix);

// Channel credentials: TLS presenting `files.cert` and verifying the server
// against `files.ca`, or insecure ones when `files` is not enabled.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const TlsFiles& files, absl::string_view prefix);

}  // namespace zeroshard
