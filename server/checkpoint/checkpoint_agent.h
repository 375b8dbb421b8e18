#pragma once

// One job copy's checkpoints on one daemon (proto/zeroshard/v1/
// checkpoint.proto): saving the committed state of the owned range (a
// snapshot under the step engine's commit lock, the training stall, then a
// background write), its status, the job-level manifest once every daemon's
// part is on disk, and loading a complete checkpoint re-sliced to this
// job's partition map.
//
// Thread-safe. Blocking: a save waits for the commit lock for its copy; a
// load reads its files with no lock held, then replaces the state under
// the commit lock.

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/job_spec.h"
#include "proto/zeroshard/v1/checkpoint.pb.h"
#include "server/checkpoint/checkpoint_writer.h"
#include "server/step/step_engine.h"

namespace zeroshard {

class CheckpointAgent {
 public:
  struct Options {
    std::string root;  // --checkpoint_dir
    uint32_t daemon_index = 0;  // the replica group this copy holds
    MemoryLedger* ledger = nullptr;
    DaemonMetrics* metrics = nullptr;  // may be null
  };

  // `spec` (the job's, written into manifests) and `step` must outlive the
  // agent.
  CheckpointAgent(Options options, const v1::JobSpec* spec, StepEngine* step);

  // Snapshots the committed state (holding the commit lock for the copy
  // only) and starts writing it in the background.
  absl::StatusOr<v1::SaveCheckpointResponse> Save(const v1::SaveCheckpointRequest& request);
  absl::StatusOr<v1::CheckpointStatus> Status(const std::string& name, absl::Duration wait);
  // Writes MANIFEST from every daemon's part (`map` is this job's).
  absl::StatusOr<v1::CompleteCheckpointResponse> Complete(
      const v1::CompleteCheckpointRequest& request, const v1::PartitionMap& map);
  // Reads the owned range of a complete checkpoint (no lock held), then
  // replaces the state with it. Nothing changes on any error.
  absl::StatusOr<v1::LoadCheckpointResponse> Load(const std::string& name);

 private:
  const Options options_;
  const v1::JobSpec* const spec_;
  StepEngine* const step_;
  const JobConfig& config_;
  CheckpointWriter writer_;
};

}  // namespace zeroshard
