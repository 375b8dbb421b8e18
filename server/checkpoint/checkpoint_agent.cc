#include "server/checkpoint/checkpoint_agent.h"

#include <unistd.h>

#include <cstdio>

#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/checkpoint_files.h"
#include "common/status_macros.h"

namespace zeroshard {

CheckpointAgent::CheckpointAgent(Options options, const v1::JobSpec* spec, StepEngine* step)
    : options_(std::move(options)),
      spec_(spec),
      step_(step),
      config_(step->config()),
      writer_(std::make_shared<CheckpointWriter>([&] {
        CheckpointWriter::Options o;
        o.root = options_.root;
        o.job_id = config_.job_id;
        o.daemon_index = options_.daemon_index;
        o.daemon_count = static_cast<uint32_t>(config_.daemons.size());
        o.ledger = options_.ledger;
        o.metrics = options_.metrics;
        return o;
      }())) {}

CheckpointAgent::~CheckpointAgent() {
  if (!writer_->Retire(kWriteWaitAtRemoval)) {
    std::fprintf(stderr,
                 "zeroshardd: job %s: a checkpoint write is still in progress %s after the job's "
                 "removal began (its disk hangs?); it goes on, and its buffers are freed when it "
                 "ends\n",
                 config_.job_id.c_str(), absl::FormatDuration(kWriteWaitAtRemoval).c_str());
  }
}

absl::StatusOr<CheckpointSaved> CheckpointAgent::Save(const std::string& name, uint64_t step) {
  if (absl::Status s = ValidateCheckpointName(name, false); !s.ok()) return s;
  const std::string manifest =
      absl::StrCat(CheckpointDir(writer_->root(), config_.job_id, name), "/",
                   kManifestFile);
  if (::access(manifest.c_str(), F_OK) == 0) {
    return absl::AlreadyExistsError(absl::StrCat("checkpoint ", config_.job_id, "/", name,
                                                 " exists and is complete; save under a new name"));
  }
  const std::vector<std::string> files = ArrayFilesOf(*spec_);
  const uint64_t n = step_->owned_unpadded().size();
  // States on disk are written from their file under the commit lock (the
  // stall is the whole write, no copy in RAM); others are copied into the
  // writer's buffers, claimed (allocated and faulted in on the first save)
  // before the commit lock, and written in the background.
  const bool from_disk = step_->states_on_disk();
  if (absl::Status s = from_disk ? writer_->Claim(0, 0) : writer_->Claim(n, files.size());
      !s.ok()) {
    return s;
  }
  // Holding the commit lock keeps every step out while the copy runs: the
  // training stall. Gathers go on (they share the parameter lock).
  absl::Time start;
  v1::TrainingState state;
  {
    absl::MutexLock commit_lock(&step_->commit_lock());
    if (step != step_->committed_step()) {
      writer_->Release(/*failed=*/true);
      return absl::FailedPreconditionError(
          absl::StrCat("step: job ", config_.job_id, " has committed step ",
                       step_->committed_step(), ", asked to save ", step));
    }
    start = absl::Now();
    state = step_->TrainingState();
    absl::Status copied;
    step_->ReadModelStates([&](const ShardState& shard) {
      state.set_optimizer_steps(shard.optimizer_steps());
      for (v1::TensorStep& t : shard.TensorStepsApart()) {
        *state.add_tensor_steps() = std::move(t);
      }
      if (from_disk) {
        // Ends the claim.
        copied = writer_->WriteNow(
            name, step_->owned_unpadded(), files, state, [&](size_t i, ArraySink sink) {
              return shard.StreamOut(i, n, [&](const float* data, size_t count) {
                return sink(data, count * sizeof(float));
              });
            });
        return;
      }
      std::vector<float*> dst;
      for (size_t i = 0; i < files.size(); ++i) dst.push_back(writer_->buffer(i));
      copied = shard.CopyOut(n, dst.data());
    });
    if (!copied.ok()) {
      if (!from_disk) writer_->Release(/*failed=*/true);
      return copied;
    }
  }
  const absl::Duration stall = absl::Now() - start;
  if (!from_disk) writer_->StartWrite(name, step_->owned_unpadded(), files, state);
  CheckpointSaved out;
  out.step = state.committed_step();
  out.bytes = n * sizeof(float) * files.size();
  out.snapshot_seconds = absl::ToDoubleSeconds(stall);
  if (options_.metrics != nullptr) {
    options_.metrics->RecordCheckpointSnapshot(config_.job_id, stall, out.bytes);
  }
  return out;
}

absl::StatusOr<CheckpointProgress> CheckpointAgent::Status(const std::string& name,
                                                           absl::Duration wait) {
  return writer_->Status(name, wait);
}

absl::StatusOr<uint64_t> CheckpointAgent::Complete(const std::string& name,
                                                   const std::vector<v1::PartManifest>& parts) {
  if (absl::Status s = ValidateCheckpointName(name, false); !s.ok()) return s;
  const uint32_t daemons = static_cast<uint32_t>(config_.daemons.size());
  if (parts.size() != daemons) {
    return absl::InvalidArgumentError(absl::StrCat(
        "parts: job ", config_.job_id, " has ", daemons, " daemons, got ", parts.size(), " parts"));
  }
  // This daemon's part must be the one it wrote.
  v1::PartManifest mine;
  const std::string root = writer_->root();
  if (absl::Status s = ReadProtoFile(
          absl::StrCat(CheckpointPartDir(root, config_.job_id, name, options_.daemon_index), "/",
                       kPartManifestFile),
          &mine);
      !s.ok()) {
    if (absl::IsNotFound(s)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint ", config_.job_id, "/", name, ": this daemon (part ", options_.daemon_index,
          ") has not written its part; wait for GetCheckpointStatus to report it written"));
    }
    return s;
  }
  if (mine.SerializeAsString() != parts[options_.daemon_index].SerializeAsString()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "parts[", options_.daemon_index, "]: differs from the part this daemon wrote for checkpoint ",
        config_.job_id, "/", name));
  }
  // The other daemons' parts go into MANIFEST as sent: each must cover what
  // its daemon owns under this job's partition map (CheckManifest below ties
  // their files to those ranges and the map to the spec).
  for (uint32_t d = 0; d < daemons; ++d) {
    const v1::FlatRange& got = parts[d].range();
    const FlatRange owned = config_.map.DaemonRange(d).Intersect({0, config_.map.total_elements()});
    if (got.begin() != owned.begin || got.end() != owned.end) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parts[", d, "].range: [", got.begin(), ", ", got.end(), "), daemon ", d, " of job ",
          config_.job_id, " owns [", owned.begin, ", ", owned.end, ")"));
    }
  }
  v1::CheckpointManifest m;
  m.set_format_version(kCheckpointFormatVersion);
  m.set_job_id(config_.job_id);
  m.set_name(name);
  *m.mutable_spec() = *spec_;
  FillPartitionMap(config_, m.mutable_partition_map());
  *m.mutable_state() = mine.state();
  // The update counts differ between parts (each lists the tensors it
  // overlaps) and a load reads them from the parts: without them the
  // manifest is the same whichever daemon completes it.
  m.mutable_state()->clear_tensor_steps();
  m.mutable_parts()->Add(parts.begin(), parts.end());
  if (absl::Status s = CheckManifest(m); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("parts: ", s.message()));
  }
  absl::StatusOr<v1::CheckpointManifest> existing = ReadManifest(root, config_.job_id, name);
  if (existing.ok()) {
    // Idempotent: the same parts again.
    existing->clear_completed_unix_ms();
    if (existing->SerializeAsString() != m.SerializeAsString()) {
      return absl::AlreadyExistsError(absl::StrCat("checkpoint ", config_.job_id, "/", name,
                                                   " is complete with other parts"));
    }
  } else {
    m.set_completed_unix_ms(absl::ToUnixMillis(absl::Now()));
    if (absl::Status s =
            WriteProtoFile(CheckpointDir(root, config_.job_id, name), kManifestFile, m);
        !s.ok()) {
      return s;
    }
  }
  if (options_.metrics != nullptr) {
    options_.metrics->SetCheckpointComplete(config_.job_id, m.state().committed_step());
  }
  return m.state().committed_step();
}

