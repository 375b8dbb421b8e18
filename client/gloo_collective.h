#pragma once

// The trainer collective on CPUs (REDUCTION_MODE_TRAINER_COLLECTIVE) over
// Gloo's TCP transport: the ranks reduce-scatter their gradients among
// themselves, and rank p pushes only partition p of the PartitionMap, summed
// over the ranks, to the daemon owning it. Per rank and step that is Ψ/N_d
// elements to the daemons (in the job's precision) and (N_d - 1)/N_d Ψ fp32
// elements out to the other ranks and as many in (TrafficBytes::collective_*).
// Parameters: AllGather (Client::GatherAll, stages 1-2 once a step; each
// layer gather in stage 3) fetches only the part of the range inside
// partition p from the daemons (Ψ/N_d elements of the gather's dtype for
// the whole model) and exchanges the parts among the ranks, straight into
// the caller's buffer ((N_d - 1)/N_d of the range out and as much in).
//
// Memory, allocated once by Bind: one fp32 buffer of the rank's full
// gradient (Layout::total_elements), a receive buffer of (N_d - 1) exchange
// chunks, and one bucket of the wire dtype for the pushes.
//
// Reduce adds each contribution into the fp32 buffer at once (converting
// bf16/fp16), on the calling thread, and returns a ticket that is already
// complete: the caller's buffer is never kept (BufferUse is irrelevant).
// Micro-batches are summed in micro-batch order: micro-batch m may be
// contributed only once micro-batch m - 1 is complete (FailedPrecondition
// otherwise), so the sum does not depend on thread timing. Within a
// micro-batch, concurrent Reduce calls on disjoint ranges copy in parallel.
//
// Finish runs the exchange, then the pushes, on the calling thread;
// AllGather its fetch and exchange, on the calling thread, with no memory of
// its own. One of the two at a time (FailedPrecondition otherwise). The
// reduced value of element i is (((g_0 + g_1) + g_2) + ...) in rank order,
// with g_r rank r's micro-batch sum, in fp32: the order in which the daemons
// sum contributions in daemon reduce (server/reduction.h), so with one
// micro-batch and an fp32 job both modes deliver the same bits. One Finish
// at a time: from the moment Finish is called (while it still waits for
// running Reduce calls to finish their copies) until it returns, Reduce and
// a second Finish return FailedPrecondition.
//
// Contract difference in bf16/fp16 jobs: the sum over the ranks, formed in
// fp32, is rounded to the wire dtype before rank p pushes it, so the daemon
// receives the reduced gradient rounded to bf16/fp16 (a relative error of up
// to about 2^-8 for bf16, 2^-11 for fp16, per element). In daemon reduce the
// daemon sums the ranks' pushes in fp32 and never rounds the sum. The two
// modes' reduced gradients are then not bit-equal: with bf16/fp16 inputs this
// mode's carries one rounding more. The push stays in the job's precision on
// purpose (half the bytes of fp32 to the daemons).
//
// Rendezvous: the first Finish connects the ranks through a
// gloo::rendezvous::FileStore in `Options::rendezvous_dir` under the key
// prefix "zeroshard/<job id>". The directory must be the same one for every
// rank (one host, or a filesystem every node mounts, e.g. NFS: the store
// polls files and needs no inotify). Once connected, a rank removes the
// files it wrote; a rendezvous that failed leaves them, and the next run of
// the same job id in that directory then fails with FailedPrecondition (use
// a fresh directory or remove them). Each rank listens on the TCP transport
// of `Options::hostname` (or `Options::interface`).
//
// Deadlines: every wait (the rendezvous, each chunk of the exchange, each
// push) ends at Finish's deadline or sooner. The rendezvous store is a
// FileStore whose waits (also those inside Gloo's connectFullMesh, which
// would otherwise wait up to Gloo's default of 30 s per key) poll every
// 10 ms until the deadline.
//
// Errors (absl::Status; Gloo's exceptions are caught and converted):
//   DeadlineExceeded    a rank did not arrive at the rendezvous, or did not
//                       send its part of the exchange or of an AllGather
//                       before the deadline (the message names the ranks
//                       whose arrival or data was missing at the deadline);
//   Unavailable         a peer's connection failed;
//   FailedPrecondition  a contribution is missing, out of micro-batch order,
//                       Reduce, Finish or AllGather while a Finish runs
//                       (Finish or AllGather while an AllGather runs), the rendezvous
//                       directory is unusable (Gloo's error text included),
//                       or holds files of an earlier failed run;
//   InvalidArgument     a range contributed twice in one micro-batch of a step;
//   ResourceExhausted   Bind could not allocate its buffers (the message
//                       names the bytes).
// A failed rendezvous, exchange or all-gather leaves the Gloo context in an
// unknown state: every later Finish returns FailedPrecondition carrying the first
// error (restart the ranks). A failed push does not: the step's reduced
// partition is kept, and a retry of the same step (whose Reduce calls are
// then accepted and ignored) pushes again only the buckets the daemons have
// not confirmed, without exchanging again.

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "client/bucket_plan.h"
#include "client/collective.h"

