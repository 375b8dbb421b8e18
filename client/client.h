#pragma once

// zeroshard::Client: the trainer side of ZeRO-as-a-service. One Client per
// data-parallel rank; it registers the model with the job's daemons, pushes
// gradients, runs the two-phase optimizer step and gathers parameters.
//
// A step, stages 1 and 2 (the paper's 2Ψ per rank):
//   client->GatherAll(params, DType::kBf16);        // Ψ in
//   ... forward / backward ...
//   client->PushGradients({0, n}, grads, DType::kBf16);  // Ψ out
//   client->Step(lr);
// A step, stage 3 (3Ψ per rank):
//   for each layer l, in order:           client->Gather(l, buf);  ... forward ...
//   for each layer l, in reverse order:   client->Gather(l, buf);  ... backward ...
//                                         client->PushGradients(layer_range(l), grad_l, ...);
//   client->Step(lr);
//
// Threads: PushGradients, the PushTicket it returns, MemoryReport and
// TrafficReport may be used from any thread, concurrently. Every other
// method must be called from one thread at a time (the training loop). The
// client runs its RPCs on its own threads: `sender_threads` for gradient
// buckets, `io_threads` for gathers and per-daemon calls, one prefetch
// thread, and one heartbeat thread from RegisterModel until Leave or
// destruction.
//
// Incarnation: Create picks this process's incarnation for the rank (its
// start time in microseconds since the Unix epoch, strictly increasing within
// the process), which every request of the rank carries. A restarted trainer
// joins with a larger one, and the daemons then refuse the old process.
//
// Deadlines: nothing blocks without one. A single RPC, or a wait for local
// resources, is bounded by `rpc_timeout`; a wait that depends on the other
// ranks (the step's barrier, a gather of a step not yet committed, the
// start-up barrier) by `step_timeout`.
//
// Errors (one meaning per code): InvalidArgument / FailedPrecondition: the
// caller's mistake (bad config, range, call order), nothing was sent;
// Unavailable: a daemon (named in the message) cannot be reached or went
// away; DeadlineExceeded: a wait ran out (the message says what it waited
// for); ResourceExhausted: the fixed buffer pools cannot serve the request;
// DataLoss: a corrupted reply. A daemon's own error passes through with the
// daemon's address prefixed.

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/activation_store.h"
#include "client/checkpoint_driver.h"
#include "client/collective.h"
#include "client/data_path.h"
#include "client/device_memory.h"
#include "client/executor.h"
#include "client/push_memories.h"
#include "client/replica_placement.h"
#include "client/step_coordinator.h"
#include "client/traffic.h"
#include "common/channel.h"
#include "common/dtype.h"
#include "common/job_spec.h"
#include "common/layout.h"
#include "common/partition_map.h"
#include "common/tls.h"