absl::StatusOr<CheckpointLoaded> CheckpointAgent::Load(const std::string& requested) {
  const absl::Time start = absl::Now();
  const std::string root = writer_->root();
  absl::StatusOr<std::string> name = ResolveCheckpointName(root, config_.job_id, requested);
  if (!name.ok()) return name.status();
  absl::StatusOr<v1::CheckpointManifest> m = ReadManifest(root, config_.job_id, *name);
  if (!m.ok()) return m.status();
  if (m->spec().layout_fingerprint() != spec_->layout_fingerprint()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint ", config_.job_id, "/", *name, " is of another model (layout fingerprint ",
        m->spec().layout_fingerprint(), ", this job's is ", spec_->layout_fingerprint(), ")"));
  }
  if (m->spec().optimizer().kind() != spec_->optimizer().kind()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint ", config_.job_id, "/", *name, " holds the state of optimizer kind ",
        m->spec().optimizer().kind(), ", this job uses ", spec_->optimizer().kind()));
  }
  // The fingerprint is the manifest's word; its flat space (tied to its
  // layout by ReadManifest) must also be this job's, or the parts would not
  // cover what this daemon owns.
  if (m->partition_map().total_elements() != config_.map.total_elements()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint ", config_.job_id, "/", *name, " spans ", m->partition_map().total_elements(),
        " elements, this job's layout ", config_.map.total_elements()));
  }
  const std::vector<std::string> files = ArrayFilesOf(*spec_);
  const FlatRange owned = step_->owned_unpadded();
  CheckpointReader reader(root, *m);
  if (absl::Status s = reader.CheckReadable(owned, files); !s.ok()) return s;
  const uint64_t n = owned.size();
  // States on disk are restored from the files chunk by chunk (no copy in
  // RAM); others through the writer's buffers.
  const bool to_disk = step_->states_on_disk();
  if (absl::Status s = to_disk ? writer_->Claim(0, 0) : writer_->Claim(n, files.size());
      !s.ok()) {
    return s;
  }
  // Read and check everything before touching the state, with no lock held
  // (on disk: every block's CRC through a scratch buffer of one block, then
  // read again in the restore).
  uint64_t bytes_read = 0;
  std::vector<const float*> src;
  std::vector<float> scratch(to_disk ? std::min<uint64_t>(n, kCheckpointBlockBytes / 4) : 0);
  for (size_t i = 0; i < files.size(); ++i) {
    absl::Status s;
    if (to_disk) {
      for (uint64_t pos = owned.begin; s.ok() && pos < owned.end; pos += scratch.size()) {
        const FlatRange r{pos, std::min<uint64_t>(owned.end, pos + scratch.size())};
        s = reader.ReadRange(files[i], r, scratch.data(), &bytes_read);
      }
    } else {
      src.push_back(writer_->buffer(i));
      s = reader.ReadRange(files[i], owned, writer_->buffer(i), &bytes_read);
    }
    if (!s.ok()) {
      writer_->Release(/*failed=*/true);
      return s;
    }
  }
  const v1::TrainingState& state = m->state();
  // Each part lists the counts of the tensors it overlaps that differ from
  // the step count; a tensor's count is the same in every part holding it.
  std::vector<v1::TensorStep> tensor_steps;
  for (const v1::PartManifest& part : m->parts()) {
    tensor_steps.insert(tensor_steps.end(), part.state().tensor_steps().begin(),
                        part.state().tensor_steps().end());
  }
  absl::Status restored;
  {
    absl::MutexLock commit_lock(&step_->commit_lock());
    restored = step_->Restore(state, [&](ShardState& shard) {
      if (!to_disk) {
        return shard.Restore(step_->optimizer(), n, src.data(), state.optimizer_steps(),
                             tensor_steps);
      }
      return shard.RestoreFrom(
          step_->optimizer(), n,
          [&](size_t i, const FlatRange& r, float* dst) {
            return reader.ReadRange(files[i], r, dst, &bytes_read);
          },
          state.optimizer_steps(), tensor_steps);
    });
  }
  writer_->Release(/*failed=*/!restored.ok());
  if (!restored.ok()) return restored;
  CheckpointLoaded out;
  out.name = *name;
  out.step = state.committed_step();
  out.bytes_read = bytes_read;
  out.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  return out;
}

}  // namespace zeroshard
