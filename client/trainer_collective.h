#pragma once

// What every trainer collective (REDUCTION_MODE_TRAINER_COLLECTIVE) shares,
// whatever moves its bytes between the ranks: the ranks reduce-scatter
// their gradients among themselves, and rank p pushes only partition p of
// the PartitionMap, summed over the ranks, to the daemon owning it. Per rank
// and step that is Ψ/N_d elements to the daemons (in the job's precision).
// Parameters: AllGather (Client::GatherAll, stages 1-2 once a step; each
// layer gather in stage 3) fetches only the part of the range inside
// partition p from the daemons (Ψ/N_d elements of the gather's dtype for
// the whole model) and exchanges the parts among the ranks, straight into
// the caller's buffer.
//
// This class keeps the bookkeeping: which ranges of which micro-batch were
// contributed, the step being finished, the buckets of partition p the
// daemons confirmed, and the state after a failure. A subclass owns the
// buffers and the exchange (GlooCollective over TCP on CPUs, NcclCollective
// over NCCL on GPUs) through the hooks below.
//
// Reduce adds each contribution into the subclass's fp32 accumulator at
// once (converting bf16/fp16), on the calling thread, and returns a ticket
// that is already complete: the caller's buffer is never kept (BufferUse is
// irrelevant). Micro-batches are summed in micro-batch order: micro-batch m
// may be contributed only once micro-batch m - 1 is complete
// (FailedPrecondition otherwise), so the sum does not depend on thread
// timing. Within a micro-batch, concurrent Reduce calls on disjoint ranges
// run in parallel.
//
// Finish runs the exchange, then the pushes, on the calling thread;
// AllGather its fetch and exchange, on the calling thread. One of the two at
// a time (FailedPrecondition otherwise). One Finish at a time: from the
// moment Finish is called (while it still waits for running Reduce calls)
// until it returns, Reduce and a second Finish return FailedPrecondition.
//
// Contract difference in bf16/fp16 jobs: the sum over the ranks, formed in
// fp32, is rounded to the wire dtype before rank p pushes it, so the daemon
// receives the reduced gradient rounded to bf16/fp16 (a relative error of up
// to about 2^-8 for bf16, 2^-11 for fp16, per element). In daemon reduce the
// daemon sums the ranks' pushes in fp32 and never rounds the sum. The push
// stays in the job's precision on purpose (half the bytes of fp32).
//
// Errors of the shared part (absl::Status):
//   FailedPrecondition  a contribution is missing, out of micro-batch order,
//                       Reduce, Finish or AllGather while a Finish runs
//                       (Finish or AllGather while an AllGather runs), memory
//                       of a kind the subclass does not take, or the
//                       collective failed earlier;
//   InvalidArgument     a range contributed twice in one micro-batch of a step;
//   ResourceExhausted   Bind could not allocate the subclass's buffers.
// A failed exchange (or all-gather, or a failed device operation) leaves
// the ranks in an unknown state: every later call returns
// FailedPrecondition carrying the first error (restart the ranks). A failed
// push does not: the step's reduced partition is kept, and a retry of the
// same step (whose Reduce calls are then accepted and ignored) pushes again
// only the buckets the daemons have not confirmed, without exchanging again.

#include <atomic>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "client/bucket_plan.h"
#include "client/collective.h"

namespace zeroshard {

class TrainerCollective : public Collective {
 public:
  absl::Status Bind(const CollectiveJob& job) final;
  absl::StatusOr<PushTicket> Reduce(uint64_t step, uint32_t micro_batch, const FlatRange& range,
                                    const void* grads, DType dtype, BufferUse use,
                                    MemoryKind memory, absl::Time deadline) final;
  // Whether the subclass exchanges marks among the ranks (carries_marks()).
  bool carries_no_grad_marks() const final { return carries_marks(); }
  // With a subclass that carries marks: recorded for the step; Finish has
  // the ranks agree (ExchangeMarks) on the tensors that no rank had a
  // gradient for in any micro-batch, and rank p's pushes of partition p
  // name those, so the daemons skip them as torch.optim skips a parameter
  // without a gradient. Otherwise FailedPrecondition for a non-empty
  // `tensors`.
  absl::Status MarkNoGradient(uint64_t step, uint32_t micro_batch,
                              absl::Span<const uint32_t> tensors) final;
  absl::Status Finish(uint64_t step, absl::Time deadline) final;
  uint64_t staging_bytes() const final;
  bool gathers_parameters() const final { return true; }
  absl::Status AllGather(const FlatRange& range, void* dst, DType dtype, MemoryKind memory,
                         const FetchRange& fetch_own, absl::Time deadline) final;

