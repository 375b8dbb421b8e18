#include "server/daemon.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/checkpoint_files.h"
#include "common/job_spec.h"
#include "common/keepalive.h"
#include "common/protocol.h"
#include "common/status_macros.h"
#include "common/tls.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/resource_quota.h"
#include "server/rpc/grpc_replica_link.h"
#include "server/rpc/services.h"
#include "server/status_page.h"
#include "server/ledger/system_resources.h"
#include "transport/host_address.h"

namespace zeroshard {

int DefaultOptimizerThreads() { return std::min(UsableCpus(), 256); }

namespace {

// Threads of the gRPC server that, after answering a request, keep waiting
// for the next one instead of exiting (gRPC's default keeps 2). Long polls
// (GetStepState, Gather waiting for a commit) and held pushes occupy a thread
// each until they are answered; with the default, the threads the server
// starts for a step's requests exit as soon as they are answered and are
// started again for the next step (ranks_bench: about 25 threads a step at
// 16 ranks, 100 at 64). Idle threads above gRPC's minimum still exit after
// its completion-queue timeout (10 s).
constexpr int kRpcThreadsKeptPolling = 256;

// Calls one connection may have open at once. A trainer's channel carries
// its prefetched gathers, its pushes in flight and its control calls: a few
// dozen.
constexpr int kMaxStreamsPerConnection = 256;

void Log(const std::string& line) { std::fprintf(stderr, "zeroshardd: %s\n", line.c_str()); }

// The path of a --listen=unix:PATH socket.
std::string SocketPath(const std::string& listen) {
  return listen.substr(sizeof(kUnixSocketPrefix) - 1);
}

// A unix socket is as private as its directory: it must exist, belong to
// this user (or root) and be closed to group and others, so that no other
// user reaches the socket or puts another in its place.
absl::Status CheckSocketDirectory(const std::string& listen) {
  const std::string path = SocketPath(listen);
  const std::string dir = path.substr(0, std::max<size_t>(path.rfind('/'), 1));
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--listen=", listen, ": its directory ", dir, ": ", std::strerror(errno),
        " (create it, mode 0700, owned by the daemon's user)"));
  }
  if (!S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("--listen=", listen, ": ", dir, " is not a directory"));
  }
  if ((st.st_uid != ::geteuid() && st.st_uid != 0) || (st.st_mode & 077) != 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "--listen=%s: the socket's directory %s (owner uid %d, mode %04o) must belong to the "
        "daemon's user and be closed to group and others, or other users could reach the "
        "socket: chmod 700 %s",
        listen, dir, st.st_uid, st.st_mode & 07777, dir));
  }
  // gRPC replaces a socket file it finds: refuse one a live daemon serves.
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd >= 0) {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, path.data(), std::min(path.size(), sizeof(addr.sun_path) - 1));
    const bool served = ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0;
    ::close(fd);
    if (served) {
      return absl::UnavailableError(absl::StrCat(
          "--listen=", listen, ": another process serves this socket (a daemon running?)"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateOptions(const DaemonOptions& o) {
  RETURN_IF_ERROR(ValidateHostPort(o.listen, "--listen"));
  if (o.optimizer_threads < 1 || o.optimizer_threads > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("--optimizer_threads: must be in 1..256, got ", o.optimizer_threads));
  }
  if (!o.optimizer_cpus.empty()) {
    if (o.optimizer_cpus.size() != static_cast<size_t>(o.optimizer_threads)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--optimizer_cpus: ", o.optimizer_cpus.size(), " CPUs for ", o.optimizer_threads,
          " optimizer threads (--optimizer_threads); give one CPU per thread"));
    }
    RETURN_IF_ERROR(CheckCpuList(o.optimizer_cpus, AffinityCpuList(), "--optimizer_cpus"));
  }
  if (o.max_chunk_bytes < 1024 || o.max_chunk_bytes > kMaxChunkBytes) {
    return absl::InvalidArgumentError("max_chunk_bytes: must be in 1 KiB..64 MiB");
  }
  if (!o.bulk_transport.empty()) {
    RETURN_IF_ERROR(TransportKindFromName(o.bulk_transport, "--bulk_transport").status());
  }
  if (o.staging_slots < 1 || o.staging_slots > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("--staging_slots: must be in 1..64, got ", o.staging_slots));
  }
  if (o.reduction_hold < absl::ZeroDuration() || o.reduction_hold > absl::Seconds(60)) {
    return absl::InvalidArgumentError(absl::StrCat("--reduction_hold_ms: must be in 0..60000, got ",
                                                   absl::ToInt64Milliseconds(o.reduction_hold)));
  }
  if (o.read_lease < absl::ZeroDuration() || o.rank_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--read_lease must be >= 0 and --rank_timeout > 0");
  }
  if (o.join_timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--join_timeout_seconds: must be >= 0 (0: never)");
  }
  RETURN_IF_ERROR(ValidateLivenessTimeout(o.liveness_timeout, "--liveness_timeout_seconds"));
  if (o.disk_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--disk_timeout_seconds: must be > 0");
  }
  if (o.job_idle_timeout < absl::ZeroDuration() ||
      (o.job_idle_timeout > absl::ZeroDuration() && o.job_idle_timeout <= o.rank_timeout)) {
    return absl::InvalidArgumentError(
        "--job_idle_timeout_seconds: must be 0 (never) or longer than --rank_timeout_seconds");
  }
  if (!o.spill_dir.empty() && o.activation_arena_bytes == 0) {
    return absl::InvalidArgumentError("--spill_dir: needs an arena (--activation_arena_bytes > 0)");
  }
  if (o.state_dir.empty() && o.state_memory_bytes != 0) {
    return absl::InvalidArgumentError("--state_memory: needs --state_dir");
  }
  if (o.state_dir.empty() && o.state_disk_limit_bytes != 0) {
    return absl::InvalidArgumentError("--state_disk_limit: needs --state_dir");
  }
  if (o.state_dir.empty() && o.state_gradients) {
    return absl::InvalidArgumentError("--state_gradients: needs --state_dir");
  }
  if (!o.spill_dir.empty() && o.spill_bytes == 0) {
    return absl::InvalidArgumentError("--spill_bytes: must be > 0 with --spill_dir");
  }
  RETURN_IF_ERROR(ValidateTlsFiles(o.tls, "--"));
  if (!o.tls.enabled() && !o.insecure && !IsLoopbackAddress(o.listen)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--listen=", o.listen, " is reachable from other machines, and plaintext would let ",
        "anyone there read and change every job: give --tls_cert, --tls_key and --tls_ca ",
        "(mutual TLS, docs/security.md), or --insecure to serve plaintext anyway"));
  }
  if (!o.admin_token.empty()) RETURN_IF_ERROR(ValidateToken(o.admin_token, "--admin_token_file"));
  if (!o.registration_token.empty()) {
    RETURN_IF_ERROR(ValidateToken(o.registration_token, "--registration_token_file"));
  }
  if ((!o.bulk_listen.empty() || !o.advertise_address.empty()) && o.bulk_transport != "grpc") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--bulk_listen_address and --advertise_address apply to --bulk_transport=grpc only, got "
        "--bulk_transport=\"",
        o.bulk_transport, "\" (UCX's worker address lists the interfaces UCX chose)"));
  }
  if (!o.bulk_listen.empty()) {
    RETURN_IF_ERROR(ValidateHostPort(o.bulk_listen, "--bulk_listen_address"));
    if (IsUnixSocketAddress(o.bulk_listen)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--bulk_listen_address=", o.bulk_listen,
          ": the grpc bulk transport listens on TCP (HOST:PORT), not on a unix socket"));
    }
    if (!o.tls.enabled() && !o.insecure && !IsLoopbackAddress(o.bulk_listen)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--bulk_listen_address=", o.bulk_listen,
          " is reachable from other machines, and plaintext would show region keys and bytes "
          "to anyone there: give --tls_cert, --tls_key and --tls_ca, or --insecure"));
    }
  }
  if (!o.advertise_address.empty()) {
    RETURN_IF_ERROR(transport::CanonicalHost(o.advertise_address, "--advertise_address").status());
  }
  if (o.max_jobs < 1) return absl::InvalidArgumentError("--max_jobs: must be >= 1");
  if (o.rpc_memory_bytes != 0 && o.rpc_memory_bytes < kMinRpcMemoryBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--rpc_memory_bytes: must be 0 (unbounded) or at least ", kMinRpcMemoryBytes,
        " (two messages of the largest size), got ", o.rpc_memory_bytes));
  }
  if (o.max_rpc_threads < 4 || o.max_rpc_threads > 65536) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_rpc_threads: must be in 4..65536, got ", o.max_rpc_threads));
  }
  if (o.max_calls_per_caller < 0 || o.max_calls_per_caller > o.max_rpc_threads) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max_calls_per_caller: must be in 1..--max_rpc_threads (", o.max_rpc_threads,
        "), or 0 for all of them but ", kRpcThreadsKeptForOthers, ", got ",
        o.max_calls_per_caller));
  }
  if (o.handshake_timeout < absl::Milliseconds(100) || o.handshake_timeout > absl::Hours(1) ||
      o.connection_idle_timeout < absl::Seconds(1) || o.connection_idle_timeout > absl::Hours(24)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "handshake timeout (", absl::FormatDuration(o.handshake_timeout),
        ") must be in 100ms..1h and connection idle timeout (",
        absl::FormatDuration(o.connection_idle_timeout), ") in 1s..24h"));
  }
  if (o.stream_idle_timeout < absl::Seconds(1) && o.stream_idle_timeout != absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--stream_idle_timeout_seconds: must be >= 1 (0: never), got ",
        absl::FormatDuration(o.stream_idle_timeout)));
  }
  return absl::OkStatus();
}

