#include "client/client.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "client/daemon_control.h"
#include "client/daemon_reduce_collective.h"
#include "client/grpc_data_path.h"
#include "client/ucx_data_path.h"
#include "client/rpc.h"
#include "common/job_id.h"
#include "common/status_macros.h"

namespace zeroshard {

struct Client::LayerSlot {
  enum class State { kFree, kFetching, kReady, kHeld };
  std::unique_ptr<uint8_t[]> data;
  State state = State::kFree;
  size_t index = 0;          // position in layout_.layers()
  uint64_t after_step = 0;   // parameters as of this committed step
  bool discard = false;      // released while fetching: free it when done
  absl::Status status;       // of the fetch
  std::shared_ptr<CountDown> done;
};

struct Client::PendingCommit {
  uint64_t step = 0;
  float lr = 0;
  float clip_coef = 1.0f;
  bool skip = false;
  float grad_norm = 0;
};

namespace {

constexpr uint64_t kUploadPieceElements = 1ull << 20;  // 4 MiB of fp32 per stream
constexpr absl::Duration kMinBackoff = absl::Milliseconds(1);
constexpr absl::Duration kMaxBackoff = absl::Milliseconds(50);

absl::Status Invalid(absl::string_view field, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("ClientConfig.", field, ": ", what));
}

absl::Status ValidateConfig(const ClientConfig& c) {
  if (!IsValidJobId(c.job_id)) {
    return Invalid("job_id", absl::StrCat("must be ", kJobIdRule, ", got \"",
                                          c.job_id.substr(0, 140), "\""));
  }
  if (c.world_size < 1 || c.world_size > PartitionMap::kMaxWorldSize) {
    return Invalid("world_size", absl::StrCat("must be in 1..", PartitionMap::kMaxWorldSize,
                                              ", got ", c.world_size));
  }
  if (c.rank >= c.world_size) {
    return Invalid("rank", absl::StrCat("must be < world_size (", c.world_size, "), got ",
                                        c.rank));
  }
  if (c.daemons.empty() || c.daemons.size() > c.world_size) {
    return Invalid("daemons", absl::StrCat("needs 1..world_size (", c.world_size,
                                           ") addresses, got ", c.daemons.size()));
  }
  absl::flat_hash_set<std::string> seen;
  for (size_t i = 0; i < c.daemons.size(); ++i) {
    const std::string& d = c.daemons[i];
    const size_t colon = d.rfind(':');
    if (d.empty() || d.size() > 256 || colon == std::string::npos || colon == 0 ||
        colon + 1 == d.size()) {
      return Invalid(absl::StrCat("daemons[", i, "]"),
                     absl::StrCat("must be HOST:PORT, got \"", d.substr(0, 260), "\""));
    }
    if (!seen.insert(d).second) {
      return Invalid(absl::StrCat("daemons[", i, "]"), absl::StrCat("\"", d, "\" is listed twice"));
    }
  }
  if (c.stage < 1 || c.stage > 3) {
    return Invalid("stage", absl::StrCat("must be 1, 2 or 3, got ", c.stage));
  }
  if (c.precision != DType::kFp32 && c.precision != DType::kBf16 &&
      c.precision != DType::kFp16) {
    return Invalid("precision", absl::StrCat("unknown dtype ", static_cast<int>(c.precision)));
  }
  if (c.reduction != Reduction::kDaemon && c.reduction != Reduction::kTrainerCollective) {
    return Invalid("reduction", absl::StrCat("unknown mode ", static_cast<int>(c.reduction)));
  }
  if (c.bucket_bytes < 4096 || c.bucket_bytes > (1ull << 30)) {
    return Invalid("bucket_bytes", absl::StrCat("must be in 4 KiB..1 GiB, got ", c.bucket_bytes));
  }
  if (c.staging_buffers < 2 || c.staging_buffers > 1024) {
    return Invalid("staging_buffers", absl::StrCat("must be in 2..1024, got ", c.staging_buffers));
  }
  if (c.prefetch_depth > 64) {
    return Invalid("prefetch_depth", absl::StrCat("must be at most 64, got ", c.prefetch_depth));
  }
  if (c.layer_buffers > 1024) {
    return Invalid("layer_buffers", absl::StrCat("must be at most 1024, got ", c.layer_buffers));
  }
  if (c.micro_batches < 1 || c.micro_batches > 4096) {
    return Invalid("micro_batches", absl::StrCat("must be in 1..4096, got ", c.micro_batches));
  }
  const OptimizerOptions& o = c.optimizer;
  if (o.kind != Optimizer::kAdamW && o.kind != Optimizer::kAdam &&
      o.kind != Optimizer::kSgdMomentum) {
    return Invalid("optimizer.kind", absl::StrCat("unknown kind ", static_cast<int>(o.kind)));
  }
  if (!std::isfinite(o.lr) || o.lr < 0) {
    return Invalid("optimizer.lr", absl::StrCat("must be finite and >= 0, got ", o.lr));
  }
  if (o.kind != Optimizer::kSgdMomentum) {
    if (!(o.beta1 >= 0 && o.beta1 < 1)) {
      return Invalid("optimizer.beta1", absl::StrCat("must be in [0, 1), got ", o.beta1));
    }
    if (!(o.beta2 >= 0 && o.beta2 < 1)) {
      return Invalid("optimizer.beta2", absl::StrCat("must be in [0, 1), got ", o.beta2));
    }
    if (!(o.eps > 0) || !std::isfinite(o.eps)) {
      return Invalid("optimizer.eps", absl::StrCat("must be finite and > 0, got ", o.eps));
    }
  } else if (!(o.momentum >= 0 && o.momentum < 1)) {
    return Invalid("optimizer.momentum", absl::StrCat("must be in [0, 1), got ", o.momentum));
  }
  if (!std::isfinite(o.weight_decay) || o.weight_decay < 0) {
    return Invalid("optimizer.weight_decay",
                   absl::StrCat("must be finite and >= 0, got ", o.weight_decay));
  }
  if (!std::isfinite(c.max_grad_norm) || c.max_grad_norm < 0) {
    return Invalid("max_grad_norm",
                   absl::StrCat("must be finite and >= 0 (0: no clipping), got ", c.max_grad_norm));
  }
  const LossScaleOptions& ls = c.loss_scale;
  if (!std::isfinite(ls.initial_scale) || ls.initial_scale <= 0) {
    return Invalid("loss_scale.initial_scale",
                   absl::StrCat("must be finite and > 0, got ", ls.initial_scale));
  }
  if (ls.dynamic) {
    if (ls.growth_interval < 1) return Invalid("loss_scale.growth_interval", "must be >= 1");
    if (!(ls.growth_factor > 1) || !std::isfinite(ls.growth_factor)) {
      return Invalid("loss_scale.growth_factor",
                     absl::StrCat("must be finite and > 1, got ", ls.growth_factor));
    }
    if (!(ls.backoff_factor > 0 && ls.backoff_factor < 1)) {
      return Invalid("loss_scale.backoff_factor",
                     absl::StrCat("must be in (0, 1), got ", ls.backoff_factor));
    }
  }
  if (c.rpc_timeout <= absl::ZeroDuration() || c.rpc_timeout == absl::InfiniteDuration()) {
    return Invalid("rpc_timeout", "must be positive and finite");
  }
  if (c.step_timeout <= absl::ZeroDuration() || c.step_timeout == absl::InfiniteDuration()) {
    return Invalid("step_timeout", "must be positive and finite");
  }
  if (c.transport != "grpc" && c.transport != "ucx") {
    return Invalid("transport", absl::StrCat("unknown transport \"", c.transport,
                                             "\" (available: grpc, ucx)"));
  }
  if (c.sender_threads < 1 || c.sender_threads > 64) {
    return Invalid("sender_threads", absl::StrCat("must be in 1..64, got ", c.sender_threads));
  }
  if (c.ucx_progress_threads < 1 || c.ucx_progress_threads > 16) {
    return Invalid("ucx_progress_threads",
                   absl::StrCat("must be in 1..16, got ", c.ucx_progress_threads));
  }
  if (c.io_threads < 1 || c.io_threads > 64) {
    return Invalid("io_threads", absl::StrCat("must be in 1..64, got ", c.io_threads));
  }
  return absl::OkStatus();
}

// The global gradient norm from every daemon's partial sum of squares,
// summed in daemon order, so that every rank computes the same bits.
float GlobalNorm(const std::vector<std::optional<v1::PrepareStepResponse>>& prepared) {
  double sum_sq = 0;
  for (const auto& p : prepared) sum_sq += p->grad_sq_sum();
  return static_cast<float>(std::sqrt(sum_sq));
}

// torch.nn.utils.clip_grad_norm_'s coefficient.
float ClipCoef(float norm, float max_grad_norm) {
  return std::min(1.0f, max_grad_norm / (norm + 1e-6f));
}

v1::JobSpec BuildJobSpec(const ClientConfig& c, const Layout& layout) {
  v1::JobSpec spec;
  spec.set_job_id(c.job_id);
  v1::Layout* l = spec.mutable_layout();
  l->set_alignment_elements(static_cast<uint32_t>(layout.alignment()));
  for (const TensorPlacement& t : layout.tensors()) {
    v1::TensorSpec* s = l->add_tensors();
    s->set_name(t.spec.name);
    for (int64_t d : t.spec.shape) s->add_shape(d);
    s->set_dtype(WireDType(t.spec.dtype));
    s->set_layer(t.spec.layer);
  }
  spec.set_layout_fingerprint(layout.fingerprint());
  spec.set_stage(c.stage);
  spec.set_world_size(c.world_size);
  spec.set_precision(WireDType(c.precision));
  spec.set_reduction(c.reduction == Reduction::kDaemon ? v1::REDUCTION_MODE_DAEMON
                                                       : v1::REDUCTION_MODE_TRAINER_COLLECTIVE);
  v1::OptimizerConfig* o = spec.mutable_optimizer();
  switch (c.optimizer.kind) {
    case Optimizer::kAdamW: o->set_kind(v1::OPTIMIZER_KIND_ADAMW); break;
    case Optimizer::kAdam: o->set_kind(v1::OPTIMIZER_KIND_ADAM); break;
    case Optimizer::kSgdMomentum: o->set_kind(v1::OPTIMIZER_KIND_SGD_MOMENTUM); break;
  }
  o->set_lr(c.optimizer.lr);
  o->set_beta1(c.optimizer.beta1);
  o->set_beta2(c.optimizer.beta2);
  o->set_eps(c.optimizer.eps);
  o->set_weight_decay(c.optimizer.weight_decay);
  o->set_momentum(c.optimizer.momentum);
  v1::LossScaleConfig* ls = spec.mutable_loss_scale();
  ls->set_dynamic(c.loss_scale.dynamic);
  ls->set_initial_scale(c.loss_scale.initial_scale);
  if (c.loss_scale.dynamic) {
    ls->set_growth_interval(c.loss_scale.growth_interval);
    ls->set_growth_factor(c.loss_scale.growth_factor);
    ls->set_backoff_factor(c.loss_scale.backoff_factor);
  }
  spec.set_bucket_bytes(c.bucket_bytes);
  for (const std::string& d : c.daemons) spec.add_daemons(d);
  return spec;
}

// The data path of `transport` (ValidateConfig admits only the ones here).
std::unique_ptr<DataPath> MakeDataPath(const ClientConfig& c, const std::string& address,
                                       std::shared_ptr<grpc::Channel> channel,
                                       std::shared_ptr<transport::Transport> bulk) {
  if (c.transport == "grpc") return std::make_unique<GrpcDataPath>(address, std::move(channel));
  if (c.transport == "ucx") {
    return std::make_unique<UcxDataPath>(address, std::move(channel), std::move(bulk),
                                         c.ucx_progress_threads);
  }
  return nullptr;
}

// Sleeps for the current backoff (never past `deadline`) and doubles it.
void Backoff(absl::Duration* backoff, absl::Time deadline) {
  absl::SleepFor(std::max(absl::ZeroDuration(), std::min(*backoff, deadline - absl::Now())));
  *backoff = std::min(*backoff * 2, kMaxBackoff);
}

}  // namespace

