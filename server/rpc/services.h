#pragma once

// zeroshardd's gRPC services, thin layers over the JobManager: each handler
// validates its request, finds the job, calls it, and counts the result.
// Handlers run on gRPC's synchronous-server threads; the only waits inside
// them (a gather waiting for a commit, a push waiting for buffer space or its
// staging slot, a stream reading its next chunk) are bounded by a deadline,
// and none holds a lock that another job's requests need.

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/auth.h"
#include "grpcpp/health_check_service_interface.h"
#include "proto/zeroshard/v1/activation.grpc.pb.h"
#include "proto/zeroshard/v1/admin.grpc.pb.h"
#include "proto/zeroshard/v1/checkpoint.grpc.pb.h"
#include "proto/zeroshard/v1/control.grpc.pb.h"
#include "proto/zeroshard/v1/replica.grpc.pb.h"
#include "proto/zeroshard/v1/shard.grpc.pb.h"
#include "server/activation/activation_metrics.h"
#include "server/activation/activation_store.h"
#include "server/activation/arena_tenancy.h"
#include "server/disk/disk_worker.h"
#include "server/metrics/daemon_metrics.h"
#include "server/job/job_manager.h"
#include "server/ledger/memory_ledger.h"
#include "server/rpc/caller_calls.h"
#include "server/rpc/grpc_param_fetcher.h"
#include "server/rpc/stream_watchdog.h"
#include "transport/transport.h"

namespace zeroshard {

// What the services share; owned by the Daemon, which outlives them.
struct ServiceContext {
  std::string version;
  uint64_t max_chunk_bytes = 4ull << 20;  // gather chunk size
  JobManager* jobs = nullptr;
  MemoryLedger* ledger = nullptr;
  DaemonMetrics* metrics = nullptr;
  transport::Transport* bulk = nullptr;  // null: no bulk data path
  std::string bulk_error;                // why bulk is null
  std::string checkpoint_dir;            // empty: checkpoints are refused
  // Runs the handlers' short calls on checkpoint_dir (owner files, the
  // quota walk, listings, manifests), so that a hung disk holds its thread
  // and answers every handler within --disk_timeout_seconds
  // (server/disk/disk_worker.h). Null: on the handler's thread (services
  // built without a daemon).
  DiskWorker* checkpoint_disk = nullptr;
  ActivationStore* activations = nullptr;  // null: --activation_arena_bytes=0
  ArenaTenancy* arena_tenancy = nullptr;    // with `activations`
  ActivationMetrics* activation_metrics = nullptr;
  // How a primary reaches its backup (replicated jobs); set with `jobs`.
  ReplicaLink* replica_link = nullptr;
  absl::Duration replica_timeout = absl::Seconds(5);
  // How node caches reach the owning daemons (node_cache jobs); null: a
  // gather of another daemon's range is refused as in other jobs.
  PeerChannels* peer_gather = nullptr;
  absl::Time start;
  std::atomic<bool> draining{false};
  // gRPC's health service of this daemon's server (set once it is built;
  // null before): Drain sets it NOT_SERVING.
  std::atomic<grpc::HealthCheckServiceInterface*> health{nullptr};
  // The same for the health-only server (DaemonOptions::health_listen), or null.
  std::atomic<grpc::HealthCheckServiceInterface*> probe_health{nullptr};
  // The admin token's digest; nullopt: no caller has admin authority.
  std::optional<TokenDigest> admin;
  // Bytes on disk the checkpoints of one identity's jobs may take on this
  // daemon (--max_checkpoint_bytes_per_identity); 0: no bound.
  uint64_t max_checkpoint_bytes_per_identity = 0;
  // The registration token's digest; nullopt: any caller may create jobs.
  std::optional<TokenDigest> registration;
  // Whether the daemon serves mutual TLS (DaemonOptions::tls): only then do
  // services demand roles of the callers' certificates (peer_role.h).
  bool tls = false;
  // Ends streams whose peer stopped (--stream_idle_timeout_seconds); null:
  // none (streams wait for as long as their deadline allows).
  StreamWatchdog* stream_watchdog = nullptr;
  // Calls in flight per caller (--max_calls_per_caller); CallerToken refuses
  // a call past the limit. Null: unbounded (services built without a
  // daemon's server).
  CallerCalls* caller_calls = nullptr;

