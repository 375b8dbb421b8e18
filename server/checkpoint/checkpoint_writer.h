#pragma once

// One job copy's checkpoint files on one daemon: the snapshot buffers, the
// background write of the last save and its status. The checkpoint agent
// fills the buffers (holding the step engine's commit lock, so no step runs
// meanwhile) and calls StartWrite; a thread of this object then writes them
// to disk with no lock of the job held, so training goes on during the
// write.
//
// The buffers (one per saved array, each the owned range) are allocated on
// the first save, booked as `buffer` in the ledger, and kept for the next
// saves and loads: a save's stall is a copy into warm memory. They are
// freed with the job.
//
// Thread-safe. Blocking: only Status with a wait, and Retire. Held in a
// shared_ptr: a write in progress holds the writer until it ends, so that
// the job can go while its disk hangs (the write then ends, and the writer
// goes, when the disk answers; the ledger it was given must outlive that:
// the daemon's does, but for a process that destroys its daemon and goes
// on while a disk hangs).

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/checkpoint_files.h"
#include "common/flat_range.h"
#include "proto/zeroshard/v1/checkpoint.pb.h"
#include "server/metrics/daemon_metrics.h"
#include "server/ledger/memory_ledger.h"

namespace zeroshard {

// The last save's progress on this daemon. The part manifest is the
// checkpoint files' own format (common/checkpoint_files.h), kept as a
// protobuf, as the TrainingState a write is given.
struct CheckpointProgress {
  enum class State : uint8_t { kWriting, kWritten, kFailed };
  State state = State::kWriting;
  std::string name;
  uint64_t bytes_written = 0;
  uint64_t bytes_total = 0;
  std::optional<v1::PartManifest> part;  // kWritten: the part as written
  absl::Status error;                    // kFailed: why
};

class CheckpointWriter : public std::enable_shared_from_this<CheckpointWriter> {
 public:
  struct Options {
    std::string root;  // --checkpoint_dir
    std::string job_id;
    uint32_t daemon_index = 0;
    uint32_t daemon_count = 1;
    MemoryLedger* ledger = nullptr;
    DaemonMetrics* metrics = nullptr;  // may be null
  };

  // Make it with std::make_shared (StartWrite shares it with its thread).
  explicit CheckpointWriter(Options options);

  const std::string& root() const { return options_.root; }

  // Claims the buffers for a save or a load: Unavailable while a write
  // holds them, FailedPrecondition while another claim does. Allocates `arrays` buffers of
  // `elements` floats on first use and touches every page (ResourceExhausted
  // past the ledger's limit, nothing allocated). Call it without job locks. The claim ends with StartWrite (a save) or
  // Release (a load, or a save that failed before writing).
  absl::Status Claim(uint64_t elements, size_t arrays);
  // Buffer i of the claim; valid while it lasts.
  float* buffer(size_t i);
  // Ends a claim. `failed`: the operation changed nothing, so buffers this
  // claim allocated are freed again (the ledger is as before).
  void Release(bool failed);

  // Writes the claimed buffers as `name`'s part (the files named `files`,
  // buffer i to files[i]) on a thread of its own, which holds this writer,
  // and ends the claim when done.
  // `range` is the flat range the buffers hold.
  void StartWrite(std::string name, FlatRange range, std::vector<std::string> files,
                  v1::TrainingState state);

  // Array i's bytes of a part, handed to the sink piece by piece.
  using ArraySource = std::function<absl::Status(size_t array, ArraySink sink)>;
  // Writes `name`'s part from `source` on the calling thread instead of from
  // the buffers (a disk-resident job's states, read from their file: no
  // second copy in RAM), and ends the claim (Claim(0, 0) holds no
  // buffers). Blocks until written; returns the write's result, which
  // Status then reports as for StartWrite.
  absl::Status WriteNow(std::string name, FlatRange range, std::vector<std::string> files,
                        v1::TrainingState state, const ArraySource& source);

  // The owner goes (its job is removed): waits up to `max` for no claim
  // (and so no write) to be in progress, then frees the buffers and returns
  // true. Past `max` (a hung disk) returns false: the write goes on, and
  // when it ends its thread frees the buffers and removes the job's ledger
  // entry if that leaves it empty, and records no metrics.
  bool Retire(absl::Duration max);

  // The last save's status; waits up to `wait` for a write in progress.
  // NotFound when `name` is not the last save this daemon started for the
  // job.
  absl::StatusOr<CheckpointProgress> Status(const std::string& name, absl::Duration wait);

 private:
  // Sets the status to writing `name`.
  void BeginLocked(const std::string& name, uint64_t bytes_total)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Write(std::string name, FlatRange range, std::vector<std::string> files,
                     v1::TrainingState state, const ArraySource& source);

  const Options options_;

  absl::Mutex mu_;
  bool claimed_ ABSL_GUARDED_BY(mu_) = false;
  bool allocated_by_claim_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<LedgerArray<float>> buffers_ ABSL_GUARDED_BY(mu_);
  std::optional<CheckpointProgress> status_ ABSL_GUARDED_BY(mu_);  // of the last save
  std::atomic<uint64_t> bytes_written_{0};
  bool orphaned_ ABSL_GUARDED_BY(mu_) = false;  // Retire gave up waiting
};

}  // namespace zeroshard
