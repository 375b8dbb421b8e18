#include "server/step/shard_state.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/fnv.h"
#include "common/status_macros.h"

namespace zeroshard {

StepHyperParams HyperParamsOf(const OptimizerSettings& s) {
  StepHyperParams hp;
  hp.kind = s.kind;
  hp.lr = s.lr;
  hp.beta1 = s.beta1;
  hp.beta2 = s.beta2;
  hp.eps = s.eps;
  hp.weight_decay = s.weight_decay;
  hp.momentum = s.momentum;
  return hp;
}

std::vector<StepHyperParams> GroupHyperParams(const JobSettings& settings) {
  std::vector<StepHyperParams> out;
  for (uint32_t g = 0; g < GroupCount(settings); ++g) {
    out.push_back(HyperParamsOf(GroupOptimizer(settings, g)));
  }
  return out;
}

namespace {

// The half copy is the partitioned parameter only in stage 3; before that it
// stages gathers.
MemoryCategory HalfCategory(const JobConfig& c) {
  return c.stage == 3 ? MemoryCategory::kParamHalf : MemoryCategory::kBuffer;
}

}  // namespace

CategoryBytes BookedAsReplica(const CategoryBytes& bytes) {
  CategoryBytes out{};
  for (uint64_t b : bytes) out[static_cast<int>(MemoryCategory::kReplica)] += b;
  return out;
}

namespace {

// How a job's arrays on disk are laid out: arrays per chunk, elements per
// chunk, chunks.
struct DiskLayout {
  size_t slots = 0;
  uint64_t chunk_elements = 0;
  uint64_t chunks = 0;
  uint64_t chunk_bytes() const { return slots * chunk_elements * sizeof(float); }
  uint64_t file_bytes() const { return chunks * chunk_bytes(); }
};

constexpr uint64_t kChunkGranule = StateFile::kAlignment / sizeof(float);

DiskLayout LayoutOnDisk(const JobConfig& c, FlatRange owned, const DiskResidence& d) {
  DiskLayout l;
  l.slots = (c.precision != DType::kFp32 ? 1 : 0) + 1 +
            (c.optimizer.kind != OptimizerKind::kSgdMomentum ? 1 : 0);
  const uint64_t n = std::max<uint64_t>(owned.size(), 1);
  const uint64_t rounded = (n + kChunkGranule - 1) / kChunkGranule * kChunkGranule;
  l.chunk_elements = std::min<uint64_t>(d.chunk_elements, rounded);
  l.chunks = (n + l.chunk_elements - 1) / l.chunk_elements;
  return l;
}

}  // namespace

CategoryBytes ShardState::Footprint(const JobConfig& c, FlatRange owned, bool replica,
                                    const DiskResidence& disk) {
  if (replica) return BookedAsReplica(Footprint(c, owned, false, disk));
  const uint64_t n = owned.size();
  CategoryBytes bytes{};
  if (c.precision != DType::kFp32) {
    bytes[static_cast<int>(HalfCategory(c))] += n * sizeof(uint16_t);
  }
  if (disk.dir != nullptr) {
    // In RAM: what gathers read (the half copy, or an fp32 job's masters)
    // and the chunk buffers.
    if (c.precision == DType::kFp32) {
      bytes[static_cast<int>(MemoryCategory::kParamMaster)] = n * sizeof(float);
    }
    bytes[static_cast<int>(MemoryCategory::kBuffer)] +=
        disk.buffers * LayoutOnDisk(c, owned, disk).chunk_bytes();
    return bytes;
  }
  const uint64_t moments = n - OwnedTensors(c.layout, owned).frozen_elements();
  bytes[static_cast<int>(MemoryCategory::kParamMaster)] = n * sizeof(float);
  bytes[static_cast<int>(MemoryCategory::kOptimM)] = moments * sizeof(float);
  if (c.optimizer.kind != OptimizerKind::kSgdMomentum) {
    bytes[static_cast<int>(MemoryCategory::kOptimV)] = moments * sizeof(float);
  }
  return bytes;
}

uint64_t ShardState::DiskFootprint(const JobConfig& c, FlatRange owned,
                                   const DiskResidence& disk) {
  return disk.dir == nullptr ? 0 : LayoutOnDisk(c, owned, disk).file_bytes();
}

absl::StatusOr<std::unique_ptr<ShardState>> ShardState::Create(const JobConfig& c, FlatRange owned,
                                                               LedgerReservation* booked,
                                                               transport::Transport* transport,
                                                               bool replica,
                                                               const DiskResidence& disk) {
  const bool on_disk = disk.dir != nullptr;
  if (on_disk) {
    if (c.replicas > 1 || replica) {
      return absl::FailedPreconditionError(absl::StrCat(
          "job ", c.job_id, " has ", c.replicas, " replicas: the model states of a replicated ",
          "job stay in RAM (replicas of states on --state_dir are not supported)"));
    }
    if (disk.chunk_elements == 0 || disk.chunk_elements % kChunkGranule != 0 ||
        disk.buffers < 3) {
      return absl::InvalidArgumentError(
          absl::StrCat("state on disk: chunks of ", disk.chunk_elements, " elements and ",
                       disk.buffers, " buffers; need a multiple of ", kChunkGranule,
                       " and at least 3"));
    }
  }
  std::unique_ptr<ShardState> s(
      new ShardState(c.precision, OwnedTensors(c.layout, owned), HalfCategory(c)));
  const uint64_t n = owned.size();
  const uint64_t moment_elements = s->tensors_.moment_elements();
  const bool sgd = c.optimizer.kind == OptimizerKind::kSgdMomentum;
  const bool half = c.precision != DType::kFp32;
  // Checked before any allocation: a region is never allocated for bytes
  // nobody booked.
  const CategoryBytes needed = Footprint(c, owned, replica, disk);
  for (int cat = 0; cat < kNumMemoryCategories; ++cat) {
    if (booked->held(static_cast<MemoryCategory>(cat)) < needed[cat]) {
      return absl::InternalError(absl::StrCat("job ", c.job_id, ": the shard states' ",
                                              MemoryCategoryName(static_cast<MemoryCategory>(cat)),
                                              " bytes were not booked"));
    }
  }
  // Arrays peers read directly (trainers the masters and half copy, in a
  // replicated job a backup every checkpoint array in a state transfer) are
  // allocated by the transport (placed for remote access) and booked once,
  // as the arrays themselves.
  auto remote = [&](size_t size, std::unique_ptr<transport::Region>* region)
      -> absl::StatusOr<void*> {
    if (transport == nullptr || size == 0) return nullptr;
    absl::StatusOr<std::unique_ptr<transport::Region>> r =
        transport->AllocateRegion(size, transport::Access::kRemoteRead);
    if (!r.ok()) return r.status();
    *region = *std::move(r);
    return (*region)->base();
  };
  auto array = [&](auto* out, MemoryCategory category, std::unique_ptr<transport::Region>* region,
                   uint64_t n) -> absl::Status {
    using T = typename std::remove_pointer_t<decltype(out)>::value_type;
    void* memory = nullptr;
    if (region != nullptr) {
      absl::StatusOr<void*> m = remote(n * sizeof(T), region);
      if (!m.ok()) return m.status();
      memory = *m;
    }
    absl::StatusOr<LedgerArray<T>> a =
        LedgerArray<T>::Create(booked, replica ? MemoryCategory::kReplica : category, n, memory);
    if (!a.ok()) return a.status();
    *out = *std::move(a);
    return absl::OkStatus();
  };
  s->has_v_ = !sgd;
  if (!on_disk || !half) {
    if (absl::Status st =
            array(&s->master_, MemoryCategory::kParamMaster, &s->master_region_, n);
        !st.ok()) {
      return st;
    }
  }
  // The moments only where a backup may read them.
  const bool replicated = c.replicas > 1;
  if (!on_disk) {
    if (absl::Status st =
            array(&s->m_, MemoryCategory::kOptimM, replicated ? &s->m_region_ : nullptr,
                  moment_elements);
        !st.ok()) {
      return st;
    }
    if (!sgd) {
      if (absl::Status st =
              array(&s->v_, MemoryCategory::kOptimV, replicated ? &s->v_region_ : nullptr,
                    moment_elements);
          !st.ok()) {
        return st;
      }
    }
  }
  if (half) {
    if (absl::Status st = array(&s->half_, HalfCategory(c), &s->half_region_, n); !st.ok()) {
      return st;
    }
  }
  if (on_disk) {
    const DiskLayout layout = LayoutOnDisk(c, owned, disk);
    absl::StatusOr<std::unique_ptr<StateFile>> file =
        StateFile::Create(disk.dir, layout.file_bytes(), layout.chunk_bytes(), disk.buffers,
                          disk.queue_depth);
    if (!file.ok()) {
      return absl::Status(file.status().code(),
                          absl::StrCat("job ", c.job_id, ": ", file.status().message()));
    }
    const uint64_t buffer_bytes = disk.buffers * layout.chunk_bytes();
    if (!booked->Take(MemoryCategory::kBuffer, buffer_bytes)) {
      return absl::InternalError(
          absl::StrCat("job ", c.job_id, ": the state file's buffers were not booked"));
    }
    s->file_ = *std::move(file);
    s->masters_on_disk_ = half;
    s->disk_slots_ = layout.slots;
    s->chunk_elements_ = layout.chunk_elements;
    s->io_timeout_ = disk.io_timeout;
    s->buffer_ledger_ = booked->ledger();
    s->buffer_job_ = booked->job();
    s->buffer_bytes_ = buffer_bytes;
  }
  s->tensor_steps_.assign(s->tensors_.entries().size(), 0);
  return s;
}

ShardState::~ShardState() {
  file_.reset();  // drains its transfers before the buffers' bytes are released
  if (buffer_ledger_ != nullptr) {
    buffer_ledger_->Release(buffer_job_, MemoryCategory::kBuffer, buffer_bytes_);
  }
}

uint64_t ShardState::disk_bytes() const { return file_ == nullptr ? 0 : file_->size(); }

absl::Status ShardState::damaged() const {
  absl::MutexLock lock(&disk_mu_);
  return damaged_;
}

void ShardState::MarkDamaged(const absl::Status& why) {
  if (!on_disk()) return;
  absl::MutexLock lock(&disk_mu_);
  if (!damaged_.ok()) return;
  damaged_ = absl::FailedPreconditionError(absl::StrCat(
      "job ", buffer_job_, ": the model states in ", file_->path(), " are damaged (",
      why.message(), "); remove the job and register it again from a checkpoint"));
}

FlatRange ShardState::ChunkRange(uint64_t chunk) const {
  const uint64_t begin = owned_.begin + chunk * chunk_elements_;
  return {begin, std::min(owned_.end, begin + chunk_elements_)};
}

absl::Status ShardState::DiskPass(const FlatRange& range, bool write_back, ChunkFn fn) const {
  absl::MutexLock lock(&disk_mu_);
  if (!damaged_.ok()) return damaged_;
  if (range.empty()) return absl::OkStatus();
  const uint64_t first = ChunkOf(range.begin);
  const uint64_t last = ChunkOf(range.end - 1) + 1;
  const size_t buffers = file_->buffers();
  const size_t ahead = buffers - 2;
  const size_t bytes = file_->buffer_bytes();
  auto deadline = [this] { return absl::Now() + io_timeout_; };
  auto read_id = [](uint64_t chunk) { return 2 * chunk; };
  auto write_id = [](uint64_t chunk) { return 2 * chunk + 1; };
  absl::Status error;
  bool wrote = false;
  uint64_t next_read = first;
  for (uint64_t c = first; c < last && error.ok(); ++c) {
    // Reads ahead; a buffer is read into only after its last chunk's write.
    while (error.ok() && next_read < last && next_read <= c + ahead) {
      const size_t b = (next_read - first) % buffers;
      if (write_back && next_read >= first + buffers) {
        error = file_->Wait(write_id(next_read - buffers), deadline());
        if (!error.ok()) break;
      }
      error = file_->StartRead(read_id(next_read), FileOffset(next_read, 0), b, 0, bytes,
                               deadline());
      if (error.ok()) ++next_read;
    }
    if (!error.ok()) break;
    error = file_->Wait(read_id(c), deadline());
    if (!error.ok()) break;
    float* buffer = reinterpret_cast<float*>(file_->buffer((c - first) % buffers));
    const FlatRange chunk = ChunkRange(c);
    ChunkArrays arrays{};
    size_t slot = 0;
    if (masters_on_disk_) {
      arrays[0] = buffer + chunk_elements_ * slot++;
    } else if (!master_.empty()) {
      // The RAM masters of an fp32 job; passes that write them are the
      // non-const methods' (Step, WriteMasters, Restore, WriteArray).
      arrays[0] = const_cast<float*>(master_.data()) + (chunk.begin - owned_.begin);
    }
    arrays[1] = buffer + chunk_elements_ * slot++;
    if (has_v_) arrays[2] = buffer + chunk_elements_ * slot++;
    error = fn(chunk, arrays);
    if (!error.ok()) {
      wrote = wrote || write_back;  // fn may have changed RAM arrays
      break;
    }
    if (write_back) {
      wrote = true;
      error = file_->StartWrite(write_id(c), FileOffset(c, 0), (c - first) % buffers, 0, bytes,
                                deadline());
    }
  }
  const absl::Status drained = file_->WaitAll(deadline());
  if (error.ok()) error = drained;
  // A pass that wrote, or a drain that left transfers in flight (the
  // buffers may still change under the next pass), damages the state.
  if (!error.ok() && (wrote || file_->in_flight() > 0)) {
    damaged_ = absl::FailedPreconditionError(absl::StrCat(
        "job ", buffer_job_, ": the model states in ", file_->path(), " are damaged (",
        error.message(), "); remove the job and register it again from a checkpoint"));
  }
  return error;
}

absl::Status ShardState::WriteMasters(ShardOptimizer* optimizer, uint64_t begin, const void* src,
                                      DType type, size_t n) {
  const uint64_t off = begin - owned_.begin;
  if (!masters_on_disk_) {
    optimizer->ConvertIn(master_.data() + off, src, type, n);
    if (!half_.empty()) {
      optimizer->ConvertOut(half_.data() + off, precision_, master_.data() + off, n);
    }
    return absl::OkStatus();
  }
  const char* bytes = static_cast<const char*>(src);
  const FlatRange range{begin, begin + n};
  return DiskPass(range, true, [&](const FlatRange& chunk, const ChunkArrays& a) {
    const FlatRange r = chunk.Intersect(range);
    float* masters = a[0] + (r.begin - chunk.begin);
    optimizer->ConvertIn(masters, bytes + (r.begin - begin) * DTypeSize(type), type, r.size());
    optimizer->ConvertOut(half_.data() + (r.begin - owned_.begin), precision_, masters,
                          r.size());
    return absl::OkStatus();
  });
}

absl::Status ShardState::RefreshHalfCopy(ShardOptimizer* optimizer) {
  if (half_.empty()) return absl::OkStatus();
  if (!masters_on_disk_) {
    optimizer->ConvertOut(half_.data(), precision_, master_.data(), master_.size());
    return absl::OkStatus();
  }
  return DiskPass(owned_, false, [&](const FlatRange& chunk, const ChunkArrays& a) {
    optimizer->ConvertOut(half_.data() + (chunk.begin - owned_.begin), precision_, a[0],
                          chunk.size());
    return absl::OkStatus();
  });
}

absl::Status ShardState::Read(uint64_t begin, size_t n, DType dtype, void* dst) const {
  const uint64_t off = begin - owned_.begin;
  if (dtype == precision_ && !half_.empty()) {
    std::memcpy(dst, half_.data() + off, n * DTypeSize(dtype));
    return absl::OkStatus();
  }
  if (!masters_on_disk_) {
    FromFloat(dtype, master_.data() + off, dst, n);
    return absl::OkStatus();
  }
  char* out = static_cast<char*>(dst);
  const FlatRange range{begin, begin + n};
  return DiskPass(range, false, [&](const FlatRange& chunk, const ChunkArrays& a) {
    const FlatRange r = chunk.Intersect(range);
    FromFloat(dtype, a[0] + (r.begin - chunk.begin), out + (r.begin - begin) * DTypeSize(dtype),
              r.size());
    return absl::OkStatus();
  });
}

absl::Status ShardState::Step(ShardOptimizer* optimizer, absl::Span<const StepHyperParams> groups,
                              const float* grad, const FlatRange& range,
                              absl::Span<const uint32_t> no_grad) {
  for (size_t g = 0; g < groups.size(); ++g) {
    StepHyperParams hp = groups[g];
    hp.step = 1;
    if (absl::Status s = ValidateHyperParams(hp); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("parameter group ", g, ": ", s.message()));
    }
  }
  const std::vector<OwnedTensors::Entry>& entries = tensors_.entries();
  for (const OwnedTensors::Entry& e : entries) {
    if (!e.frozen && e.group >= groups.size()) {
      return absl::InternalError(absl::StrCat("tensor ", e.index, " is in parameter group ",
                                              e.group, " of ", groups.size()));
    }
  }
  // Runs of updated tensors: [run_first, i) share a group and an update count
  // and follow each other with nothing skipped between.
  size_t skip = 0;  // next candidate in no_grad
  auto skipped = [&](uint32_t index) {
    while (skip < no_grad.size() && no_grad[skip] < index) ++skip;
    return skip < no_grad.size() && no_grad[skip] == index;
  };
  // Entry i's span: its elements and the alignment gap after it (the first
  // also the gap before it, the last up to the end of `range`), so that a
  // step of every tensor covers `range` whole.
  auto span_begin = [&](size_t i) { return i == 0 ? range.begin : entries[i].range.begin; };
  auto span_end = [&](size_t i) {
    return i + 1 < entries.size() ? entries[i + 1].range.begin : range.end;
  };
  struct Run {
    size_t first = 0;  // entries [first, last)
    size_t last = 0;
    FlatRange range;
    StepHyperParams hp;
  };
  std::vector<Run> runs;
  auto add_run = [&](size_t first, size_t last) {
    Run run;
    run.first = first;
    run.last = last;
    run.range = {span_begin(first), span_end(last - 1)};
    run.hp = groups[entries[first].group];
    run.hp.step = static_cast<int64_t>(tensor_steps_[first] + 1);
    runs.push_back(run);
  };
  size_t run_first = 0;
  bool in_run = false;
  for (size_t i = 0; i < entries.size(); ++i) {
    const OwnedTensors::Entry& e = entries[i];
    const bool update = !e.frozen && !e.range.empty() && !skipped(e.index);
    const bool joins = in_run && update && e.group == entries[run_first].group &&
                       tensor_steps_[i] == tensor_steps_[run_first];
    if (in_run && !joins) {
      add_run(run_first, i);
      in_run = false;
    }
    if (update && !in_run) {
      run_first = i;
      in_run = true;
    }
  }
  if (in_run) add_run(run_first, entries.size());
  auto buffers = [&](const FlatRange& r) {
    ShardBuffers b;
    b.grad = grad + (r.begin - owned_.begin);
    b.model_copy = half_.empty() ? nullptr : half_.data() + (r.begin - owned_.begin);
    b.model_copy_type = precision_;
    b.size = r.size();
    return b;
  };
  if (on_disk()) RETURN_IF_ERROR(damaged());
  if (!on_disk()) {
    for (const Run& run : runs) {
      const uint64_t moment = tensors_.MomentIndex(run.range.begin);
      ShardBuffers b = buffers(run.range);
      b.param = master_.data() + (run.range.begin - owned_.begin);
      b.exp_avg = m_.data() + moment;
      b.exp_avg_sq = v_.empty() ? nullptr : v_.data() + moment;
      RETURN_IF_ERROR(optimizer->Step(run.hp, b));
    }
  } else if (!runs.empty()) {
    // Chunk by chunk, each run's part in the chunk: the same elements get
    // the same arithmetic as in one call over the run.
    size_t next = 0;  // the first run that may overlap the chunk
    RETURN_IF_ERROR(DiskPass(
        {runs.front().range.begin, runs.back().range.end}, true,
        [&](const FlatRange& chunk, const ChunkArrays& a) -> absl::Status {
          while (next < runs.size() && runs[next].range.end <= chunk.begin) ++next;
          for (size_t k = next; k < runs.size() && runs[k].range.begin < chunk.end; ++k) {
            const FlatRange r = runs[k].range.Intersect(chunk);
            if (r.empty()) continue;
            const uint64_t at = r.begin - chunk.begin;
            ShardBuffers b = buffers(r);
            b.param = a[0] + at;
            b.exp_avg = a[1] + at;
            b.exp_avg_sq = a[2] == nullptr ? nullptr : a[2] + at;
            RETURN_IF_ERROR(optimizer->Step(runs[k].hp, b));
          }
          return absl::OkStatus();
        }));
  }
  for (const Run& run : runs) {
    for (size_t j = run.first; j < run.last; ++j) ++tensor_steps_[j];
  }
  ++optimizer_steps_;
  return absl::OkStatus();
}

