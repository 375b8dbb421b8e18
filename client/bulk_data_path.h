#pragma once

// DataPath over a bulk transport (transport::Transport: "ucx", "grpc" or
// "inproc", the daemon's --bulk_transport): gradient bytes are Put into a
// slot of the rank's GRAD_STAGING region on the daemon and announced by a
// PushGradient RPC whose chunk names the slot and the slot's generation
// (`staged`); parameters are read with Get straight from the daemon's
// PARAM_MASTER / PARAM_HALF region into the caller's buffer, after a Gather
// RPC with `wait_only` has confirmed the step is committed, and within the
// daemon's read lease. That confirmation serves later reads of the same or
// an older step in the same dtype, within the parameters the daemon has
// accepted ranges of, while at least half of its lease is left (a stage-3
// layer's gathers after the step's first wave, not an RPC each); those
// reads are reported to the daemon, for its traffic counters, in the next
// wait_only Gather or by TakeUnreportedReads (the rank's Leave), best
// effort (docs/protocol.md). A daemon that grants no lease (read_lease_ms 0)
// is asked before every read. Initial parameters (and a push larger than a
// staging slot) use the streaming RPCs. The control plane stays on gRPC.
//
// Set-up is lazy: the first push or gather exchanges endpoints
// (ExchangeEndpoint with the rank's incarnation) and connects, bounded by
// that call's deadline. The slot count and size come from the daemon's
// answer. One BulkDataPath serves one job.
//
// The cached endpoint is dropped when the daemon seems to have gone away or
// lost the job, or a connection is gone: a transport operation fails with
// Unavailable or Cancelled (its connection closed, as UCX does to stop
// another operation on it that was aborted at its deadline), or a push or
// gather is answered Unavailable, NotFound (the job is unknown: a restarted
// daemon) or FailedPrecondition (e.g. the staging region is missing). The
// next call exchanges and connects again. A call whose Put or Get failed
// with Unavailable or Cancelled before anything was announced, and did not
// run out of time, retries once, at once, on a fresh endpoint.
//
// Staging (client/staging_slots.h): a push holds one slot from its Put until
// the daemon answered; a push whose RPC failed or timed out fences its slot
// (FenceStagingSlot) before the slot is written again, and counts as
// delivered when the daemon says it applied that generation. At most
// staging_slots pushes to one daemon are in flight; further ones wait (until
// their deadline) for a slot. Nothing is allocated per push.
//
// Push memory (same host): pushes whose bytes all lie in one of the
// client's push memories (Options::push_memories, client/push_memories.h)
// are not Put: the daemon maps that memory once (MapPushMemory) and sums
// the pushes straight from it, announced by the same staged PushGradient
// with the memory's id and each push's offset. The slot lease, generation
// and fence work as for a Put into the slot (a pulled push holds a slot
// without writing it), so a push whose RPC failed is resolved the same way
// before its bytes count as free; when that fence fails, the push waits
// (fencing again once a second) until a fence answers or fence_timeout past
// its deadline, since the caller's memory, unlike a slot, is reused as soon
// as the push returns. Where the daemon cannot map the memory (another
// host, another pid namespace, no permission), the pushes are Put as before;
// the refusal is printed once per endpoint.
//
// Connections: `connections` per daemon. The Puts of all pushes take the
// first, so one progress thread copies gradients while the daemon applies the
// previous slot; the Gets of a gather and the parts of a region access
// (below) take each connection in turn.
//
// Other regions: PutRegion / GetRegion move bytes into and out of any other
// region the daemon hands the rank in ExchangeEndpoint (the activation arena,
// REGION_PURPOSE_ACTIVATION_ARENA), on the same endpoint and connections, for
// protocols that announce the bytes themselves (client/activation_store.h).
// An access of 2 MiB or more is split into up to one part per connection
// (at most one per MiB), moved side by side by their progress threads.

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "client/data_path.h"
#include "client/push_memories.h"
#include "client/staging_slots.h"
#include "client/stream_data_path.h"
#include "grpcpp/grpcpp.h"
#include "proto/zeroshard/v1/shard.grpc.pb.h"
#include "transport/transport.h"