  // Counts the request under its RPC name and result code.
  grpc::Status Done(const char* rpc, const absl::Status& status);

  // Authority (docs/security.md). Each reads the caller's bearer token from
  // `call`'s metadata.
  // The job `id`, if the caller's token opens it (the job's token or the
  // admin token): Unauthenticated without a token, NotFound for no such
  // job, PermissionDenied for another token.
  // Replicated jobs: the copy of the replica group the call's metadata
  // names (common/channel.h; none: the home copy), which must serve the
  // group at the call's epoch (Job::CheckServing) unless `serving` is false
  // (reads: the step state, the partition map). A serving request of a
  // replicated job without that metadata is FailedPrecondition.
  absl::StatusOr<std::shared_ptr<Job>> FindJob(const grpc::ServerContext& call,
                                               const std::string& id, bool serving = true) const;
  // The copy of replica group `group`, whatever its role (the Replica
  // service), with the same token check.
  absl::StatusOr<std::shared_ptr<Job>> FindCopy(const grpc::ServerContext& call,
                                                const std::string& id, uint32_t group) const;
  // OK for the admin token; Unauthenticated / PermissionDenied otherwise.
  absl::Status RequireAdmin(const grpc::ServerContext& call) const;
  // Checkpoints of job `id` on disk: the job's token while it is registered
  // here, the admin token always.
  absl::Status AuthorizeJobFiles(const grpc::ServerContext& call, const std::string& id) const;
  // Checkpoint files belong to the token of the job that first saved them
  // (kCheckpointOwnerFile). OK when there are none (or no checkpoint_dir),
  // or `token` is their owner or the admin; PermissionDenied otherwise.
  // `job_id` must be a valid id.
  absl::Status CheckFilesOwner(const std::string& job_id, const TokenDigest& token) const;
  // Before `job` saves: records its token as the owner of its files, or
  // checks it is (CheckFilesOwner), and records its registrant's identity
  // for the checkpoint quota (kCheckpointIdentityFile) unless one is.
  absl::Status ClaimFiles(const Job& job) const;
  // Before `job` saves: ResourceExhausted when its checkpoint's bytes would
  // take the checkpoints of the identity its files count toward (recorded
  // in them, else its registrant's) past
  // max_checkpoint_bytes_per_identity. Walks the checkpoint directory.
  absl::Status CheckCheckpointQuota(const Job& job) const;
  // Before `job` saves: ClaimFiles, then CheckCheckpointQuota, on
  // checkpoint_disk (Unavailable when its disk does not answer in time).
  absl::Status PrepareSave(const Job& job) const;
  // Runs `fn` on checkpoint_disk (on this thread without one). `fn` must
  // own what it uses: after a timeout it may still run, with nobody waiting.
  absl::Status OnCheckpointDisk(std::function<absl::Status()> fn) const {
    return checkpoint_disk == nullptr ? fn() : checkpoint_disk->Run(std::move(fn));
  }
  template <typename T>
  absl::StatusOr<T> OnCheckpointDisk(std::function<absl::StatusOr<T>()> fn) const {
    if (checkpoint_disk == nullptr) return fn();
    return checkpoint_disk->Call<T>(std::move(fn));
  }
  // Whether the caller may create a job: always without a registration
  // token; with one, when it presented it (kRegistrationMetadataKey) or its
  // bearer token `caller` is the admin's.
  bool MayCreateJobs(const grpc::ServerContext& call, const TokenDigest& caller) const;
  // Who registers a job, for JobManager::Register: whether it may create
  // one (MayCreateJobs) and the identity its quotas count against: "admin"
  // (exempt) for the admin token; under mutual TLS the client certificate,
  // "cert:" and its subject; otherwise "registration token" when the
  // deployment's registration token was presented (every holder of it is
  // one identity), and "anonymous" on a daemon that asks for none.
  JobManager::Registrant RegistrantOf(const grpc::ServerContext& call,
                                      const TokenDigest& caller) const;
  // Whether the caller's token opens `job` (for the all-jobs views).
  bool MayOpen(const grpc::ServerContext& call, const Job& job) const;
  // The caller's token's digest: Unauthenticated naming `what` without one.
  absl::StatusOr<TokenDigest> CallerToken(const grpc::ServerContext& call,
                                          absl::string_view what) const;