namespace gloo {
class Context;
namespace transport {
class UnboundBuffer;
}  // namespace transport
}  // namespace gloo

namespace zeroshard {

class GlooCollective final : public Collective {
 public:
  struct Options {
    // Shared by every rank of the job (see above). Required.
    std::string rendezvous_dir;
    // The address this rank's TCP transport listens on and tells its peers;
    // used when `interface` is empty.
    std::string hostname = "127.0.0.1";
    // A network interface name (e.g. "eth0") instead of `hostname`.
    std::string interface;
    // fp32 bytes exchanged with each peer per round of the exchange (the
    // receive buffer holds N_d - 1 of them). kMinExchangeChunkBytes..kMaxExchangeChunkBytes;
    // Bind refuses a job whose partitions would take more than 2^24 rounds.
    uint64_t chunk_bytes = 4ull << 20;
  };
  static constexpr uint64_t kMinExchangeChunkBytes = uint64_t{64} << 10;
  static constexpr uint64_t kMaxExchangeChunkBytes = uint64_t{1} << 30;

  // InvalidArgument for a bad option. Connects nothing yet.
  static absl::StatusOr<std::unique_ptr<GlooCollective>> Create(const Options& options);
  ~GlooCollective() override;

  const char* name() const override { return "gloo"; }
  // Allocates the buffers. InvalidArgument for a job it cannot serve,
  // ResourceExhausted if an allocation fails (nothing is kept then).
  absl::Status Bind(const CollectiveJob& job) override;
  absl::StatusOr<PushTicket> Reduce(uint64_t step, uint32_t micro_batch, const FlatRange& range,
                                    const void* grads, DType dtype, BufferUse use,
                                    MemoryKind memory, absl::Time deadline) override;
  absl::Status Finish(uint64_t step, absl::Time deadline) override;
  uint64_t staging_bytes() const override;
  bool gathers_parameters() const override { return true; }
  absl::Status AllGather(const FlatRange& range, void* dst, DType dtype,
                         const FetchRange& fetch_own, absl::Time deadline) override;

 private:
  explicit GlooCollective(const Options& options);

  absl::Status CheckArguments(uint32_t micro_batch, const FlatRange& range, const void* grads,
                              DType dtype) const;
  // Enters `step` / `micro_batch` and claims `range`; counts the caller in
  // writers_ on success.
  absl::Status BeginReduce(uint64_t step, uint32_t micro_batch, const FlatRange& range,
                           bool* ignored) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Why the step cannot be exchanged yet (OK when complete).
  absl::Status Incomplete(uint64_t step) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops the contributions of the step being collected.
  void ResetContributions() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Rendezvous and connection (first Finish). Runs without mu_.
  absl::Status Connect(absl::Time deadline);
  // The reduce-scatter: afterwards acc_'s partition `rank` holds the rank
  // sum. Runs without mu_ (Reduce refuses while finishing_).
  absl::Status Exchange(absl::Time deadline);
  // Pushes the buckets of partition `rank` whose entry in `confirmed` (by
  // index into my_buckets_) is 0, setting it once the daemon confirms. Runs
  // without mu_.
  absl::Status PushPartition(uint64_t step, absl::Time deadline, std::vector<uint8_t>* confirmed);

  const Options options_;

  // Written once by Bind, before bound_ is set; read-only afterwards.
  CollectiveJob job_;
  BucketPlan plan_;
  uint64_t real_elements_ = 0;      // tensor elements of the layout
  uint64_t chunk_elements_ = 0;     // per peer and round of the exchange
  std::vector<size_t> my_buckets_;  // indices of partition `rank`'s buckets
  std::atomic<bool> bound_{false};

  // Owned by the protocol, not by mu_: Reduce writes the ranges it claimed
  // under mu_; Finish uses them while finishing_ (Reduce refuses then).
  std::unique_ptr<float[]> acc_;        // total_elements, gaps stay 0
  std::unique_ptr<float[]> recv_;       // (world_size - 1) * chunk_elements_, by peer
  std::unique_ptr<uint8_t[]> staging_;  // one bucket of the wire dtype

  // Gloo objects: created by Connect, used by Exchange (one Finish at a
  // time, guarded by finishing_).
  std::shared_ptr<gloo::Context> context_;
  std::unique_ptr<gloo::transport::UnboundBuffer> send_buffer_;  // over acc_
  // Peer q's chunk of recv_, at index q < rank ? q : q - 1.
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> recv_buffers_;
  // The slot of the next exchange round (not the context's int counter,
  // which would wrap in a long run).
  uint64_t next_slot_ = 0;

  mutable absl::Mutex mu_;
  bool finishing_ ABSL_GUARDED_BY(mu_) = false;
  bool gathering_ ABSL_GUARDED_BY(mu_) = false;       // an AllGather runs
  uint64_t finishing_step_ ABSL_GUARDED_BY(mu_) = 0;  // while finishing_
  absl::Status broken_ ABSL_GUARDED_BY(mu_);          // a failed rendezvous or exchange
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
};

}  // namespace zeroshard