// Where a "grpc" bulk transport listens (--bulk_listen_address, else
// --listen's host with port 0) and the host it advertises
// (--advertise_address, else the listen host, else for a wildcard this
// machine's primary address). FailedPrecondition when a wildcard leaves no
// address to advertise: peers would be handed one they cannot dial.
absl::Status GrpcBulkAddresses(const DaemonOptions& o, std::string* listen,
                               std::string* advertise) {
  if (IsUnixSocketAddress(o.listen) && o.bulk_listen.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--bulk_transport=grpc listens on TCP: with --listen=", o.listen,
        " give --bulk_listen_address=HOST:PORT (e.g. 127.0.0.1:0)"));
  }
  *listen = !o.bulk_listen.empty() ? o.bulk_listen
                                   : o.listen.substr(0, o.listen.rfind(':')) + ":0";
  *advertise = o.advertise_address;
  const std::string host = listen->substr(0, listen->rfind(':'));
  if (!advertise->empty() || !transport::IsWildcardHost(host)) return absl::OkStatus();
  absl::StatusOr<std::string> primary = transport::PrimaryHostAddress();
  if (!primary.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--bulk_transport=grpc listens on ", *listen, ", a wildcard trainers cannot dial, and ",
        primary.status().message(),
        ": give --advertise_address=HOST, the address trainers reach this machine at"));
  }
  *advertise = *std::move(primary);
  return absl::OkStatus();
}

