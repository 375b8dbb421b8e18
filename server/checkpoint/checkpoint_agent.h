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
//
// Its calls take names and steps and answer the plain structs below (and
// CheckpointProgress, checkpoint_writer.h);
// server/rpc/checkpoint_service.cc does the wire form. The checkpoint files'
// own format stays protobuf (common/checkpoint_files.h): the part manifests
// a Complete is given and a written part's status carries, and the
// manifest built from them.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/job_spec.h"
#include "proto/zeroshard/v1/checkpoint.pb.h"
#include "server/checkpoint/checkpoint_writer.h"
#include "server/step/step_engine.h"

namespace zeroshard {

// A save's snapshot, taken; its write goes on in the background.
struct CheckpointSaved {
  uint64_t step = 0;
  uint64_t bytes = 0;             // being written
  double snapshot_seconds = 0;    // the training stall
};

struct CheckpointLoaded {
  std::string name;  // "latest" resolved
  uint64_t step = 0;  // the job's committed step now
  uint64_t bytes_read = 0;
  double seconds = 0;
};

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
  // Waits up to kWriteWaitAtRemoval for a write in progress and frees the
  // snapshot buffers; past it (a hung disk) the write goes on, and frees
  // them when it ends (CheckpointWriter::Retire).
  ~CheckpointAgent();
  static constexpr absl::Duration kWriteWaitAtRemoval = absl::Seconds(10);

  // Snapshots the committed state (holding the commit lock for the copy
  // only) and starts writing it in the background.
  // FailedPrecondition unless `step` is the committed step.
  absl::StatusOr<CheckpointSaved> Save(const std::string& name, uint64_t step);
  // Waits up to `wait` for the save of `name` to finish writing.
  absl::StatusOr<CheckpointProgress> Status(const std::string& name, absl::Duration wait);
  // Writes MANIFEST from every daemon's part (`parts`, one per daemon);
  // the checkpoint's step.
  absl::StatusOr<uint64_t> Complete(const std::string& name,
                                    const std::vector<v1::PartManifest>& parts);
  // Reads the owned range of a complete checkpoint (no lock held), then
  // replaces the state with it. Nothing changes on any error.
  absl::StatusOr<CheckpointLoaded> Load(const std::string& name);

 private:
  const Options options_;
  const v1::JobSpec* const spec_;
  StepEngine* const step_;
  const JobConfig& config_;
  // Shared with its write in progress, which may outlive the agent (a hung
  // disk: the job can go meanwhile).
  const std::shared_ptr<CheckpointWriter> writer_;
};

}  // namespace zeroshard
