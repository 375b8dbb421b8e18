#pragma once

// gRPC plumbing shared by the client's control and data paths: channels with
// the project's message limits, deadlines, and status conversion that names
// the daemon.

#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/channel.h"
#include "common/keepalive.h"
#include "common/protocol.h"
#include "grpcpp/grpcpp.h"

namespace zeroshard {

// A channel to `address` ("HOST:PORT") with `security` (TLS or plaintext,
// and the bearer token every call carries) whose messages may be up to
// kMaxGrpcMessageBytes (common/protocol.h) each way. Does not connect: the
// first RPC does.
// With `target`, every call names a replica group and epoch (replicated
// jobs, proto/zeroshard/v1/replica.proto). A daemon silent for
// `liveness_timeout` fails the calls in flight on the channel with
// UNAVAILABLE (keepalive pings, common/keepalive.h; zero: none).
std::shared_ptr<grpc::Channel> MakeDaemonChannel(
    const std::string& address, const ChannelSecurity& security,
    std::optional<ReplicaTarget> target = std::nullopt,
    absl::Duration liveness_timeout = kDefaultLivenessTimeout);

void SetDeadline(grpc::ClientContext* context, absl::Time deadline);

// `status` as an absl::Status whose message starts with
// "daemon <address>: <what>: ". A daemon that cannot be reached, closed the
// connection, or cancelled the call (it was shutting down) gives Unavailable;
// the other codes pass through.
absl::Status DaemonError(const grpc::Status& status, absl::string_view address,
                         absl::string_view what);

}  // namespace zeroshard