// The bulk transport the options ask for, or null with *error saying why
// (not asked for, or it did not initialise: the daemon then serves the
// streaming RPCs only, which is logged). A "grpc" one listens on
// `grpc_listen` and advertises `grpc_advertise` (GrpcBulkAddresses).
std::unique_ptr<transport::Transport> CreateBulkTransport(const DaemonOptions& options,
                                                          const std::string& grpc_listen,
                                                          const std::string& grpc_advertise,
                                                          std::string* error) {
  if (options.bulk_transport.empty()) {
    *error = "started without --bulk_transport";
    return nullptr;
  }
  transport::TransportOptions common;
  common.name = absl::StrCat("zeroshardd ", options.listen);
  // Where a forged key would reach any memory of the daemon (UCX over tcp,
  // or UCX's own choice), the transport refuses to start (no listener, no
  // keys) unless every peer that can reach it is trusted.
  common.require_enforced_remote_keys = !options.ucx_trust_peers;
  transport::BackendOptions to;
  to.SetCommon(common);
  to.ucx.tls = options.ucx_tls;
  to.grpc.tls = options.tls;
  to.grpc.listen_address = grpc_listen;
  to.grpc.advertise_host = grpc_advertise;
  absl::StatusOr<std::unique_ptr<transport::Transport>> t =
      transport::CreateTransport(options.bulk_transport, to);
  if (t.ok() && !(*t)->enforces_remote_keys()) {
    if (options.ucx_trust_peers) {
      Log(absl::StrCat(options.bulk_transport,
                       " does not enforce remote keys: serving it to the peers "
                       "--ucx_trust_peers trusts"));
    } else {
      t = absl::FailedPreconditionError(
          absl::StrCat(options.bulk_transport, " does not enforce remote keys"));
    }
  }
  if (t.ok()) {
    if (options.bulk_transport == "grpc") {
      Log(absl::StrCat("grpc bulk transport on ", to.grpc.listen_address, ", advertised as ",
                       (*t)->LocalAddress()));
    }
    return *std::move(t);
  }
  if (absl::IsFailedPrecondition(t.status()) && options.bulk_transport == "ucx") {
    *error = absl::StrCat("UCX is not started with --ucx_tls=\"", options.ucx_tls, "\": ",
                          t.status().message(),
                          "; give --ucx_tls naming shared-memory transports only, or "
                          "--ucx_trust_peers on a trusted network (docs/security.md)");
  } else {
    *error = absl::StrCat(options.bulk_transport, " did not initialise: ", t.status().message());
  }
  Log(absl::StrCat("serving the streaming data path only: ", *error));
  return nullptr;
}

}  // namespace