absl::Status ShardState::CopyOut(size_t n, float* const* dst) const {
  const FlatRange range{owned_.begin, owned_.begin + n};
  if (on_disk()) {
    // Frozen tensors' moments are zeros in the file.
    return DiskPass(range, false, [&](const FlatRange& chunk, const ChunkArrays& a) {
      const FlatRange r = chunk.Intersect(range);
      for (size_t i = 0; i < checkpoint_arrays(); ++i) {
        std::memcpy(dst[i] + (r.begin - owned_.begin), a[i] + (r.begin - chunk.begin),
                    r.size() * sizeof(float));
      }
      return absl::OkStatus();
    });
  }
  std::memcpy(dst[0], master_.data(), n * sizeof(float));
  for (size_t i = 1; i < checkpoint_arrays(); ++i) {
    RETURN_IF_ERROR(ReadArray(static_cast<StateArrayKind>(i + 1), range, dst[i]));
  }
  return absl::OkStatus();
}

void ShardState::SetAllSteps(uint64_t optimizer_steps,
                             absl::Span<const v1::TensorStep> tensor_steps) {
  optimizer_steps_ = optimizer_steps;
  const std::vector<OwnedTensors::Entry>& entries = tensors_.entries();
  for (size_t i = 0; i < entries.size(); ++i) {
    tensor_steps_[i] = entries[i].frozen ? 0 : optimizer_steps;
  }
  for (const v1::TensorStep& t : tensor_steps) {
    const int64_t pos = tensors_.Find(t.tensor());
    if (pos >= 0 && !entries[pos].frozen) tensor_steps_[pos] = t.steps();
  }
}