  // Streams whose messages name their job. Before a client-streaming
  // handler reads anything: OK when the call's token opens some job on this
  // daemon or is the admin's; Unauthenticated without a usable token,
  // NotFound for a token that opens nothing here (its job is not registered
  // here: a primary re-registers its job on a restarted backup on
  // NotFound). The job the first message names is then checked as usual
  // (FindJob).
  absl::Status CheckStreamCaller(const grpc::ServerContext& call, absl::string_view rpc) const;
  // A watch over `call`'s reads and writes (stream_watchdog); one that does
  // nothing without a watchdog.
  std::unique_ptr<StreamWatch> WatchStream(grpc::ServerContext* call) const;
  // What a handler returns when its watch expired.
  absl::Status IdleStreamError(absl::string_view what) const;
};

class StreamBooking;  // server/rpc/shard_service.cc

class ControlService final : public v1::Control::Service {
 public:
  explicit ControlService(ServiceContext* context) : ctx_(context) {}
  grpc::Status RegisterJob(grpc::ServerContext*, const v1::RegisterJobRequest* req,
                           v1::RegisterJobResponse* resp) override;
  grpc::Status JoinJob(grpc::ServerContext*, const v1::JoinJobRequest* req,
                       v1::JoinJobResponse* resp) override;
  grpc::Status GetPartitionMap(grpc::ServerContext*, const v1::GetPartitionMapRequest* req,
                               v1::PartitionMap* resp) override;
  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest* req,
                         v1::HeartbeatResponse* resp) override;
  grpc::Status Leave(grpc::ServerContext*, const v1::LeaveRequest* req,
                     v1::LeaveResponse* resp) override;
  grpc::Status Drain(grpc::ServerContext*, const v1::DrainRequest*,
                     v1::DrainResponse* resp) override;

 private:
  ServiceContext* const ctx_;
};

class ShardService final : public v1::Shard::Service {
 public:
  explicit ShardService(ServiceContext* context) : ctx_(context) {}
  grpc::Status InitParameters(grpc::ServerContext* ctx,
                              grpc::ServerReader<v1::ParameterChunk>* reader,
                              v1::InitParametersResponse* resp) override;
  grpc::Status PushGradient(grpc::ServerContext* ctx,
                            grpc::ServerReader<v1::GradientChunk>* reader,
                            v1::PushGradientResponse* resp) override;
  grpc::Status Gather(grpc::ServerContext* ctx, const v1::GatherRequest* req,
                      grpc::ServerWriter<v1::ParameterChunk>* writer) override;
  grpc::Status PrepareStep(grpc::ServerContext*, const v1::PrepareStepRequest* req,
                           v1::PrepareStepResponse* resp) override;
  grpc::Status CommitStep(grpc::ServerContext*, const v1::CommitStepRequest* req,
                          v1::CommitStepResponse* resp) override;
  grpc::Status GetStepState(grpc::ServerContext*, const v1::GetStepStateRequest* req,
                            v1::StepState* resp) override;
  grpc::Status ExchangeEndpoint(grpc::ServerContext*, const v1::ExchangeEndpointRequest* req,
                                v1::ExchangeEndpointResponse* resp) override;
  grpc::Status FenceStagingSlot(grpc::ServerContext*, const v1::FenceStagingSlotRequest* req,
                                v1::FenceStagingSlotResponse* resp) override;
  grpc::Status MapPushMemory(grpc::ServerContext*, const v1::MapPushMemoryRequest* req,
                             v1::MapPushMemoryResponse* resp) override;
  grpc::Status ReadState(grpc::ServerContext* ctx, const v1::ReadStateRequest* req,
                         grpc::ServerWriter<v1::StateChunk>* writer) override;
  grpc::Status WriteState(grpc::ServerContext* ctx, grpc::ServerReader<v1::StateChunk>* reader,
                          v1::WriteStateResponse* resp) override;