Daemon::Daemon(const DaemonOptions& options)
    : options_(options),
      ledger_(options.memory_limit_bytes, options.max_memory_per_identity),
      metrics_(&registry_, &ledger_, options.version),
      activation_metrics_(&registry_) {
  // A job the ledger forgets takes its series with it.
  ledger_.SetRemoveListener([this](const std::string& job) {
    metrics_.RemoveJob(job);
    activation_metrics_.RemoveJob(job);
  });
}

uint64_t AutoRpcMemoryBytes(uint64_t memory_limit_bytes) {
  constexpr uint64_t kMostRpcMemoryBytes = uint64_t{1} << 30;
  if (memory_limit_bytes == 0) return kMostRpcMemoryBytes;
  return std::clamp(memory_limit_bytes / 8, kMinRpcMemoryBytes, kMostRpcMemoryBytes);
}

Daemon::~Daemon() {
  Shutdown(absl::Seconds(1));
  Wait();
  // Its hooks (the idle save) use the services, which go before it.
  if (jobs_ != nullptr) jobs_->StopJanitor();
}

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(const DaemonOptions& options) {
  RETURN_IF_ERROR(ValidateOptions(options));
  std::unique_ptr<Daemon> d(new Daemon(options));
  ShardOptimizer::Options oo;
  oo.num_threads = options.optimizer_threads;
  oo.cpus = options.optimizer_cpus;
  ASSIGN_OR_RETURN(d->optimizer_, ShardOptimizer::Create(oo));
  if (!options.checkpoint_dir.empty()) {
    RETURN_IF_ERROR(MakeDirectories(options.checkpoint_dir), "--checkpoint_dir");
  }
  std::string grpc_listen, grpc_advertise;
  if (options.bulk_transport == "grpc") {
    RETURN_IF_ERROR(GrpcBulkAddresses(options, &grpc_listen, &grpc_advertise));
  }
  std::string bulk_error;
  d->transport_ = CreateBulkTransport(options, grpc_listen, grpc_advertise, &bulk_error);
  // An address given explicitly is a promise to the deployment: no silent
  // fallback to the streaming path when it cannot be served.
  if (d->transport_ == nullptr && !options.bulk_listen.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("--bulk_listen_address=", options.bulk_listen, ": ", bulk_error));
  }
  if (options.rpc_memory_bytes != 0) {
    // Held for the daemon's life; released with the ledger.
    RETURN_IF_ERROR(d->ledger_.Reserve(kDaemonLedgerEntry, MemoryCategory::kBuffer,
                                       options.rpc_memory_bytes),
                    "--rpc_memory_bytes (booked at start, within --memory_limit)");
  }
  if (options.activation_arena_bytes > 0) RETURN_IF_ERROR(d->StartActivations());
  if (!options.state_dir.empty()) {
    ASSIGN_OR_RETURN(d->state_dir_, InstanceDirectory::Open(options.state_dir,
                                                            InstanceDirectory::StateNaming()));
    Log(absl::StrCat("model states beyond ", options.state_memory_bytes,
                     " bytes of RAM go to ", options.state_dir,
                     d->state_dir_->direct() ? " (O_DIRECT)" : " (buffered)"));
  }
  d->state_memory_ = std::make_unique<ByteBudget>(options.state_memory_bytes);
  if (options.state_disk_limit_bytes > 0) {
    d->state_disk_limit_ = std::make_unique<ByteBudget>(options.state_disk_limit_bytes);
  }
  d->StartJobs();
  d->StartServices(bulk_error);
  if (!options.metrics_listen.empty()) {
    d->http_ = std::make_unique<metrics::MetricsHttpServer>(
        d->registry_, options.metrics_listen,
        StatusPageRenderer({options.version, [jobs = d->jobs_.get()] { return jobs->All(); },
                            options.rank_timeout, &d->ledger_, d->context_->start}));
    RETURN_IF_ERROR(d->http_->Start(), "--metrics_port");
  }
  RETURN_IF_ERROR(d->StartGrpcServers());
  return d;
}