namespace zeroshard {

class BulkTransport;
class DaemonControl;
class HeartbeatLoop;
class LayerCache;

// The job's settings (common/job_spec.h: job_id, stage, world_size,
// precision, reduction, optimizer, loss_scale, bucket_bytes, daemons; every
// rank passes the same) plus this rank's and this client's own.
struct ClientConfig : JobSettings {
  uint32_t rank = 0;
  // Staging pool for gradient pushes: this many buffers of one bucket
  // (at most kMaxChunkBytes) each, allocated by Create.
  uint32_t staging_buffers = 4;
  // Stage 3: layers gathered ahead of the one the caller asks for. Ignored
  // (0) with a collective that gathers parameters (GlooCollective): its
  // layer gathers are collective calls, made only when the trainer asks.
  uint32_t prefetch_depth = 2;
  // Layer buffers for prefetching and GatherView (each as large as the
  // largest layer); 0 means prefetch_depth + 2. Allocated by RegisterModel.
  uint32_t layer_buffers = 0;
  uint32_t micro_batches = 1;  // gradient accumulation: pushes per range per step
  float max_grad_norm = 0.0f;  // 0: no clipping (the leader's applies)
  absl::Duration rpc_timeout = absl::Seconds(60);
  absl::Duration step_timeout = absl::Minutes(5);
  // How long SaveCheckpoint waits for the previous save to complete (its
  // parts written on every daemon). Past it the new save is not started:
  // Unavailable, and training goes on, so that a hung or far too slow
  // checkpoint disk stalls a step by at most this long.
  absl::Duration checkpoint_wait = absl::Seconds(10);
  // Liveness: every this often the client tells each daemon the rank is
  // alive (from RegisterModel until Leave or destruction). 0 disables it
  // (the daemons then count the rank connected only while it pushes).
  absl::Duration heartbeat_interval = absl::Seconds(5);
  // A daemon that answers no keepalive ping for this long fails every call
  // in flight to it with UNAVAILABLE, whatever the call's deadline, and a
  // replicated job fails over from it as from a dead one (common/
  // keepalive.h). 0: off (a silent daemon is found by call deadlines only);
  // else at least 2 s.
  absl::Duration liveness_timeout = absl::Seconds(4);
  // Data path: "stream" (the Shard streaming RPCs, always available), or a
  // bulk transport, which must be the daemons' --bulk_transport: "ucx",
  // "grpc" (transport/grpc one-sided Put/Get) or "inproc" (daemons in the
  // same process; tests). Create fails with Unavailable when the bulk
  // transport cannot initialise (UCX). The control plane is gRPC.
  std::string transport = "stream";
  // UCX_TLS of a "ucx" transport, e.g. "posix,cma,self" or "tcp"; empty =
  // UCX's choice (or the UCX_TLS environment variable).
  std::string ucx_tls;
  // Bulk transports: progress threads (1..16), with one connection per
  // thread to every daemon. A gather's Gets are spread over them, so they
  // copy in parallel; a daemon's gradient Puts all take the first.
  int bulk_progress_threads = 2;
  // Bulk transports: keep the gradient staging pool in push memory
  // (AllocatePushMemory), so that a daemon on the same host sums staged
  // buckets straight from it instead of from a copy Put into its staging
  // slot. Where a daemon cannot map it (another host or pid namespace), the
  // buckets are Put as without it.
  bool push_memory = true;
  // Gradient buckets in flight at once (each on its own thread): a bulk
  // push holds one of the daemon's staging slots (--staging_slots, 4 by
  // default) from its Put until the daemon has summed it, so up to that
  // many per daemon overlap one bucket's Put with earlier buckets' sums.
  int sender_threads = 4;
  int io_threads = 4;
  // The job's secret, sent with every request (common/auth.h); the first
  // rank to register the job binds it. Empty: ZS_JOB_TOKEN from the
  // environment (zsrun sets it); one of them is required.
  std::string job_token;
  // The deployment's registration token, which a daemon started with
  // --registration_token_file demands of a RegisterJob that creates a job.
  // Empty: ZS_REGISTRATION_TOKEN from the environment (zsrun sets it), or
  // none.
  std::string registration_token;
  // Mutual TLS to the daemons (and a "grpc" bulk transport's connections):
  // the three PEM files, each empty field taken from ZS_TLS_CERT /
  // ZS_TLS_KEY / ZS_TLS_CA; all empty: plaintext.
  TlsFiles tls;
  // Plaintext (no `tls`) sends the job token in the clear, so Create refuses
  // it to a daemon address that is not loopback (127.0.0.0/8, [::1],
  // localhost) unless this is true or ZS_INSECURE=1 is in the environment:
  // for networks where something else (a VPN, a private fabric) already
  // protects the traffic, as the daemons' --insecure.
  bool insecure = false;
  // Resume: a checkpoint name, or "latest" (the complete checkpoint with the
  // highest step that verifies on every daemon: newer ones whose files are
  // damaged or missing are passed over, each said on stderr and in
  // resume_skipped()), that RegisterModel on rank 0 loads into the daemons
  // instead of uploading initial parameters. With "latest" and no complete
  // checkpoint, the job starts from the initial parameters; when none
  // verifies, RegisterModel fails with DataLoss. A name that does not
  // verify fails the load (DataLoss naming the file). Empty: no resume.
  std::string resume;
  // Replicated jobs (JobSettings::replicas = 2): the least step this rank
  // knows committed (a trainer reconnecting after a failure passes the last
  // step it saw committed), so that a backup behind it is never promoted.
  uint64_t known_committed_step = 0;
  // The node cache (JobSettings::node_cache): the index in `daemons` of
  // this rank's host daemon, which serves the rank's streamed gathers of
  // other daemons' ranges from one copy per step. -1: found by Create, the
  // first daemon whose host is one of this machine's addresses
  // (client/local_daemon.h); when none is, this rank gathers from every
  // owner as without the cache (said on stderr). Ignored without
  // node_cache.
  int local_daemon = -1;
  // The CUDA device whose memory PushGradients, GatherAll and Gather may be
  // given (MemoryKind::kCudaDevice); -1: host buffers only. With a device,
  // Create makes a copier on it (client/device_memory.h) and pins two gather
  // bounce buffers of min(C_B, 64 MiB) each (RegisterModel pins the staging
  // pool), and fails with FailedPrecondition when the build has no CUDA or
  // the device is not there. Device buffers must be ready when passed: the
  // client's copies are ordered after work on the legacy default stream
  // (stream 0, PyTorch's default), not after other streams' work, which the
  // caller synchronises first.
  int cuda_device = -1;
};

// OK, or InvalidArgument naming the field ("ClientConfig.<field>: ...").
absl::Status ValidateConfig(const ClientConfig& config);

// Bytes the client holds, by ledger category.
struct ClientMemoryReport {
  uint64_t buffer = 0;      // gradient staging pool (fixed: C_B-bounded)
  uint64_t param = 0;       // gathered-layer buffers, fp32 jobs
  uint64_t param_half = 0;  // gathered-layer buffers, bf16/fp16 jobs
  uint64_t total() const { return buffer + param + param_half; }
};

struct ClientTrafficReport {
  TrafficBytes total;      // since Create
  // Between the return of the previous Step (or of RegisterModel) and the
  // return of the last Step.
  TrafficBytes last_step;
  TrafficBytes current;    // since the last Step (or RegisterModel) returned
  uint64_t prefetch_hits = 0;    // layer gathers served by a prefetch
  uint64_t prefetch_misses = 0;  // layer gathers fetched on demand
  // Of total.gather: bytes read from the daemons' parameter regions under a
  // read lease that the daemons have not counted yet (reported with the
  // next wait_only Gather to each, or with Leave; BulkDataPath).
  uint64_t unreported_gather = 0;
};

class Client {
 public:
  // Validates `config` (InvalidArgument naming the field), allocates the
  // staging pool, creates the bulk transport and starts the client's
  // threads. Connects to nothing yet. `collective` replaces the built-in
  // reduction (required for ReductionMode::kTrainerCollective, which has no
  // built-in implementation: InvalidArgument without one).
  static absl::StatusOr<std::unique_ptr<Client>> Create(
      ClientConfig config, std::unique_ptr<Collective> collective = nullptr);
  // Stops heartbeats and waits for the client's in-flight RPCs (each bounded
  // by its deadline). Does not leave the job: call Leave() for that.
  ~Client();

  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Registers the job on every daemon (idempotent across ranks), joins it as
  // this rank and, on rank 0, uploads `initial_params` (total_elements() fp32
  // values in flat order; alignment gaps are sent as zeros) unless the job
  // has already committed a step (4 MiB streams, every element confirmed by
  // the daemon; up to 4 MiB of scratch per daemon while it runs). Other
  // ranks' `initial_params` are not read (pass null or their identical copy).
  // Returns once every rank has joined every daemon; rank 0 joins only after
  // its upload was confirmed, so the daemons hold the initial parameters when
  // any rank returns. Blocks up to step_timeout for the other ranks.
  // FailedPrecondition if the job exists with a different spec. May be
  // retried after an error (with the same layout).
  absl::Status RegisterModel(const Layout& layout, const float* initial_params);

