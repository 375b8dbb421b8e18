#pragma once

// How the primary of a replica group reaches the group's backup on the other
// daemon (proto/zeroshard/v1/replica.proto). An interface, so that a job's
// replication can be tested with both daemons' jobs in one process.
//
// Every call blocks its calling thread until the peer answered or
// `deadline`; `token` is the job token the leader presented, passed on (a
// daemon keeps only digests of tokens). Errors name the peer.

#include <cstdint>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/zeroshard/v1/common.pb.h"
#include "proto/zeroshard/v1/replica.pb.h"

namespace zeroshard {

class ReplicaLink {
 public:
  virtual ~ReplicaLink() = default;

  // Control.RegisterJob on `peer` with `as_backup` set: a restarted peer
  // gets the job back, holding backups only.
  virtual absl::Status RegisterBackup(const std::string& peer, const std::string& token,
                                      const v1::JobSpec& spec, uint32_t daemon_index,
                                      absl::Time deadline) = 0;
  // The streams: `next` fills the next chunk and returns true, or returns
  // false when there is none left (it is called until then, or until the
  // stream breaks).
  virtual absl::StatusOr<v1::TransferStateResponse> TransferState(
      const std::string& peer, const std::string& token,
      absl::FunctionRef<bool(v1::ReplicaStateChunk*)> next, absl::Time deadline) = 0;
  virtual absl::Status ForwardGradient(const std::string& peer, const std::string& token,
                                       absl::FunctionRef<bool(v1::ForwardedGradientChunk*)> next,
                                       absl::Time deadline) = 0;
  virtual absl::Status CommitReplica(const std::string& peer, const std::string& token,
                                     const v1::CommitReplicaRequest& request,
                                     absl::Time deadline) = 0;
  // grpc.health.v1.Health/Check on `peer` (no token): OK when its daemon
  // answers at all, whatever it says; the call's error otherwise.
  virtual absl::Status Probe(const std::string& peer, absl::Time deadline) = 0;
  // Replica.GetReplicaState of `job_id` on `peer`: the copies of the job
  // its daemon holds (a backup asks whether its primary still serves).
  virtual absl::StatusOr<v1::ReplicaState> GetReplicaState(const std::string& peer,
                                                           const std::string& token,
                                                           const std::string& job_id,
                                                           absl::Time deadline) = 0;
  virtual absl::Status ReleaseReplica(const std::string& peer, const std::string& token,
                                      const v1::ReleaseReplicaRequest& request,
                                      absl::Time deadline) = 0;
};

}  // namespace zeroshard
