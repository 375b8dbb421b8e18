#pragma once

// zeroshardd's process: options, the bulk transport, the job manager, and
// the gRPC services (server/rpc/services.h) over them. The optimizer step runs on
// the daemon's ShardOptimizer threads, which the committing handler joins.

#include <atomic>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/keepalive.h"
#include "common/protocol.h"
#include "common/tls.h"
#include "grpcpp/grpcpp.h"
#include "metrics/http_server.h"
#include "prometheus/registry.h"
#include "server/activation/activation_metrics.h"
#include "server/activation/activation_store.h"
#include "server/activation/arena_tenancy.h"
#include "server/disk/disk_worker.h"
#include "server/disk/instance_directory.h"
#include "server/metrics/daemon_metrics.h"
#include "server/job/job_manager.h"
#include "server/ledger/memory_ledger.h"
#include "server/optimizer/optimizer.h"
#include "transport/transport.h"

namespace zeroshard {

// zeroshardd's optimizer threads with --optimizer_threads=0 (its default):
// the CPUs this process may use (UsableCpus(), server/ledger/system_resources.h),
// at most 256.
int DefaultOptimizerThreads();

class ReplicaLink;

// The least --rpc_memory_bytes: two messages of the largest size.
inline constexpr uint64_t kMinRpcMemoryBytes = 2 * static_cast<uint64_t>(kMaxGrpcMessageBytes);
// --rpc_memory_bytes=auto: an eighth of the memory limit, within
// [kMinRpcMemoryBytes, 1 GiB] (1 GiB without a limit).
uint64_t AutoRpcMemoryBytes(uint64_t memory_limit_bytes);

struct DaemonOptions {
  std::string listen = "127.0.0.1:0";  // HOST:PORT; port 0 picks a free one
  uint64_t memory_limit_bytes = 0;     // 0 = unlimited
  int optimizer_threads = 1;
  // CPUs the optimizer threads are pinned to, one each
  // (ShardOptimizer::Options::cpus; --optimizer_cpus): as many as
  // optimizer_threads, each in this process's affinity mask. Empty: unpinned.
  std::vector<int> optimizer_cpus;
  uint64_t max_chunk_bytes = 4ull << 20;  // gather chunk size
  std::string version = "dev";
  // HOST:PORT of the Prometheus /metrics endpoint; empty = off; port 0 picks.
  std::string metrics_listen;
  // HOST:PORT of a second gRPC server, always plaintext, that serves only
  // grpc.health.v1.Health (SERVING until Drain or Shutdown, like the main
  // server's): for probes that cannot present a client certificate, such as
  // the kubelet's gRPC probe against a daemon serving mutual TLS. It answers
  // nothing but the serving status. Empty = none; port 0 picks.
  std::string health_listen;
  // The bulk transport served to trainers ("ucx", "grpc" or "inproc"; empty:
  // none, only the streaming RPCs): created at start (a failure is logged and
  // leaves the streaming path only), job parameters and staging regions are
  // allocated through it, and ExchangeEndpoint hands out its regions.
  // zeroshardd uses "ucx" by default (--bulk_transport).
  std::string bulk_transport;
  // UCX_TLS for a "ucx" bulk transport; empty = UCX's choice.
  std::string ucx_tls;
  // HOST:PORT a "grpc" bulk transport serves regions on
  // (--bulk_listen_address); empty: `listen`'s host, any free port.
  std::string bulk_listen;
  // The host trainers and other daemons dial for a "grpc" bulk transport
  // (--advertise_address): ExchangeEndpoint's and a replica transfer's
  // worker_address carry it in place of the bulk listen host. Empty: that
  // host, or, when it is a wildcard, this machine's primary address
  // (transport/host_address.h); Start fails with FailedPrecondition when
  // there is none. InvalidArgument with any other bulk transport: UCX's
  // worker address lists the interfaces UCX itself chose.
  std::string advertise_address;
  // A removed job's memory stays mapped this long after it last handed out
  // remote access (trainers finish their reads within it).
  absl::Duration read_lease = absl::Seconds(30);
  // A joined rank not heard from this long no longer counts as connected.
  absl::Duration rank_timeout = absl::Seconds(30);
  // A registered job no rank joins within this is removed (zero: never).
  absl::Duration join_timeout = absl::Minutes(2);
  // A joined job no rank is heard from within this is removed (zero: never;
  // JobManager::Options::job_idle_timeout).
  absl::Duration job_idle_timeout = absl::Hours(1);
  // A peer daemon silent this long (no answer to HTTP/2 keepalive pings,
  // common/keepalive.h) fails the replica link's and the node cache's calls
  // in flight to it, and a primary calls its silent backup again only once
  // it answers a probe (--liveness_timeout_seconds; 0: off, else >= 2 s).
  absl::Duration liveness_timeout = kDefaultLivenessTimeout;
  // Out-of-order gradient contributions each job may buffer (booked as
  // `buffer`); pushes past it wait.
  uint64_t reduction_buffer_bytes = 256ull << 20;
  // Slots in each rank's staging region (each one bucket, at most 64 MiB and
  // at most the daemon's share of the parameters in fp32): how many of a
  // rank's pushes this daemon may hold at once (--staging_slots, 1..64).
  uint32_t staging_slots = 4;
  // Daemon reduction: how long a staged push of the last micro-batch may be
  // held in its slot for its range's other contributions
  // (--reduction_hold_ms; 0: never).
  absl::Duration reduction_hold = absl::Milliseconds(50);
  // Where checkpoints are written and read (created if missing); empty: the
  // Checkpoint RPCs are refused. Resharding a checkpoint across daemons
  // needs every part readable here: a shared filesystem, or copies.
  std::string checkpoint_dir;
  // The longest a request handler waits for a call on checkpoint_dir (an
  // owner file, the quota walk, a listing, a manifest): past it the request
  // is answered UNAVAILABLE naming the directory, and while that call has
  // not returned every other is refused at once, so a hung disk stalls a
  // save for at most this long and holds no handler thread. The same bound
  // for spill writes under spill_dir that make no progress
  // (ActivationStore::Options::disk_timeout). (--disk_timeout_seconds; > 0.)
  absl::Duration disk_timeout = absl::Seconds(10);
  // Activation checkpoints (the Activation service): an arena of this many
  // bytes, allocated and booked in the ledger at start (through the bulk
  // transport when there is one). 0: no arena, and the Activation RPCs are
  // refused with FAILED_PRECONDITION. zeroshardd's --activation_arena_bytes
  // defaults to 256 MiB; embedders and tests opt in here.
  uint64_t activation_arena_bytes = 0;
  // Where slices that do not fit the arena are spilled (created if missing;
  // spill files of daemons killed earlier are removed at start); empty: no
  // spilling.
  std::string spill_dir;
  // Bytes of spill files at most (with spill_dir).
  uint64_t spill_bytes = 4ull << 30;
  // Model states beyond RAM (ZeRO-Infinity's NVMe offload): with a
  // state_dir (local NVMe; created if missing, 0700; state files of daemons
  // killed earlier are removed at start), a job's fp32 masters and optimizer
  // moments stay in RAM while every RAM-resident job's fit in
  // state_memory_bytes, and live in a file there otherwise (server/step/
  // shard_state.h). Replicated jobs stay in RAM. Empty: all in RAM.
  std::string state_dir;
  uint64_t state_memory_bytes = 0;
  // With state_dir: a disk-resident job's gradient accumulator too, as a
  // file mapping there that the kernel writes back and evicts under memory
  // pressure (server/disk/mapped_file.h): RAM keeps the half copy alone.
  bool state_gradients = false;
  // With state_dir: the bytes every job's files there may take together
  // (a job that would pass it is refused with RESOURCE_EXHAUSTED); 0: as
  // much as the disk holds (each file's blocks are allocated when its job
  // registers, so a full disk refuses the job then).
  uint64_t state_disk_limit_bytes = 0;
  // Elements per chunk of a state file (a multiple of 1024; tests use small
  // ones to cut a small model into many chunks).
  uint64_t state_chunk_elements = DiskResidence{}.chunk_elements;

