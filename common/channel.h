#pragma once

// How a process talks to daemons: the channel credentials (mutual TLS or
// plaintext, common/tls.h) and the bearer token (common/auth.h) every call
// carries. Built once (reading the PEM files), then shared by every channel
// the process opens.

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/tls.h"
#include "grpcpp/grpcpp.h"

namespace zeroshard {

struct ChannelSecurity {
  // Never null in a ChannelSecurity from MakeChannelSecurity or Plaintext.
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  // Sent as "authorization: Bearer <token>" on every call; empty: none.
  std::string token;
  bool tls = false;

  // Plaintext channels carrying `token` (loopback and tests).
  static ChannelSecurity Plaintext(std::string token = "");
};

// TLS credentials from `tls` (or plaintext when it names no file) with
// `token`. InvalidArgument naming the field as `prefix` + name for
// unreadable TLS files or a malformed (non-empty) token.
absl::StatusOr<ChannelSecurity> MakeChannelSecurity(const TlsFiles& tls, std::string token,
                                                    absl::string_view prefix);

// Replicated jobs (proto/zeroshard/v1/replica.proto): the replica group a
// call is for and the epoch the caller knows, sent as metadata on every
// call of a channel.
inline constexpr char kReplicaGroupMetadataKey[] = "zs-replica-group";
inline constexpr char kReplicaEpochMetadataKey[] = "zs-replica-epoch";
struct ReplicaTarget {
  uint32_t group = 0;
  uint64_t epoch = 0;
};

// The target a call names: nullopt when it names none, InvalidArgument when
// the metadata is malformed (one key without the other, not decimal).
absl::StatusOr<std::optional<ReplicaTarget>> ReplicaTargetOf(
    const std::multimap<grpc::string_ref, grpc::string_ref>& client_metadata);

// A channel to `address` ("HOST:PORT") with `security` and `args`, whose
// calls carry `target` when given. Does not connect: the first RPC does.
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address,
                                           const ChannelSecurity& security,
                                           grpc::ChannelArguments args,
                                           std::optional<ReplicaTarget> target = std::nullopt);

}  // namespace zeroshard
