#pragma once

// The trainer collective on GPUs (REDUCTION_MODE_TRAINER_COLLECTIVE) over
// NCCL; what every trainer collective does, and its bookkeeping and errors,
// are in client/trainer_collective.h. Gradients and gathered parameters are
// CUDA device memory of the client's device (ClientConfig::cuda_device:
// Bind refuses a client without one); host buffers are FailedPrecondition.
// Built only where nvcc and NCCL were found (third_party/cuda).
//
// Step: Reduce adds each contribution into an fp32 accumulator on the
// device (bf16/fp16 converted there) and waits for the kernel before it
// returns. Finish runs ncclReduceScatter in place over the accumulator
// (padded to N_d equal partitions), so that partition p holds the sum over
// the ranks, in NCCL's summation order (not rank order: with 3 or more ranks
// the result may differ from daemon reduce in the last bits). It then packs
// each bucket of partition p to the wire dtype on the device, copies it to a
// pinned host bucket, and pushes it to the daemon owning it: Ψ/N_d elements
// per rank and step to the daemons.
//
// Gather: AllGather fetches this rank's piece of the range from the daemons
// into the pinned host buffer, copies it to its place in the caller's device
// buffer, and broadcasts every rank's piece from its owner (one grouped
// ncclBroadcast per rank with a non-empty piece; partitions need not be
// equal), in place.
//
// Traffic (TrafficBytes::collective_*) is the logical exchange: a step sends
// (N_d - 1)/N_d of the padded fp32 accumulator and receives as much; an
// AllGather sends this rank's piece to N_d - 1 peers and receives the
// others' pieces. The bytes NCCL moves on its links depend on its algorithm.
//
// Device memory, allocated once by Bind: the fp32 accumulator, N_d x the
// padded partition (4 Ψ bytes, a little more for the padding; not in the
// client's memory report, which counts host memory). Host: one pinned bucket
// of BucketPlan::StagingBytes (at least 64 KiB), which is also the gather's
// bounce buffer (two halves, one copying while the other fills); that is
// staging_bytes(). The collective's two streams (the accumulation's and
// NCCL's) are blocking CUDA streams: their work is ordered with the legacy
// default stream (PyTorch's default stream) as the client's DeviceCopier's
// is; work on other streams must be finished by the caller before it hands
// a buffer over.
//
// Rendezvous: the first Finish or AllGather connects the ranks. Rank 0
// writes an NCCL unique id to "<rendezvous_dir>/zeroshard-nccl-<job id>.id"
// (written under another name, then renamed); the others poll for that file
// every 10 ms. Once the communicator is up (every rank has joined, so every
// rank has read it), or its creation failed, rank 0 removes the file. A file
// left by a rank 0 that died during a rendezvous makes the next run's rank 0
// refuse (FailedPrecondition; remove it, or use a fresh directory). The
// directory must be shared by every rank (one host, or a filesystem every
// node mounts).
//
// Deadlines: the communicator is created non-blocking, so every NCCL wait
// (the rendezvous, the communicator's creation, each reduce-scatter and
// broadcast) polls until the call's deadline; at the deadline the call
// returns DeadlineExceeded, naming what it waited for. NCCL errors are
// Unavailable (a peer or the network failed: ncclRemoteError,
// ncclSystemError) or Internal (others), with NCCL's message; CUDA errors
// are Internal. After any NCCL failure (a timeout included) the
// communicator is aborted (ncclCommAbort stops its kernels) and its stream
// drained before the call returns. Any failure of an exchange, or of a
// device operation of a step or gather, breaks the collective (restart the
// ranks). Bind's failures are FailedPrecondition (CUDA refused) or
// ResourceExhausted (an allocation failed), and keep nothing.
//
// Ranks and devices: NCCL refuses two ranks of one communicator on the same
// GPU, so each rank needs a device of its own. One rank alone still builds
// a communicator of one and makes every NCCL call (so one GPU exercises
// them all).

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "client/device_memory.h"
#include "client/trainer_collective.h"