absl::Status Daemon::StartActivations() {
  const DaemonOptions& options = options_;
  ActivationStore::Options ao;
  ao.arena_bytes = options.activation_arena_bytes;
  ao.spill_dir = options.spill_dir;
  ao.spill_bytes = options.spill_bytes;
  ao.disk_timeout = options.disk_timeout;
  ao.reservation_lease = options.read_lease;
  ASSIGN_OR_RETURN(activations_,
                   ActivationStore::Create(ao, transport_.get(), &ledger_, &activation_metrics_));
  Log(absl::StrCat(
      "activation arena of ", options.activation_arena_bytes, " bytes",
      transport_ != nullptr ? absl::StrCat(" (", transport_->kind(), ")") : "",
      options.spill_dir.empty()
          ? std::string(", no spilling")
          : absl::StrCat(", spilling up to ", options.spill_bytes, " bytes to ", options.spill_dir,
                         activations_->spill_directory()->direct() ? " (O_DIRECT)"
                                                                   : " (buffered)")));
  return absl::OkStatus();
}

void Daemon::StartJobs() {
  const DaemonOptions& options = options_;
  JobManager::Options jo;
  jo.read_lease = options.read_lease;
  jo.rank_timeout = options.rank_timeout;
  jo.join_timeout = options.join_timeout;
  jo.job_idle_timeout = options.job_idle_timeout;
  // Runs only once jobs exist, so after the services were made.
  jo.before_idle_removal = [this](const std::shared_ptr<Job>& job) {
    return checkpoint_ == nullptr || checkpoint_->SaveBeforeIdleRemoval(job);
  };
  jo.max_jobs = options.max_jobs;
  jo.max_jobs_per_identity = options.max_jobs_per_identity;
  if (ActivationStore* store = activations_.get(); store != nullptr) {
    ArenaTenancy* tenancy = &arena_tenancy_;
    jo.on_remove = [store, tenancy](const std::shared_ptr<Job>& job) {
      // The key first: from here the job's ranks reach none of the arena.
      tenancy->Return(job.get(), store);
      store->RemoveJob(job->config().job_id, job);
    };
  }
  JobResources resources;
  resources.ledger = &ledger_;
  resources.optimizer = optimizer_.get();
  resources.transport = transport_.get();
  resources.reduction_buffer_bytes = options.reduction_buffer_bytes;
  resources.staging_slots = options.staging_slots;
  resources.reduction_hold = options.reduction_hold;
  resources.checkpoint_dir = options.checkpoint_dir;
  resources.metrics = &metrics_;
  if (options.replica_link == nullptr) {
    replica_link_ = std::make_unique<GrpcReplicaLink>(options.tls, options.liveness_timeout);
  }
  resources.replica_link =
      options.replica_link != nullptr ? options.replica_link : replica_link_.get();
  resources.liveness_timeout = options.liveness_timeout;
  resources.state_disk.dir = state_dir_.get();
  resources.state_disk.chunk_elements = options.state_chunk_elements;
  resources.state_disk.gradient = options.state_gradients;
  resources.state_memory = state_memory_.get();
  resources.state_disk_limit = state_disk_limit_.get();
  jobs_ = std::make_unique<JobManager>(jo, resources, &metrics_);
}

