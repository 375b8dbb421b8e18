#include "client/client.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/bulk_data_path.h"
#include "client/local_daemon.h"
#include "client/daemon_control.h"
#include "client/daemon_reduce_collective.h"
#include "client/heartbeat.h"
#include "client/layer_cache.h"
#include "client/rpc.h"
#include "client/stream_data_path.h"
#include "common/auth.h"
#include "common/checkpoint_files.h"
#include "common/crc32c.h"
#include "common/protocol.h"
#include "common/status_macros.h"

namespace zeroshard {
namespace {

// Payload of one WriteState chunk.
constexpr uint64_t kWriteStateChunkBytes = uint64_t{4} << 20;

constexpr uint64_t kUploadPieceElements = 1ull << 20;  // 4 MiB of fp32 per stream
// GatherRange's daemon index for a request sent to the node cache's path.
constexpr uint32_t kNodeCachePath = ~0u;
constexpr absl::string_view kStream = "stream";

absl::Status Invalid(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("ClientConfig.", field, ": ", what));
}

bool PositiveFinite(absl::Duration d) {
  return d > absl::ZeroDuration() && d != absl::InfiniteDuration();
}

// Microseconds since the Unix epoch, strictly increasing within the process
// (two clients of one process never share one), >= 1.
uint64_t NextIncarnation() {
  static std::atomic<uint64_t> last{0};
  const uint64_t now = static_cast<uint64_t>(std::max<int64_t>(1, absl::ToUnixMicros(absl::Now())));
  uint64_t prev = last.load();
  uint64_t next = 0;
  do {
    next = std::max(now, prev + 1);
  } while (!last.compare_exchange_weak(prev, next));
  return next;
}

absl::StatusOr<std::unique_ptr<Collective>> DefaultCollective(
    const ClientConfig& config, std::shared_ptr<PushMemories> push_memories) {
  if (config.reduction == ReductionMode::kTrainerCollective) {
    return absl::InvalidArgumentError(
        "ClientConfig.reduction: the trainer collective is not built into this client; pass "
        "a Collective (e.g. GlooCollective, client/gloo_collective.h) to Client::Create or use "
        "ReductionMode::kDaemon");
  }
  DaemonReduceCollective::Options o;
  o.bucket_bytes = config.bucket_bytes;
  o.wire_dtype = config.precision;
  o.staging_buffers = config.staging_buffers;
  o.sender_threads = config.sender_threads;
  if (config.push_memory && config.transport != kStream) o.push_memories = std::move(push_memories);
  ASSIGN_OR_RETURN(std::unique_ptr<DaemonReduceCollective> c, DaemonReduceCollective::Create(o));
  return std::unique_ptr<Collective>(std::move(c));
}

}  // namespace

absl::Status ValidateConfig(const ClientConfig& c) {
  RETURN_IF_ERROR(ValidateJobSettings(c, "ClientConfig."));
  if (c.rank >= c.world_size) {
    return Invalid("rank", absl::StrCat("must be < world_size (", c.world_size, "), got ", c.rank));
  }
  struct Bounds {
    const char* field;
    int64_t value, min, max;
  };
  for (const Bounds& b : std::initializer_list<Bounds>{
           {"staging_buffers", c.staging_buffers, 2, 1024},
           {"prefetch_depth", c.prefetch_depth, 0, 64},
           {"layer_buffers", c.layer_buffers, 0, 1024},
           {"micro_batches", c.micro_batches, 1, 4096},
           {"sender_threads", c.sender_threads, 1, 64},
           {"bulk_progress_threads", c.bulk_progress_threads, 1, 16},
           {"io_threads", c.io_threads, 1, 64}}) {
    if (b.value < b.min || b.value > b.max) {
      return Invalid(b.field, absl::StrCat("must be in ", b.min, "..", b.max, ", got ", b.value));
    }
  }
  if (!std::isfinite(c.max_grad_norm) || c.max_grad_norm < 0) {
    return Invalid("max_grad_norm", absl::StrCat("must be finite and >= 0 (0: no clipping), got ",
                                                 c.max_grad_norm));
  }
  if (!PositiveFinite(c.rpc_timeout)) return Invalid("rpc_timeout", "must be positive and finite");
  if (c.local_daemon < -1 || c.local_daemon >= static_cast<int>(c.daemons.size())) {
    return Invalid("local_daemon",
                   absl::StrCat("must be an index into daemons (", c.daemons.size(),
                                ") or -1 (this machine's daemon), got ", c.local_daemon));
  }
  if (c.cuda_device < -1) {
    return Invalid("cuda_device", absl::StrCat("must be a device index or -1 (host buffers only), "
                                               "got ",
                                               c.cuda_device));
  }
  if (!PositiveFinite(c.step_timeout)) {
    return Invalid("step_timeout", "must be positive and finite");
  }
  if (!ValidateLivenessTimeout(c.liveness_timeout, "liveness_timeout").ok()) {
    return Invalid("liveness_timeout",
                   absl::StrCat("must be 0 (off) or between 2s and 1h, got ",
                                absl::FormatDuration(c.liveness_timeout)));
  }
  if (c.heartbeat_interval < absl::ZeroDuration() ||
      c.heartbeat_interval == absl::InfiniteDuration()) {
    return Invalid("heartbeat_interval", "must be finite and >= 0 (0: no heartbeats)");
  }
  if (c.transport != kStream && !TransportKindFromName(c.transport, "transport").ok()) {
    return Invalid("transport", absl::StrCat("unknown transport \"", c.transport.substr(0, 64),
                                             "\" (one of stream, ucx, grpc, inproc)"));
  }
  if (c.job_token.empty()) {
    return Invalid("job_token",
                   absl::StrCat("required: the job's secret (or set ", kJobTokenEnvironment,
                                "; zsrun generates one per run, `zsctl token` "
                                "prints a fresh one)"));
  }
  RETURN_IF_ERROR(ValidateToken(c.job_token, "ClientConfig.job_token"));
  if (!c.registration_token.empty()) {
    RETURN_IF_ERROR(ValidateToken(c.registration_token, "ClientConfig.registration_token"));
  }
  RETURN_IF_ERROR(ValidateTlsFiles(c.tls, "ClientConfig."));
  for (size_t i = 0; i < c.daemons.size(); ++i) {
    RETURN_IF_ERROR(CheckPlaintextAddress(
        c.daemons[i], c.tls.enabled(), c.insecure, absl::StrCat("ClientConfig.daemons[", i, "]"),
        "ClientConfig.tls (or ZS_TLS_CERT, ZS_TLS_KEY and ZS_TLS_CA)",
        "ClientConfig.insecure = true (or ZS_INSECURE=1)"));
  }
  if (!c.resume.empty() && !ValidateCheckpointName(c.resume, true).ok()) {
    return Invalid("resume", absl::StrCat("must be \"latest\" or a checkpoint name (",
                                          kCheckpointNameRule, "), got \"",
                                          c.resume.substr(0, 140), "\""));
  }
  return absl::OkStatus();
}