Client::Client(ClientConfig config, std::unique_ptr<Collective> collective)
    : config_(std::move(config)), collective_(std::move(collective)) {
  loss_scale_ = config_.loss_scale.initial_scale;
}

Client::~Client() {
  prefetcher_.reset();
  io_.reset();
  collective_.reset();
}

absl::StatusOr<std::unique_ptr<Client>> Client::Create(ClientConfig config,
                                                       std::unique_ptr<Collective> collective) {
  RETURN_IF_ERROR(ValidateConfig(config));
  if (collective == nullptr) {
    if (config.reduction == Reduction::kTrainerCollective) {
      return absl::UnimplementedError(
          "ClientConfig.reduction: the trainer collective (NCCL) is not built into this "
          "client; pass a Collective to Client::Create or use Reduction::kDaemon");
    }
    DaemonReduceCollective::Options o;
    o.bucket_bytes = config.bucket_bytes;
    o.wire_dtype = config.precision;
    o.staging_buffers = config.staging_buffers;
    o.sender_threads = config.sender_threads;
    ASSIGN_OR_RETURN(std::unique_ptr<DaemonReduceCollective> c, DaemonReduceCollective::Create(o));
    collective = std::move(c);
  }
  std::unique_ptr<Client> client(new Client(std::move(config), std::move(collective)));
  const ClientConfig& c = client->config_;
  if (c.transport == "ucx") {
    transport::TransportOptions to;
    to.name = absl::StrCat("client ", c.job_id, " rank ", c.rank);
    to.ucx_tls = c.ucx_tls;
    to.progress_threads = c.ucx_progress_threads;
    ASSIGN_OR_RETURN(std::unique_ptr<transport::Transport> t,
                     transport::CreateTransport("ucx", to), "ClientConfig.transport \"ucx\"");
    client->transport_ = std::move(t);
  }
  for (const std::string& address : c.daemons) {
    std::shared_ptr<grpc::Channel> channel = MakeDaemonChannel(address);
    client->controls_.push_back(std::make_unique<DaemonControl>(address, channel));
    client->data_paths_.push_back(
        MakeDataPath(c, address, channel, client->transport_));
  }
  client->io_ = std::make_unique<Executor>(c.io_threads);
  client->prefetcher_ = std::make_unique<Executor>(1);
  return client;
}