void Daemon::StartServices(const std::string& bulk_error) {
  const DaemonOptions& options = options_;
  context_ = std::make_unique<ServiceContext>();
  ServiceContext& ctx = *context_;
  ctx.version = options.version;
  ctx.max_chunk_bytes = options.max_chunk_bytes;
  ctx.jobs = jobs_.get();
  ctx.ledger = &ledger_;
  ctx.metrics = &metrics_;
  ctx.bulk = transport_.get();
  ctx.bulk_error = bulk_error;
  ctx.checkpoint_dir = options.checkpoint_dir;
  if (!options.checkpoint_dir.empty()) {
    checkpoint_disk_ = std::make_unique<DiskWorker>(
        absl::StrCat("--checkpoint_dir ", options.checkpoint_dir),
        DiskTimeoutFlag(options.disk_timeout), options.disk_timeout);
    ctx.checkpoint_disk = checkpoint_disk_.get();
  }
  ctx.max_checkpoint_bytes_per_identity = options.max_checkpoint_bytes_per_identity;
  ctx.activations = activations_.get();
  ctx.arena_tenancy = &arena_tenancy_;
  ctx.activation_metrics = &activation_metrics_;
  ctx.replica_link = jobs_->resources().replica_link;
  ctx.replica_timeout = jobs_->resources().replica_timeout;
  peer_gather_ = std::make_unique<PeerChannels>(options.tls, "zeroshard.node_cache_channel",
                                                options.liveness_timeout);
  ctx.peer_gather = peer_gather_.get();
  ctx.start = absl::Now();
  ctx.tls = options.tls.enabled();
  if (!options.admin_token.empty()) ctx.admin = TokenDigest::Of(options.admin_token);
  if (!options.registration_token.empty()) {
    ctx.registration = TokenDigest::Of(options.registration_token);
  }
  if (options.stream_idle_timeout > absl::ZeroDuration()) {
    stream_watchdog_ = std::make_unique<StreamWatchdog>(options.stream_idle_timeout);
    ctx.stream_watchdog = stream_watchdog_.get();
  }
  caller_calls_ = std::make_unique<CallerCalls>(
      options.max_calls_per_caller != 0
          ? options.max_calls_per_caller
          : std::max(1, options.max_rpc_threads - kRpcThreadsKeptForOthers));
  ctx.caller_calls = caller_calls_.get();
  control_ = std::make_unique<ControlService>(&ctx);
  shard_ = std::make_unique<ShardService>(&ctx);
  admin_ = std::make_unique<AdminService>(&ctx);
  checkpoint_ = std::make_unique<CheckpointService>(&ctx);
  activation_ = std::make_unique<ActivationService>(&ctx);
  replica_ = std::make_unique<ReplicaService>(&ctx);
}