 protected:
  // `what` names the collective in messages, e.g. "trainer collective (Gloo)".
  explicit TrainerCollective(std::string what) : what_(std::move(what)) {}

  const std::string& what() const { return what_; }
  // Valid once bound (the hooks below run only then).
  const CollectiveJob& job() const { return job_; }
  const BucketPlan& plan() const { return plan_; }

  // --- Hooks. Each runs on the calling thread of the public call. ---

  // The memory kind the collective takes for gradients and gathers
  // (checked before anything else).
  virtual MemoryKind memory_kind() const = 0;

  // Whether `p` (`bytes` of a caller's buffer, named `what` in messages)
  // is memory the collective can use: InvalidArgument otherwise. Called by
  // Reduce and AllGather before anything changes. The default accepts all.
  virtual absl::Status CheckBuffer(const void* p, uint64_t bytes, const char* what) const;

  // Called by Bind once the job is checked: allocates the subclass's
  // buffers (an fp32 accumulator of at least plan.total_elements(), host or
  // device, whatever its exchange needs, a push bucket of BucketPlan::StagingBytes). An error is
  // returned by Bind as it is, and nothing is bound (nor kept: Bind may be
  // called again).
  virtual absl::Status Allocate(const CollectiveJob& job, const BucketPlan& plan) = 0;
  // Bytes of host memory Allocate allocated (staging_bytes()).
  virtual uint64_t allocated_bytes() const = 0;

  // Writes (micro_batch == 0) or adds (later micro-batches) `grads`
  // (range.size() elements of `dtype`, flat range `range`) into the real
  // segments of `range` in the accumulator; the alignment gaps stay 0. The
  // range is this call's alone; calls on disjoint ranges run concurrently.
  // Returns once `grads` is no longer read. An error breaks the collective.
  virtual absl::Status Accumulate(uint32_t micro_batch, const FlatRange& range, const void* grads,
                                  DType dtype, absl::Time deadline) = 0;

  // The reduce-scatter: afterwards partition job().rank of the accumulator
  // holds the sum over the ranks. Called by Finish with every contribution
  // of the step in, none running, connecting first where needed. An error
  // breaks the collective.
  virtual absl::Status Exchange(absl::Time deadline) = 0;

  // The reduced values of `bucket` (a bucket of partition job().rank) in the
  // job's wire dtype, for the push; valid until the next call. An error
  // breaks the collective.
  virtual absl::StatusOr<const void*> WireBucket(const FlatRange& bucket, absl::Time deadline) = 0;

  // Puts this rank's piece `own` of the gathered range (non-empty; its first
  // element at `own_dst` in the caller's buffer) there by calling
  // `fetch_own` (which writes host memory). The default fetches straight
  // into `own_dst`.
  virtual absl::Status FetchOwn(const FlatRange& own, void* own_dst, DType dtype,
                                const FetchRange& fetch_own, absl::Time deadline);

  // Whether the subclass implements ExchangeMarks. Every rank's Finish then
  // calls it once per step before Exchange, marks or not.
  virtual bool carries_marks() const { return false; }
  // The ranks agree on the tensors no rank had a gradient for: `marks` (a
  // byte per tensor of the layout, 1 where this rank had none in any
  // micro-batch of the step) becomes the minimum over the ranks. Connects
  // first where needed. An error breaks the collective. Called only when
  // carries_marks(); a subclass that carries marks overrides it.
  virtual absl::Status ExchangeMarks(std::vector<uint8_t>* marks, absl::Time deadline);