  // Contributes this rank's gradient for flat elements [range.begin,
  // range.end) (range.size() elements of `dtype`, converted to the job's
  // precision) to the next step, micro-batch `micro_batch` (< micro_batches).
  // Any split into calls works (whole model, per layer, per tensor; ranks
  // need not split alike), as long as every element is pushed exactly once
  // per micro-batch before Step; gap elements need not be pushed and are
  // sent as zeros. The client re-cuts the gradient into the job's buckets
  // (client/bucket_plan.h: each daemon's range cut every C_B bytes from its
  // start; in trainer-collective mode each partition), sending each one
  // when all of its elements have arrived.
  // Buffer use:
  //  - BufferUse::kCopy (the default): `grads` is copied (and converted to
  //    the wire dtype) into the staging pool before the call returns, so the
  //    caller may reuse it at once. Blocks to copy, and while the pool is
  //    fully in flight (up to rpc_timeout; ResourceExhausted at once if the
  //    pool is full of partly pushed buckets that no other thread is
  //    completing).
  //  - BufferUse::kBorrow: the client reads `grads` until the ticket
  //    completes; the caller must neither modify nor free it before then,
  //    errors included (a Wait that times out does not stop the send;
  //    destroying the Client waits for every send in flight).
  //    Every bucket the call covers whole, in the wire dtype and without
  //    alignment gaps, is sent straight from `grads` (no staging copy, no
  //    staging buffer held); the rest is staged as with kCopy. What DDP-style
  //    trainers with persistent gradient buffers want.
  // InvalidArgument for a range out of bounds or pushed twice. A send error
  // reaches the ticket and the next Step.
  // Memory: with MemoryKind::kCudaDevice `grads` is memory of
  // ClientConfig::cuda_device (InvalidArgument otherwise; FailedPrecondition
  // for a client without a device); it is cast to the wire dtype on the
  // device and copied into the pinned staging pool before the call returns
  // (kBorrow then works as kCopy), while earlier buckets are being sent.
  // No gradient: `no_grad_tensors` (layout indices, ascending, each
  // overlapping `range`) are tensors this push has no gradient for (torch's
  // grad is None): their elements in `grads` must be zeros, and the step
  // updates a tensor only if some rank's push, in some micro-batch, carried
  // a gradient for it, as torch.optim skips a parameter without one (no
  // weight decay, no moment update, its update count unchanged). Name a
  // tensor in every push that covers part of it, or in none.
  // InvalidArgument for an index that is not ascending or outside `range`;
  // With the Gloo trainer collective the ranks agree on the marks in each
  // Step (a tensor is without a gradient when every rank marked it in every
  // micro-batch). A collective that does not carry marks (the NCCL trainer
  // collective: carries_no_grad_marks() false) takes none:
  // FailedPrecondition for any `no_grad_tensors`; push zeros without them
  // there.
  // Gradient memory that a daemon on the same host reads in place: a
  // bulk-transport push (BufferUse::kBorrow) whose buckets lie in it is not
  // copied into the daemon's staging slot; the daemon sums it from here
  // (transport/shm/push_memory.h says what it checks). `bytes` rounded up to
  // whole pages, zeroed. Keep gradients there (e.g. a DDP-style flat
  // gradient buffer) and push with kBorrow. Works with any client: where the
  // daemons cannot map it, or on the "stream" path, pushes from it are sent
  // as from any memory. A daemon keeps a memory it mapped (booked in its
  // ledger) until this rank process leaves or is replaced, and maps at most
  // 16 per process (the staging pool is one): allocate few, long-lived
  // memories. ResourceExhausted when the system refuses the memory.
  absl::StatusOr<std::shared_ptr<transport::PushMemory>> AllocatePushMemory(size_t bytes);