absl::Status ShardState::Restore(ShardOptimizer* optimizer, size_t n, const float* const* src,
                                 uint64_t optimizer_steps,
                                 absl::Span<const v1::TensorStep> tensor_steps) {
  if (on_disk()) {
    // RestoreFrom with the values taken from `src` (one pass, the half copy
    // in it: a restore lands whole or damages the state).
    return RestoreFrom(
        optimizer, n,
        [&](size_t i, const FlatRange& r, float* dst) {
          std::memcpy(dst, src[i] + (r.begin - owned_.begin), r.size() * sizeof(float));
          return absl::OkStatus();
        },
        optimizer_steps, tensor_steps);
  }
  std::memcpy(master_.data(), src[0], n * sizeof(float));
  std::memset(master_.data() + n, 0, (master_.size() - n) * sizeof(float));
  const FlatRange range{owned_.begin, owned_.begin + n};
  for (size_t i = 1; i < checkpoint_arrays(); ++i) {
    LedgerArray<float>& a = i == 1 ? m_ : v_;
    std::memset(a.data(), 0, a.size() * sizeof(float));
    tensors_.ForEachUnfrozen(range, [&](const FlatRange& r) {
      std::memcpy(a.data() + tensors_.MomentIndex(r.begin), src[i] + (r.begin - owned_.begin),
                  r.size() * sizeof(float));
    });
  }
  SetAllSteps(optimizer_steps, tensor_steps);
  return RefreshHalfCopy(optimizer);
}

