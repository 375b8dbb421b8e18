#include "server/checkpoint/checkpoint_writer.h"

#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/checkpoint_files.h"

namespace zeroshard {

CheckpointWriter::CheckpointWriter(Options options) : options_(std::move(options)) {}

absl::Status CheckpointWriter::Claim(uint64_t elements, size_t arrays) {
  absl::MutexLock lock(&mu_);
  if (claimed_) {
    if (status_.has_value() && status_->state == CheckpointProgress::State::kWriting) {
      // Transient (and a hung disk's symptom): UNAVAILABLE, as for a save
      // the disk worker refuses.
      return absl::UnavailableError(absl::StrCat(
          "job ", options_.job_id, ": checkpoint \"", status_->name,
          "\" is still being written (", bytes_written_.load(), " of ", status_->bytes_total,
          " bytes); try again when GetCheckpointStatus reports it written"));
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "job ", options_.job_id, ": a checkpoint save or load is running; try again"));
  }
  allocated_by_claim_ = false;
  if (buffers_.size() != arrays || (arrays > 0 && buffers_[0].size() != elements)) {
    buffers_.clear();
    if (absl::Status s = options_.ledger->CheckFits(options_.job_id, elements * arrays * 4);
        !s.ok()) {
      return absl::ResourceExhaustedError(
          absl::StrCat("job ", options_.job_id, ": the checkpoint snapshot needs ",
                       elements * arrays * 4, " bytes of buffers: ", s.message()));
    }
    for (size_t i = 0; i < arrays; ++i) {
      absl::StatusOr<LedgerArray<float>> a = LedgerArray<float>::Create(
          options_.ledger, options_.job_id, MemoryCategory::kBuffer, elements);
      if (!a.ok()) {
        buffers_.clear();
        return a.status();
      }
      // Faulted in now, so that the snapshot copies into warm memory.
      std::memset(a->data(), 0, elements * sizeof(float));
      buffers_.push_back(*std::move(a));
    }
    allocated_by_claim_ = true;
  }
  claimed_ = true;
  return absl::OkStatus();
}

float* CheckpointWriter::buffer(size_t i) {
  absl::MutexLock lock(&mu_);
  return buffers_[i].data();
}

void CheckpointWriter::Release(bool failed) {
  absl::MutexLock lock(&mu_);
  if (failed && allocated_by_claim_) buffers_.clear();
  allocated_by_claim_ = false;
  claimed_ = false;
}

void CheckpointWriter::BeginLocked(const std::string& name, uint64_t bytes_total) {
  status_.emplace();
  status_->state = CheckpointProgress::State::kWriting;
  status_->name = name;
  status_->bytes_total = bytes_total;
  bytes_written_ = 0;
}

void CheckpointWriter::StartWrite(std::string name, FlatRange range, std::vector<std::string> files,
                                v1::TrainingState state) {
  absl::MutexLock lock(&mu_);
  BeginLocked(name, range.size() * sizeof(float) * files.size());
  std::thread([this, self = shared_from_this(), name = std::move(name), range,
               files = std::move(files), state = std::move(state)]() mutable {
    const ArraySource buffers = [this, range](size_t i, ArraySink sink) {
      float* data = nullptr;
      {
        absl::MutexLock lock(&mu_);
        data = buffers_[i].data();  // stable: buffers change only under a claim
      }
      return sink(data, range.size() * sizeof(float));
    };
    Write(std::move(name), range, std::move(files), std::move(state), buffers).IgnoreError();
    // Its job went while the disk hung: what it booked goes now.
    std::vector<LedgerArray<float>> orphaned_buffers;
    {
      absl::MutexLock lock(&mu_);
      if (orphaned_) orphaned_buffers = std::move(buffers_);
    }
    if (!orphaned_buffers.empty()) {
      orphaned_buffers.clear();
      options_.ledger->RemoveJobIfEmpty(options_.job_id);
    }
  }).detach();
}

bool CheckpointWriter::Retire(absl::Duration max) {
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !claimed_; };
  if (!mu_.AwaitWithTimeout(absl::Condition(&idle), max)) {
    orphaned_ = true;
    return false;
  }
  // Released here, not by whichever thread lets go of the writer last.
  buffers_.clear();
  return true;
}

absl::Status CheckpointWriter::WriteNow(std::string name, FlatRange range,
                                        std::vector<std::string> files, v1::TrainingState state,
                                        const ArraySource& source) {
  {
    absl::MutexLock lock(&mu_);
    BeginLocked(name, range.size() * sizeof(float) * files.size());
  }
  return Write(std::move(name), range, std::move(files), std::move(state), source);
}

absl::Status CheckpointWriter::Write(std::string name, FlatRange range,
                                     std::vector<std::string> files, v1::TrainingState state,
                                     const ArraySource& source) {
  const absl::Time start = absl::Now();
  v1::PartManifest part;
  part.set_daemon_index(options_.daemon_index);
  part.set_daemon_count(options_.daemon_count);
  part.mutable_range()->set_begin(range.begin);
  part.mutable_range()->set_end(range.end);
  *part.mutable_state() = std::move(state);
  const std::string dir =
      CheckpointPartDir(options_.root, options_.job_id, name, options_.daemon_index);
  absl::Status s = MakeDirectories(dir);
  for (size_t i = 0; s.ok() && i < files.size(); ++i) {
    s = WriteArrayFileFrom(dir, files[i], range.size() * sizeof(float), &bytes_written_,
                           part.add_files(), [&](ArraySink sink) { return source(i, sink); });
  }
  const absl::Duration took = absl::Now() - start;
  part.set_write_seconds(absl::ToDoubleSeconds(took));
  part.set_written_unix_ms(absl::ToUnixMillis(absl::Now()));
  if (s.ok()) s = WriteProtoFile(dir, kPartManifestFile, part);
  if (!s.ok()) {
    // Leave no pieces of a failed part under final names.
    for (const v1::CheckpointFile& f : part.files()) {
      ::unlink(absl::StrCat(dir, "/", f.name()).c_str());
    }
  }
  bool orphaned;
  {
    absl::MutexLock lock(&mu_);
    orphaned = orphaned_;
  }
  // An orphaned writer's job is gone, and with it the job's metrics.
  if (s.ok() && options_.metrics != nullptr && !orphaned) {
    options_.metrics->RecordCheckpointWrite(options_.job_id, took, bytes_written_.load());
  }
  absl::MutexLock lock(&mu_);
  status_->bytes_written = bytes_written_.load();
  if (s.ok()) {
    status_->state = CheckpointProgress::State::kWritten;
    status_->part = std::move(part);
  } else {
    status_->state = CheckpointProgress::State::kFailed;
    status_->error = s;
  }
  claimed_ = false;
  return s;
}

absl::StatusOr<CheckpointProgress> CheckpointWriter::Status(const std::string& name,
                                                            absl::Duration wait) {
  absl::MutexLock lock(&mu_);
  if (!status_.has_value() || status_->name != name) {
    const std::string last = status_.has_value() ? status_->name : std::string();
    return absl::NotFoundError(absl::StrCat(
        "job ", options_.job_id, ": no save of checkpoint \"", name,
        "\" was started on this daemon", last.empty()
                                             ? std::string()
                                             : absl::StrCat(" (the last was \"", last, "\")")));
  }
  auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return status_->state != CheckpointProgress::State::kWriting;
  };
  mu_.AwaitWithTimeout(absl::Condition(&done), wait);
  CheckpointProgress out = *status_;
  if (out.state == CheckpointProgress::State::kWriting) {
    out.bytes_written = bytes_written_.load();
  }
  return out;
}

}  // namespace zeroshard