  absl::StatusOr<PushTicket> PushGradients(const FlatRange& range, const void* grads, DType dtype,
                                           uint32_t micro_batch = 0,
                                           BufferUse use = BufferUse::kCopy,
                                           MemoryKind memory = MemoryKind::kHost,
                                           absl::Span<const uint32_t> no_grad_tensors = {});

  // Ends the step: waits until this rank's pushes are accepted
  // (FailedPrecondition if some element was not pushed), then on the leader
  // (rank 0) waits for every rank's pushes, runs PrepareStep on every daemon,
  // combines the norms (sum of grad_sq_sum in daemon order, norm =
  // float(sqrt(sum)), clip = min(1, max_grad_norm / (norm + 1e-6)), skip on
  // inf/nan) and commits on every daemon; other ranks return once every
  // daemon has committed, with the leader's decisions read from the daemons
  // (GetStepState). Blocks up to step_timeout. All ranks must pass the
  // same `lr`; the leader's is applied. If Step fails in its commit phase,
  // calling it again resends the same commit (CommitStep is idempotent). If
  // it fails before, the rank retries by pushing its whole gradient again
  // and calling Step: buckets the daemons confirmed in the failed attempt
  // count as delivered and are not sent again (when all were confirmed, as
  // after a timeout waiting for the other ranks or the leader, Step may also
  // be called again without pushing). A borrowed gradient buffer stays in use until
  // the tickets of its pushes complete, also after a failed Step (one that
  // timed out may leave sends running). Stage-3 layer views must be released
  // first (FailedPrecondition); prefetched layers of the old parameters are
  // dropped without waiting (a prefetch still running frees its buffer when
  // it ends). Once the commit succeeded Step returns OK: it never advances
  // committed_step() and then fails. Step gathers nothing: stages 1-2 call
  // GatherAll for the new parameters.
  absl::StatusOr<StepResult> Step(float lr);
  // Step with each parameter group's learning rate (JobSettings::
  // param_groups; one per group, each finite and >= 0: InvalidArgument
  // otherwise).
  absl::StatusOr<StepResult> Step(absl::Span<const float> group_lrs);