  // How this daemon's primaries reach their backups; null: over gRPC with
  // `tls` (tests put a link of their own here; it must outlive the daemon).
  ReplicaLink* replica_link = nullptr;

  // Security (docs/security.md).
  // Mutual TLS for the gRPC services (and a "grpc" bulk transport): all three
  // files, or none for plaintext.
  TlsFiles tls;
  // Plaintext on an address other hosts can reach is refused at start
  // unless this is set.
  bool insecure = false;
  // The secret that opens every job, Admin.Drain and the all-jobs views;
  // empty: no caller has that authority.
  std::string admin_token;
  // The secret a RegisterJob that creates a job must carry (or the admin
  // token); empty: any caller may create jobs.
  std::string registration_token;
  // Start a "ucx" bulk transport even where a peer can reach memory of the
  // daemon that no key it was given names (tcp, where UCX emulates remote
  // access in software; RDMA, where UCX also serves keyless put and get
  // messages; UCX's own choice: ucx_tls empty). Without it, the bulk
  // transport starts only where it enforces remote keys (transport::
  // Transport::enforces_remote_keys(); "ucx": ucx_tls names shared-memory
  // transports alone, and UCX selected only such); otherwise the daemon
  // serves the streaming RPCs only (logged, and ExchangeEndpoint says why).
  bool ucx_trust_peers = false;
  // Jobs registered at once, at most (RESOURCE_EXHAUSTED past it).
  uint32_t max_jobs = 64;
  // Quotas per identity (server/rpc/services.h RegistrantOf): jobs one
  // identity may have registered at once (0: only max_jobs), and bytes its
  // jobs may hold together (0: only memory_limit_bytes).
  uint32_t max_jobs_per_identity = 32;
  uint64_t max_memory_per_identity = 0;
  // Bytes the checkpoints of one identity's jobs may take in checkpoint_dir
  // (0: no bound): a save past it is RESOURCE_EXHAUSTED.
  uint64_t max_checkpoint_bytes_per_identity = 0;
  // Bytes gRPC may hold for messages it is receiving, over all connections
  // (--rpc_memory_bytes; grpc::ResourceQuota's memory): a message is held
  // whole before its handler sees it, so this bounds what callers can make
  // the daemon hold outside the jobs' bookings. Past it gRPC resets streams
  // (the caller sees RESOURCE_EXHAUSTED). Booked whole at start as the
  // daemon's own `buffer` (MemoryLedger entry kDaemonLedgerEntry); at least
  // kMinRpcMemoryBytes. 0: unbounded, nothing booked.
  uint64_t rpc_memory_bytes = 0;
  // Threads of the gRPC server, at most (--max_rpc_threads): one serves each
  // request in flight, and a request past them is answered
  // RESOURCE_EXHAUSTED at once. Streams are only read after their token
  // opened a job here, so callers without one hold no thread.
  int max_rpc_threads = 256;
  // Calls one caller (the bearer token of its calls) may have in flight at
  // once (--max_calls_per_caller); a call past it is answered
  // RESOURCE_EXHAUSTED before anything is read (server/rpc/caller_calls.h).
  // 0: max_rpc_threads - kRpcThreadsKeptForOthers, so that the operator's
  // calls and another job's find threads whatever one job's token holder
  // does.
  int max_calls_per_caller = 0;
  // A connection that has not completed its handshake (TCP accepted, TLS
  // and the HTTP/2 preface not done) within this is closed, so that peers
  // which connect and send nothing hold a file descriptor only this long.
  absl::Duration handshake_timeout = absl::Seconds(10);
  // A connection without a call for this long is closed (its client
  // reconnects when it calls again).
  absl::Duration connection_idle_timeout = absl::Minutes(10);
  // A stream whose peer sends (or reads) nothing for this long is cancelled
  // (--stream_idle_timeout_seconds): a stalled trainer holds no thread,
  // reservation or activation slice past it.
  absl::Duration stream_idle_timeout = absl::Seconds(60);
};

// Threads of --max_rpc_threads that one caller cannot take by default.
inline constexpr int kRpcThreadsKeptForOthers = 16;

struct ServiceContext;
class StreamWatchdog;
class CallerCalls;
class PeerChannels;
class ControlService;
class ShardService;
class AdminService;
class CheckpointService;
class ActivationService;
class ReplicaService;

class Daemon {
 public:
  // Binds `options.listen` and starts serving. InvalidArgument for bad
  // options, Unavailable when the address cannot be bound,
  // FailedPrecondition when a "grpc" bulk transport on a wildcard has no
  // address to advertise (DaemonOptions::advertise_address).
  static absl::StatusOr<std::unique_ptr<Daemon>> Start(const DaemonOptions& options);
  ~Daemon();