Client::Client(ClientConfig config, std::unique_ptr<Collective> collective,
               std::shared_ptr<PushMemories> push_memories)
    : config_(std::move(config)),
      incarnation_(NextIncarnation()),
      collective_(std::move(collective)),
      push_memories_(std::move(push_memories)),
      loss_scale_(config_.loss_scale.initial_scale) {}

Client::~Client() {
  if (checkpoint_finisher_.joinable()) checkpoint_finisher_.join();  // bounded by step_timeout
  heartbeat_.reset();
  layers_.reset();  // its prefetches use io_
  io_.reset();
  collective_.reset();  // its sends use the data paths
  if (bounce_.data() != nullptr) device_->Unpin(bounce_.data());
}

absl::StatusOr<std::unique_ptr<Client>> Client::Create(ClientConfig config,
                                                       std::unique_ptr<Collective> collective) {
  config.job_token = JobTokenOrEnvironment(config.job_token);
  config.registration_token = RegistrationTokenOrEnvironment(config.registration_token);
  config.tls = TlsFilesFromEnvironment(config.tls);
  config.insecure = InsecureOrEnvironment(config.insecure);
  RETURN_IF_ERROR(ValidateConfig(config));
  auto push_memories = std::make_shared<PushMemories>();
  if (collective == nullptr) {
    ASSIGN_OR_RETURN(collective, DefaultCollective(config, push_memories));
  }
  std::unique_ptr<Client> client(
      new Client(std::move(config), std::move(collective), std::move(push_memories)));
  RETURN_IF_ERROR(client->Connect());
  return client;
}

absl::Status Client::Connect() {
  const ClientConfig& c = config_;
  if (c.cuda_device >= 0) {
    bounce_bytes_ = std::min(c.bucket_bytes, kMaxChunkBytes);
    ASSIGN_OR_RETURN(device_, CreateDeviceCopier(c.cuda_device, bounce_bytes_),
                     "ClientConfig.cuda_device");
    PinnableBuffer bounce(DeviceCopier::kLanes * bounce_bytes_);
    if (bounce.data() == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("ClientConfig.cuda_device: allocating ",
                                                       DeviceCopier::kLanes * bounce_bytes_,
                                                       " bytes of bounce buffers"));
    }
    if (absl::Status s = device_->Pin(bounce.data(), bounce.size()); !s.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("ClientConfig.cuda_device: pinning the bounce buffers: ", s.message()));
    }
    bounce_ = std::move(bounce);
  }
  ASSIGN_OR_RETURN(const ChannelSecurity security,
                   MakeChannelSecurity(c.tls, c.job_token, "ClientConfig."));
  if (c.transport != kStream) {
    transport::TransportOptions common;
    common.name = absl::StrCat("client ", c.job_id, " rank ", c.rank);
    transport::BackendOptions to;
    to.SetCommon(common);
    to.ucx.tls = c.ucx_tls;
    to.ucx.progress_threads = c.bulk_progress_threads;
    to.inproc.progress_threads = c.bulk_progress_threads;
    to.grpc.tls = c.tls;
    ASSIGN_OR_RETURN(bulk_, BulkTransport::Create(c.transport, to));
  }
  std::vector<DaemonControl*> controls;
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (const std::string& address : c.daemons) placement_.push_back({address, 1, true});
  if (c.replicas > 1) {
    PlacementOptions po;
    po.job_id = c.job_id;
    po.rank = c.rank;
    po.known_committed_step = c.known_committed_step;
    po.rpc_timeout = std::min(c.rpc_timeout, absl::Seconds(5));
    po.wait = c.step_timeout;
    po.liveness_timeout = c.liveness_timeout;
    ASSIGN_OR_RETURN(placement_, ResolvePlacement(c.daemons, security, po));
  }
  for (uint32_t d = 0; d < c.daemons.size(); ++d) {
    const std::string& address = placement_[d].address;
    std::optional<ReplicaTarget> target;
    if (c.replicas > 1) target = ReplicaTarget{d, placement_[d].epoch};
    std::shared_ptr<grpc::Channel> channel =
        MakeDaemonChannel(address, security, target, c.liveness_timeout);
    home_controls_.push_back(std::make_unique<DaemonControl>(
        c.daemons[d], target ? MakeDaemonChannel(c.daemons[d], security, std::nullopt,
                                                 c.liveness_timeout)
                             : channel));
    channels.push_back(channel);
    controls_.push_back(std::make_unique<DaemonControl>(address, channel));
    controls.push_back(controls_.back().get());
    if (bulk_ == nullptr) {
      data_paths_.push_back(std::make_unique<StreamDataPath>(address, std::move(channel)));
    } else {
      BulkDataPath::Options o;
      o.connections = c.bulk_progress_threads;
      o.fence_timeout = c.rpc_timeout;
      o.push_memories = push_memories_;
      auto path = std::make_unique<BulkDataPath>(address, std::move(channel), bulk_, o);
      bulk_paths_.push_back(path.get());
      data_paths_.push_back(std::move(path));
    }
  }
  if (c.node_cache && c.daemons.size() > 1) {
    node_daemon_ = c.local_daemon;
    if (node_daemon_ < 0) {
      absl::StatusOr<int> found = FindLocalDaemon(c.daemons);
      if (!found.ok()) {
        std::fprintf(stderr, "zeroshard: rank %u: node cache off: %s\n", c.rank,
                     std::string(found.status().message()).c_str());
      } else if (*found < 0) {
        std::fprintf(stderr,
                     "zeroshard: rank %u: node cache off: no daemon of the job runs on this "
                     "machine (set ClientConfig.local_daemon to name one)\n",
                     c.rank);
      }
      node_daemon_ = found.ok() ? *found : -1;
    }
    if (node_daemon_ >= 0) {
      const size_t d = static_cast<size_t>(node_daemon_);
      node_path_ = std::make_unique<StreamDataPath>(placement_[d].address, channels[d]);
    }
  }
  channels_ = channels;
  checkpoints_ = std::make_unique<CheckpointDriver>(c.job_id, c.daemons, std::move(channels));
  io_ = std::make_unique<Executor>(c.io_threads);
  StepCoordinator::Options so;
  so.id = rank_id();
  so.world_size = c.world_size;
  so.max_grad_norm = c.max_grad_norm;
  so.rpc_timeout = c.rpc_timeout;
  so.step_timeout = c.step_timeout;
  coordinator_ = std::make_unique<StepCoordinator>(so, std::move(controls), io_.get());
  return absl::OkStatus();
}

