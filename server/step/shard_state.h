#pragma once

// The model states of the partitions a daemon owns for one job: fp32
// masters, the optimizer's moments, and (for half-precision jobs) the
// half-precision copy trainers gather. With a bulk transport the masters and
// the half copy live in transport regions, so trainers read them directly.
//
// On disk (DiskResidence, the daemon's --state_dir): the optimizer moments,
// and the fp32 masters of half-precision jobs, live in one StateFile, chunk
// by chunk (chunk c holds elements [c C, (c + 1) C) of the owned range of
// every array on disk, one after the other, so one read brings everything a
// chunk's update needs). Frozen tensors' moments keep their places there as
// zeros. What gathers read stays in RAM: the half copy, or the fp32 masters
// of an fp32 job. The optimizer step streams the file through the kernels:
// the read of the next chunks, the update of one and the write-back of the
// one before overlap (StateFile's buffers, allocated once). The step's
// result equals the RAM-resident step bit for bit (the update is per
// element). A transfer that fails or hangs in a pass that writes leaves the
// file's contents unknown: the state is damaged from then on (damaged()),
// and every later step, checkpoint and state read is refused; the job must
// resume from a checkpoint. Replicas of a disk-resident job are not built:
// array() and array_region() serve RAM-resident states only.
//
// Not thread-safe: the Job guards it with its parameter lock (gathers read
// under the shared lock, the optimizer step and initial parameters write
// under the exclusive one). Readers under the shared lock that touch the
// file take an internal lock of their own, one at a time. Methods that touch
// the file block on the disk; each transfer waits at most io_timeout.

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/dtype.h"
#include "common/flat_range.h"
#include "common/job_spec.h"
#include "proto/zeroshard/v1/common.pb.h"
#include "server/disk/state_file.h"
#include "server/ledger/memory_ledger.h"
#include "server/optimizer/optimizer.h"
#include "server/step/owned_tensors.h"
#include "transport/transport.h"

namespace zeroshard {

// A model-state array, as ReadState / WriteState name them.
enum class StateArrayKind : uint8_t { kMaster = 1, kExpAvg = 2, kExpAvgSq = 3 };

// Where a job's fp32 masters (of half-precision jobs) and optimizer moments
// live when they do not stay in RAM.
struct DiskResidence {
  // The daemon's --state_dir; null: every array in RAM.
  InstanceDirectory* dir = nullptr;
  // Elements of one chunk (a multiple of 1024); smaller for a smaller range.
  uint64_t chunk_elements = uint64_t{1} << 18;
  // Chunk buffers (>= 3): buffers - 2 chunks are read ahead of the update.
  size_t buffers = 4;
  unsigned queue_depth = 8;
  // How long one transfer may take before the state is called damaged.
  absl::Duration io_timeout = absl::Seconds(120);
  // The gradient accumulator too (StepEngine): a MappedFile in `dir` that
  // the kernel writes back and evicts under memory pressure, out of the
  // ledger (4 bytes per owned element).
  bool gradient = false;
};

class ShardState {
 public:
  // The bytes Create books for the owned range of this job, by category:
  // fp32 masters, the optimizer's moments (none for frozen tensors), and the
  // half-precision copy (param_half in stage 3, buffer before: it only
  // stages gathers). With `replica` (a backup's copy of another daemon's
  // group) all of it is booked as replica. On disk (`disk.dir` set): what
  // stays in RAM, the chunk buffers booked as buffer.
  static CategoryBytes Footprint(const JobConfig& config, FlatRange owned, bool replica = false,
                                 const DiskResidence& disk = {});
  // The bytes of the state file on disk (0 without `disk.dir`).
  static uint64_t DiskFootprint(const JobConfig& config, FlatRange owned,
                                const DiskResidence& disk);
  // Allocates the owned range's states with bytes taken from `booked`, which
  // must hold Footprint(config, owned, replica, disk) for the job: the caller
  // books the whole footprint at once before anything is allocated.
  // Transport regions are allocated only here, after that booking.
  // ResourceExhausted when an allocation fails (what was not taken stays in
  // `booked`), or when the state directory has no room for the file (its
  // message names the directory). `transport` may be null (no bulk data
  // path). FailedPrecondition for a replicated job on disk.
  static absl::StatusOr<std::unique_ptr<ShardState>> Create(const JobConfig& config,
                                                            FlatRange owned,
                                                            LedgerReservation* booked,
                                                            transport::Transport* transport,
                                                            bool replica = false,
                                                            const DiskResidence& disk = {});
  ~ShardState();