  // The all-gather among the ranks: fills the other ranks' pieces of
  // `range` in `dst` (range.size() elements of `dtype`), with this rank's
  // piece already in place. Connects first where needed. An error breaks
  // the collective.
  virtual absl::Status ExchangeGather(const FlatRange& range, void* dst, DType dtype,
                                      absl::Time deadline) = 0;

 private:
  absl::Status CheckArguments(uint32_t micro_batch, const FlatRange& range, const void* grads,
                              DType dtype, MemoryKind memory) const;
  absl::Status Broken() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Enters `step` / `micro_batch` and claims `range`; counts the caller in
  // writers_ on success.
  absl::Status BeginReduce(uint64_t step, uint32_t micro_batch, const FlatRange& range,
                           bool* ignored) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Why the step cannot be exchanged yet (OK when complete).
  absl::Status Incomplete(uint64_t step) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops the contributions of the step being collected.
  void ResetContributions() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Pushes the buckets of partition `rank` whose entry in `confirmed` (by
  // index into my_buckets_) is 0, setting it once the daemon confirms.
  // `read_failed`: the error came from WireBucket (which breaks the
  // collective), not from a push. Runs without mu_.
  // `no_grad`: the tensors no rank had a gradient for (ascending); each
  // push names those overlapping its bucket.
  absl::Status PushPartition(uint64_t step, absl::Time deadline,
                             const std::vector<uint32_t>& no_grad, std::vector<uint8_t>* confirmed,
                             bool* read_failed);
  // This rank's marks of `step` (MarkNoGradient), a byte per tensor: 1 for
  // a tensor marked in every micro-batch.
  std::vector<uint8_t> LocalMarks(uint64_t step) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops the marks of `step` (Finish consumed them, or dropped the step).
  void ClearMarks(uint64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string what_;

  // Written once by Bind, before bound_ is set; read-only afterwards.
  CollectiveJob job_;
  BucketPlan plan_;
  uint64_t real_elements_ = 0;      // tensor elements of the layout
  std::vector<size_t> my_buckets_;  // indices of partition `rank`'s buckets
  std::atomic<bool> bound_{false};

  mutable absl::Mutex mu_;
  bool finishing_ ABSL_GUARDED_BY(mu_) = false;
  bool gathering_ ABSL_GUARDED_BY(mu_) = false;       // an AllGather runs
  uint64_t finishing_step_ ABSL_GUARDED_BY(mu_) = 0;  // while finishing_
  absl::Status broken_ ABSL_GUARDED_BY(mu_);          // a failed exchange
  uint64_t step_ ABSL_GUARDED_BY(mu_) = 0;            // step being collected (0: none)
  uint32_t micro_batch_ ABSL_GUARDED_BY(mu_) = 0;     // being collected
  // Ranges claimed in micro_batch_, merged: begin -> end.
  std::map<uint64_t, uint64_t> claimed_ ABSL_GUARDED_BY(mu_);
  uint64_t real_written_ ABSL_GUARDED_BY(mu_) = 0;  // of micro_batch_, copies done
  int writers_ ABSL_GUARDED_BY(mu_) = 0;            // copies in progress
  // The step whose exchange is done but whose push failed (0: none), and
  // which of my_buckets_ the daemons confirmed.
  uint64_t exchanged_step_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<uint8_t> confirmed_ ABSL_GUARDED_BY(mu_);
  // MarkNoGradient's marks for step marks_step_: micro_batch * tensors + t.
  uint64_t marks_step_ ABSL_GUARDED_BY(mu_) = 0;
  std::set<uint64_t> marks_ ABSL_GUARDED_BY(mu_);
  // The tensors of the step being pushed (or whose push failed: the retry
  // pushes the same) that no rank had a gradient for, ascending.
  std::vector<uint32_t> no_grad_ ABSL_GUARDED_BY(mu_);
};

}  // namespace zeroshard