absl::Status Client::ForEachDaemon(const std::function<absl::Status(uint32_t)>& fn) {
  return ParallelFor(*io_, static_cast<uint32_t>(controls_.size()), fn);
}

absl::Status Client::RegisterJobEverywhere(const Layout& layout, const PartitionMap& map) {
  const v1::JobSpec spec = ToJobSpec(config_, layout);
  return ForEachDaemon([&](uint32_t d) -> absl::Status {
    // A group served away from its own daemon (promoted): that daemon, if
    // it is back, holds backups only; if it is not, the job runs without it
    // (its primary registers the job there itself once it answers), so a
    // daemon that is silent holds the reconnect up for a second at most.
    const bool away = !placement_[d].home;
    absl::StatusOr<v1::RegisterJobResponse> registered = home_controls_[d]->RegisterJob(
        spec, d, away,
        away ? absl::Now() + std::min(config_.rpc_timeout, absl::Seconds(1)) : RpcDeadline(),
        config_.registration_token);
    if (away && !registered.ok()) return absl::OkStatus();
    ASSIGN_OR_RETURN(v1::RegisterJobResponse r, std::move(registered));
    const v1::PartitionMap& m = r.partition_map();
    if (m.total_elements() != map.total_elements() ||
        m.partition_elements() != map.partition_elements()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "daemon ", controls_[d]->address(), ": partition map of ", m.total_elements(), "/",
          m.partition_elements(), " elements, this client computes ", map.total_elements(), "/",
          map.partition_elements()));
    }
    return absl::OkStatus();
  });
}

absl::Status Client::BindCollective() {
  if (bound_fingerprint_.has_value()) return absl::OkStatus();  // a retried RegisterModel
  CollectiveJob job;
  job.job_id = config_.job_id;
  job.rank = config_.rank;
  job.incarnation = incarnation_;
  job.world_size = config_.world_size;
  job.layout = &layout_;
  job.map = &map_;
  job.wire_dtype = config_.precision;
  job.bucket_bytes = config_.bucket_bytes;
  job.micro_batches = config_.micro_batches;
  job.stage = config_.stage;
  for (const auto& p : data_paths_) job.daemons.push_back(p.get());
  job.traffic = &traffic_;
  job.rpc_timeout = config_.rpc_timeout;
  job.device = device_.get();
  RETURN_IF_ERROR(collective_->Bind(job));
  bound_fingerprint_ = layout_.fingerprint();
  return absl::OkStatus();
}

absl::Status Client::JoinEverywhere() {
  v1::JoinJobRequest join;
  join.set_job_id(config_.job_id);
  join.set_rank(config_.rank);
  join.set_layout_fingerprint(layout_.fingerprint());
  join.set_stage(config_.stage);
  join.set_world_size(config_.world_size);
  join.set_precision(WireDType(config_.precision));
  join.set_incarnation(incarnation_);
  return ForEachDaemon([&](uint32_t d) -> absl::Status {
    return controls_[d]->JoinJob(join, RpcDeadline()).status();
  });
}

absl::StatusOr<uint64_t> Client::AgreedCommittedStep() {
  const absl::Time deadline = absl::Now() + config_.step_timeout;
  for (;;) {
    std::vector<v1::StepState> states(controls_.size());
    RETURN_IF_ERROR(ForEachDaemon([&](uint32_t d) -> absl::Status {
      ASSIGN_OR_RETURN(states[d], controls_[d]->GetStepState(config_.job_id, RpcDeadline()));
      return absl::OkStatus();
    }));
    uint32_t lo = 0, hi = 0;
    for (uint32_t d = 1; d < states.size(); ++d) {
      if (states[d].committed_step() < states[lo].committed_step()) lo = d;
      if (states[d].committed_step() > states[hi].committed_step()) hi = d;
    }
    const uint64_t low = states[lo].committed_step();
    const uint64_t high = states[hi].committed_step();
    if (low == high) {
      // A rank joining a job that has committed steps (a restarted trainer)
      // takes the daemons' loss scale for its first step, not the initial one.
      const float scale = states[hi].loss_scale();
      if (high > 0 && std::isfinite(scale) && scale > 0) loss_scale_.store(scale);
      return high;
    }
    if (high == low + 1 && config_.rank == 0) {
      // The previous leader died between its CommitSteps: finish the step on
      // the daemons behind with the decision the others recorded, so every
      // daemon applies the same update.
      const v1::StepState& done = states[hi];
      RETURN_IF_ERROR(ForEachDaemon([&](uint32_t d) -> absl::Status {
        if (states[d].committed_step() != low) return absl::OkStatus();
        RETURN_IF_ERROR(controls_[d]->PrepareStep(rank_id(), high, RpcDeadline()).status(),
                        absl::StrCat("finishing step ", high, " (committed on ",
                                     controls_[hi]->address(), ")"));
        v1::CommitStepRequest commit;
        commit.set_job_id(config_.job_id);
        commit.set_step(high);
        commit.set_lr(done.last_lr());
        commit.set_clip_coef(done.last_clip_coef());
        commit.set_skip(done.last_skipped());
        commit.set_grad_norm(done.last_grad_norm());
        commit.set_rank(0);
        commit.set_incarnation(incarnation_);
        return controls_[d]->CommitStep(commit, RpcDeadline()).status();
      }));
      continue;
    }
    if (high > low + 1 || config_.rank == 0 || absl::Now() >= deadline) {
      return absl::FailedPreconditionError(absl::StrCat(
          "job ", config_.job_id, ": daemons disagree on the committed step (",
          controls_[lo]->address(), " has ", low, ", ", controls_[hi]->address(), " has ", high,
          "); restart the trainers with a resume checkpoint (ClientConfig.resume)"));
    }
    // Rank 0 is finishing the step; look again.
    absl::SleepFor(absl::Milliseconds(50));
  }
}

