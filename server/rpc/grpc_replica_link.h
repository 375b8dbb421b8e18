#pragma once

// The ReplicaLink between daemons over gRPC (Replica and Control services),
// with the daemon's own TLS files as the client side of mutual TLS. One
// channel per peer address, opened on first use and kept.
//
// Thread-safe; calls block as ReplicaLink says.

#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "common/tls.h"
#include "grpcpp/grpcpp.h"
#include "server/replica/replica_link.h"
#include "server/rpc/peer_channels.h"

namespace zeroshard {

class GrpcReplicaLink final : public ReplicaLink {
 public:
  // Reads no file yet: the credentials are made on the first call, and a
  // failure to make them is every call's error.
  // `liveness_timeout`: a peer silent that long fails the calls in flight
  // to it (PeerChannels).
  GrpcReplicaLink(TlsFiles tls, absl::Duration liveness_timeout)
      : channels_(std::move(tls), "zeroshard.replica_link_channel", liveness_timeout) {}

  absl::Status RegisterBackup(const std::string& peer, const std::string& token,
                              const v1::JobSpec& spec, uint32_t daemon_index,
                              absl::Time deadline) override;
  absl::StatusOr<v1::TransferStateResponse> TransferState(
      const std::string& peer, const std::string& token,
      absl::FunctionRef<bool(v1::ReplicaStateChunk*)> next, absl::Time deadline) override;
  absl::Status ForwardGradient(const std::string& peer, const std::string& token,
                               absl::FunctionRef<bool(v1::ForwardedGradientChunk*)> next,
                               absl::Time deadline) override;
  absl::Status CommitReplica(const std::string& peer, const std::string& token,
                             const v1::CommitReplicaRequest& request, absl::Time deadline) override;
  absl::Status ReleaseReplica(const std::string& peer, const std::string& token,
                              const v1::ReleaseReplicaRequest& request,
                              absl::Time deadline) override;
  absl::Status Probe(const std::string& peer, absl::Time deadline) override;
  absl::StatusOr<v1::ReplicaState> GetReplicaState(const std::string& peer,
                                                   const std::string& token,
                                                   const std::string& job_id,
                                                   absl::Time deadline) override;

 private:
  // Returns `s`; an UNAVAILABLE one drops the peer's channel first, so that
  // the next call dials afresh instead of waiting out the old channel's
  // reconnect backoff (a restarted peer is found at the next attempt).
  absl::Status Checked(const std::string& peer, absl::Status s);
  // A unary call on the peer's channel with the token and deadline; errors
  // name `what` and the peer.
  absl::Status Unary(
      const std::string& peer, const std::string& token, absl::Time deadline,
      absl::string_view what,
      absl::FunctionRef<grpc::Status(const std::shared_ptr<grpc::Channel>&, grpc::ClientContext*)>
          call);

  PeerChannels channels_;
};

}  // namespace zeroshard