 private:
  absl::Status DoPush(grpc::ServerContext* ctx, grpc::ServerReader<v1::GradientChunk>* reader,
                      v1::PushGradientResponse* resp);
  absl::Status DoGather(grpc::ServerContext* ctx, const v1::GatherRequest& req,
                        grpc::ServerWriter<v1::ParameterChunk>* writer);
  // A streamed gather of a node_cache job's range that is not all this
  // daemon's: its own part from the step engine, the others from the job's
  // node cache (filled from the owners once per step), or straight from
  // the owners for an older step than the cache's or when the ledger has no
  // room for a copy. Every chunk is of the step committed here when the
  // request was served (ABORTED when a part is found at another).
  // `deadline` bounds the wait for this daemon's commit (wait_ms); the
  // fetches take up to the call's deadline.
  absl::Status GatherThroughNodeCache(grpc::ServerContext* ctx, const v1::GatherRequest& req,
                                      Job& job, const FlatRange& range, DType dtype,
                                      absl::Time deadline, uint64_t chunk_elements,
                                      grpc::ServerWriter<v1::ParameterChunk>* writer);
  // The staging of the rank process ExchangeEndpoint served (the caller's
  // credentials checked for the job), and the job when `job` is non-null.
  absl::StatusOr<std::shared_ptr<RankStaging>> ExchangedStaging(const grpc::ServerContext& call,
                                                                const std::string& job_id,
                                                                uint32_t rank,
                                                                uint64_t incarnation,
                                                                std::shared_ptr<Job>* job = nullptr);
  absl::Status DoExchangeEndpoint(const grpc::ServerContext& call,
                                  const v1::ExchangeEndpointRequest& req,
                                  v1::ExchangeEndpointResponse* resp);
  // Reads a whole client stream of RPC `rpc`: nothing before the call's
  // token passed CheckStreamCaller; the first chunk names the job (whose
  // token the caller must present), later chunks must name the same one (or
  // none). The bytes held are bounded (per chunk too) and booked in
  // `booking`. A stream the client abandons yields Cancelled, one idle past
  // the watchdog's limit DeadlineExceeded, and nothing is applied.
  template <typename Chunk>
  absl::Status ReadStream(const char* rpc, grpc::ServerContext* ctx,
                          grpc::ServerReader<Chunk>* reader,
                          std::vector<Chunk>* chunks, std::shared_ptr<Job>* job,
                          StreamBooking* booking);

  ServiceContext* const ctx_;
};

class AdminService final : public v1::Admin::Service {
 public:
  explicit AdminService(ServiceContext* context) : ctx_(context) {}
  grpc::Status MemoryReport(grpc::ServerContext*, const v1::MemoryReportRequest* req,
                            v1::MemoryReportResponse* resp) override;
  grpc::Status Status(grpc::ServerContext*, const v1::StatusRequest*,
                      v1::StatusResponse* resp) override;
  grpc::Status Estimate(grpc::ServerContext*, const v1::EstimateRequest* req,
                        v1::EstimateResponse* resp) override;

 private:
  ServiceContext* const ctx_;
};