absl::Status Client::RegisterModel(const Layout& layout, const float* initial_params) {
  if (registered()) {
    return absl::FailedPreconditionError("RegisterModel: this client already registered a model");
  }
  if (bound_fingerprint_.has_value() && *bound_fingerprint_ != layout.fingerprint()) {
    return absl::FailedPreconditionError(
        "RegisterModel: a retry must pass the layout of the first attempt");
  }
  RETURN_IF_ERROR(ValidateLayoutGroups(config_, layout, "RegisterModel: "));
  ASSIGN_OR_RETURN(PartitionMap map,
                   PartitionMap::Create(layout.total_elements(), config_.world_size,
                                        static_cast<uint32_t>(config_.daemons.size())));
  RETURN_IF_ERROR(RegisterJobEverywhere(layout, map));
  layout_ = layout;
  map_ = map;
  RETURN_IF_ERROR(BindCollective());
  // Rank 0 loads or uploads before it joins, so that "every rank joined"
  // implies the state is in place; a job that has committed a step keeps
  // its own unless resuming.
  bool loaded = false;
  if (config_.rank == 0 && config_.resume == "latest" && !resumed_.has_value()) {
    absl::StatusOr<LatestLoad> r =
        checkpoints_->LoadLatestVerified(absl::Now() + config_.step_timeout);
    if (r.ok()) {
      for (const std::string& s : r->skipped) {
        std::fprintf(stderr, "zeroshard: resume=latest skipped checkpoint %s\n", s.c_str());
      }
      resume_skipped_ = std::move(r->skipped);
      resumed_ = std::move(r->loaded);
      loaded = true;
    } else if (!absl::IsNotFound(r.status())) {
      return r.status();
    }
  } else if (config_.rank == 0 && !config_.resume.empty() && !resumed_.has_value()) {
    ASSIGN_OR_RETURN(v1::LoadCheckpointResponse r,
                     checkpoints_->Load(config_.resume, absl::Now() + config_.step_timeout));
    resumed_ = std::move(r);
    loaded = true;
  }
  if (config_.rank == 0 && initial_params != nullptr && !loaded && !resumed_.has_value()) {
    ASSIGN_OR_RETURN(uint64_t committed, coordinator_->MaxCommittedStep());
    if (committed == 0) RETURN_IF_ERROR(UploadInitialParams(initial_params));
  }
  RETURN_IF_ERROR(JoinEverywhere());
  if (heartbeat_ == nullptr && config_.heartbeat_interval > absl::ZeroDuration()) {
    std::vector<DaemonControl*> controls;
    for (const auto& c : controls_) controls.push_back(c.get());
    heartbeat_ = std::make_unique<HeartbeatLoop>(rank_id(), std::move(controls),
                                                 config_.heartbeat_interval, config_.rpc_timeout);
  }
  RETURN_IF_ERROR(coordinator_->AwaitAllRanksJoined());
  ASSIGN_OR_RETURN(uint64_t committed, AgreedCommittedStep());
  step_ = committed;
  if (layers_ == nullptr) {
    LayerCache::Options o;
    o.dtype = config_.precision;
    const uint32_t buffers =
        config_.layer_buffers != 0 ? config_.layer_buffers : config_.prefetch_depth + 2;
    o.buffers = config_.stage == 3 ? buffers : 0;
    // A collective that gathers parameters is a collective call, made by
    // every rank in the same order: only the trainer's own gathers, in its
    // order, never prefetches timed by a thread.
    o.prefetch_depth = collective_->gathers_parameters() ? 0 : config_.prefetch_depth;
    o.timeout = config_.step_timeout;
    layers_ = std::make_unique<LayerCache>(
        &layout_, o, [this](const FlatRange& range, uint64_t after_step, void* dst) {
          return GatherParameters(range, config_.precision, after_step, dst, MemoryKind::kHost);
        });
  }
  registered_.store(true, std::memory_order_release);
  // Step windows count from here; the upload stays in the totals.
  absl::MutexLock lock(&report_mu_);
  traffic_.CloseWindow();
  return absl::OkStatus();
}

absl::Status Client::UploadInitialParams(const float* params) {
  const uint64_t total = layout_.total_elements();
  // The plan's tensor index tells real elements from alignment gaps.
  ASSIGN_OR_RETURN(const BucketPlan plan,
                   BucketPlan::Create(layout_, map_, kUploadPieceElements * sizeof(float),
                                      DType::kFp32, BucketCut::kPartition));
  return ForEachDaemon([&](uint32_t d) -> absl::Status {
    const FlatRange owned = map_.DaemonRange(d).Intersect({0, total});
    std::vector<float> scratch;
    for (uint64_t b = owned.begin; b < owned.end; b += kUploadPieceElements) {
      const FlatRange piece{b, std::min(owned.end, b + kUploadPieceElements)};
      const float* values = params + piece.begin;
      if (plan.RealElements(piece) != piece.size()) {
        // Alignment gaps inside: send them as zeros.
        scratch.assign(piece.size(), 0.0f);
        plan.ForEachRealSegment(piece, [&](const FlatRange& s) {
          std::memcpy(scratch.data() + (s.begin - piece.begin), params + s.begin,
                      s.size() * sizeof(float));
        });
        values = scratch.data();
      }
      ParameterUpload upload{config_.job_id, config_.rank, piece, values};
      ASSIGN_OR_RETURN(uint64_t bytes, data_paths_[d]->InitParameters(upload, RpcDeadline()));
      traffic_.AddInit(bytes);
    }
    return absl::OkStatus();
  });
}

