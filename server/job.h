#pragma once

// One training job's model states on one daemon: the partitions the daemon
// owns (a contiguous run of the flat space), the gradient reduction of the
// current step, the two-phase optimizer step and the loss-scale state.
//
// Thread-safety: every method may be called from any thread. Reduction state
// is guarded by mu_; parameters by params_mu_ (gathers read them under a
// shared lock, a commit updates them under the exclusive lock). Methods that
// wait take a deadline.

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "proto/zeroshard/v1/common.pb.h"
#include "proto/zeroshard/v1/control.pb.h"
#include "proto/zeroshard/v1/shard.pb.h"
#include "server/job_config.h"
#include "server/memory_ledger.h"
#include "server/optimizer/optimizer.h"
#include "transport/transport.h"

namespace zeroshard {

class Job {
 public:
  // Allocates the owned partitions' states (checked against the ledger's
  // limit before any allocation: ResourceExhausted). `optimizer` is shared by
  // all jobs of the daemon and must outlive the job. With a `transport`, the
  // fp32 masters and the half-precision copy are allocated by it
  // (AllocateRegion, remote-readable) so trainers can read them directly
  // (FillParameterRegions); the job does not keep the pointer.
  static absl::StatusOr<std::unique_ptr<Job>> Create(JobConfig config, v1::JobSpec spec,
                                                      uint32_t daemon_index, MemoryLedger* ledger,
                                                      ShardOptimizer* optimizer,
                                                      transport::Transport* transport = nullptr);
  ~Job();

  const JobConfig& config() const { return config_; }
  const v1::JobSpec& spec() const { return spec_; }
  uint32_t daemon_index() const { return daemon_index_; }
  // Owned partitions and their padded flat range.
  const std::vector<uint32_t>& owned_partitions() const { return owned_partitions_; }
  FlatRange owned_range() const { return owned_; }
  // Owned elements below total_elements (real parameters plus alignment gaps).
  FlatRange owned_unpadded() const { return owned_unpadded_; }

  // FailedPrecondition naming the field and both values when the rank's view
  // differs from the registered job; InvalidArgument for rank >= N_d.
  absl::Status Join(const v1::JoinJobRequest& request, uint32_t* ranks_connected,
                    uint64_t* committed_step);
  // Returns true when no rank remains connected.
  absl::StatusOr<bool> Leave(uint32_t rank);

  // Stores initial parameters; all chunks are validated before any is
  // applied. FailedPrecondition after the first commit.
  absl::Status InitParameters(const std::vector<v1::ParameterChunk>& chunks, uint64_t* elements);

  // Applies one pushed stream atomically: every chunk is validated against
  // the request rules and the step's reduction state first; on any error
  // nothing changes. Each chunk's payload is given separately (`payloads[i]`
  // for `chunks[i]`: its data(), or bytes in a staging region); the payloads
  // are read only during the call; the caller keeps them unchanged until it
  // returns.
  absl::Status PushGradient(const std::vector<v1::GradientChunk>& chunks,
                            const std::vector<absl::string_view>& payloads,
                            v1::PushGradientResponse* response);

  // Waits until `after_step` is committed (or `deadline`: DeadlineExceeded),
  // then calls `write` with consecutive chunks of at most max_chunk_elements
  // covering `range` in `dtype`. `write` returning false stops (Cancelled).
  // An empty `write` only validates and waits (the caller reads the range
  // from the parameter regions itself).
  absl::Status Gather(uint64_t after_step, const FlatRange& range, DType dtype,
                      absl::Time deadline, uint64_t max_chunk_elements,
                      const std::function<bool(v1::ParameterChunk&)>& write);

  absl::StatusOr<v1::PrepareStepResponse> PrepareStep(uint64_t step);
  absl::StatusOr<v1::CommitStepResponse> CommitStep(const v1::CommitStepRequest& request);

  // Adds "param_master" (and "param_half" for half-precision jobs)
  // RemoteRegions covering owned_range(), when the job was created with a
  // transport; nothing otherwise. Readers see the parameters of the last
  // committed step only while no commit runs: callers wait for the commit
  // (Gather with an empty `write`) and the next one cannot start before
  // every rank has pushed again.
  void FillParameterRegions(v1::ExchangeEndpointResponse* response) const;