// Replicated partitions (proto/zeroshard/v1/replica.proto): the backup's
// side of its primary's calls, promotion, and the placement view. A stream
// handler holds one chunk at a time besides what the job books for it.
class ReplicaService final : public v1::Replica::Service {
 public:
  explicit ReplicaService(ServiceContext* context) : ctx_(context) {}
  grpc::Status GetReplicaState(grpc::ServerContext* ctx, const v1::GetReplicaStateRequest* req,
                               v1::ReplicaState* resp) override;
  grpc::Status Promote(grpc::ServerContext* ctx, const v1::PromoteRequest* req,
                       v1::ReplicaState* resp) override;
  grpc::Status TransferState(grpc::ServerContext* ctx,
                             grpc::ServerReader<v1::ReplicaStateChunk>* reader,
                             v1::TransferStateResponse* resp) override;
  grpc::Status ForwardGradient(grpc::ServerContext* ctx,
                               grpc::ServerReader<v1::ForwardedGradientChunk>* reader,
                               v1::ForwardGradientResponse* resp) override;
  grpc::Status CommitReplica(grpc::ServerContext* ctx, const v1::CommitReplicaRequest* req,
                             v1::CommitStepResponse* resp) override;
  grpc::Status ReleaseReplica(grpc::ServerContext* ctx, const v1::ReleaseReplicaRequest* req,
                              v1::ReleaseReplicaResponse* resp) override;

 private:
  // Whether the caller may promote a backup whose primary still serves: the
  // admin token, or under mutual TLS a daemon or admin certificate.
  bool MayReplaceLivePrimary(const grpc::ServerContext& call) const;
  absl::Status FillState(const grpc::ServerContext& call, const std::string& id,
                         v1::ReplicaState* out);

  ServiceContext* const ctx_;
};

// Checkpoints (proto/zeroshard/v1/checkpoint.proto). Disk I/O runs on the
// handler's thread with no lock another request needs; a status request
// waits at most its wait_ms, ending before its deadline.
class CheckpointService final : public v1::Checkpoint::Service {
 public:
  explicit CheckpointService(ServiceContext* context) : ctx_(context) {}
  grpc::Status SaveCheckpoint(grpc::ServerContext*, const v1::SaveCheckpointRequest* req,
                              v1::SaveCheckpointResponse* resp) override;
  grpc::Status GetCheckpointStatus(grpc::ServerContext* context,
                                   const v1::GetCheckpointStatusRequest* req,
                                   v1::CheckpointStatus* resp) override;
  grpc::Status CompleteCheckpoint(grpc::ServerContext*, const v1::CompleteCheckpointRequest* req,
                                  v1::CompleteCheckpointResponse* resp) override;
  grpc::Status LoadCheckpoint(grpc::ServerContext*, const v1::LoadCheckpointRequest* req,
                              v1::LoadCheckpointResponse* resp) override;
  grpc::Status ListCheckpoints(grpc::ServerContext*, const v1::ListCheckpointsRequest* req,
                               v1::ListCheckpointsResponse* resp) override;
  grpc::Status VerifyCheckpoint(grpc::ServerContext*, const v1::VerifyCheckpointRequest* req,
                                v1::VerifyCheckpointResponse* resp) override;

  // Before a primary copy of an idle job is removed (JobManager::Options::
  // before_idle_removal), with --checkpoint_dir: starts the save of its part
  // of checkpoint "idle-step-<committed step>" (kIdleCheckpointPrefix)
  // unless a complete checkpoint of that step exists, and answers false
  // (keep the job) while it writes; once written, writes the MANIFEST too
  // when the job has one daemon, and answers true (remove it). Does not
  // wait for the write, except for a job on --state_dir, whose save writes
  // before it returns (CheckpointAgent::Save). Failures are logged and
  // answer true; so does a save still writing 30 min after the first pass
  // that asked about the job.
  bool SaveBeforeIdleRemoval(const std::shared_ptr<Job>& job);