  // Whether the masters and moments are on disk, and the file's bytes.
  bool on_disk() const { return file_ != nullptr; }
  uint64_t disk_bytes() const;
  // OK, or why the state on disk is damaged (see the class comment).
  absl::Status damaged() const;
  // Damages the state (on disk) because `why`: a caller's change that
  // landed in part. No-op in RAM.
  void MarkDamaged(const absl::Status& why);

  const OwnedTensors& tensors() const { return tensors_; }

  // Every method that returns a Status below fails only on disk: the errno
  // text of a transfer naming the file, DeadlineExceeded for a transfer past
  // io_timeout, or FailedPrecondition when the state is damaged.

  // Stores fp32-converted `src` (n elements of `type`) at flat index
  // `begin`, and rewrites the half-precision copy of those elements.
  absl::Status WriteMasters(ShardOptimizer* optimizer, uint64_t begin, const void* src,
                            DType type, size_t n);
  // Rewrites the whole half-precision copy from the masters.
  absl::Status RefreshHalfCopy(ShardOptimizer* optimizer);
  // Copies n elements at flat index `begin` into `dst` as `dtype` (fp32 from
  // the masters, the job's precision from the half copy).
  absl::Status Read(uint64_t begin, size_t n, DType dtype, void* dst) const;
  // One optimizer update of `range` (owned, unpadded) with the reduced
  // gradient `grad` (indexed like the owned range): every trainable tensor
  // not in `no_grad` (layout indices, ascending) is updated with its
  // group's hyper-parameters (`groups[group]`; their `step` is filled in
  // here from the tensor's own update count) and its update count
  // advanced, writing the half copy of what changed; the other tensors
  // keep their values, moments and counts, as torch.optim leaves a
  // parameter without a gradient. The alignment gaps go with the tensor
  // before them (zeros stay zeros). Adjacent tensors of one group and one
  // count are updated in one kernel call: a step of every tensor is one
  // call over `range`. InvalidArgument, with nothing written, for bad
  // hyper-parameters.
  absl::Status Step(ShardOptimizer* optimizer, absl::Span<const StepHyperParams> groups,
                    const float* grad, const FlatRange& range,
                    absl::Span<const uint32_t> no_grad);

  // ---- Checkpoints (dense: every array indexed like the owned range) ----
  // The arrays a checkpoint holds, in checkpoint_files.h's file order:
  // masters, m, and v for Adam(W).
  size_t checkpoint_arrays() const { return has_v_ ? 3 : 2; }
  // Copies the first n owned elements of each checkpoint array into dst[i]
  // (moments of frozen tensors as zeros).
  absl::Status CopyOut(size_t n, float* const* dst) const;
  // Replaces the first n owned elements of each checkpoint array with src[i]
  // (the rest, partition padding, is zeroed; frozen tensors' moments are
  // not kept), sets the update counts (`tensor_steps` may name tensors this
  // range does not hold: they are ignored; the others count
  // optimizer_steps) and rewrites the half copy.
  // On disk, a failed restore leaves the state damaged.
  absl::Status Restore(ShardOptimizer* optimizer, size_t n, const float* const* src,
                       uint64_t optimizer_steps, absl::Span<const v1::TensorStep> tensor_steps);