namespace zeroshard {

// A client's bulk transport, shared by its data paths (one per daemon).
class BulkTransport {
 public:
  // transport::CreateTransport(name, options). InvalidArgument naming
  // ClientConfig.transport for a name that is no bulk transport; the
  // factory's error otherwise (Unavailable when UCX cannot initialise).
  static absl::StatusOr<std::shared_ptr<BulkTransport>> Create(
      const std::string& name, const transport::BackendOptions& options);
  // A BulkTransport over a transport made elsewhere (e.g. one wrapped by a
  // test). InvalidArgument when its kind() is no bulk transport.
  static absl::StatusOr<std::shared_ptr<BulkTransport>> Of(
      std::unique_ptr<transport::Transport> transport);

  v1::TransportKind kind() const { return kind_; }
  const std::string& local_address() const { return transport_->LocalAddress(); }

  // Opens `n` connections to `peer_address`, back to back. The transport
  // hands connections to its progress threads in turn, so that one data
  // path's connections land on distinct threads, the calls of all data paths
  // of this transport are serialised by a mutex of this object (only
  // connection set-up waits for it, each call bounded by its `deadline`;
  // no data operation takes it).
  absl::StatusOr<std::vector<std::unique_ptr<transport::Connection>>> ConnectAll(
      const std::string& peer_address, int n, absl::Time deadline);

 private:
  BulkTransport(v1::TransportKind kind, std::unique_ptr<transport::Transport> transport)
      : kind_(kind), transport_(std::move(transport)) {}

  const v1::TransportKind kind_;
  absl::Mutex connect_mu_;
  const std::unique_ptr<transport::Transport> transport_;
};

class BulkDataPath final : public DataPath {
 public:
  struct Options {
    int connections = 1;  // >= 1, connections to the daemon
    // Deadline of a FenceStagingSlot (its own: the push it resolves may have
    // run out of time already).
    absl::Duration fence_timeout = absl::Seconds(60);
    // The client's push memories; null: every push is Put.
    std::shared_ptr<const PushMemories> push_memories;
  };

  // `channel` is the daemon's channel (shared with the control plane).
  BulkDataPath(std::string address, std::shared_ptr<grpc::Channel> channel,
               std::shared_ptr<BulkTransport> transport, Options options);
  // Waits for nothing: every operation has finished when its call returned.
  ~BulkDataPath() override;

  const std::string& address() const override { return stream_.address(); }
  const char* name() const override;

  // Blocks until the daemon applied the chunk (or a fence proved it did).
  // `push.data` is read by the transport only during the call.
  absl::StatusOr<uint64_t> PushGradient(const GradientPush& push, absl::Time deadline) override;
  // Named once the daemon has mapped the push memory (for the rank
  // process now connected): a refused or not yet mapped one is not.
  PullMemory PullMemoryOf(const void* data, uint64_t bytes) const override;
  // Pushes the daemon reads from one push memory are announced in one
  // request, whatever their bytes (the daemon holds them chunk by chunk:
  // one that fails part way keeps what it applied before,
  // docs/protocol.md). Others that fit one staging slot together (of one
  // rank process, step and dtype) are put into it back to back and
  // announced in one request (one generation: applied all or none); the
  // rest go one by one, inline when one is larger than a slot.
  std::vector<absl::StatusOr<uint64_t>> PushGradients(const std::vector<GradientPush>& pushes,
                                                      absl::Time deadline) override;
  absl::StatusOr<uint64_t> InitParameters(const ParameterUpload& upload,
                                          absl::Time deadline) override;
  // Blocks until the step is committed and the bytes are in `dst`. Range and
  // dtype are checked by the daemon (wait_only Gather) before any Get.
  absl::StatusOr<uint64_t> Gather(const GatherRequestSpec& request, void* dst,
                                  absl::Time deadline) override;