namespace zeroshard {

class NcclCollective final : public TrainerCollective {
 public:
  struct Options {
    // Shared by every rank of the job (see above). Required.
    std::string rendezvous_dir;
  };

  // InvalidArgument for a bad option. Connects nothing yet.
  static absl::StatusOr<std::unique_ptr<NcclCollective>> Create(const Options& options);
  // Destroys the communicator (or aborts it, after a failure), frees the
  // device and host buffers.
  ~NcclCollective() override;

  const char* name() const override { return "nccl"; }

 private:
  explicit NcclCollective(const Options& options);

  MemoryKind memory_kind() const override { return MemoryKind::kCudaDevice; }
  // FailedPrecondition without a device (CollectiveJob::device) or when CUDA
  // refuses; ResourceExhausted when an allocation fails.
  absl::Status Allocate(const CollectiveJob& job, const BucketPlan& plan) override;
  uint64_t allocated_bytes() const override;
  // InvalidArgument unless `p` is memory of the client's device.
  absl::Status CheckBuffer(const void* p, uint64_t bytes, const char* what) const override;
  absl::Status Accumulate(uint32_t micro_batch, const FlatRange& range, const void* grads,
                          DType dtype, absl::Time deadline) override;
  absl::Status Exchange(absl::Time deadline) override;
  absl::StatusOr<const void*> WireBucket(const FlatRange& bucket, absl::Time deadline) override;
  absl::Status FetchOwn(const FlatRange& own, void* own_dst, DType dtype,
                        const FetchRange& fetch_own, absl::Time deadline) override;
  absl::Status ExchangeGather(const FlatRange& range, void* dst, DType dtype,
                              absl::Time deadline) override;

  absl::Status AllocateBuffers(const CollectiveJob& job, const BucketPlan& plan);
  // Frees what AllocateBuffers allocated, after aborting the communicator
  // if there is one; leaves the collective as created.
  void Release();
  // The rendezvous and the communicator (the first exchange).
  absl::Status Connect(absl::Time deadline);
  absl::Status CreateCommunicator(const ncclUniqueId& id, absl::Time deadline);
  // Exchange and ExchangeGather without the abort on failure.
  absl::Status ReduceScatter(absl::Time deadline);
  absl::Status Broadcast(const FlatRange& range, void* dst, DType dtype, absl::Time deadline);
  // Polls the communicator until its pending NCCL calls are issued, then
  // `done_` (recorded on stream_ here) until it completes: DeadlineExceeded
  // naming `what` at the deadline.
  absl::Status AwaitNccl(absl::Time deadline, const std::string& what);
  // An NCCL result as a Status (OK for success or in progress).
  absl::Status CommStatus(ncclResult_t r, const std::string& what) const;
  // Aborts the communicator (NCCL's kernels stop), then waits for stream_
  // to drain; after any NCCL failure, so that nothing stays queued on the
  // device or writes a caller's buffer.
  void AbortAndDrain();
  std::string IdPath() const;

  const Options options_;

  // Written by Allocate; used by the hooks under the protocol of
  // TrainerCollective (Accumulate concurrently on claimed ranges; the rest
  // one at a time).
  DeviceCopier* device_ = nullptr;
  int device_index_ = -1;
  cudaStream_t stream_ = nullptr;             // NCCL's calls
  cudaStream_t accumulate_stream_ = nullptr;  // Accumulate's kernels
  cudaEvent_t done_ = nullptr;                // AwaitNccl's
  float* acc_ = nullptr;  // N_d * partition_elements fp32 on the device, gaps and padding 0
  PinnableBuffer host_;  // the push bucket, and the gather's two bounce halves
  bool host_pinned_ = false;

  ncclComm_t comm_ = nullptr;  // created by Connect; null again once aborted
};

}  // namespace zeroshard