absl::Status ShardState::StreamOut(
    size_t array, size_t n,
    absl::FunctionRef<absl::Status(const float* data, size_t count)> sink) const {
  const FlatRange range{owned_.begin, owned_.begin + n};
  return DiskPass(range, false, [&](const FlatRange& chunk, const ChunkArrays& a) {
    const FlatRange r = chunk.Intersect(range);
    return sink(a[array] + (r.begin - chunk.begin), r.size());
  });
}

absl::Status ShardState::RestoreFrom(
    ShardOptimizer* optimizer, size_t n,
    absl::FunctionRef<absl::Status(size_t array, const FlatRange& range, float* dst)> read,
    uint64_t optimizer_steps, absl::Span<const v1::TensorStep> tensor_steps) {
  const FlatRange restored{owned_.begin, owned_.begin + n};
  RETURN_IF_ERROR(DiskPass(owned_, true, [&](const FlatRange& chunk, const ChunkArrays& a) {
    const FlatRange held = chunk.Intersect(restored);
    for (size_t i = 0; i < checkpoint_arrays(); ++i) {
      std::memset(a[i], 0, chunk.size() * sizeof(float));
      if (held.empty()) continue;
      RETURN_IF_ERROR(read(i, held, a[i] + (held.begin - chunk.begin)));
      if (i == 0) continue;
      // Frozen tensors keep no moments: zeros, whatever the checkpoint says.
      const auto [first, last] = tensors_.In(held);
      for (size_t e = first; e < last; ++e) {
        if (!tensors_.entries()[e].frozen) continue;
        const FlatRange f = tensors_.entries()[e].range.Intersect(held);
        std::memset(a[i] + (f.begin - chunk.begin), 0, f.size() * sizeof(float));
      }
    }
    if (!half_.empty()) {
      optimizer->ConvertOut(half_.data() + (chunk.begin - owned_.begin), precision_, a[0],
                            chunk.size());
    }
    return absl::OkStatus();
  }));
  SetAllSteps(optimizer_steps, tensor_steps);
  return absl::OkStatus();
}