absl::StatusOr<std::shared_ptr<transport::PushMemory>> Client::AllocatePushMemory(
    size_t bytes) {
  return push_memories_->Allocate(bytes);
}

absl::StatusOr<PushTicket> Client::PushGradients(const FlatRange& range, const void* grads,
                                                 DType dtype, uint32_t micro_batch, BufferUse use,
                                                 MemoryKind memory,
                                                 absl::Span<const uint32_t> no_grad_tensors) {
  if (!registered()) return absl::FailedPreconditionError("PushGradients before RegisterModel");
  if (dtype != DType::kFp32 && dtype != DType::kBf16 && dtype != DType::kFp16) {
    return absl::InvalidArgumentError(
        absl::StrCat("dtype: unknown dtype ", static_cast<int>(dtype)));
  }
  if (range.empty() || range.end > layout_.total_elements()) {
    return absl::InvalidArgumentError(
        absl::StrCat("range: [", range.begin, ", ", range.end, ") is empty or outside the ",
                     "flat space [0, ", layout_.total_elements(), ")"));
  }
  if (!no_grad_tensors.empty()) {
    if (!collective_->carries_no_grad_marks()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "no_grad_tensors: the ", collective_->name(), " collective does not carry "
          "no-gradient marks (Client::carries_no_grad_marks() is false); push zeros without "
          "them (such tensors are then stepped), or use daemon reduction or the Gloo collective"));
    }
    const auto [first, last] = layout_.TensorsIn(range);
    for (size_t i = 0; i < no_grad_tensors.size(); ++i) {
      const uint32_t t = no_grad_tensors[i];
      if (t < first || t >= last || (i > 0 && t <= no_grad_tensors[i - 1])) {
        return absl::InvalidArgumentError(
            absl::StrCat("no_grad_tensors[", i, "]: ", t, " is not ascending or does not overlap ",
                         "range [", range.begin, ", ", range.end, ") (tensors ", first, "..",
                         last, " do)"));
      }
    }
    RETURN_IF_ERROR(collective_->MarkNoGradient(step_ + 1, micro_batch, no_grad_tensors));
  }
  return collective_->Reduce(step_ + 1, micro_batch, range, grads, dtype, use, memory,
                             RpcDeadline());
}

absl::StatusOr<StepResult> Client::Step(float lr) {
  if (!std::isfinite(lr) || lr < 0) {
    return absl::InvalidArgumentError(absl::StrCat("lr: must be finite and >= 0, got ", lr));
  }
  return StepWith(lr, {});
}

absl::StatusOr<StepResult> Client::Step(absl::Span<const float> group_lrs) {
  const uint32_t groups = GroupCount(config_);
  if (group_lrs.size() != groups) {
    return absl::InvalidArgumentError(absl::StrCat("group_lrs: the job has ", groups,
                                                   " parameter groups, got ", group_lrs.size(),
                                                   " learning rates"));
  }
  for (size_t g = 0; g < group_lrs.size(); ++g) {
    if (!std::isfinite(group_lrs[g]) || group_lrs[g] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("group_lrs[", g, "]: must be finite and >= 0, got ", group_lrs[g]));
    }
  }
  return StepWith(group_lrs[0], std::vector<float>(group_lrs.begin(), group_lrs.end()));
}

absl::StatusOr<StepResult> Client::StepWith(float lr, std::vector<float> group_lrs) {
  if (!registered()) return absl::FailedPreconditionError("Step before RegisterModel");
  RETURN_IF_ERROR(layers_->CheckNoneHeld());
  const uint64_t step = step_.load() + 1;
  // A retry of a failed commit phase resends the commit: the gradients are in.
  const absl::Time push_start = absl::Now();
  if (!coordinator_->HasPendingCommit(step)) {
    RETURN_IF_ERROR(collective_->Finish(step, push_start + config_.step_timeout));
  }
  const absl::Duration push_wait = absl::Now() - push_start;
  ASSIGN_OR_RETURN(StepResult result, coordinator_->Step(step, lr, std::move(group_lrs)));
  result.push_wait = push_wait;
  // Committed: nothing below may fail.
  step_ = step;
  loss_scale_ = result.loss_scale;
  {
    absl::MutexLock lock(&report_mu_);
    last_step_traffic_ = traffic_.CloseWindow();
  }
  layers_->DiscardAll();
  return result;
}