 private:
  // When SaveBeforeIdleRemoval first asked about `job` (now, the first time).
  absl::Time IdleSince(const std::shared_ptr<Job>& job);
  void ForgetIdle(const Job& job);

  ServiceContext* const ctx_;
  struct IdleEntry {
    std::weak_ptr<Job> job;
    absl::Time since;
  };
  absl::Mutex idle_mu_;
  std::map<const Job*, IdleEntry> idle_since_ ABSL_GUARDED_BY(idle_mu_);
};

// Activation checkpoints (proto/zeroshard/v1/activation.proto) over the
// ActivationStore. Every request names its owner, a joined rank of a job
// registered here, as its current incarnation. Handlers wait only for the
// store (room in the arena, a read-back from a spill file), until the
// request's deadline or kMaxActivationWait, whichever is first; a stream
// handler copies each chunk into the arena with no lock held.
class ActivationService final : public v1::Activation::Service {
 public:
  explicit ActivationService(ServiceContext* context) : ctx_(context) {}
  grpc::Status ReserveActivation(grpc::ServerContext* ctx, const v1::ReserveActivationRequest* req,
                                 v1::ActivationPlacement* resp) override;
  grpc::Status CommitActivation(grpc::ServerContext*, const v1::CommitActivationRequest* req,
                                v1::ActivationStored* resp) override;
  grpc::Status OffloadActivation(grpc::ServerContext* ctx,
                                 grpc::ServerReader<v1::ActivationChunk>* reader,
                                 v1::ActivationStored* resp) override;
  grpc::Status LocateActivation(grpc::ServerContext* ctx, const v1::LocateActivationRequest* req,
                                v1::ActivationPlacement* resp) override;
  grpc::Status FetchActivation(grpc::ServerContext* ctx, const v1::FetchActivationRequest* req,
                               grpc::ServerWriter<v1::ActivationChunk>* writer) override;
  grpc::Status PrefetchActivations(grpc::ServerContext* ctx,
                                   const v1::PrefetchActivationsRequest* req,
                                   v1::PrefetchActivationsResponse* resp) override;
  grpc::Status FreeActivations(grpc::ServerContext*, const v1::FreeActivationsRequest* req,
                               v1::FreeActivationsResponse* resp) override;

  // The longest a request waits inside the daemon, whatever its deadline.
  static constexpr absl::Duration kMaxActivationWait = absl::Seconds(60);

 private:
  // The owner as the store knows it: FAILED_PRECONDITION without an arena,
  // NOT_FOUND for a job not registered here, and the rank check's errors
  // (Job::CheckRank) naming owner.rank / owner.incarnation.
  absl::StatusOr<SliceOwner> Owner(const grpc::ServerContext& call,
                                   const v1::ActivationOwner& owner, bool has_owner);
  absl::Status DoReserve(grpc::ServerContext* ctx, const v1::ReserveActivationRequest& req,
                         v1::ActivationPlacement* resp);
  absl::Status DoCommit(const grpc::ServerContext& call, const v1::CommitActivationRequest& req,
                        v1::ActivationStored* resp);
  absl::Status DoOffload(grpc::ServerContext* ctx, grpc::ServerReader<v1::ActivationChunk>* reader,
                         v1::ActivationStored* resp);
  absl::Status DoLocate(grpc::ServerContext* ctx, const v1::LocateActivationRequest& req,
                        v1::ActivationPlacement* resp);
  absl::Status DoFetch(grpc::ServerContext* ctx, const v1::FetchActivationRequest& req,
                       grpc::ServerWriter<v1::ActivationChunk>* writer);
  absl::Status DoPrefetch(grpc::ServerContext* ctx, const v1::PrefetchActivationsRequest& req,
                          v1::PrefetchActivationsResponse* resp);
  absl::Status DoFree(const grpc::ServerContext& call, const v1::FreeActivationsRequest& req,
                      v1::FreeActivationsResponse* resp);

  ServiceContext* const ctx_;
};

}  // namespace zeroshard