  // Which region of the daemon a PutRegion / GetRegion addresses, and as whom
  // (the endpoint is exchanged with the rank's incarnation).
  struct RegionAccess {
    std::string job_id;
    uint32_t rank = 0;
    uint64_t incarnation = 0;
    v1::RegionPurpose purpose = v1::REGION_PURPOSE_UNSPECIFIED;
  };
  // Bytes of the daemon's region `at.purpose`, or 0 when the daemon hands out
  // none (e.g. it runs without an activation arena). Exchanges endpoints
  // and connects first if needed, bounded by `deadline`.
  absl::StatusOr<uint64_t> RegionLength(const RegionAccess& at, absl::Time deadline);
  // Copies `bytes` from `src` into the region at `offset` (PutRegion), or
  // from the region at `offset` into `dst` (GetRegion). Blocks until the
  // transport completed the operation (the bytes are in the target's
  // memory), or until `deadline`: then the operation is aborted and the call
  // returns only once the transport has let go of the buffer, so the caller
  // owns `src` / `dst` again whenever the call returned. What the bytes mean,
  // and telling the daemon about them, is the caller's protocol. An
  // operation that failed with Unavailable or Cancelled (its connection
  // gone) before `deadline` is retried once at once on a fresh endpoint
  // (both directions are idempotent). Errors: FailedPrecondition when the daemon hands out no
  // region of that purpose; InvalidArgument for a range outside it;
  // Unavailable or Cancelled (the endpoint is dropped; the next call
  // exchanges again); DeadlineExceeded.
  // `while_copying` runs on the calling thread while the transport copies
  // the first attempt's bytes (e.g. a checksum of `src`, which both only
  // read, or of memory the copy does not touch), before the call waits for
  // the copy.
  absl::Status PutRegion(const RegionAccess& at, uint64_t offset, const void* src, uint64_t bytes,
                         absl::Time deadline, absl::FunctionRef<void()> while_copying = [] {});
  absl::Status GetRegion(
      const RegionAccess& at, uint64_t offset, void* dst, uint64_t bytes, absl::Time deadline,
      absl::FunctionRef<void()> while_copying = [] {});

  // ExchangeEndpoint calls that succeeded so far (for tests).
  uint64_t exchanges() const { return exchanges_.load(); }
  // Bytes read under a confirmation without asking that no request has
  // reported to the daemon yet; resets them (the caller reports them,
  // LeaveRequest.unreported_read_bytes). At most kMaxUnreportedReadBytes.
  uint64_t TakeUnreportedReads();
  // The same without resetting them.
  uint64_t unreported_reads() const;

  // Staging slots quarantined now (for tests).
  int quarantined_slots() const { return slots_.quarantined(); }

 private:
  struct Endpoint;
  struct JobKey {
    std::string job_id;
    uint32_t rank = 0;
    uint64_t incarnation = 0;
  };
  // One attempt of a gather or a region access; `retry` is set when its
  // transport operation found its connection gone (Unavailable, Cancelled)
  // and the endpoint was dropped.
  struct Attempt {
    absl::StatusOr<uint64_t> result;
    bool retry = false;
  };
  // Where the daemon reads a batch of pushes in place: push memory `id` (0:
  // nowhere, the pushes are Put), the push i at offsets[i].
  struct Pull {
    uint32_t id = 0;
    int64_t daemon_pid = 0;  // MapPushMemoryResponse.daemon_pid (0: unknown)
    std::shared_ptr<const transport::PushMemory> memory;  // held for the push
    std::vector<uint64_t> offsets;
  };

