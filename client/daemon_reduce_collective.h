#pragma once

// Daemon reduce (REDUCTION_MODE_DAEMON): every rank pushes its whole gradient,
// cut into the job's constant-size buckets (client/bucket_plan.h), to the
// daemon owning each bucket; the daemons sum the N_d contributions in rank
// order. Per rank and step that is Ψ elements out.
//
// Staging: a fixed pool of `staging_buffers` buffers of one bucket each is
// allocated by Create and reused for the life of the collective; nothing on
// the push path allocates per step. Reduce copies (and converts to the wire
// dtype) the caller's gradient into the staging buffer of each bucket it
// touches (a borrowed buffer's whole, gap-free, wire-dtype buckets are sent
// from the caller's memory instead); a bucket is sent, on one of
// `sender_threads` threads, as soon as all of its tensor elements have been
// written (in whatever order and by whatever mix of calls), and its buffer
// returns to the pool when the daemon has answered. Gap elements (alignment
// padding between tensors) are sent as zeros. Buckets that hold only gap
// elements are sent by Finish.
//
// Reduce blocks (up to its deadline) while every staging buffer is in
// flight. If every buffer holds a partly written bucket and nothing is in
// flight or being pushed by another thread, waiting cannot help:
// ResourceExhausted at once (push ranges in flat order, or raise
// staging_buffers).
//
// Retries: the collective remembers, for the step being pushed, which
// buckets the daemons confirmed (the data path answered OK). When a Step
// fails (in Finish, or later while it waits for the commit) and the caller
// pushes the step again, those buckets are taken as delivered: their
// elements are accepted (and checked for overlap) but neither copied nor
// sent, and a retry need not push them at all (Finish counts them). The
// record is dropped when pushes, or Finish, of another step begin.
// ALREADY_EXISTS from a data path is an error here; a data path that can
// prove a duplicate carried the same bytes answers OK itself
// (client/data_path.h).

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "client/bucket_plan.h"
#include "client/collective.h"
#include "client/executor.h"
#include "client/push_memories.h"

namespace zeroshard {

class DaemonReduceCollective final : public Collective {
 public:
  struct Options {
    uint64_t bucket_bytes = 32ull << 20;  // C_B
    DType wire_dtype = DType::kFp32;       // the job's precision
    uint32_t staging_buffers = 4;          // >= 2
    int sender_threads = 4;                // >= 1
    // Where the staging pool is allocated: one push memory from here (so
    // that a daemon on the same host sums staged buckets in place), or,
    // when null or when the system gives no push memory, plain host memory.
    std::shared_ptr<PushMemories> push_memories;
  };

  // Allocates the staging pool. InvalidArgument for a bad option.
  static absl::StatusOr<std::unique_ptr<DaemonReduceCollective>> Create(const Options& options);
  // Waits for sends in flight (each bounded by its RPC deadline).
  ~DaemonReduceCollective() override;

  const char* name() const override { return "daemon_reduce"; }
  absl::Status Bind(const CollectiveJob& job) override;
  absl::StatusOr<PushTicket> Reduce(uint64_t step, uint32_t micro_batch, const FlatRange& range,
                                    const void* grads, DType dtype, BufferUse use,
                                    MemoryKind memory, absl::Time deadline) override;
  bool carries_no_grad_marks() const override { return true; }
  absl::Status MarkNoGradient(uint64_t step, uint32_t micro_batch,
                              absl::Span<const uint32_t> tensors) override;
  absl::Status Finish(uint64_t step, absl::Time deadline) override;
  uint64_t staging_bytes() const override { return buffer_bytes_ * buffer_count_; }

  // The bucket plan (valid after Bind).
  const BucketPlan& plan() const { return plan_; }
  // Most staging buffers ever in use at once.
  uint32_t peak_buffers_in_use() const;

 private:
  // A bucket being filled.
  struct Active {
    int buffer = -1;                    // -1: delivered in an earlier attempt, nothing to copy
    uint64_t written_real = 0;          // tensor elements written so far
    int writers = 0;                    // copies in progress
    std::vector<FlatRange> written;     // ranges claimed, for overlap checks
    std::vector<std::shared_ptr<CountDown>> tickets;
  };
  // One Reduce call's arguments.
  struct Contribution {
    uint64_t step;
    uint32_t micro_batch;
    FlatRange range;
    const uint8_t* grads;
    DType dtype;
    BufferUse use;
    MemoryKind memory;
    absl::Time deadline;
  };
  // A whole bucket of a borrowed buffer reserved by Reduce, sent (unless
  // delivered already) once the whole call has succeeded.
  struct Borrowed {
    uint64_t key;
    const uint8_t* data;
    bool delivered;
  };

  explicit DaemonReduceCollective(const Options& options);