absl::Status Client::ForEachDaemon(const std::function<absl::Status(uint32_t)>& fn) {
  const uint32_t n = static_cast<uint32_t>(controls_.size());
  auto group = std::make_shared<CountDown>(n);
  for (uint32_t d = 0; d < n; ++d) {
    io_->Submit([group, &fn, d] { group->Done(fn(d)); });
  }
  // `fn` refers to the caller's state, so this must not return before every
  // call has; each call bounds its own RPCs with deadlines, so the wait ends.
  return group->Wait(absl::InfiniteFuture(), "calls to every daemon");
}

absl::Status Client::RegisterModel(const Layout& layout, const float* initial_params) {
  if (registered_) {
    return absl::FailedPreconditionError("RegisterModel: this client already registered a model");
  }
  if (bound_fingerprint_.has_value() && *bound_fingerprint_ != layout.fingerprint()) {
    return absl::FailedPreconditionError(
        "RegisterModel: a retry must pass the layout of the first attempt");
  }
  ASSIGN_OR_RETURN(PartitionMap map,
                   PartitionMap::Create(layout.total_elements(), config_.world_size,
                                        static_cast<uint32_t>(config_.daemons.size())));
  const v1::JobSpec spec = BuildJobSpec(config_, layout);
  RETURN_IF_ERROR(ForEachDaemon([&](uint32_t d) -> absl::Status {
    ASSIGN_OR_RETURN(v1::RegisterJobResponse r,
                     controls_[d]->RegisterJob(spec, d, RpcDeadline()));
    const v1::PartitionMap& m = r.partition_map();
    if (m.total_elements() != map.total_elements() ||
        m.partition_elements() != map.partition_elements()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "daemon ", controls_[d]->address(), ": partition map of ", m.total_elements(), "/",
          m.partition_elements(), " elements, this client computes ", map.total_elements(), "/",
          map.partition_elements()));
    }
    return absl::OkStatus();
  }));
  layout_ = layout;
  map_ = map;

  CollectiveJob job;
  job.job_id = config_.job_id;
  job.rank = config_.rank;
  job.world_size = config_.world_size;
  job.layout = &layout_;
  job.map = &map_;
  job.wire_dtype = config_.precision;
  job.bucket_bytes = config_.bucket_bytes;
  job.micro_batches = config_.micro_batches;
  for (const auto& p : data_paths_) job.daemons.push_back(p.get());
  job.traffic = &traffic_;
  job.rpc_timeout = config_.rpc_timeout;
  if (!bound_fingerprint_.has_value()) {
    RETURN_IF_ERROR(collective_->Bind(job));
    bound_fingerprint_ = layout_.fingerprint();
  }

  // Rank 0 uploads before it joins, so that "every rank joined" implies the
  // parameters are in place.
  if (config_.rank == 0 && initial_params != nullptr) {
    std::vector<uint64_t> committed(controls_.size());
    RETURN_IF_ERROR(ForEachDaemon([&](uint32_t d) -> absl::Status {
      ASSIGN_OR_RETURN(committed[d],
                       controls_[d]->Heartbeat(config_.job_id, config_.rank, RpcDeadline()));
      return absl::OkStatus();
    }));
    if (*std::max_element(committed.begin(), committed.end()) == 0) {
      RETURN_IF_ERROR(UploadInitialParams(initial_params));
    }
  }
  v1::JoinJobRequest join;
  join.set_job_id(config_.job_id);
  join.set_rank(config_.rank);
  join.set_layout_fingerprint(layout_.fingerprint());
  join.set_stage(config_.stage);
  join.set_world_size(config_.world_size);
  join.set_precision(WireDType(config_.precision));
  std::vector<uint64_t> committed(controls_.size());
  RETURN_IF_ERROR(ForEachDaemon([&](uint32_t d) -> absl::Status {
    ASSIGN_OR_RETURN(v1::JoinJobResponse r, controls_[d]->JoinJob(join, RpcDeadline()));
    committed[d] = r.committed_step();
    return absl::OkStatus();
  }));
  for (size_t d = 1; d < committed.size(); ++d) {
    if (committed[d] != committed[0]) {
      return absl::FailedPreconditionError(absl::StrCat(
          "job ", config_.job_id, ": daemons disagree on the committed step (",
          controls_[0]->address(), " has ", committed[0], ", ", controls_[d]->address(),
          " has ", committed[d], ")"));
    }
  }
  step_ = committed[0];
  RETURN_IF_ERROR(AwaitAllRanksJoined());
  if (config_.stage == 3) {
    absl::MutexLock lock(&layer_mu_);
    if (slots_.empty()) {  // a retried RegisterModel keeps them
      uint64_t largest = 0;
      for (uint32_t l : layout_.layers()) {
        largest = std::max(largest, layout_.LayerRange(l)->size());
      }
      layer_buffer_bytes_ = largest * DTypeSize(config_.precision);
      const uint32_t count =
          config_.layer_buffers != 0 ? config_.layer_buffers : config_.prefetch_depth + 2;
      for (uint32_t i = 0; i < count; ++i) {
        auto slot = std::make_unique<LayerSlot>();
        slot->data.reset(new uint8_t[layer_buffer_bytes_]);
        slots_.push_back(std::move(slot));
      }
    }
  }
  registered_ = true;
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
                                      DType::kFp32));
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