  // The endpoint for `key`, exchanging and connecting when there is none.
  absl::StatusOr<std::shared_ptr<const Endpoint>> GetEndpoint(const JobKey& key,
                                                              absl::Time deadline);
  absl::StatusOr<std::shared_ptr<const Endpoint>> Exchange(const JobKey& key,
                                                           absl::Time deadline);
  // Fills `ep` from the daemon's answer; DataLoss for a malformed one,
  // FailedPrecondition when the daemon serves another bulk transport.
  absl::Status ParseEndpoint(const v1::ExchangeEndpointResponse& resp, Endpoint* ep) const;
  // The cached endpoint, null when there is none; never exchanges.
  std::shared_ptr<const Endpoint> CachedEndpoint() const;
  // Forgets `stale` if it is still the cached endpoint.
  void DropEndpoint(const Endpoint* stale);
  // Puts `pushes` (of one rank process and step, together at most a slot)
  // into one slot and announces them in one request; those an earlier,
  // unanswered attempt turned out to have delivered are not sent again.
  // Sets one result per push; returns whether the endpoint was lost before
  // anything was announced (the caller may try once more).
  bool PushStaged(const Endpoint& ep, absl::Span<const GradientPush> pushes, const Pull& pull,
                  absl::Time deadline, std::vector<absl::StatusOr<uint64_t>>* results);
  // Whether the daemon of `ep` reads `pushes` in place: they all lie in one
  // push memory (each at most a chunk) that it mapped, or maps now
  // (MapPushMemory, bounded by `deadline`). Never an error: what cannot be
  // pulled is Put.
  Pull PlanPull(const Endpoint& ep, absl::Span<const GradientPush> pushes, absl::Time deadline);
  // The push memory that holds a push of `bytes` at `data` as a daemon
  // reads it (whole, at most a chunk, at an offset `align` divides).
  std::optional<PushMemories::Found> FindPullable(const void* data, uint64_t bytes,
                                                  uint64_t align) const;
  Attempt GetOnce(const Endpoint& ep, const GatherRequestSpec& request, void* dst,
                  absl::Time deadline);
  // Its deadline: fence_timeout from now, and at most `until`.
  absl::StatusOr<uint64_t> FenceSlot(const GradientPush& push, uint32_t slot,
                                     uint64_t generation,
                                     absl::Time until = absl::InfiniteFuture());
  // A pulled push (`lease`, announced with `deadline`) whose fence failed
  // (`failed`): fences again once a second until one answers (whether the
  // daemon applied it), the daemon's process (`pull.daemon_pid`) has exited
  // (`failed`: it reads nothing any more), or Options::fence_timeout past
  // `deadline` (the last error: the daemon starts no read of a pulled push
  // past its deadline, and a read under way ends with the job lock's
  // current work). Blocks until then.
  absl::StatusOr<bool> AwaitPulledFence(const GradientPush& push, const Pull& pull,
                                        const StagingSlots::Lease& lease, absl::Time deadline,
                                        absl::Status failed);
  // One Put (`put`) or Get of a region access.
  // `while_copying` runs once the operation is issued (first attempt only,
  // when `*ran` is false; sets it).
  Attempt RegionOnce(const Endpoint& ep, const RegionAccess& at, bool put, uint64_t offset,
                     void* buffer, uint64_t bytes, absl::Time deadline,
                     absl::FunctionRef<void()> while_copying, bool* ran);
  absl::Status RegionOp(const RegionAccess& at, bool put, uint64_t offset, void* buffer,
                        uint64_t bytes, absl::Time deadline,
                        absl::FunctionRef<void()> while_copying);
  // Waits for `completion` until `deadline`; past it, aborts the operation
  // and waits until the transport has let go of the buffer (which an aborted
  // operation does promptly; a line on stderr every 10 s while it has not).
  // `what` names the operation in an error (built only then).
  absl::Status Finish(transport::Completion& completion, absl::Time deadline,
                      absl::FunctionRef<std::string()> what);
  // Finish for each of the operations of one call, in order, whatever the
  // earlier ones returned (each buffer is the transport's until its own
  // operation let go); the call's status as FoldStatus (.cc) gives it.
  absl::Status FinishAll(absl::Span<transport::Completion> operations, absl::Time deadline,
                         absl::FunctionRef<std::string()> what);

  const std::shared_ptr<BulkTransport> transport_;
  // Serves what the bulk transport does not (initial parameters, oversized
  // pushes, wait_only gathers) and shares its Shard stub and address.
  StreamDataPath stream_;
  const Options options_;
  StagingSlots slots_;
  std::atomic<uint64_t> exchanges_{0};

  mutable absl::Mutex mu_;
  std::shared_ptr<const Endpoint> endpoint_ ABSL_GUARDED_BY(mu_);
  bool exchanging_ ABSL_GUARDED_BY(mu_) = false;  // one thread sets up at a time
};

}  // namespace zeroshard
