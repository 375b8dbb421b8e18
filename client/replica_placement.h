#pragma once

// Where a replicated job's replica groups are served (JobSpec.replicas = 2,
// proto/zeroshard/v1/replica.proto): for each group, the daemon holding its
// primary and the epoch to name in calls. Read from the daemons themselves
// (Replica.GetReplicaState): there is no other record of it.
//
// When a group's primary is gone (its daemon unreachable) and its backup is
// current, the job leader (rank 0) promotes the backup under the next epoch;
// the other ranks wait for that promotion. Blocking, with deadlines.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/channel.h"

namespace zeroshard {

struct GroupPlacement {
  std::string address;  // HOST:PORT serving the group
  uint64_t epoch = 1;
  bool home = true;  // address is the group's own daemon (spec.daemons[group])
};

struct PlacementOptions {
  std::string job_id;
  uint32_t rank = 0;
  // The least step the caller knows committed (a trainer reconnecting after
  // a failure): a backup behind it is not promoted.
  uint64_t known_committed_step = 0;
  // Each GetReplicaState / Promote call, and the whole wait for a
  // promotion.
  absl::Duration rpc_timeout = absl::Seconds(5);
  absl::Duration wait = absl::Minutes(1);
  // A group whose only possible copy is on an unreachable daemon (the other
  // holder is up and has none) is given up after this long, not `wait`.
  absl::Duration lost_grace = absl::Seconds(10);
  // The channels' keepalive (MakeDaemonChannel).
  absl::Duration liveness_timeout = absl::Seconds(4);
};

// The placement of every group of the job on `daemons` (spec.daemons). A
// job registered nowhere yet, by a caller that knows no committed step, is
// placed at home, epoch 1. DataLoss at once when a group has no copy left
// (both of its daemons answer and neither holds a current one: they were
// restarted empty, or hold a backup that was not current), or after
// lost_grace when its only possible copy is on a daemon that does not
// answer; the message names the group, what each daemon holds and the
// newest complete checkpoint the reachable daemons have, to resume from.
// FailedPrecondition naming the group when a group has neither a primary
// nor a current backup on a reachable daemon by the deadline otherwise.
// Blocks: polls every 100 ms.
absl::StatusOr<std::vector<GroupPlacement>> ResolvePlacement(
    const std::vector<std::string>& daemons, const ChannelSecurity& security,
    const PlacementOptions& options);

}  // namespace zeroshard