absl::Status Client::ReadState(v1::StateArray array, const FlatRange& range, float* dst,
                               std::map<uint32_t, uint64_t>* steps) {
  if (!registered()) return absl::FailedPreconditionError("ReadState before RegisterModel");
  if (range.empty() || range.end > layout_.total_elements()) {
    return absl::InvalidArgumentError(
        absl::StrCat("range: [", range.begin, ", ", range.end, ") is empty or outside the ",
                     "flat space [0, ", layout_.total_elements(), ")"));
  }
  absl::Mutex steps_mu;
  return ForEachDaemon([&](uint32_t d) -> absl::Status {
    const FlatRange piece = map_.DaemonRange(d).Intersect(range);
    if (piece.empty()) return absl::OkStatus();
    v1::ReadStateRequest request;
    request.set_job_id(config_.job_id);
    request.set_rank(config_.rank);
    request.set_incarnation(incarnation_);
    request.set_array(array);
    request.mutable_range()->set_begin(piece.begin);
    request.mutable_range()->set_end(piece.end);
    uint64_t filled = piece.begin;
    RETURN_IF_ERROR(controls_[d]->ReadState(
        request, RpcDeadline(), [&](const v1::StateChunk& c) -> absl::Status {
          const FlatRange r{c.range().begin(), c.range().end()};
          if (r.begin != filled || r.end > piece.end || r.end < r.begin ||
              c.data().size() != r.size() * sizeof(float)) {
            return absl::DataLossError(absl::StrCat(
                "daemon ", controls_[d]->address(), ": ReadState answered range [", r.begin,
                ", ", r.end, ") with ", c.data().size(), " bytes where [", filled, ", ",
                piece.end, ") was expected"));
          }
          if (c.crc32c() != 0 && Crc32c(c.data().data(), c.data().size()) != c.crc32c()) {
            return absl::DataLossError(absl::StrCat("daemon ", controls_[d]->address(),
                                                    ": ReadState: CRC-32C mismatch"));
          }
          std::memcpy(dst + (r.begin - range.begin), c.data().data(), c.data().size());
          filled = r.end;
          if (steps != nullptr && c.tensor_steps_size() > 0) {
            absl::MutexLock lock(&steps_mu);
            for (const v1::TensorStep& t : c.tensor_steps()) (*steps)[t.tensor()] = t.steps();
          }
          return absl::OkStatus();
        }));
    if (filled != piece.end) {
      return absl::DataLossError(absl::StrCat("daemon ", controls_[d]->address(),
                                              ": ReadState ended at element ", filled, " of [",
                                              piece.begin, ", ", piece.end, ")"));
    }
    return absl::OkStatus();
  });
}

absl::Status Client::WriteState(v1::StateArray array, const FlatRange& range, const float* src,
                                const std::map<uint32_t, uint64_t>& steps) {
  if (!registered()) return absl::FailedPreconditionError("WriteState before RegisterModel");
  if (range.end > layout_.total_elements() || range.begin > range.end) {
    return absl::InvalidArgumentError(absl::StrCat("range: [", range.begin, ", ", range.end,
                                                   ") is outside the flat space [0, ",
                                                   layout_.total_elements(), ")"));
  }
  for (const auto& [t, n] : steps) {
    if (t >= layout_.tensors().size() || layout_.tensors()[t].spec.frozen) {
      return absl::InvalidArgumentError(
          absl::StrCat("steps: tensor ", t, " is not a trainable tensor of the layout"));
    }
  }
  RETURN_IF_ERROR(layers_->CheckNoneHeld());
  const uint64_t chunk_elements = kWriteStateChunkBytes / sizeof(float);
  const uint64_t stream_bytes = MaxPushStreamBytes(config_.bucket_bytes);
  absl::Status written = ForEachDaemon([&](uint32_t d) -> absl::Status {
    const FlatRange owned = map_.DaemonRange(d).Intersect({0, layout_.total_elements()});
    const FlatRange piece = owned.Intersect(range);
    std::vector<v1::StateChunk> stream;
    uint64_t bytes = 0;
    auto send = [&]() -> absl::Status {
      if (stream.empty()) return absl::OkStatus();
      RETURN_IF_ERROR(controls_[d]->WriteState(stream, RpcDeadline()).status());
      stream.clear();
      bytes = 0;
      return absl::OkStatus();
    };
    auto header = [&]() {
      v1::StateChunk c;
      c.set_job_id(config_.job_id);
      c.set_rank(config_.rank);
      c.set_incarnation(incarnation_);
      c.set_array(array);
      return c;
    };
    // The counts of the tensors this daemon holds go with its first stream.
    v1::StateChunk counts = header();
    const auto [first, last] = layout_.TensorsIn(owned);
    for (auto it = steps.lower_bound(static_cast<uint32_t>(first));
         it != steps.end() && it->first < last; ++it) {
      v1::TensorStep* t = counts.add_tensor_steps();
      t->set_tensor(it->first);
      t->set_steps(it->second);
    }
    if (counts.tensor_steps_size() > 0) {
      bytes += counts.ByteSizeLong() + kPushChunkOverheadBytes;
      stream.push_back(std::move(counts));
    }
    for (uint64_t pos = piece.begin; pos < piece.end;) {
      const uint64_t end = std::min(piece.end, pos + chunk_elements);
      const uint64_t held = (end - pos) * sizeof(float) + kPushChunkOverheadBytes;
      if (!stream.empty() && bytes + held > stream_bytes) RETURN_IF_ERROR(send());
      v1::StateChunk c = header();
      c.mutable_range()->set_begin(pos);
      c.mutable_range()->set_end(end);
      c.set_data(reinterpret_cast<const char*>(src + (pos - range.begin)),
                 (end - pos) * sizeof(float));
      c.set_crc32c(Crc32c(c.data().data(), c.data().size()));
      bytes += held;
      stream.push_back(std::move(c));
      pos = end;
    }
    return send();
  });
  // Whatever was written, the layers held from before are stale.
  layers_->DiscardAll();
  return written;
}

absl::Status Client::GatherRange(const FlatRange& range, DType dtype, uint64_t after_step,
                                 void* dst) {
  const size_t esize = DTypeSize(dtype);
  const uint64_t request_elements =
      std::max<uint64_t>(1, std::min(config_.bucket_bytes, kMaxChunkBytes) / esize);
  std::vector<std::pair<uint32_t, FlatRange>> requests;  // (daemon, range)
  if (node_path_ != nullptr) {
    // Node cache: the host daemon serves every slice (its own part from its
    // parameters, the rest from its copy of the other daemons').
    const FlatRange local = map_.DaemonRange(static_cast<uint32_t>(node_daemon_));
    for (uint64_t b = range.begin; b < range.end; b += request_elements) {
      requests.push_back({static_cast<uint32_t>(node_daemon_),
                          {b, std::min(range.end, b + request_elements)}});
      if (!local.Contains(requests.back().second)) requests.back().first = kNodeCachePath;
    }
  } else {
    for (uint32_t d = 0; d < map_.num_daemons(); ++d) {
      const FlatRange piece = map_.DaemonRange(d).Intersect(range);
      for (uint64_t b = piece.begin; b < piece.end; b += request_elements) {
        requests.push_back({d, {b, std::min(piece.end, b + request_elements)}});
      }
    }
  }
  auto group = std::make_shared<CountDown>(static_cast<int64_t>(requests.size()));
  auto cancelled = std::make_shared<std::atomic<bool>>(false);
  for (const auto& [daemon, r] : requests) {
    void* out = static_cast<uint8_t*>(dst) + (r.begin - range.begin) * esize;
    GatherRequestSpec spec{config_.job_id, config_.rank, incarnation_, after_step,
                           r,              dtype,        config_.rpc_timeout};
    io_->Submit([this, d = daemon, spec, out, group, cancelled] {
      if (cancelled->load()) return group->Done(absl::CancelledError("gather abandoned"));
      DataPath* path = d == kNodeCachePath ? node_path_.get() : data_paths_[d].get();
      absl::StatusOr<uint64_t> bytes = path->Gather(spec, out, RpcDeadline());
      if (bytes.ok()) traffic_.AddGather(*bytes);
      group->Done(bytes.status());
    });
  }
  absl::Status s = group->Wait(absl::Now() + config_.step_timeout, "gather");
  if (absl::IsDeadlineExceeded(s)) {
    // Nothing may write into `dst` after we return: requests not started yet
    // are dropped, those running end by their RPC deadline.
    cancelled->store(true);
    group->Wait(absl::InfiniteFuture(), "gather").IgnoreError();
  }
  return s;
}