uint64_t ShardState::raw_elements(size_t i, uint64_t n) const {
  if (i == 0) return n;
  uint64_t count = 0;
  tensors_.ForEachUnfrozen({owned_.begin, owned_.begin + n},
                           [&](const FlatRange& r) { count += r.size(); });
  return count;
}

void ShardState::RestoreRaw(ShardOptimizer* optimizer, size_t n, const float* const* src,
                            uint64_t optimizer_steps,
                            absl::Span<const v1::TensorStep> tensor_steps) {
  for (size_t i = 0; i < checkpoint_arrays(); ++i) {
    LedgerArray<float>& a = i == 0 ? master_ : i == 1 ? m_ : v_;
    const uint64_t count = raw_elements(i, n);
    std::memcpy(a.data(), src[i], count * sizeof(float));
    std::memset(a.data() + count, 0, (a.size() - count) * sizeof(float));
  }
  SetAllSteps(optimizer_steps, tensor_steps);
  // In RAM the half copy's refresh cannot fail.
  RefreshHalfCopy(optimizer).IgnoreError();
}

absl::Status ShardState::CheckArray(StateArrayKind array, absl::string_view field) const {
  if (array == StateArrayKind::kExpAvgSq && !has_v_) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": this job's optimizer keeps no second moment (exp_avg_sq)"));
  }
  return absl::OkStatus();
}