  // On disk, checkpoints without a second copy of the states in RAM:
  // StreamOut hands the first n owned elements of checkpoint array `array`
  // to `sink` chunk by chunk, in order (the values CopyOut copies);
  // RestoreFrom is Restore with each chunk's values filled by `read(array,
  // range, dst)` (range.size() floats of checkpoint array `array`, ranges
  // inside the first n owned elements, in order). A read that fails damages
  // the state, as any failure after the first write does: check the
  // checkpoint first.
  absl::Status StreamOut(size_t array, size_t n,
                         absl::FunctionRef<absl::Status(const float* data, size_t count)> sink)
      const;
  absl::Status RestoreFrom(
      ShardOptimizer* optimizer, size_t n,
      absl::FunctionRef<absl::Status(size_t array, const FlatRange& range, float* dst)> read,
      uint64_t optimizer_steps, absl::Span<const v1::TensorStep> tensor_steps);

  // ---- State transfers (raw: the arrays as held, moments in moment space) ----
  // Elements of raw array i (i < checkpoint_arrays()) that cover the first
  // `n` owned elements.
  uint64_t raw_elements(size_t i, uint64_t n) const;
  const float* array(size_t i) const {
    return i == 0 ? master_.data() : i == 1 ? m_.data() : v_.data();
  }
  // The transport region holding array(i) (a backup reads it in a state
  // transfer); null when created without a transport.
  const transport::Region* array_region(size_t i) const {
    return i == 0 ? master_region_.get() : i == 1 ? m_region_.get() : v_region_.get();
  }
  // Restore from raw arrays (raw_elements(i, n) elements each). RAM only.
  void RestoreRaw(ShardOptimizer* optimizer, size_t n, const float* const* src,
                  uint64_t optimizer_steps, absl::Span<const v1::TensorStep> tensor_steps);

  // ---- State dicts (ReadState / WriteState; dense over a flat range) ----
  // Whether the job has `array` (InvalidArgument naming `field` if not).
  absl::Status CheckArray(StateArrayKind array, absl::string_view field) const;
  // Copies `array` over `range` (owned) into dst (range.size() floats).
  absl::Status ReadArray(StateArrayKind array, const FlatRange& range, float* dst) const;
  // OK iff `src` may be written to `array` over `range`: zeros in the
  // alignment gaps, and for moments in frozen tensors (InvalidArgument
  // naming `field` and the element otherwise).
  absl::Status CheckWrite(StateArrayKind array, const FlatRange& range, const float* src,
                          absl::string_view field) const;
  // Whether `array` over `range` holds exactly `src`'s bytes (where it holds
  // anything: frozen tensors have no moments).
  absl::StatusOr<bool> Holds(StateArrayKind array, const FlatRange& range,
                             const float* src) const;
  // Whether tensor `index` (trainable, owned) has update count `steps`.
  bool HasTensorStep(uint32_t index, uint64_t steps) const;
  // Writes a checked `src`; masters also rewrite the range's half copy. On
  // disk, a failed write leaves the state damaged.
  absl::Status WriteArray(ShardOptimizer* optimizer, StateArrayKind array,
                          const FlatRange& range, const float* src);
  // The update count of every trainable tensor overlapping `range`.
  std::vector<v1::TensorStep> TensorStepsIn(const FlatRange& range) const;
  // The trainable tensors whose count differs from optimizer_steps().
  std::vector<v1::TensorStep> TensorStepsApart() const;
  // OK iff tensor `index` is trainable and overlaps the owned range.
  absl::Status CheckTensorStep(uint32_t index, absl::string_view field) const;
  void SetTensorStep(uint32_t index, uint64_t steps);

  // The transport region holding the half copy; null without a transport
  // or a half copy. The masters' is array_region(0).
  const transport::Region* half_region() const { return half_region_.get(); }
  // Commits that updated (skipped steps excluded).
  uint64_t optimizer_steps() const { return optimizer_steps_; }
  // On disk, a transfer that fails mixes in its error's text.
  void Hash(uint64_t& h) const;
  // Books every array as replica (`replica`), or each under its own
  // category again (a replica group's copy that changed role).
  void Rebook(bool replica);