  // The bound port and "HOST:PORT" with it.
  int port() const { return port_; }
  // The bound /metrics port, or 0 when metrics are off.
  int metrics_port() const;
  // The bound health-only port (DaemonOptions::health_listen), or 0.
  int health_port() const { return health_port_; }
  const std::string& address() const { return address_; }

  // Stops accepting RPCs and waits up to `grace` for those in flight, then
  // cancels the rest. Idempotent.
  void Shutdown(absl::Duration grace);
  // Blocks until Shutdown has completed.
  void Wait();

  JobManager& jobs() { return *jobs_; }
  MemoryLedger& ledger() { return ledger_; }
  // Calls in flight per caller (--max_calls_per_caller).
  const CallerCalls& caller_calls() const { return *caller_calls_; }
  // The bulk transport served, or null (see DaemonOptions::bulk_transport).
  transport::Transport* bulk_transport() const { return transport_.get(); }
  // The activation store, or null (DaemonOptions::activation_arena_bytes 0).
  ActivationStore* activations() const { return activations_.get(); }
  // What /metrics serves (metrics/metric_names.h).
  const prometheus::Registry& registry() const { return registry_; }

 private:
  explicit Daemon(const DaemonOptions& options);
  // The parts of Start, in its order (each with the parts before it built).
  absl::Status StartActivations();  // the activation store
  void StartJobs();                 // the job manager and what jobs borrow
  void StartServices(const std::string& bulk_error);  // the gRPC services' context
  absl::Status StartGrpcServers();  // the main server and the health-only one