  // Gathers every parameter as of the last committed step into `dst`
  // (total_elements() elements of `dtype`: fp32 or the job's precision;
  // gaps read as zeros), from all daemons in parallel, in C_B-sized
  // requests written straight into `dst`. Stages 1-2 call it once per step,
  // before the forward pass. Blocks until done (each request bounded by
  // rpc_timeout); `dst` is not written after it returns. With a collective
  // that gathers parameters (GlooCollective) it is a collective call: this
  // rank fetches its own partition from the daemons and the others come from
  // their ranks, so every rank calls GatherAll at the same points (bounded
  // by step_timeout). With MemoryKind::kCudaDevice `dst` is memory of
  // ClientConfig::cuda_device: the parameters come in through the two pinned
  // bounce buffers, each one's host-to-device copy overlapping the gather of
  // the next, or through the collective where it gathers parameters (the
  // NCCL collective takes device memory only, the Gloo one host memory
  // only: FailedPrecondition for the other kind).
  absl::Status GatherAll(void* dst, DType dtype, MemoryKind memory = MemoryKind::kHost);
  // GatherAll of flat `range` only (non-empty, inside [0, total_elements()):
  // InvalidArgument otherwise) into `dst` (range.size() elements of `dtype`),
  // e.g. a layer's fp32 masters in a bf16 or fp16 job without a buffer for
  // the whole model. Collective as GatherAll: with a collective that gathers
  // parameters every rank gathers the same ranges in the same order.
  absl::Status GatherAll(const FlatRange& range, void* dst, DType dtype,
                         MemoryKind memory = MemoryKind::kHost);