absl::Status Daemon::StartGrpcServers() {
  const DaemonOptions& options = options_;
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                   MakeServerCredentials(options.tls, "--"));
  // Standard probes (process-wide settings of gRPC, read by every server
  // built after them): grpc.health.v1.Health, SERVING until Drain or
  // Shutdown, and server reflection for tools without the .proto files.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  const bool unix_socket = IsUnixSocketAddress(options.listen);
  if (unix_socket) RETURN_IF_ERROR(CheckSocketDirectory(options.listen));
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen, credentials, &port_);
  builder.SetMaxReceiveMessageSize(kMaxGrpcMessageBytes);
  builder.SetMaxSendMessageSize(kMaxGrpcMessageBytes);
  builder.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::MAX_POLLERS,
                              std::min(kRpcThreadsKeptPolling, options.max_rpc_threads));
  // Each request in flight holds one of these threads; past the quota gRPC
  // answers RESOURCE_EXHAUSTED itself. One connection opens at most
  // kMaxStreamsPerConnection calls at once (HTTP/2 SETTINGS; more wait in
  // the client).
  grpc::ResourceQuota quota("zeroshardd");
  quota.SetMaxThreads(options.max_rpc_threads);
  if (options.rpc_memory_bytes != 0) quota.Resize(options.rpc_memory_bytes);
  builder.SetResourceQuota(quota);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, kMaxStreamsPerConnection);
  builder.AddChannelArgument(
      GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS,
      static_cast<int>(absl::ToInt64Milliseconds(options.handshake_timeout)));
  builder.AddChannelArgument(
      GRPC_ARG_MAX_CONNECTION_IDLE_MS,
      static_cast<int>(absl::ToInt64Milliseconds(options.connection_idle_timeout)));
  // Clients and peer daemons ping every second or two to find a silent
  // daemon fast (common/keepalive.h).
  SetServerKeepalivePolicy(&builder);
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(CallerCallsInterceptorFactory(caller_calls_.get()));
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  builder.RegisterService(control_.get());
  builder.RegisterService(shard_.get());
  builder.RegisterService(admin_.get());
  builder.RegisterService(checkpoint_.get());
  builder.RegisterService(activation_.get());
  builder.RegisterService(replica_.get());
  server_ = builder.BuildAndStart();
  if (server_ == nullptr || port_ == 0) {
    return absl::UnavailableError(
        absl::StrCat("--listen: cannot bind ", options.listen, " (in use or not local?)"));
  }
  if (unix_socket) {
    // Only this user connects (connect(2) needs write permission on it).
    if (::chmod(SocketPath(options.listen).c_str(), 0600) != 0) {
      return absl::UnavailableError(absl::StrCat("--listen=", options.listen,
                                                 ": chmod 600: ", std::strerror(errno)));
    }
    address_ = options.listen;
  } else {
    address_ = options.listen.substr(0, options.listen.rfind(':') + 1) + std::to_string(port_);
  }
  context_->health = server_->GetHealthCheckService();
  if (!options.health_listen.empty()) {
    // Plaintext on purpose: it carries only the serving status.
    grpc::ServerBuilder probe_builder;
    probe_builder.AddListeningPort(options.health_listen, grpc::InsecureServerCredentials(),
                                   &health_port_);
    health_server_ = probe_builder.BuildAndStart();
    if (health_server_ == nullptr || health_port_ == 0) {
      return absl::UnavailableError(absl::StrCat("--health_listen: cannot bind ",
                                                 options.health_listen, " (in use or not local?)"));
    }
    context_->probe_health = health_server_->GetHealthCheckService();
  }
  return absl::OkStatus();
}

void Daemon::Shutdown(absl::Duration grace) {
  if (shut_down_.exchange(true)) return;
  // The health-only server says NOT_SERVING while the main one drains, and
  // stops with it.
  if (grpc::HealthCheckServiceInterface* probe =
          context_ ? context_->probe_health.load() : nullptr) {
    probe->SetServingStatus(false);
  }
  if (server_ != nullptr) {
    context_->draining = true;
    server_->Shutdown(std::chrono::system_clock::now() +
                      std::chrono::milliseconds(absl::ToInt64Milliseconds(grace)));
  }
  if (health_server_ != nullptr) health_server_->Shutdown(std::chrono::system_clock::now());
  if (http_ != nullptr) http_->Stop();
}

int Daemon::metrics_port() const { return http_ == nullptr ? 0 : http_->port(); }

void Daemon::Wait() {
  if (server_ != nullptr) server_->Wait();
}

}  // namespace zeroshard