absl::Status Client::GatherParameters(const FlatRange& range, DType dtype, uint64_t after_step,
                                      void* dst, MemoryKind memory) {
  if (!collective_->gathers_parameters()) return GatherRange(range, dtype, after_step, dst);
  return collective_->AllGather(
      range, dst, dtype, memory,
      [this, dtype, after_step](const FlatRange& piece, void* out) {
        return GatherRange(piece, dtype, after_step, out);
      },
      absl::Now() + config_.step_timeout);
}

absl::Status Client::GatherAll(void* dst, DType dtype, MemoryKind memory) {
  if (!registered()) return absl::FailedPreconditionError("GatherAll before RegisterModel");
  return GatherAll({0, layout_.total_elements()}, dst, dtype, memory);
}

absl::Status Client::GatherAll(const FlatRange& range, void* dst, DType dtype,
                               MemoryKind memory) {
  if (!registered()) return absl::FailedPreconditionError("GatherAll before RegisterModel");
  if (range.empty() || range.end > layout_.total_elements()) {
    return absl::InvalidArgumentError(
        absl::StrCat("range: [", range.begin, ", ", range.end, ") is empty or outside the ",
                     "flat space [0, ", layout_.total_elements(), ")"));
  }
  if (dtype != DType::kFp32 && dtype != config_.precision) {
    return absl::InvalidArgumentError(absl::StrCat("dtype: must be fp32 or the job's precision (",
                                                   DTypeName(config_.precision), "), got ",
                                                   DTypeName(dtype)));
  }
  if (dst == nullptr) return absl::InvalidArgumentError("dst: null");
  if (memory == MemoryKind::kCudaDevice) {
    RETURN_IF_ERROR(CheckDeviceDestination("GatherAll", dst, range.size() * DTypeSize(dtype)));
    return GatherRangeToDevice(range, dtype, dst);
  }
  return GatherParameters(range, dtype, step_, dst, MemoryKind::kHost);
}

absl::Status Client::CheckDeviceDestination(absl::string_view call, const void* dst,
                                            uint64_t bytes) const {
  if (device_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(call,
                     ": dst in CUDA device memory, but the client has no device "
                     "(ClientConfig.cuda_device is -1)"));
  }
  return device_->CheckDevicePointer(dst, bytes, absl::StrCat(call, ": dst"));
}

absl::Status Client::GatherRangeToDevice(const FlatRange& range, DType dtype, void* dst) {
  if (collective_->gathers_parameters()) {
    return GatherParameters(range, dtype, step_, dst, MemoryKind::kCudaDevice);
  }
  const uint64_t step = step_;
  return FetchToDevice(
      *device_, bounce_.data(), bounce_bytes_, range, DTypeSize(dtype),
      [&](const FlatRange& piece, void* out) { return GatherRange(piece, dtype, step, out); }, dst,
      [this] { return RpcDeadline(); });
}

absl::StatusOr<uint64_t> Client::layer_elements(uint32_t layer) const {
  ASSIGN_OR_RETURN(FlatRange r, layout_.LayerRange(layer));
  return r.size();
}

absl::StatusOr<size_t> Client::LayerIndex(uint32_t layer) const {
  if (!registered()) return absl::FailedPreconditionError("layer gather before RegisterModel");
  const auto& layers = layout_.layers();
  auto it = std::lower_bound(layers.begin(), layers.end(), layer);
  if (it == layers.end() || *it != layer) {
    return absl::InvalidArgumentError(absl::StrCat("layer: ", layer, " is not in the layout"));
  }
  return static_cast<size_t>(it - layers.begin());
}

absl::Status Client::Gather(uint32_t layer, void* dst, MemoryKind memory) {
  ASSIGN_OR_RETURN(size_t index, LayerIndex(layer));
  if (dst == nullptr) return absl::InvalidArgumentError("dst: null");
  if (memory == MemoryKind::kHost) return layers_->Gather(index, step_, dst);
  ASSIGN_OR_RETURN(const FlatRange range, layout_.LayerRange(layer));
  const uint64_t bytes = range.size() * DTypeSize(config_.precision);
  RETURN_IF_ERROR(CheckDeviceDestination("Gather", dst, bytes));
  // A prefetched layer goes from its buffer to the device; one not fetched
  // yet comes through the bounce buffers.
  return layers_->GatherWith(
      index, step_,
      [&](const void* src) -> absl::Status {
        absl::Status s = device_->FromHostAsync(src, dst, bytes, /*lane=*/0);
        absl::Status waited = device_->WaitLane(0, RpcDeadline());
        return s.ok() ? waited : s;
      },
      [&] { return GatherRangeToDevice(range, config_.precision, dst); });
}