 private:
  ShardState(DType precision, const OwnedTensors& tensors, MemoryCategory half_category)
      : precision_(precision),
        owned_(tensors.owned()),
        tensors_(tensors),
        half_category_(half_category) {}
  // The moment array of `array` (kExpAvg, kExpAvgSq).
  const LedgerArray<float>& moments(StateArrayKind array) const {
    return array == StateArrayKind::kExpAvg ? m_ : v_;
  }
  void SetAllSteps(uint64_t optimizer_steps, absl::Span<const v1::TensorStep> tensor_steps);

  // ---- On disk ----
  // Pointers to chunk `chunk`'s arrays by StateArrayKind - 1 (master, m, v;
  // null for what the job lacks), each at the chunk's first element, in owned
  // space: the buffer's for the arrays on disk, master_'s for RAM masters.
  using ChunkArrays = std::array<float*, 3>;
  // What DiskPass calls for each chunk overlapping the pass's range (`chunk`
  // is the chunk's range inside the owned range).
  using ChunkFn = absl::FunctionRef<absl::Status(const FlatRange& chunk, const ChunkArrays&)>;
  // Runs fn over every chunk overlapping `range` in order, the reads of the
  // next buffers - 2 chunks queued ahead and, with `write_back`, each
  // chunk's write queued after fn. Returns the first error (fn's or a
  // transfer's) once nothing is in flight; with `write_back`, a transfer's
  // error damages the state.
  absl::Status DiskPass(const FlatRange& range, bool write_back, ChunkFn fn) const
      ABSL_LOCKS_EXCLUDED(disk_mu_);
  // Offset in the file of array slot `slot` of chunk `chunk`.
  uint64_t FileOffset(uint64_t chunk, size_t slot) const {
    return (chunk * disk_slots_ + slot) * chunk_elements_ * sizeof(float);
  }
  // The chunk of owned element `pos`, and chunk c's range (clipped to owned_).
  uint64_t ChunkOf(uint64_t pos) const { return (pos - owned_.begin) / chunk_elements_; }
  FlatRange ChunkRange(uint64_t chunk) const;

  const DType precision_;
  const FlatRange owned_;
  const OwnedTensors tensors_;
  const MemoryCategory half_category_;
  // Transport memory behind master_, m_, v_ and half_; declared first so it
  // is freed after the arrays.
  std::unique_ptr<transport::Region> master_region_;
  std::unique_ptr<transport::Region> m_region_;
  std::unique_ptr<transport::Region> v_region_;
  std::unique_ptr<transport::Region> half_region_;
  LedgerArray<float> master_;        // owned range
  LedgerArray<float> m_;             // moment space
  LedgerArray<float> v_;             // moment space; empty for SGD
  LedgerArray<uint16_t> half_;       // owned range; empty for fp32 jobs
  bool has_v_ = false;  // Adam(W): a second moment, in RAM or on disk
  uint64_t optimizer_steps_ = 0;
  // By position in tensors_.entries(); frozen tensors' stay 0.
  std::vector<uint64_t> tensor_steps_;

  // On disk: the file (set by Create, then constant; its transfers under
  // disk_mu_), its layout, and the chunk buffers' booking (buffer bytes
  // taken from Create's reservation, released by the destructor).
  std::unique_ptr<StateFile> file_;
  bool masters_on_disk_ = false;
  size_t disk_slots_ = 0;  // arrays per chunk in the file
  uint64_t chunk_elements_ = 0;
  absl::Duration io_timeout_;
  MemoryLedger* buffer_ledger_ = nullptr;
  std::string buffer_job_;
  uint64_t buffer_bytes_ = 0;
  mutable absl::Mutex disk_mu_;
  mutable absl::Status damaged_ ABSL_GUARDED_BY(disk_mu_);
};

// `bytes` summed into the replica category.
CategoryBytes BookedAsReplica(const CategoryBytes& bytes);

// Hyper-parameters of a job's update rule, without the per-step fields.
StepHyperParams HyperParamsOf(const OptimizerSettings& settings);
// The same for each of the job's parameter groups, in group order.
std::vector<StepHyperParams> GroupHyperParams(const JobSettings& settings);

}  // namespace zeroshard
