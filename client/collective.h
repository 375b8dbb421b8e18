#pragma once

// The gradient-reduction seam. The client hands every gradient contribution
// to a Collective, which gets it reduced into the daemons' gradient shards:
//  - DaemonReduceCollective (client/daemon_reduce_collective.h): every rank
//    pushes its whole gradient, bucket by bucket, to the owning daemons, which
//    sum the N_d contributions (REDUCTION_MODE_DAEMON).
//  - a trainer collective (a reduce-scatter among the ranks, then a push of
//    this rank's reduced shard to its daemon; REDUCTION_MODE_TRAINER_COLLECTIVE)
//    implements the same interface (client/trainer_collective.h):
//    GlooCollective (client/gloo_collective.h) on CPUs over TCP, and
//    NcclCollective (client/nccl_collective.h) on GPUs over NCCL.
// All must deliver the same numbers: every element of [0, total_elements)
// reaches the daemons each step, alignment gaps as zeros (the daemons count
// them in the gradient norm), summed over the ranks: in rank order, except
// NcclCollective, which sums in NCCL's order (with three or more ranks the
// sums may differ in the last bits).

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/data_path.h"
#include "client/device_memory.h"
#include "client/executor.h"
#include "client/traffic.h"
#include "common/dtype.h"
#include "common/layout.h"
#include "common/partition_map.h"

namespace zeroshard {

// Completion of one PushGradients call: done once every byte of it has been
// accepted by the daemons (or has failed). Copyable; all copies share state.
class PushTicket {
 public:
  // A ticket that is already complete and OK.
  PushTicket() = default;
  explicit PushTicket(std::shared_ptr<CountDown> state) : state_(std::move(state)) {}

  // Blocks until the push completes (its status) or `deadline`
  // (DeadlineExceeded; the push goes on). May be called from any thread, any
  // number of times.
  absl::Status Wait(absl::Time deadline) const {
    if (state_ == nullptr) return absl::OkStatus();
    return state_->Wait(deadline, "PushGradients");
  }
  bool done() const { return state_ == nullptr || state_->done(); }

 private:
  std::shared_ptr<CountDown> state_;
};

// Who owns a pushed gradient buffer while its push is in flight.
enum class BufferUse {
  kCopy,    // the callee copies what it needs before returning
  kBorrow,  // the callee may read the buffer until the push's ticket completes
};

// What a collective needs to know about the job; the pointers stay valid for
// the collective's lifetime once bound.
struct CollectiveJob {
  std::string job_id;
  uint32_t rank = 0;
  uint64_t incarnation = 0;  // the rank's, carried by every push
  uint32_t world_size = 1;
  const Layout* layout = nullptr;
  const PartitionMap* map = nullptr;
  DType wire_dtype = DType::kFp32;  // the job's precision
  uint64_t bucket_bytes = 0;        // C_B
  uint32_t micro_batches = 1;
  // ZeRO stage: stage 3 pushes layer by layer, so daemon reduction cuts its
  // buckets at the layer boundaries too (BucketPlan's at_layers).
  uint32_t stage = 1;
  std::vector<DataPath*> daemons;   // by daemon index
  TrafficCounters* traffic = nullptr;
  absl::Duration rpc_timeout = absl::Seconds(60);
  // Copies gradients held in CUDA device memory into host buffers; null
  // when the client has no device (ClientConfig::cuda_device unset).
  DeviceCopier* device = nullptr;
};

class Collective {
 public:
  virtual ~Collective() = default;

  virtual const char* name() const = 0;

  // Called once by Client::RegisterModel. InvalidArgument if the collective
  // cannot serve this job (e.g. a reduction mode it does not implement).
  virtual absl::Status Bind(const CollectiveJob& job) = 0;

  // Contributes `grads` (range.size() elements of `dtype`, flat indices
  // [range.begin, range.end)) of micro-batch `micro_batch` to step `step`.
  // May be called from several threads at once. Blocks at most until
  // `deadline` for buffer space. With BufferUse::kCopy the collective is done
  // with `grads` when Reduce returns; with kBorrow it may read `grads` until
  // the returned ticket completes (the caller must neither modify nor free it
  // before then). `memory` says where `grads` lives; device memory is
  // copied to host buffers through CollectiveJob::device before Reduce
  // returns, whatever `use` says.
  // InvalidArgument: part of the range was already contributed this step.
  // FailedPrecondition: device memory this collective cannot take.
  virtual absl::StatusOr<PushTicket> Reduce(uint64_t step, uint32_t micro_batch,
                                            const FlatRange& range, const void* grads, DType dtype,
                                            BufferUse use, MemoryKind memory,
                                            absl::Time deadline) = 0;