absl::Status Client::AwaitAllRanksJoined() {
  const absl::Time deadline = absl::Now() + config_.step_timeout;
  absl::Duration backoff = kMinBackoff;
  std::vector<bool> ready(controls_.size(), false);
  for (;;) {
    std::string waiting;
    for (size_t d = 0; d < controls_.size(); ++d) {
      if (ready[d]) continue;
      ASSIGN_OR_RETURN(v1::JobStatus s,
                       controls_[d]->JobStatus(config_.job_id, std::min(RpcDeadline(), deadline)));
      ready[d] = s.ranks_connected() >= config_.world_size;
      if (!ready[d] && waiting.empty()) {
        waiting = absl::StrCat(controls_[d]->address(), " has ", s.ranks_connected(), " of ",
                               config_.world_size, " ranks");
      }
    }
    if (waiting.empty()) return absl::OkStatus();
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "RegisterModel: not every rank joined job ", config_.job_id, " within step_timeout (",
          absl::FormatDuration(config_.step_timeout), "): daemon ", waiting));
    }
    Backoff(&backoff, deadline);
  }
}

absl::StatusOr<PushTicket> Client::PushGradients(const FlatRange& range, const void* grads,
                                                 DType dtype, uint32_t micro_batch,
                                                 BufferUse use) {
  if (!registered_) return absl::FailedPreconditionError("PushGradients before RegisterModel");
  if (dtype != DType::kFp32 && dtype != DType::kBf16 && dtype != DType::kFp16) {
    return absl::InvalidArgumentError(
        absl::StrCat("dtype: unknown dtype ", static_cast<int>(dtype)));
  }
  if (range.empty() || range.end > layout_.total_elements()) {
    return absl::InvalidArgumentError(
        absl::StrCat("range: [", range.begin, ", ", range.end, ") is empty or outside the ",
                     "flat space [0, ", layout_.total_elements(), ")"));
  }
  return collective_->Reduce(step_ + 1, micro_batch, range, grads, dtype, use, RpcDeadline());
}