  // Stage 3 (works in any stage): the parameters of `layer`
  // (Layout::LayerRange, layer_elements(layer) elements of the job's
  // precision) as of the last committed step, copied into `dst`. Served from
  // a prefetched buffer when there is one, else gathered from the owning
  // daemons in parallel. Then starts prefetching the next prefetch_depth
  // layers in the direction of travel: forward while layer ids increase,
  // backward once a layer repeats or ids decrease. With a collective that
  // gathers parameters, a layer not held is all-gathered among the ranks
  // (each fetching its own partition's part from the daemons): every rank
  // then gathers, views and releases the same layers in the same order.
  // With MemoryKind::kCudaDevice `dst` is memory of ClientConfig::cuda_device:
  // a prefetched layer is copied from its buffer to the device, any other
  // comes through the bounce buffers as in GatherAll.
  absl::Status Gather(uint32_t layer, void* dst, MemoryKind memory = MemoryKind::kHost);
  // Stage 3: like Gather, but returns a pointer into a client-owned layer
  // buffer (layer_buffers of them, allocated by RegisterModel) that stays
  // valid until Release(layer) or Step. Gathering a layer already held
  // returns the same buffer without traffic. ResourceExhausted if every layer
  // buffer is held by an unreleased view; FailedPrecondition in stages 1-2.
  absl::StatusOr<const void*> GatherView(uint32_t layer);
  // Drops the client's copy of `layer` (a view, or a prefetched buffer not
  // yet used). OK if it holds none.
  absl::Status Release(uint32_t layer);
  // Stage 3: starts gathering `layer` into a free layer buffer in the
  // background; a no-op if it is already there, no buffer is free, the
  // stage has no layer buffers, or the collective gathers parameters (its
  // gathers are made when the trainer asks, in every rank's same order).
  absl::Status Prefetch(uint32_t layer);

  // ---- Checkpoints (call from one rank, usually 0, between steps) ----
  // Saves the committed state under `name` (client/checkpoint_driver.h):
  // waits for this client's previous save to complete, then has every daemon
  // snapshot its partitions and returns. The daemons write in the
  // background, and a background thread of the client completes the
  // checkpoint (the job manifest) once every part is on disk; the next step
  // may run meanwhile. Blocks for the snapshots (the training stall) and up
  // to checkpoint_wait for a previous save. InvalidArgument for a bad name;
  // Unavailable, nothing started, while the previous save is not complete
  // after checkpoint_wait; Unavailable when a daemon's checkpoint disk does
  // not answer (its --disk_timeout_seconds: the other daemons may have
  // written their parts of the save, which stay incomplete); a previous
  // save that failed is reported in CheckpointStarted::previous (or in the
  // error); the daemons' errors pass through (FailedPrecondition without
  // --checkpoint_dir, ResourceExhausted when the snapshot does not fit).
  absl::StatusOr<CheckpointStarted> SaveCheckpoint(const std::string& name);
  // Waits (up to step_timeout) for the last save to complete; its result.
  // FailedPrecondition if there was none.
  absl::StatusOr<CheckpointCompleted> AwaitCheckpoint();
  // Complete checkpoints of the job on every daemon, by step.
  absl::StatusOr<std::vector<v1::CheckpointInfo>> ListCheckpoints();
  // Whether RegisterModel resumed from a checkpoint, and which.
  const std::optional<v1::LoadCheckpointResponse>& resumed_from() const { return resumed_; }
  // With resume = "latest": the newer checkpoints passed over because they
  // did not verify ("NAME (step S): why", newest first).
  const std::vector<std::string>& resume_skipped() const { return resume_skipped_; }

  // ---- State dicts (Shard.ReadState / WriteState) ----
  // Reads the committed `array` (masters or moments) over `range` (inside
  // [0, total_elements())) into `dst` (range.size() floats: alignment gaps,
  // and the moments of frozen tensors, read as zeros) from the daemons that
  // own it, and when `steps` is not null adds the update count of every
  // trainable tensor overlapping the range (layout index -> count). Call
  // between steps. Blocks (rpc_timeout per daemon, in parallel).
  absl::Status ReadState(v1::StateArray array, const FlatRange& range, float* dst,
                         std::map<uint32_t, uint64_t>* steps);
  // Overwrites `array` over `range` with `src` (range.size() floats; zeros
  // in the alignment gaps and, for moments, in frozen tensors) on the
  // daemons that own it, in streams of at most C_B, and sets the update
  // counts in `steps` (trainable tensors; each daemon gets those of the
  // tensors overlapping its range). Each daemon applies its part whole or
  // not at all. Call between steps, on one rank or on every rank with the
  // same values (writes of equal values are harmless); the gathered layers
  // this client holds are dropped, so the next gathers read the new values.
  // An empty `range` writes only the counts. Blocks.
  absl::Status WriteState(v1::StateArray array, const FlatRange& range, const float* src,
                          const std::map<uint32_t, uint64_t>& steps);