  uint64_t committed_step() const;
  uint32_t ranks_connected() const;
  float loss_scale() const;

  // A hash over every piece of mutable state (parameters, optimizer states,
  // gradients, reduction bookkeeping, step, loss scale), for tests that check
  // a rejected request changed nothing.
  uint64_t StateHash() const;

 private:
  struct PendingContribution {
    std::vector<float> values;  // converted to fp32
  };
  struct KeyState {
    uint64_t end = 0;
    uint32_t partition = 0;
    uint32_t next_order = 0;  // contributions applied so far, in order
    std::map<uint32_t, PendingContribution> pending;  // arrived ahead of turn
  };

  Job(JobConfig config, v1::JobSpec spec, uint32_t daemon_index, MemoryLedger* ledger,
      ShardOptimizer* optimizer);
  uint32_t ExpectedContributions() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckChunk(const v1::GradientChunk& chunk, size_t index,
                          absl::string_view payload) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adds `n` elements of `src` (type `type`) for the key at `begin` as
  // contribution number `order` if its turn has come (then drains pending
  // ones), else keeps an fp32 copy until its turn.
  void ApplyContribution(KeyState& key, uint64_t begin, uint32_t order, const void* src,
                         DType type, size_t n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AccumulateInto(uint64_t begin, uint32_t order, const void* src, DType type, size_t n)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t CompleteElements() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string DescribeIncomplete() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ResetReduction() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RefreshHalfCopy() ABSL_EXCLUSIVE_LOCKS_REQUIRED(params_mu_);
  absl::Status RunOptimizer(double lr, double grad_scale)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_, params_mu_);

  const JobConfig config_;
  const v1::JobSpec spec_;
  const uint32_t daemon_index_;
  MemoryLedger* const ledger_;
  ShardOptimizer* const optimizer_;
  std::vector<uint32_t> owned_partitions_;
  FlatRange owned_;
  FlatRange owned_unpadded_;

  // Transport memory behind master_ / half_ when created with a transport;
  // declared first so it is freed after the arrays.
  std::unique_ptr<transport::Region> master_region_;
  std::unique_ptr<transport::Region> half_region_;

  // Parameters and optimizer states, indexed from owned_.begin.
  mutable absl::Mutex params_mu_ ABSL_ACQUIRED_AFTER(mu_);
  LedgerArray<float> master_ ABSL_GUARDED_BY(params_mu_);
  LedgerArray<float> m_ ABSL_GUARDED_BY(params_mu_);
  LedgerArray<float> v_ ABSL_GUARDED_BY(params_mu_);
  LedgerArray<uint16_t> half_ ABSL_GUARDED_BY(params_mu_);  // empty for fp32 jobs
  uint64_t optimizer_steps_ ABSL_GUARDED_BY(params_mu_) = 0;

  mutable absl::Mutex mu_;
  LedgerArray<float> grad_ ABSL_GUARDED_BY(mu_);  // reduced (summed) gradients
  std::map<uint64_t, KeyState> keys_ ABSL_GUARDED_BY(mu_);
  uint32_t micro_batches_ ABSL_GUARDED_BY(mu_) = 0;  // 0: no push yet this step
  uint64_t pending_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // booked as buffer
  uint64_t committed_step_ ABSL_GUARDED_BY(mu_) = 0;
  bool prepared_ ABSL_GUARDED_BY(mu_) = false;
  v1::PrepareStepResponse prepare_result_ ABSL_GUARDED_BY(mu_);
  v1::CommitStepResponse last_commit_ ABSL_GUARDED_BY(mu_);
  float loss_scale_ ABSL_GUARDED_BY(mu_) = 1.0f;
  uint32_t good_steps_ ABSL_GUARDED_BY(mu_) = 0;
  std::set<uint32_t> ranks_ ABSL_GUARDED_BY(mu_);
};

}  // namespace zeroshard