absl::Status ShardState::ReadArray(StateArrayKind array, const FlatRange& range,
                                   float* dst) const {
  const size_t slot = static_cast<size_t>(array) - 1;
  if (array == StateArrayKind::kMaster && !masters_on_disk_) {
    std::memcpy(dst, master_.data() + (range.begin - owned_.begin), range.size() * sizeof(float));
    return absl::OkStatus();
  }
  if (on_disk()) {
    return DiskPass(range, false, [&](const FlatRange& chunk, const ChunkArrays& a) {
      const FlatRange r = chunk.Intersect(range);
      std::memcpy(dst + (r.begin - range.begin), a[slot] + (r.begin - chunk.begin),
                  r.size() * sizeof(float));
      return absl::OkStatus();
    });
  }
  const LedgerArray<float>& a = moments(array);
  std::memset(dst, 0, range.size() * sizeof(float));
  tensors_.ForEachUnfrozen(range, [&](const FlatRange& r) {
    std::memcpy(dst + (r.begin - range.begin), a.data() + tensors_.MomentIndex(r.begin),
                r.size() * sizeof(float));
  });
  return absl::OkStatus();
}

absl::Status ShardState::CheckWrite(StateArrayKind array, const FlatRange& range,
                                    const float* src, absl::string_view field) const {
  // Every element outside a tensor (gaps) must be zero, and for moments every
  // element of a frozen tensor.
  const bool moments = array != StateArrayKind::kMaster;
  uint64_t pos = range.begin;
  auto must_be_zero = [&](const FlatRange& r, absl::string_view what) -> absl::Status {
    for (uint64_t x = r.begin; x < r.end; ++x) {
      const float v = src[x - range.begin];
      if (v != 0.0f) {
        return absl::InvalidArgumentError(
            absl::StrCat(field, ": element ", x, " is ", what, " and must be 0, got ", v));
      }
    }
    return absl::OkStatus();
  };
  const auto [first, last] = tensors_.In(range);
  for (size_t i = first; i < last; ++i) {
    const OwnedTensors::Entry& e = tensors_.entries()[i];
    const FlatRange t = e.range.Intersect(range);
    if (t.begin > pos) RETURN_IF_ERROR(must_be_zero({pos, t.begin}, "an alignment gap"));
    if (moments && e.frozen) {
      RETURN_IF_ERROR(must_be_zero(
          t, absl::StrCat("in frozen tensor ", e.index, ", which holds no optimizer state")));
    }
    pos = t.end;
  }
  if (pos < range.end) RETURN_IF_ERROR(must_be_zero({pos, range.end}, "an alignment gap"));
  return absl::OkStatus();
}