  // ---- Activation checkpoints (client/activation_store.h) ----
  // A store for this rank's activation checkpoints on daemon `daemon` (an
  // index into ClientConfig.daemons; a trainer usually takes
  // rank * daemons / world_size, its partition's daemon). It shares the
  // client's channel to the daemon and, with a bulk transport, the client's
  // data path (Puts and Gets into the daemon's activation arena). Creates
  // no connection and blocks on nothing. FailedPrecondition before
  // RegisterModel (the rank must have joined the job), InvalidArgument for
  // an index out of range. The store must be destroyed before the client.
  // Its slices stay on the daemon until freed (FreeStep) or until the job is
  // removed there (every rank left).
  absl::StatusOr<std::unique_ptr<DaemonSliceStore>> OpenActivationStore(
      uint32_t daemon, const DaemonSliceStore::Options& options);

  // Stops the heartbeats and leaves the job on every daemon (the job is
  // freed when every rank has left). Returns the first error, after trying
  // every daemon.
  absl::Status Leave();

  ClientMemoryReport MemoryReport() const;
  ClientTrafficReport TrafficReport() const;

  const ClientConfig& config() const { return config_; }
  // Valid after RegisterModel.
  const Layout& layout() const { return layout_; }
  const PartitionMap& partition_map() const { return map_; }
  uint64_t total_elements() const { return layout_.total_elements(); }
  absl::StatusOr<uint64_t> layer_elements(uint32_t layer) const;
  // The last committed step this client knows of.
  uint64_t committed_step() const { return step_.load(); }
  // The scale to multiply the next step's loss by (fp16 loss scaling).
  float loss_scale() const { return loss_scale_.load(); }
  // Whether PushGradients takes no_grad_tensors with this client's
  // collective (Collective::carries_no_grad_marks()).
  bool carries_no_grad_marks() const { return collective_->carries_no_grad_marks(); }
  // This process's incarnation for the rank (>= 1), fixed by Create.
  uint64_t incarnation() const { return incarnation_; }

 private:
  friend class ClientTestPeer;  // tests: replaces data paths before RegisterModel

  Client(ClientConfig config, std::unique_ptr<Collective> collective,
         std::shared_ptr<PushMemories> push_memories);

  absl::Time RpcDeadline() const { return absl::Now() + config_.rpc_timeout; }
  // Step with the learning rates checked (`group_lrs` empty: `lr` for every
  // group).
  absl::StatusOr<StepResult> StepWith(float lr, std::vector<float> group_lrs);
  RankId rank_id() const { return {config_.job_id, config_.rank, incarnation_}; }
  // Creates the controls, data paths, executor and step coordinator.
  absl::Status Connect();
  // Runs fn(d) for every daemon in parallel on the io threads (first error).
  absl::Status ForEachDaemon(const std::function<absl::Status(uint32_t)>& fn);
  // RegisterJob on every daemon; checks their partition maps against `map`.
  absl::Status RegisterJobEverywhere(const Layout& layout, const PartitionMap& map);
  absl::Status BindCollective();
  absl::Status UploadInitialParams(const float* params);
  // JoinJob on every daemon.
  absl::Status JoinEverywhere();
  // After every rank joined: the committed step all daemons agree on. A step
  // committed on some daemons and not others (one behind) is finished by
  // rank 0 with the recorded decision; other ranks wait for it (up to
  // step_timeout). FailedPrecondition for a larger split.
  absl::StatusOr<uint64_t> AgreedCommittedStep();
  // Gathers `range` (inside [0, total)) as `dtype` into dst, cut at daemon
  // boundaries and into C_B-sized requests, in parallel on the io threads.
  absl::Status GatherRange(const FlatRange& range, DType dtype, uint64_t after_step, void* dst);
  // GatherRange, or with a collective that gathers parameters its
  // AllGather (a collective call: every rank makes it in the same order).
  absl::Status GatherParameters(const FlatRange& range, DType dtype, uint64_t after_step, void* dst,
                                MemoryKind memory);
  // OK when the client has a device and `dst` is its memory;
  // FailedPrecondition or InvalidArgument naming `call` otherwise.
  absl::Status CheckDeviceDestination(absl::string_view call, const void* dst,
                                      uint64_t bytes) const;
  // Flat `range` into CUDA device memory: through the bounce buffers (each
  // copy wait bounded by rpc_timeout), or by the collective where it
  // gathers parameters.
  absl::Status GatherRangeToDevice(const FlatRange& range, DType dtype, void* dst);
  absl::StatusOr<size_t> LayerIndex(uint32_t layer) const;
  bool registered() const { return registered_.load(std::memory_order_acquire); }