absl::StatusOr<const void*> Client::GatherView(uint32_t layer) {
  ASSIGN_OR_RETURN(size_t index, LayerIndex(layer));
  if (config_.stage != 3) {
    return absl::FailedPreconditionError(
        "GatherView: layer buffers exist in stage 3 only; use Gather(layer, dst)");
  }
  return layers_->View(index, step_);
}

absl::Status Client::Release(uint32_t layer) {
  ASSIGN_OR_RETURN(size_t index, LayerIndex(layer));
  layers_->Release(index);
  return absl::OkStatus();
}

absl::Status Client::Prefetch(uint32_t layer) {
  ASSIGN_OR_RETURN(size_t index, LayerIndex(layer));
  // A collective gather may not start on the prefetch thread at a time of
  // its choosing: the other ranks would not match it.
  if (collective_->gathers_parameters()) return absl::OkStatus();
  layers_->Prefetch(index, step_);
  return absl::OkStatus();
}

absl::StatusOr<CheckpointStarted> Client::SaveCheckpoint(const std::string& name) {
  if (!registered()) return absl::FailedPreconditionError("SaveCheckpoint before RegisterModel");
  RETURN_IF_ERROR(ValidateCheckpointName(name, false));
  absl::Status previous;  // the previous save's failure
  if (checkpoint_finisher_.joinable()) {
    // A save already waited for in vain is not waited for again: each save
    // until it completes is refused at once.
    if (!checkpoint_finished_->WaitForNotificationWithTimeout(
            checkpoint_waited_ ? absl::ZeroDuration() : config_.checkpoint_wait)) {
      checkpoint_waited_ = true;
      return absl::UnavailableError(absl::StrCat(
          "checkpoint \"", name, "\" was not started: the previous one, \"", checkpoint_pending_,
          "\", started ", absl::ToInt64Seconds(absl::Now() - checkpoint_started_),
          " s ago, is not yet written on every daemon (a daemon's checkpoint disk is hung or "
          "slow); training goes on, and every save is refused at once until it is "
          "(ClientConfig::checkpoint_wait)"));
    }
    absl::StatusOr<CheckpointCompleted> completed = AwaitCheckpoint();
    if (!completed.ok()) {
      previous = absl::Status(completed.status().code(),
                              absl::StrCat("checkpoint \"", checkpoint_pending_,
                                           "\" did not complete: ", completed.status().message()));
    }
  }
  absl::StatusOr<CheckpointStarted> started =
      checkpoints_->Start(name, step_.load(), RpcDeadline());
  if (!started.ok()) {
    if (previous.ok()) return started.status();
    return absl::Status(started.status().code(),
                        absl::StrCat(started.status().message(), " (and ", previous.message(), ")"));
  }
  started->previous = std::move(previous);
  checkpoint_pending_ = name;
  checkpoint_result_.reset();
  const absl::Time deadline = absl::Now() + config_.step_timeout;
  checkpoint_started_ = absl::Now();
  checkpoint_waited_ = false;
  checkpoint_finished_ = std::make_shared<absl::Notification>();
  checkpoint_finisher_ = std::thread([this, name, deadline, finished = checkpoint_finished_] {
    // Only this thread writes the result until the training thread joins it.
    checkpoint_result_ = checkpoints_->Finish(name, deadline);
    finished->Notify();
  });
  return started;
}

absl::StatusOr<CheckpointCompleted> Client::AwaitCheckpoint() {
  if (checkpoint_finisher_.joinable()) checkpoint_finisher_.join();
  if (!checkpoint_result_.has_value()) {
    return absl::FailedPreconditionError("AwaitCheckpoint: no checkpoint was saved");
  }
  return *checkpoint_result_;
}

absl::StatusOr<std::vector<v1::CheckpointInfo>> Client::ListCheckpoints() {
  return checkpoints_->List(RpcDeadline());
}

absl::StatusOr<std::unique_ptr<DaemonSliceStore>> Client::OpenActivationStore(
    uint32_t daemon, const DaemonSliceStore::Options& options) {
  if (!registered()) {
    return absl::FailedPreconditionError("OpenActivationStore before RegisterModel");
  }
  if (daemon >= channels_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("daemon: must be < ", channels_.size(),
                                                   " (the number of daemons), got ", daemon));
  }
  DaemonSliceStore::Owner owner{config_.job_id, config_.rank, incarnation_};
  return std::make_unique<DaemonSliceStore>(
      std::move(owner), config_.daemons[daemon], channels_[daemon],
      bulk_paths_.empty() ? nullptr : bulk_paths_[daemon], options);
}

absl::Status Client::Leave() {
  if (!registered()) return absl::FailedPreconditionError("Leave before RegisterModel");
  // A save being completed needs the job on the daemons.
  if (checkpoint_finisher_.joinable()) checkpoint_finisher_.join();
  heartbeat_.reset();
  // Parameter reads the daemons have not counted yet (BulkDataPath) go
  // with the Leave.
  return ForEachDaemon([this](uint32_t d) {
    const uint64_t reads = d < bulk_paths_.size() && bulk_paths_[d] != nullptr
                               ? bulk_paths_[d]->TakeUnreportedReads()
                               : 0;
    return controls_[d]->Leave(rank_id(), RpcDeadline(), reads);
  });
}

ClientMemoryReport Client::MemoryReport() const {
  ClientMemoryReport r;
  r.buffer = collective_->staging_bytes() + DeviceCopier::kLanes * bounce_bytes_;
  const uint64_t layers = registered() ? layers_->bytes() : 0;
  if (config_.precision == DType::kFp32) {
    r.param = layers;
  } else {
    r.param_half = layers;
  }
  return r;
}

ClientTrafficReport Client::TrafficReport() const {
  ClientTrafficReport r;
  r.total = traffic_.Total();
  r.current = traffic_.CurrentWindow();
  {
    absl::MutexLock lock(&report_mu_);
    r.last_step = last_step_traffic_;
  }
  if (registered()) {
    r.prefetch_hits = layers_->hits();
    r.prefetch_misses = layers_->misses();
  }
  for (const BulkDataPath* path : bulk_paths_) {
    if (path != nullptr) r.unreported_gather += path->unreported_reads();
  }
  return r;
}

}  // namespace zeroshard
