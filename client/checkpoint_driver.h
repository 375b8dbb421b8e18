#pragma once

// Drives one job's checkpoints across its daemons (the protocol of
// proto/zeroshard/v1/checkpoint.proto): used by the Client's leader and by
// zsctl. A save is two calls:
//   Start   SaveCheckpoint on every daemon in parallel; returns once every
//           daemon holds its snapshot (the training stall is over);
//   Finish  waits for every daemon's part to be written, then
//           CompleteCheckpoint on every daemon (MANIFEST written last).
// Errors name the daemon (client/rpc.h's DaemonError). Thread-compatible:
// one caller at a time; every call blocks its thread until done or its
// deadline.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/channel.h"
#include "grpcpp/grpcpp.h"
#include "proto/zeroshard/v1/checkpoint.grpc.pb.h"

namespace zeroshard {

struct CheckpointStarted {
  std::string name;
  uint64_t step = 0;
  uint64_t bytes = 0;              // over all daemons
  double snapshot_seconds = 0;     // the slowest daemon's snapshot
  // Client::SaveCheckpoint: the failure of the save before this one, which
  // did not complete (its message names it); OK when it did, or there was
  // none.
  absl::Status previous;
};

// What LoadLatestVerified loaded, and the newer checkpoints it passed over.
struct LatestLoad {
  v1::LoadCheckpointResponse loaded;
  // "NAME (step S): why", newest first: each failed verification.
  std::vector<std::string> skipped;
};

struct CheckpointCompleted {
  std::string name;
  uint64_t step = 0;
  uint64_t bytes = 0;
  double write_seconds = 0;  // the slowest daemon's write
};

class CheckpointDriver {
 public:
  // `addresses[d]` is daemon d of the job (the job spec's daemons, in order).
  CheckpointDriver(std::string job_id, std::vector<std::string> addresses,
                   std::vector<std::shared_ptr<grpc::Channel>> channels);
  // Opens its own channels to `addresses`, with `security`.
  static std::unique_ptr<CheckpointDriver> Connect(std::string job_id,
                                                   std::vector<std::string> addresses,
                                                   const ChannelSecurity& security);

  const std::string& job_id() const { return job_id_; }

  // Snapshots committed step `step` under `name` on every daemon.
  absl::StatusOr<CheckpointStarted> Start(const std::string& name, uint64_t step,
                                          absl::Time deadline);
  // Waits (until `deadline`: DeadlineExceeded naming the daemons still
  // writing) for every part of `name`, then writes the job manifest (parts
  // ordered by the daemon index each reports, whatever the address order).
  // A part that failed passes its daemon's error through.
  absl::StatusOr<CheckpointCompleted> Finish(const std::string& name, absl::Time deadline);
  // LoadCheckpoint on every daemon; `name` may be "latest" (resolved on
  // daemon 0 first, so every daemon loads the same checkpoint). Returns
  // daemon 0's answer; FailedPrecondition if daemons end on different steps.
  absl::StatusOr<v1::LoadCheckpointResponse> Load(const std::string& name, absl::Time deadline);
  // Loads the newest checkpoint complete on every daemon that verifies
  // (Verify) on every daemon, passing over newer ones that do not (a part
  // damaged on disk, a file missing). NotFound when there is no complete
  // checkpoint; DataLoss naming each one when none verifies. Reads every
  // file of each candidate once to verify it before the load reads it again.
  absl::StatusOr<LatestLoad> LoadLatestVerified(absl::Time deadline);
  // The checkpoints complete on every daemon (by step). First completes
  // those whose parts are all on the daemons without a MANIFEST (the
  // daemons saved their parts of an idle job before removing it,
  // ListCheckpointsResponse.pending): CompleteCheckpoint on every daemon
  // with the parts; one that does not complete (the job registered again
  // has another shape) stays pending and is said on stderr.
  absl::StatusOr<std::vector<v1::CheckpointInfo>> List(absl::Time deadline);
  // VerifyCheckpoint of every part p of `name` ("latest" resolved by daemon
  // 0) on daemon p (modulo the daemons here). The checkpoint verified, with
  // the bytes read over all parts.
  absl::StatusOr<v1::VerifyCheckpointResponse> Verify(const std::string& name,
                                                      absl::Time deadline);

 private:
  // ListCheckpoints on every daemon.
  absl::StatusOr<std::vector<v1::ListCheckpointsResponse>> ListEach(absl::Time deadline);
  // Completes what `lists` show pending on every daemon; whether any was.
  bool CompletePending(const std::vector<v1::ListCheckpointsResponse>& lists, absl::Time deadline);

  const std::string job_id_;
  const std::vector<std::string> addresses_;
  std::vector<std::unique_ptr<v1::Checkpoint::Stub>> stubs_;
};

}  // namespace zeroshard