  const ClientConfig config_;
  const uint64_t incarnation_;
  // ClientConfig::cuda_device's copier and the pinned gather bounce buffers
  // (kLanes of bounce_bytes_); null without a device. Outlive collective_,
  // whose staging pool they pinned.
  std::unique_ptr<DeviceCopier> device_;
  PinnableBuffer bounce_;  // pinned once allocated
  uint64_t bounce_bytes_ = 0;
  std::unique_ptr<Collective> collective_;
  TrafficCounters traffic_;
  mutable absl::Mutex report_mu_;
  TrafficBytes last_step_traffic_ ABSL_GUARDED_BY(report_mu_);

  // Set (release) once RegisterModel succeeded; layout_ and map_ are written
  // before and never again, so threads that saw it set may read them.
  std::atomic<bool> registered_{false};
  // Training thread only.
  std::optional<uint64_t> bound_fingerprint_;  // layout the collective is bound to
  Layout layout_;
  PartitionMap map_;
  // Per replica group (daemon index): the daemon serving it, and with
  // replicas = 2 the group's own daemon for RegisterJob.
  std::vector<std::unique_ptr<DaemonControl>> controls_;
  std::vector<std::unique_ptr<DaemonControl>> home_controls_;
  std::vector<GroupPlacement> placement_;
  // Shared with the bulk data paths and the built-in collective's pool.
  const std::shared_ptr<PushMemories> push_memories_;
  std::shared_ptr<BulkTransport> bulk_;  // null for "stream"
  std::vector<std::unique_ptr<DataPath>> data_paths_;
  // By daemon index: the channels, and the bulk data paths among
  // data_paths_ (empty for "stream"), for activation stores.
  std::vector<std::shared_ptr<grpc::Channel>> channels_;
  std::vector<BulkDataPath*> bulk_paths_;
  // Node cache: the host daemon's index and its streaming path, which
  // serves other daemons' ranges (bulk transports read only the daemon's
  // own regions); -1 / null when the node cache is off for this rank.
  int node_daemon_ = -1;
  std::unique_ptr<StreamDataPath> node_path_;
  std::atomic<uint64_t> step_{0};  // read by pushing threads
  std::atomic<float> loss_scale_{1.0f};
  std::unique_ptr<StepCoordinator> coordinator_;
  std::unique_ptr<CheckpointDriver> checkpoints_;
  std::optional<v1::LoadCheckpointResponse> resumed_;
  std::vector<std::string> resume_skipped_;
  // The background completion of the last save (training thread only).
  std::thread checkpoint_finisher_;
  // Notified by checkpoint_finisher_ as it ends; when it started.
  std::shared_ptr<absl::Notification> checkpoint_finished_;
  absl::Time checkpoint_started_;
  bool checkpoint_waited_ = false;  // a save timed out waiting for it
  std::optional<absl::StatusOr<CheckpointCompleted>> checkpoint_result_;
  std::string checkpoint_pending_;  // name of the save being completed

  // Destroyed first, in this order: their threads use the members above.
  std::unique_ptr<Executor> io_;
  std::unique_ptr<LayerCache> layers_;        // created by RegisterModel
  std::unique_ptr<HeartbeatLoop> heartbeat_;  // RegisterModel until Leave
};

}  // namespace zeroshard