  // Declaration order is destruction order in reverse: jobs release ledger
  // bytes, which update metrics, which live in the registry.
  DaemonOptions options_;
  prometheus::Registry registry_;
  MemoryLedger ledger_;
  DaemonMetrics metrics_;
  ActivationMetrics activation_metrics_;
  std::unique_ptr<transport::Transport> transport_;  // null: streaming RPCs only
  // Outlives the jobs, whose removal frees their activations in it.
  std::unique_ptr<ActivationStore> activations_;
  ArenaTenancy arena_tenancy_;  // outlives the jobs, whose removal returns the arena key
  std::unique_ptr<ShardOptimizer> optimizer_;
  // Outlive the jobs, whose state files and budget they are.
  std::unique_ptr<InstanceDirectory> state_dir_;  // null without --state_dir
  std::unique_ptr<ByteBudget> state_memory_;
  std::unique_ptr<ByteBudget> state_disk_limit_;  // null: no --state_disk_limit
  std::unique_ptr<ReplicaLink> replica_link_;  // before jobs_: they use it
  std::unique_ptr<PeerChannels> peer_gather_;  // node caches' reads from the owners
  std::unique_ptr<JobManager> jobs_;
  std::unique_ptr<StreamWatchdog> stream_watchdog_;  // null: no stream idle timeout
  std::unique_ptr<CallerCalls> caller_calls_;         // outlives server_
  // Null without --checkpoint_dir. A call stuck on a hung disk at shutdown
  // is left to finish when the disk answers (the process is ending).
  std::unique_ptr<DiskWorker> checkpoint_disk_;
  std::unique_ptr<ServiceContext> context_;
  std::unique_ptr<ControlService> control_;
  std::unique_ptr<ShardService> shard_;
  std::unique_ptr<AdminService> admin_;
  std::unique_ptr<CheckpointService> checkpoint_;
  std::unique_ptr<ActivationService> activation_;
  std::unique_ptr<ReplicaService> replica_;
  std::unique_ptr<metrics::MetricsHttpServer> http_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<grpc::Server> health_server_;  // null: no health_listen
  int port_ = 0;
  int health_port_ = 0;
  std::string address_;
  std::atomic<bool> shut_down_{false};
};

}  // namespace zeroshard