  uint8_t* buffer(int i) { return storage_ + static_cast<size_t>(i) * buffer_bytes_; }
  uint64_t KeyOf(uint32_t micro_batch, size_t index) const {
    return micro_batch * plan_.buckets().size() + index;
  }
  bool Delivered(uint64_t key) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return delivered_step_ == step_ && delivered_[key] != 0;
  }
  // InvalidArgument / FailedPrecondition for a call that cannot be served.
  absl::Status CheckArguments(uint32_t micro_batch, const FlatRange& range,
                              const void* grads) const;
  // Enters step `c.step` and rejects an overlap with what was pushed before
  // staging anything; counts the caller in pushers_ on success.
  absl::Status BeginReduce(const Contribution& c, size_t first, size_t last);
  // Writes the part of `c` in bucket `index` (staged, borrowed or, for a
  // delivered bucket, only accounted) and sends the bucket once complete.
  absl::Status ContributeBucket(const Contribution& c, size_t index,
                                const std::shared_ptr<CountDown>& ticket,
                                std::vector<Borrowed>* borrowed);
  // Hands the borrowed buckets to the senders (or releases their
  // reservation after an error) and ends the call.
  absl::StatusOr<PushTicket> EndReduce(const absl::Status& status,
                                       std::shared_ptr<CountDown> ticket,
                                       const std::vector<Borrowed>& borrowed);
  // Takes a free staging buffer, waiting up to `deadline`; `own_pushers` is
  // how many Reduce calls the caller itself accounts for in pushers_.
  absl::StatusOr<int> AcquireBuffer(absl::Time deadline, int own_pushers)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A new Active for bucket `index` with its gap elements zeroed (no buffer
  // for a delivered bucket).
  absl::StatusOr<Active*> StartBucket(uint64_t key, size_t index, absl::Time deadline,
                                      int own_pushers) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Counts `real` elements written into active bucket `key`; sends it when
  // complete.
  // Undoes a ContributeBucket whose copy failed: `clip` of this bucket is
  // unwritten again and `ticket` no longer waits for the bucket.
  void AbandonWrite(uint64_t key, const FlatRange& clip, const std::shared_ptr<CountDown>& ticket)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EndWrite(uint64_t key, uint64_t real) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks bucket `key` sent and hands it to the senders: its bytes are
  // `data`, in staging buffer `buffer_index` (returned to the pool once sent)
  // or, with -1, in a borrowed caller buffer. A delivered bucket completes
  // its tickets at once instead.
  void Send(uint64_t key, int buffer_index, const uint8_t* data,
            std::vector<std::shared_ptr<CountDown>> tickets) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Send for a bucket already marked sent: queues it for its daemon and
  // has a sender thread run RunSends for that daemon.
  void Dispatch(uint64_t key, int buffer_index, const uint8_t* data,
                std::vector<std::shared_ptr<CountDown>> tickets)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sends the buckets queued for `daemon` (none: another sender took them)
  // in one request (DataPath::PushGradients) while they are of one attempt
  // and their bytes fit one bucket, C_B: the short last buckets of a
  // daemon's range (of several micro-batches) travel together, a full
  // bucket alone.
  void RunSends(uint32_t daemon);
  // Sends the buckets that hold no tensor element (zeros) not sent yet.
  absl::Status SendGapBuckets(absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Why the step cannot finish: a partly pushed bucket, or a missing one
  // (neither pushed nor delivered before).
  absl::Status IncompleteBuckets(uint64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Completes the partly pushed buckets that an earlier attempt delivered.
  void DropDeliveredActive() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string DescribeBucket(uint64_t key) const;
  // Ends the attempt: drops partial buckets (their tickets get `reason`);
  // the delivered record stays (for a retry of the same step).
  void ResetStep(const absl::Status& reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  const uint64_t buffer_bytes_;
  const uint32_t buffer_count_;
  // The staging pool, buffer_count_ * buffer_bytes_ (page-aligned, whole
  // pages: pinnable): in push_memory_ or in heap_.
  uint8_t* storage_ = nullptr;
  size_t storage_bytes_ = 0;
  PinnableBuffer heap_;
  std::shared_ptr<transport::PushMemory> push_memory_;
  bool pinned_ = false;  // storage_ pinned by job_.device (Bind)

  // Written once by Bind, before bound_ is set; read-only afterwards.
  CollectiveJob job_;
  BucketPlan plan_;
  std::atomic<bool> bound_{false};

  mutable absl::Mutex mu_;
  std::vector<int> free_ ABSL_GUARDED_BY(mu_);
  uint32_t peak_in_use_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t step_ ABSL_GUARDED_BY(mu_) = 0;  // step of the pushes held (0: none)
  uint64_t attempt_ ABSL_GUARDED_BY(mu_) = 0;  // bumped by ResetStep
  absl::flat_hash_map<uint64_t, Active> active_ ABSL_GUARDED_BY(mu_);
  std::vector<uint8_t> sent_ ABSL_GUARDED_BY(mu_);  // by key: handed to a sender
  // By key: confirmed by the daemon in an attempt of delivered_step_.
  std::vector<uint8_t> delivered_ ABSL_GUARDED_BY(mu_);
  uint64_t delivered_step_ ABSL_GUARDED_BY(mu_) = 0;
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;         // buckets handed to the senders
  int staged_in_flight_ ABSL_GUARDED_BY(mu_) = 0;  // those of them in staging buffers
  std::vector<int> in_flight_to_ ABSL_GUARDED_BY(mu_);  // in_flight_ by daemon index
  int pushers_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status error_ ABSL_GUARDED_BY(mu_);  // first failed send of the attempt

  // A bucket handed to the senders.
  struct Queued {
    uint64_t step;
    uint64_t attempt;
    uint64_t key;
    int buffer_index;  // -1: borrowed from the caller
    const uint8_t* data;
    std::vector<std::shared_ptr<CountDown>> tickets;
  };
  // By daemon index: buckets dispatched and not yet taken by a sender.
  std::vector<std::deque<Queued>> queued_ ABSL_GUARDED_BY(mu_);
  // MarkNoGradient's marks for step no_grad_step_: micro_batch * tensors +
  // tensor index.
  uint64_t no_grad_step_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_set<uint64_t> no_grad_ ABSL_GUARDED_BY(mu_);
  // The marked tensors overlapping bucket `key` (for its push).
  std::vector<uint32_t> NoGradTensorsOf(uint64_t key) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Last member: destroyed first, so sends finish while the buffers live.
  std::unique_ptr<Executor> senders_;
};

// Converts n elements from `from` to `to` (same type: a copy).
void ConvertElements(DType from, const void* src, DType to, void* dst, size_t n);

}  // namespace zeroshard