absl::StatusOr<bool> ShardState::Holds(StateArrayKind array, const FlatRange& range,
                                       const float* src) const {
  if (on_disk() && (array != StateArrayKind::kMaster || masters_on_disk_)) {
    // Frozen tensors' moments are not state (CheckWrite accepts -0.0
    // there): compared, like in RAM, only where the state is.
    const size_t slot = static_cast<size_t>(array) - 1;
    bool same = true;
    RETURN_IF_ERROR(DiskPass(range, false, [&](const FlatRange& chunk, const ChunkArrays& a) {
      auto compare = [&](const FlatRange& r) {
        same = same && std::memcmp(a[slot] + (r.begin - chunk.begin),
                                   src + (r.begin - range.begin), r.size() * sizeof(float)) == 0;
      };
      const FlatRange r = chunk.Intersect(range);
      if (array == StateArrayKind::kMaster) {
        compare(r);
      } else {
        tensors_.ForEachUnfrozen(r, compare);
      }
      return absl::OkStatus();
    }));
    return same;
  }
  if (array == StateArrayKind::kMaster) {
    return std::memcmp(master_.data() + (range.begin - owned_.begin), src,
                       range.size() * sizeof(float)) == 0;
  }
  const LedgerArray<float>& a = moments(array);
  bool same = true;
  tensors_.ForEachUnfrozen(range, [&](const FlatRange& r) {
    same = same && std::memcmp(a.data() + tensors_.MomentIndex(r.begin),
                               src + (r.begin - range.begin), r.size() * sizeof(float)) == 0;
  });
  return same;
}

bool ShardState::HasTensorStep(uint32_t index, uint64_t steps) const {
  return tensor_steps_[tensors_.Find(index)] == steps;
}