  // Whether the collective takes MarkNoGradient's marks (daemon reduction
  // and the Gloo trainer collective do; the NCCL trainer collective does
  // not: its ranks have no exchange for them, and a tensor without a
  // gradient is pushed as zeros and stepped there).
  virtual bool carries_no_grad_marks() const = 0;
  // Records that this rank's contribution to micro-batch `micro_batch` of
  // `step` carries no gradient for `tensors` (layout indices, ascending;
  // their elements are pushed as zeros), before the Reduce that pushes
  // them. The daemons then skip a tensor in the step's update unless some
  // rank, in some micro-batch, pushed a gradient for it (GradientChunk.
  // no_grad_tensors). Thread-safe like Reduce. Only for a collective that
  // carries_no_grad_marks() (FailedPrecondition otherwise).
  virtual absl::Status MarkNoGradient(uint64_t step, uint32_t micro_batch,
                                      absl::Span<const uint32_t> tensors) = 0;

  // Blocks until every contribution of `step` has been accepted (first error
  // otherwise). FailedPrecondition (naming the first missing range) if this
  // rank has not contributed every element its role requires. Afterwards the
  // collective is ready for step + 1, or, after an error, for the caller to
  // contribute `step` again: what the daemons confirmed in an earlier attempt
  // of the same step counts as delivered and is not sent twice.
  virtual absl::Status Finish(uint64_t step, absl::Time deadline) = 0;

  // Bytes of host memory the collective holds (staging buffers), fixed once
  // bound.
  virtual uint64_t staging_bytes() const = 0;

 protected:
  // MarkNoGradient's argument checks, shared by the collectives that take
  // marks: bound (`bound`), `micro_batch` below job.micro_batches, every
  // tensor a tensor of job.layout.
  static absl::Status CheckMarks(const CollectiveJob& job, bool bound, uint32_t micro_batch,
                                 absl::Span<const uint32_t> tensors) {
    if (!bound) return absl::FailedPreconditionError("PushGradients before RegisterModel");
    if (micro_batch >= job.micro_batches) {
      return absl::InvalidArgumentError(absl::StrCat(
          "micro_batch: must be < micro_batches (", job.micro_batches, "), got ", micro_batch));
    }
    const uint64_t count = job.layout->tensors().size();
    for (uint32_t t : tensors) {
      if (t >= count) {
        return absl::InvalidArgumentError(
            absl::StrCat("no_grad_tensors: ", t, " is not a tensor of the layout (", count, ")"));
      }
    }
    return absl::OkStatus();
  }

 public:

  // Gathers parameters by exchanging them among the ranks, where the
  // collective can (gathers_parameters()): each rank fetches only the part
  // of `range` inside its own partition from the daemons, with `fetch_own`,
  // and receives the rest from the ranks owning it. A collective call: every
  // rank calls it for the same ranges in the same order (and in the same
  // order with respect to Finish).
  virtual bool gathers_parameters() const { return false; }
  // `fetch_own(piece, out)` gathers flat `piece` of the committed parameters
  // from the daemons into host memory `out` (piece.size() elements of
  // `dtype`). Fills `dst` (range.size() elements of `dtype`, in `memory`;
  // alignment gaps as the daemons return them) and returns once every piece
  // is in (or at `deadline`). FailedPrecondition for memory of a kind the
  // collective does not gather into; Unimplemented unless
  // gathers_parameters().
  using FetchRange = std::function<absl::Status(const FlatRange& piece, void* out)>;
  virtual absl::Status AllGather(const FlatRange& range, void* dst, DType dtype, MemoryKind memory,
                                 const FetchRange& fetch_own, absl::Time deadline) {
    (void)range, (void)dst, (void)dtype, (void)memory, (void)fetch_own, (void)deadline;
    return absl::UnimplementedError(absl::StrCat(name(), " does not gather parameters"));
  }
};

}  // namespace zeroshard
