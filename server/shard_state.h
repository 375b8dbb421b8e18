#pragma once

// The model states of the partitions a daemon owns for one job: fp32
// masters, the optimizer's moments, and (for half-precision jobs) the
// half-precision copy trainers gather. With a bulk transport the masters and
// the half copy live in transport regions, so trainers read them directly.
//
// Not thread-safe: the Job guards it with its parameter lock (gathers read
// under the shared lock, the optimizer step and initial parameters write
// under the exclusive one).

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "common/flat_range.h"
#include "common/job_spec.h"
#include "proto/zeroshard/v1/shard.pb.h"
#include "server/memory_ledger.h"
#include "server/optimizer/optimizer.h"
#include "transport/transport.h"

namespace zeroshard {

class ShardState {
 public:
  // The bytes Create books for `owned_elements` of this job, by category:
  // fp32 masters, the optimizer's moments, and the half-precision copy
  // (param_half in stage 3, buffer before: it only stages gathers). With
  // `replica` (a backup's copy of another daemon's group) all of it is
  // booked as replica.
  static CategoryBytes Footprint(const JobConfig& config, uint64_t owned_elements,
                                 bool replica = false);
  // Allocates the owned range's states with bytes taken from `booked`, which
  // must hold Footprint(config, owned.size()) for the job: the caller books
  // the whole footprint at once before anything is allocated. Transport
  // regions are allocated only here, after that booking. ResourceExhausted
  // when an allocation fails (what was not taken stays in `booked`).
  // `transport` may be null (no bulk data path).
  static absl::StatusOr<std::unique_ptr<ShardState>> Create(const JobConfig& config,
                                                            FlatRange owned,
                                                            LedgerReservation* booked,
                                                            transport::Transport* transport,
                                                            bool replica = false);
  ~ShardState();

  // Stores fp32-converted `src` (n elements of `type`) at flat index `begin`.
  void WriteMasters(ShardOptimizer* optimizer, uint64_t begin, const void* src, DType type,
                    size_t n);
  // Rewrites the half-precision copy from the masters (after WriteMasters).
  void RefreshHalfCopy(ShardOptimizer* optimizer);
  // Copies n elements at flat index `begin` into `dst` as `dtype` (fp32 from
  // the masters, the job's precision from the half copy).
  void Read(uint64_t begin, size_t n, DType dtype, void* dst) const;
  // One optimizer update of `range` (owned, unpadded) with the reduced
  // gradient `grad` (indexed like the owned range), also rewriting the half
  // copy. `hp.step` is filled in here.
  absl::Status Step(ShardOptimizer* optimizer, StepHyperParams hp, const float* grad,
                    const FlatRange& range);

  // The arrays a checkpoint holds, in checkpoint_files.h's file order:
  // masters, m, and v for Adam(W).
  size_t checkpoint_arrays() const { return v_.empty() ? 2 : 3; }
  // Checkpoint array i (i < checkpoint_arrays()), indexed like the owned range.
  const float* array(size_t i) const {
    return i == 0 ? master_.data() : i == 1 ? m_.data() : v_.data();
  }
  // The transport region holding array(i) (a backup reads it in a state
  // transfer); null when created without a transport.
  const transport::Region* array_region(size_t i) const {
    return i == 0 ? master_region_.get() : i == 1 ? m_region_.get() : v_region_.get();
  }
  // Copies the first n owned elements of each checkpoint array into dst[i].
  void CopyOut(size_t n, float* const* dst) const;
  // Replaces the first n owned elements of each checkpoint array with src[i]
  // (the rest, partition padding, is zeroed), sets the update count and
  // rewrites the half copy.
  void Restore(ShardOptimizer* optimizer, size_t n, const float* const* src,
               uint64_t optimizer_steps);

  // Adds PARAM_MASTER (and PARAM_HALF) regions covering the owned range, when
  // created with a transport.
  void FillRegions(v1::ExchangeEndpointResponse* response) const;
  uint64_t optimizer_steps() const { return optimizer_steps_; }
  void Hash(uint64_t& h) const;
  // Books every array as replica (`replica`), or each under its own
  // category again (a replica group's copy that changed role).
  void Rebook(bool replica);

 private:
  ShardState(DType precision, FlatRange owned, MemoryCategory half_category)
      : precision_(precision), owned_(owned), half_category_(half_category) {}

  const DType precision_;
  const FlatRange owned_;
  const MemoryCategory half_category_;
  // Transport memory behind master_, m_, v_ and half_; declared first so it
  // is freed after the arrays.
  std::unique_ptr<transport::Region> master_region_;
  std::unique_ptr<transport::Region> m_region_;
  std::unique_ptr<transport::Region> v_region_;
  std::unique_ptr<transport::Region> half_region_;
  LedgerArray<float> master_;
  LedgerArray<float> m_;
  LedgerArray<float> v_;             // empty for SGD
  LedgerArray<uint16_t> half_;       // empty for fp32 jobs
  uint64_t optimizer_steps_ = 0;
};

// `bytes` summed into the replica category.
CategoryBytes BookedAsReplica(const CategoryBytes& bytes);

// Hyper-parameters of a job's update rule, without the per-step fields.
StepHyperParams HyperParamsOf(const OptimizerSettings& settings);

}  // namespace zeroshard