absl::Status ShardState::WriteArray(ShardOptimizer* optimizer, StateArrayKind array,
                                    const FlatRange& range, const float* src) {
  const uint64_t off = range.begin - owned_.begin;
  if (array == StateArrayKind::kMaster && !masters_on_disk_) {
    std::memcpy(master_.data() + off, src, range.size() * sizeof(float));
    if (!half_.empty()) {
      optimizer->ConvertOut(half_.data() + off, precision_, master_.data() + off, range.size());
    }
    return absl::OkStatus();
  }
  if (on_disk()) {
    const size_t slot = static_cast<size_t>(array) - 1;
    return DiskPass(range, true, [&](const FlatRange& chunk, const ChunkArrays& a) {
      const FlatRange r = chunk.Intersect(range);
      auto copy = [&](const FlatRange& part) {
        std::memcpy(a[slot] + (part.begin - chunk.begin), src + (part.begin - range.begin),
                    part.size() * sizeof(float));
      };
      if (array == StateArrayKind::kMaster) {
        copy(r);
        optimizer->ConvertOut(half_.data() + (r.begin - owned_.begin), precision_,
                              a[0] + (r.begin - chunk.begin), r.size());
      } else {
        tensors_.ForEachUnfrozen(r, copy);
      }
      return absl::OkStatus();
    });
  }
  LedgerArray<float>& a = array == StateArrayKind::kExpAvg ? m_ : v_;
  tensors_.ForEachUnfrozen(range, [&](const FlatRange& r) {
    std::memcpy(a.data() + tensors_.MomentIndex(r.begin), src + (r.begin - range.begin),
                r.size() * sizeof(float));
  });
  return absl::OkStatus();
}

std::vector<v1::TensorStep> ShardState::TensorStepsIn(const FlatRange& range) const {
  std::vector<v1::TensorStep> out;
  const auto [first, last] = tensors_.In(range);
  for (size_t i = first; i < last; ++i) {
    if (tensors_.entries()[i].frozen) continue;
    v1::TensorStep t;
    t.set_tensor(tensors_.entries()[i].index);
    t.set_steps(tensor_steps_[i]);
    out.push_back(std::move(t));
  }
  return out;
}

std::vector<v1::TensorStep> ShardState::TensorStepsApart() const {
  std::vector<v1::TensorStep> out;
  for (size_t i = 0; i < tensor_steps_.size(); ++i) {
    if (tensors_.entries()[i].frozen || tensor_steps_[i] == optimizer_steps_) continue;
    v1::TensorStep t;
    t.set_tensor(tensors_.entries()[i].index);
    t.set_steps(tensor_steps_[i]);
    out.push_back(std::move(t));
  }
  return out;
}

absl::Status ShardState::CheckTensorStep(uint32_t index, absl::string_view field) const {
  const int64_t pos = tensors_.Find(index);
  if (pos < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": tensor ", index, " does not overlap the range this daemon owns"));
  }
  if (tensors_.entries()[pos].frozen) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": tensor ", index, " is frozen and has no update count"));
  }
  return absl::OkStatus();
}

void ShardState::SetTensorStep(uint32_t index, uint64_t steps) {
  tensor_steps_[tensors_.Find(index)] = steps;
}

void ShardState::Hash(uint64_t& h) const {
  Fnv1aMix(h, master_.data(), master_.size() * sizeof(float));
  Fnv1aMix(h, m_.data(), m_.size() * sizeof(float));
  Fnv1aMix(h, v_.data(), v_.size() * sizeof(float));
  Fnv1aMix(h, half_.data(), half_.size() * sizeof(uint16_t));
  if (on_disk()) {
    const absl::Status read =
        DiskPass(owned_, false, [&](const FlatRange& chunk, const ChunkArrays& a) {
          for (size_t i = masters_on_disk_ ? 0 : 1; i < checkpoint_arrays(); ++i) {
            Fnv1aMix(h, a[i], chunk.size() * sizeof(float));
          }
          return absl::OkStatus();
        });
    if (!read.ok()) Fnv1aMix(h, read.message().data(), read.message().size());
  }
  Fnv1aMix(h, &optimizer_steps_, sizeof(optimizer_steps_));
  Fnv1aMix(h, tensor_steps_.data(), tensor_steps_.size() * sizeof(uint64_t));
}

void ShardState::Rebook(bool replica) {
  auto to = [replica](MemoryCategory own) { return replica ? MemoryCategory::kReplica : own; };
  master_.Rebook(to(MemoryCategory::kParamMaster));
  m_.Rebook(to(MemoryCategory::kOptimM));
  v_.Rebook(to(MemoryCategory::kOptimV));
  half_.Rebook(to(half_category_));
}

}  // namespace zeroshard
