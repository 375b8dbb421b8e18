#pragma once

// Liveness over gRPC between a job's processes: HTTP/2 keepalive pings on
// every channel to a daemon, so that a peer that stops answering (a hung
// or SIGSTOPped process, a host that fell off the network) fails every call
// in flight on that channel with UNAVAILABLE within the liveness timeout,
// whatever the call's own deadline. The kernel of a stopped process still
// accepts TCP connections and acknowledges segments: only the peer's gRPC
// stack answering a ping proves it alive.
//
// A ping goes out every timeout/2 while the connection is otherwise quiet
// and must be answered within timeout/2; pings are sent while calls are in
// flight (an idle channel finds a silent peer at its next call), whether or
// not the client sent data since the last one. Daemons accept pings as often as every kMinKeepaliveInterval / 2
// (SetServerKeepalivePolicy); a faster client is sent GOAWAY by the server,
// so timeouts below kMinLivenessTimeout are refused by
// ValidateLivenessTimeout.

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"

namespace zeroshard {

inline constexpr absl::Duration kDefaultLivenessTimeout = absl::Seconds(4);
inline constexpr absl::Duration kMinKeepaliveInterval = absl::Seconds(1);
inline constexpr absl::Duration kMinLivenessTimeout = absl::Seconds(2);  // two intervals

// OK for zero (no keepalive: a silent peer is found by call deadlines only)
// or a timeout of at least kMinLivenessTimeout; InvalidArgument naming
// `flag` otherwise.
absl::Status ValidateLivenessTimeout(absl::Duration timeout, absl::string_view flag);

// Sets the keepalive arguments of a channel whose peer must be declared gone
// after `timeout` of silence. Zero: leaves keepalive off.
void SetChannelKeepalive(absl::Duration timeout, grpc::ChannelArguments* args);

// Lets a server accept keepalive pings every kMinKeepaliveInterval / 2, with
// or without calls in flight, and ping its own idle clients.
void SetServerKeepalivePolicy(grpc::ServerBuilder* builder);

}  // namespace zeroshard