absl::StatusOr<StepResult> Client::Step(float lr) {
  if (!registered_) return absl::FailedPreconditionError("Step before RegisterModel");
  if (!std::isfinite(lr) || lr < 0) {
    return absl::InvalidArgumentError(absl::StrCat("lr: must be finite and >= 0, got ", lr));
  }
  {
    absl::MutexLock lock(&layer_mu_);
    for (const auto& s : slots_) {
      if (s->state == LayerSlot::State::kHeld) {
        return absl::FailedPreconditionError(
            absl::StrCat("Step: layer ", layout_.layers()[s->index],
                         " is still held by GatherView; Release it first"));
      }
    }
  }
  const uint64_t step = step_.load() + 1;
  absl::StatusOr<StepResult> result;
  if (pending_commit_ != nullptr && pending_commit_->step == step) {
    result = Commit(*pending_commit_);  // a retry after a failed commit phase
  } else {
    RETURN_IF_ERROR(collective_->Finish(step, absl::Now() + config_.step_timeout));
    result = config_.rank == 0 ? LeaderStep(step, lr) : FollowerStep(step, lr);
  }
  if (!result.ok()) return result;
  step_ = step;
  loss_scale_ = result->loss_scale;
  {
    absl::MutexLock lock(&report_mu_);
    last_step_traffic_ = traffic_.CloseWindow();
  }
  RETURN_IF_ERROR(DiscardLayerSlots());
  last_layer_index_ = -1;
  return result;
}

absl::StatusOr<StepResult> Client::LeaderStep(uint64_t step, float lr) {
  const absl::Time deadline = absl::Now() + config_.step_timeout;
  const size_t n = controls_.size();
  std::vector<std::optional<v1::PrepareStepResponse>> prepared(n);
  std::vector<bool> step_checked(n, false);
  absl::Duration backoff = kMinBackoff;
  for (;;) {
    std::string waiting;
    for (size_t d = 0; d < n; ++d) {
      if (prepared[d].has_value()) continue;
      absl::StatusOr<v1::PrepareStepResponse> r =
          controls_[d]->PrepareStep(config_.job_id, step, std::min(RpcDeadline(), deadline));
      if (r.ok()) {
        prepared[d] = *std::move(r);
        continue;
      }
      if (!absl::IsFailedPrecondition(r.status())) return r.status();
      // Incomplete gradients (retry) or a daemon on another step (fail).
      if (!step_checked[d]) {
        ASSIGN_OR_RETURN(uint64_t committed,
                         controls_[d]->Heartbeat(config_.job_id, config_.rank, RpcDeadline()));
        if (committed + 1 != step) {
          return absl::FailedPreconditionError(absl::StrCat(
              "Step ", step, ": daemon ", controls_[d]->address(), " has committed step ",
              committed, ", this client expected ", step - 1));
        }
        step_checked[d] = true;
      }
      if (waiting.empty()) waiting = std::string(r.status().message());
    }
    if (waiting.empty()) break;
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "Step ", step, ": not every rank's gradients arrived within step_timeout (",
          absl::FormatDuration(config_.step_timeout), "): ", waiting));
    }
    Backoff(&backoff, deadline);
  }
  bool found_inf_nan = false;
  for (size_t d = 0; d < n; ++d) found_inf_nan = found_inf_nan || prepared[d]->found_inf_nan();
  auto commit = std::make_unique<PendingCommit>();
  commit->step = step;
  commit->lr = lr;
  commit->grad_norm = GlobalNorm(prepared);
  commit->skip = found_inf_nan || !std::isfinite(commit->grad_norm);
  if (!commit->skip && config_.max_grad_norm > 0) {
    commit->clip_coef = ClipCoef(commit->grad_norm, config_.max_grad_norm);
  }
  pending_commit_ = std::move(commit);
  return Commit(*pending_commit_);
}

absl::StatusOr<StepResult> Client::Commit(const PendingCommit& commit) {
  v1::CommitStepRequest request;
  request.set_job_id(config_.job_id);
  request.set_step(commit.step);
  request.set_clip_coef(commit.clip_coef);
  request.set_skip(commit.skip);
  request.set_lr(commit.lr);
  std::vector<v1::CommitStepResponse> responses(controls_.size());
  RETURN_IF_ERROR(ForEachDaemon([&](uint32_t d) -> absl::Status {
    ASSIGN_OR_RETURN(responses[d], controls_[d]->CommitStep(request, RpcDeadline()));
    if (responses[d].committed_step() != commit.step) {
      return absl::InternalError(absl::StrCat("daemon ", controls_[d]->address(),
                                              ": CommitStep ", commit.step, " answered step ",
                                              responses[d].committed_step()));
    }
    return absl::OkStatus();
  }));
  StepResult result;
  result.step = commit.step;
  result.skipped = responses[0].skipped();
  result.loss_scale = responses[0].loss_scale();
  result.have_norm = true;
  result.grad_norm = commit.grad_norm;
  result.clip_coef = commit.clip_coef;
  pending_commit_.reset();
  return result;
}

absl::StatusOr<StepResult> Client::FollowerStep(uint64_t step, float lr) {
  const absl::Time deadline = absl::Now() + config_.step_timeout;
  const size_t n = controls_.size();
  std::vector<std::optional<v1::PrepareStepResponse>> prepared(n);
  std::vector<bool> committed(n, false);
  absl::Duration backoff = kMinBackoff;
  for (;;) {
    std::string waiting;
    for (size_t d = 0; d < n; ++d) {
      if (committed[d]) continue;
      ASSIGN_OR_RETURN(uint64_t c, controls_[d]->Heartbeat(config_.job_id, config_.rank,
                                                           std::min(RpcDeadline(), deadline)));
      if (c > step || c + 1 < step) {
        return absl::FailedPreconditionError(absl::StrCat(
            "Step ", step, ": daemon ", controls_[d]->address(), " has committed step ", c,
            ", this client expected ", step - 1, " or ", step));
      }
      if (c == step) {
        committed[d] = true;
        continue;
      }
      if (waiting.empty()) {
        waiting = absl::StrCat("daemon ", controls_[d]->address(), " has not committed it");
      }
      if (prepared[d].has_value()) continue;
      // Learn the norm while the daemon still has it (before the commit).
      absl::StatusOr<v1::PrepareStepResponse> r =
          controls_[d]->PrepareStep(config_.job_id, step, std::min(RpcDeadline(), deadline));
      if (r.ok()) {
        prepared[d] = *std::move(r);
      } else if (!absl::IsFailedPrecondition(r.status())) {
        return r.status();
      }
    }
    if (waiting.empty()) break;
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "Step ", step, ": the leader (rank 0) did not commit within step_timeout (",
          absl::FormatDuration(config_.step_timeout), "): ", waiting));
    }
    Backoff(&backoff, deadline);
  }
  // CommitStep of the committed step only replays the daemon's answer.
  v1::CommitStepRequest replay;
  replay.set_job_id(config_.job_id);
  replay.set_step(step);
  replay.set_lr(lr);
  ASSIGN_OR_RETURN(v1::CommitStepResponse r, controls_[0]->CommitStep(replay, RpcDeadline()));
  StepResult result;
  result.step = step;
  result.skipped = r.skipped();
  result.loss_scale = r.loss_scale();
  result.have_norm = std::all_of(prepared.begin(), prepared.end(),
                                 [](const auto& p) { return p.has_value(); });
  if (result.have_norm) {
    result.grad_norm = GlobalNorm(prepared);
    if (!result.skipped && config_.max_grad_norm > 0) {
      result.clip_coef = ClipCoef(result.grad_norm, config_.max_grad_norm);
    }
  }
  return result;
}

absl::Status Client::GatherRange(const FlatRange& range, DType dtype, uint64_t after_step,
                                 void* dst) {
  const size_t esize = DTypeSize(dtype);
  const uint64_t request_elements =
      std::max<uint64_t>(1, std::min(config_.bucket_bytes, BucketPlan::kMaxChunkBytes) / esize);
  struct Request {
    uint32_t daemon;
    FlatRange range;
  };
  std::vector<Request> requests;
  for (uint32_t d = 0; d < map_.num_daemons(); ++d) {
    const FlatRange piece = map_.DaemonRange(d).Intersect(range);
    for (uint64_t b = piece.begin; b < piece.end; b += request_elements) {
      requests.push_back({d, {b, std::min(piece.end, b + request_elements)}});
    }
  }
  auto group = std::make_shared<CountDown>(static_cast<int64_t>(requests.size()));
  auto cancelled = std::make_shared<std::atomic<bool>>(false);
  for (const Request& r : requests) {
    void* out = static_cast<uint8_t*>(dst) + (r.range.begin - range.begin) * esize;
    io_->Submit([this, r, out, dtype, after_step, group, cancelled] {
      if (cancelled->load()) {
        group->Done(absl::CancelledError("gather abandoned"));
        return;
      }
      GatherRequestSpec spec;
      spec.job_id = config_.job_id;
      spec.rank = config_.rank;
      spec.after_step = after_step;
      spec.range = r.range;
      spec.dtype = dtype;
      spec.wait = config_.rpc_timeout;
      absl::StatusOr<uint64_t> bytes = data_paths_[r.daemon]->Gather(spec, out, RpcDeadline());
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

absl::Status Client::GatherAll(void* dst, DType dtype) {
  if (!registered_) return absl::FailedPreconditionError("GatherAll before RegisterModel");
  if (dtype != DType::kFp32 && dtype != config_.precision) {
    return absl::InvalidArgumentError(absl::StrCat("dtype: must be fp32 or the job's precision (",
                                                   DTypeName(config_.precision), "), got ",
                                                   DTypeName(dtype)));
  }
  if (dst == nullptr) return absl::InvalidArgumentError("dst: null");
  return GatherRange({0, layout_.total_elements()}, dtype, step_, dst);
}

absl::StatusOr<uint64_t> Client::layer_elements(uint32_t layer) const {
  ASSIGN_OR_RETURN(FlatRange r, layout_.LayerRange(layer));
  return r.size();
}

absl::StatusOr<size_t> Client::LayerIndex(uint32_t layer) const {
  if (!registered_) return absl::FailedPreconditionError("layer gather before RegisterModel");
  const auto& layers = layout_.layers();
  auto it = std::lower_bound(layers.begin(), layers.end(), layer);
  if (it == layers.end() || *it != layer) {
    return absl::InvalidArgumentError(absl::StrCat("layer: ", layer, " is not in the layout"));
  }
  return static_cast<size_t>(it - layers.begin());
}

Client::LayerSlot* Client::FindSlot(size_t index) {
  for (const auto& s : slots_) {
    if (s->state != LayerSlot::State::kFree && !s->discard && s->index == index &&
        s->after_step == step_) {
      return s.get();
    }
  }
  return nullptr;
}

Client::LayerSlot* Client::StartFetch(size_t index) {
  LayerSlot* slot = nullptr;
  for (const auto& s : slots_) {
    if (s->state == LayerSlot::State::kFree) {
      slot = s.get();
      break;
    }
  }
  if (slot == nullptr) return nullptr;
  slot->state = LayerSlot::State::kFetching;
  slot->index = index;
  slot->after_step = step_;
  slot->discard = false;
  slot->status = absl::OkStatus();
  slot->done = std::make_shared<CountDown>(1);
  const FlatRange range = *layout_.LayerRange(layout_.layers()[index]);
  prefetcher_->Submit([this, slot, range, after = step_.load(), done = slot->done] {
    const absl::Status s = GatherRange(range, config_.precision, after, slot->data.get());
    {
      absl::MutexLock lock(&layer_mu_);
      slot->status = s;
      // A failed fetch stays visible (kReady with its error) to whoever asks
      // for the layer; a released one goes back to the pool.
      slot->state = slot->discard ? LayerSlot::State::kFree : LayerSlot::State::kReady;
      slot->discard = false;
    }
    done->Done(s);
  });
  return slot;
}

absl::StatusOr<Client::LayerSlot*> Client::AcquireLayer(size_t index) {
  const absl::Time deadline = absl::Now() + config_.step_timeout;
  LayerSlot* slot = nullptr;
  std::shared_ptr<CountDown> done;
  while (done == nullptr) {
    std::shared_ptr<CountDown> fetching;
    {
      absl::MutexLock lock(&layer_mu_);
      slot = FindSlot(index);
      if (slot != nullptr) {
        ++prefetch_hits_;
      } else {
        // Evict a prefetched layer nobody has asked for yet.
        for (const auto& s : slots_) {
          if (s->state == LayerSlot::State::kReady && s->index != index) {
            s->state = LayerSlot::State::kFree;
            break;
          }
        }
        slot = StartFetch(index);
        if (slot != nullptr) ++prefetch_misses_;
      }
      if (slot != nullptr) {
        done = slot->done;
        break;
      }
      // Every buffer is held or being filled: wait for a fill to end.
      for (const auto& s : slots_) {
        if (s->state == LayerSlot::State::kFetching) fetching = s->done;
      }
      if (fetching == nullptr) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "GatherView: all ", slots_.size(), " layer buffers are held; Release a layer first"));
      }
    }
    if (absl::IsDeadlineExceeded(fetching->Wait(deadline, "layer prefetch"))) {
      return absl::DeadlineExceededError(
          "GatherView: no layer buffer became free within step_timeout");
    }
  }
  absl::Status s = done->Wait(deadline, "layer gather");
  absl::MutexLock lock(&layer_mu_);
  if (!s.ok()) {
    if (slot->state == LayerSlot::State::kReady) slot->state = LayerSlot::State::kFree;
    return s;
  }
  slot->state = LayerSlot::State::kHeld;
  return slot;
}

void Client::PrefetchAfter(size_t index) {
  const bool backward = last_layer_index_ >= 0 && static_cast<int64_t>(index) <= last_layer_index_;
  last_layer_index_ = static_cast<int64_t>(index);
  const int64_t layers = static_cast<int64_t>(layout_.layers().size());
  absl::MutexLock lock(&layer_mu_);
  for (uint32_t k = 1; k <= config_.prefetch_depth; ++k) {
    const int64_t j = backward ? static_cast<int64_t>(index) - k : static_cast<int64_t>(index) + k;
    if (j < 0 || j >= layers) break;
    if (FindSlot(static_cast<size_t>(j)) != nullptr) continue;
    if (StartFetch(static_cast<size_t>(j)) == nullptr) break;
  }
}

absl::Status Client::Gather(uint32_t layer, void* dst) {
  ASSIGN_OR_RETURN(size_t index, LayerIndex(layer));
  if (dst == nullptr) return absl::InvalidArgumentError("dst: null");
  const FlatRange range = *layout_.LayerRange(layer);
  std::shared_ptr<CountDown> done;
  LayerSlot* slot = nullptr;
  {
    absl::MutexLock lock(&layer_mu_);
    slot = FindSlot(index);
    if (slot != nullptr) done = slot->done;
  }
  if (slot == nullptr) {
    ++prefetch_misses_;
    RETURN_IF_ERROR(GatherRange(range, config_.precision, step_, dst));
  } else {
    ++prefetch_hits_;
    absl::Status s = done->Wait(absl::Now() + config_.step_timeout, "layer prefetch");
    absl::MutexLock lock(&layer_mu_);
    if (s.ok()) {
      std::memcpy(dst, slot->data.get(), range.size() * DTypeSize(config_.precision));
    }
    if (slot->state == LayerSlot::State::kReady) slot->state = LayerSlot::State::kFree;
    RETURN_IF_ERROR(s);
  }
  PrefetchAfter(index);
  return absl::OkStatus();
}

absl::StatusOr<const void*> Client::GatherView(uint32_t layer) {
  ASSIGN_OR_RETURN(size_t index, LayerIndex(layer));
  if (config_.stage != 3) {
    return absl::FailedPreconditionError(
        "GatherView: layer buffers exist in stage 3 only; use Gather(layer, dst)");
  }
  ASSIGN_OR_RETURN(LayerSlot * slot, AcquireLayer(index));
  PrefetchAfter(index);
  return static_cast<const void*>(slot->data.get());
}

absl::Status Client::Release(uint32_t layer) {
  ASSIGN_OR_RETURN(size_t index, LayerIndex(layer));
  absl::MutexLock lock(&layer_mu_);
  for (const auto& s : slots_) {
    if (s->state == LayerSlot::State::kFree || s->index != index) continue;
    if (s->state == LayerSlot::State::kFetching) {
      s->discard = true;
    } else {
      s->state = LayerSlot::State::kFree;
    }
  }
  return absl::OkStatus();
}

absl::Status Client::Prefetch(uint32_t layer) {
  ASSIGN_OR_RETURN(size_t index, LayerIndex(layer));
  absl::MutexLock lock(&layer_mu_);
  if (FindSlot(index) == nullptr) StartFetch(index);
  return absl::OkStatus();
}

absl::Status Client::DiscardLayerSlots() {
  std::vector<std::shared_ptr<CountDown>> fetching;
  {
    absl::MutexLock lock(&layer_mu_);
    for (const auto& s : slots_) {
      if (s->state == LayerSlot::State::kFetching) {
        s->discard = true;
        fetching.push_back(s->done);
      } else {
        s->state = LayerSlot::State::kFree;
      }
    }
  }
  const absl::Time deadline = absl::Now() + config_.step_timeout;
  for (const auto& f : fetching) {
    absl::Status s = f->Wait(deadline, "layer prefetch");
    if (absl::IsDeadlineExceeded(s)) return s;
  }
  return absl::OkStatus();
}

absl::Status Client::Leave() {
  if (!registered_) return absl::FailedPreconditionError("Leave before RegisterModel");
  return ForEachDaemon([this](uint32_t d) {
    return controls_[d]->Leave(config_.job_id, config_.rank, RpcDeadline());
  });
}

ClientMemoryReport Client::MemoryReport() const {
  ClientMemoryReport r;
  r.buffer = collective_->staging_bytes();
  uint64_t layers = 0;
  {
    absl::MutexLock lock(&layer_mu_);
    layers = slots_.size() * layer_buffer_bytes_;
  }
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
  r.prefetch_hits = prefetch_hits_.load();
  r.prefetch_misses = prefetch_misses_.load();
  return r;
}

}  // namespace zeroshard
