#include "examples/trainer.h"


#include <csignal>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>

#include "ATen/native/Resize.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "client/gloo_collective.h"
#include "common/status_macros.h"
#include "examples/activation_store.h"

namespace zeroshard::examples {
namespace {

absl::Status CheckOptions(const TrainOptions& o) {
  RETURN_IF_ERROR(ValidateConfig(o.model));
  if (o.steps < 1) return absl::InvalidArgumentError("steps: must be >= 1");
  if (o.checkpoint_every < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint_every: must be >= 0, got ", o.checkpoint_every));
  }
  if (o.activations != "local" && o.activations != "daemon" && o.activations != "both" &&
      o.activations != "keep") {
    return absl::InvalidArgumentError(absl::StrCat(
        "activations: local, daemon, both or keep, got \"", o.activations.substr(0, 64), "\""));
  }
  if (o.activations != "local" && o.stage != 3) {
    return absl::InvalidArgumentError(absl::StrCat(
        "activations: ", o.activations, " needs stage 3 (stages 0-2 keep autograd's "
        "activations), got stage ", o.stage));
  }
  if (o.activation_prefetch_depth < 1 || o.activation_offloads_in_flight < 1) {
    return absl::InvalidArgumentError(
        "activation_prefetch_depth and activation_offloads_in_flight: must be >= 1");
  }
  if (o.world_size < 1 || o.global_batch < 1 || o.global_batch % o.world_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "global_batch: must be a positive multiple of world_size (", o.world_size, "), got ",
        o.global_batch));
  }
  return absl::OkStatus();
}

// Layer `layer`'s parameters as tensors with storage of their own (resizable),
// copied from `flat` (whose first element is flat element `flat_begin`),
// requiring gradients.
std::vector<torch::Tensor> OwnedLayerParams(const Layout& layout, int layer, const float* flat,
                                            uint64_t flat_begin) {
  std::vector<torch::Tensor> out;
  for (const TensorPlacement& t : layout.tensors()) {
    if (t.spec.layer != static_cast<uint32_t>(layer)) continue;
    torch::Tensor v = torch::empty(t.spec.shape, torch::kFloat32);
    std::memcpy(v.data_ptr<float>(), flat + (t.offset - flat_begin), t.numel * sizeof(float));
    out.push_back(v.requires_grad_(true));
  }
  return out;
}

// Frees the bytes of each tensor's storage: autograd keeps the tensors (and
// views of them) for backward; FillLayerStorage gives them bytes again.
void FreeLayerStorage(const std::vector<torch::Tensor>& params) {
  for (const torch::Tensor& t : params) {
    at::native::resize_bytes_cpu(t.storage().unsafeGetStorageImpl(), 0);
  }
}

// Allocates each tensor's storage again and copies its values from `flat`
// (as OwnedLayerParams).
void FillLayerStorage(const Layout& layout, int layer, const float* flat, uint64_t flat_begin,
                      const std::vector<torch::Tensor>& params) {
  size_t k = 0;
  for (const TensorPlacement& t : layout.tensors()) {
    if (t.spec.layer != static_cast<uint32_t>(layer)) continue;
    const torch::Tensor& v = params[k++];
    at::native::resize_bytes_cpu(v.storage().unsafeGetStorageImpl(), t.numel * sizeof(float));
    std::memcpy(v.data_ptr<float>(), flat + (t.offset - flat_begin), t.numel * sizeof(float));
  }
}

// Copies each parameter's gradient into its place in `flat` (gaps stay 0).
void FlattenGrads(const Layout& layout, int layer, const std::vector<torch::Tensor>& params,
                  float* flat, uint64_t flat_begin) {
  size_t k = 0;
  for (const TensorPlacement& t : layout.tensors()) {
    if (t.spec.layer != static_cast<uint32_t>(layer)) continue;
    const torch::Tensor& g = params[k++].grad();
    float* dst = flat + (t.offset - flat_begin);
    if (g.defined()) {
      std::memcpy(dst, g.contiguous().data_ptr<float>(), t.numel * sizeof(float));
    } else {
      std::memset(dst, 0, t.numel * sizeof(float));
    }
  }
}

ClientConfig MakeClientConfig(const TrainOptions& o) {
  ClientConfig c;
  c.daemons = o.daemons;
  c.job_id = o.job_id;
  c.rank = o.rank;
  c.world_size = o.world_size;
  c.stage = o.stage;
  c.precision = o.precision;
  c.bucket_bytes = o.bucket_bytes;
  c.prefetch_depth = o.prefetch_depth;
  c.transport = o.transport;
  c.reduction =
      o.reduction == "trainer" ? ReductionMode::kTrainerCollective : ReductionMode::kDaemon;
  c.ucx_tls = o.ucx_tls;
  c.job_token = o.job_token;
  c.tls = o.tls;
  c.optimizer.kind = OptimizerKind::kAdamW;
  c.optimizer.lr = o.lr;
  c.optimizer.beta1 = 0.9f;
  c.optimizer.beta2 = 0.999f;
  c.optimizer.eps = 1e-8f;
  c.optimizer.weight_decay = o.weight_decay;
  c.max_grad_norm = o.max_grad_norm;
  c.resume = o.resume;
  c.rpc_timeout = o.rpc_timeout;
  c.liveness_timeout = o.liveness_timeout;
  c.step_timeout = o.step_timeout;
  c.checkpoint_wait = o.checkpoint_wait;
  c.replicas = o.replicas;
  c.node_cache = o.node_cache;
  c.local_daemon = o.local_daemon;
  return c;
}

// A layer's parameters as fp32 in `scratch` (converted from the job's
// precision when needed); returns the pointer to use.
float* AsFloat(const void* src, DType type, uint64_t n, std::vector<float>* scratch) {
  if (type == DType::kFp32) return const_cast<float*>(static_cast<const float*>(src));
  scratch->resize(n);
  ToFloat(type, src, scratch->data(), n);
  return scratch->data();
}

// TrainOptions::kill_at_step: once backward has pushed layer
// num_layers / 2 of that step, waits until the pushes before it are applied
// (the last one may share a bucket with the next layer, so it is not
// awaited) and kills the process.
absl::Status MaybeKillForDrill(const TrainOptions& o, int step, int layer, int num_layers,
                               const std::vector<PushTicket>& tickets) {
  if (step != o.kill_at_step || layer != num_layers / 2) return absl::OkStatus();
  for (size_t i = 0; i + 1 < tickets.size(); ++i) {
    RETURN_IF_ERROR(tickets[i].Wait(absl::Now() + absl::Minutes(1)));
  }
  std::fprintf(stderr, "kill_at_step: rank %u kills itself in step %d, layers %d..%d pushed\n",
               o.rank, step, num_layers - 1, layer);
  std::fflush(stderr);
  raise(SIGKILL);
  return absl::InternalError("kill_at_step: SIGKILL did not end the process");
}

}  // namespace

absl::StatusOr<TrainResult> TrainSingleProcess(const TrainOptions& o,
                                               const StepCallback& on_step) {
  RETURN_IF_ERROR(CheckOptions(o));
  ASSIGN_OR_RETURN(Layout layout, GptLayout(o.model));
  ASSIGN_OR_RETURN(std::string corpus, LoadCorpus(o.corpus_dir));
  TrainResult result;
  result.params = GptInitialParams(o.model, layout, o.seed);
  std::vector<torch::Tensor> params;
  for (int l = 0; l < NumModelLayers(o.model); ++l) {
    for (torch::Tensor& p : LayerParams(layout, l, result.params.data(), 0, true)) {
      params.push_back(p);
    }
  }
  torch::optim::AdamW optimizer(params, torch::optim::AdamWOptions(o.lr)
                                            .betas({0.9f, 0.999f})
                                            .eps(1e-8f)
                                            .weight_decay(o.weight_decay));
  for (int step = 1; step <= o.steps; ++step) {
    const absl::Time start = absl::Now();
    torch::Tensor tokens, targets;
    MakeBatch(corpus, o.model, step, o.global_batch, 0, 1, &tokens, &targets);
    optimizer.zero_grad();
    torch::Tensor x = tokens;
    size_t k = 0;
    for (int l = 0; l < NumModelLayers(o.model); ++l) {
      std::vector<torch::Tensor> lp;
      for (const TensorPlacement& t : layout.tensors()) {
        if (t.spec.layer == static_cast<uint32_t>(l)) lp.push_back(params[k++]);
      }
      x = ForwardLayer(o.model, l, lp, x, targets);
    }
    x.backward();
    float norm = 0;
    if (o.max_grad_norm > 0) {
      norm = static_cast<float>(torch::nn::utils::clip_grad_norm_(params, o.max_grad_norm));
    }
    optimizer.step();
    result.losses.push_back(x.item<float>());
    if (on_step) {
      on_step({step, x.item<float>(), absl::ToDoubleSeconds(absl::Now() - start), 0, norm});
    }
  }
  return result;
}

absl::StatusOr<float> EvaluateLoss(const TrainOptions& o, const std::vector<float>& params,
                                   uint64_t step) {
  ASSIGN_OR_RETURN(Layout layout, GptLayout(o.model));
  ASSIGN_OR_RETURN(std::string corpus, LoadCorpus(o.corpus_dir));
  if (params.size() != layout.total_elements()) {
    return absl::InvalidArgumentError("params: size does not match the model's layout");
  }
  torch::NoGradGuard no_grad;
  torch::Tensor tokens, targets;
  MakeBatch(corpus, o.model, step, o.global_batch, 0, 1, &tokens, &targets);
  std::vector<float> copy = params;
  return ForwardAll(o.model, layout, copy.data(), false, tokens, targets, nullptr).item<float>();
}

namespace {

// One connection's share of TrainRank: from the committed step until the
// end or the first failure. `known_committed_step`: ClientConfig's.
absl::StatusOr<TrainResult> TrainConnected(const TrainOptions& o, uint64_t known_committed_step,
                                           const StepCallback& on_step,
                                           const FinishCallback& on_finish,
                                           const StartCallback& on_start,
                                           const BackwardCallback& on_backward) {
  if (o.stage < 1 || o.stage > 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("stage: sharded training needs stage 1, 2 or 3, got ", o.stage));
  }
  if (o.reduction != "daemon" && o.reduction != "trainer") {
    return absl::InvalidArgumentError(
        absl::StrCat("reduction: must be daemon or trainer, got ", o.reduction));
  }
  if (o.reduction == "trainer" && (o.collective_dir.empty() || o.reconnects > 0)) {
    return absl::InvalidArgumentError(
        "reduction=trainer: needs collective_dir (a directory every rank shares) and no "
        "reconnects (the Gloo rendezvous happens once per run)");
  }
  ASSIGN_OR_RETURN(Layout layout, GptLayout(o.model));
  ASSIGN_OR_RETURN(std::string corpus, LoadCorpus(o.corpus_dir));
  // Stages 1-2 push from full_grads without a copy (BufferUse::kBorrow): it
  // is declared before the client, so that on an early return the client
  // (whose destructor waits for sends in flight) goes first.
  std::vector<float> full_grads(o.stage < 3 ? layout.total_elements() : 0);
  ClientConfig config = MakeClientConfig(o);
  config.known_committed_step = known_committed_step;
  std::unique_ptr<Collective> collective;
  if (o.reduction == "trainer") {
    GlooCollective::Options gloo;
    gloo.rendezvous_dir = o.collective_dir;
    gloo.hostname = o.collective_hostname;
    ASSIGN_OR_RETURN(collective, GlooCollective::Create(gloo));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<Client> client,
                   Client::Create(std::move(config), std::move(collective)));
  // With a resume, rank 0's RegisterModel loads the checkpoint instead of
  // uploading these (unless there is none to resume from).
  // Rank 0's only, and only while it registers (4Ψ bytes).
  {
    std::vector<float> initial;
    if (o.rank == 0) initial = GptInitialParams(o.model, layout, o.seed);
    RETURN_IF_ERROR(client->RegisterModel(layout, o.rank == 0 ? initial.data() : nullptr));
  }

  const int num_layers = NumModelLayers(o.model);
  const uint64_t total = layout.total_elements();
  const DType wire = o.precision;
  TrainResult result;
  // Stages 1-2 keep full parameters (and gradients) on the trainer; stage 3
  // keeps only the layer in use.
  std::vector<float> full_params;
  std::vector<uint16_t> half_params;
  if (o.stage < 3) {
    full_params.resize(total);
    if (wire == DType::kFp32) {
      RETURN_IF_ERROR(client->GatherAll(full_params.data(), DType::kFp32));
    } else {
      half_params.resize(total);
      RETURN_IF_ERROR(client->GatherAll(half_params.data(), wire));
      ToFloat(wire, half_params.data(), full_params.data(), total);
    }
  }
  // Stage 3's activation checkpoints. The daemon store uses the client's
  // data path: declared after the client, it is destroyed first.
  InMemoryActivationStore local_checkpoints;
  std::unique_ptr<DaemonActivationStore> daemon_checkpoints;
  if (o.activations == "daemon" || o.activations == "both") {
    const uint32_t daemon =
        static_cast<uint32_t>(uint64_t{o.rank} * o.daemons.size() / o.world_size);
    DaemonSliceStore::Options store;
    store.rpc_timeout = client->config().rpc_timeout;
    store.checksums = o.activation_checksums;
    ASSIGN_OR_RETURN(std::unique_ptr<DaemonSliceStore> s,
                     client->OpenActivationStore(daemon, store));
    DaemonActivationStore::Options ao;
    ao.prefetch_depth = o.activation_prefetch_depth;
    ao.max_offloads_in_flight = o.activation_offloads_in_flight;
    ao.keep_last = o.activation_keep_last;
    daemon_checkpoints = std::make_unique<DaemonActivationStore>(std::move(s), ao);
  }
  std::vector<float> layer_scratch, grad_scratch;
  std::vector<PushTicket> tickets;
  result.resumed_from = client->resumed_from();
  result.first_step = static_cast<int>(client->committed_step()) + 1;
  const bool saves = o.rank == 0 && o.checkpoint_every > 0;
  bool saved = false;
  std::string activations_used;
  if (on_start) on_start(*client);

  for (int step = result.first_step; step <= o.steps; ++step) {
    const absl::Time start = absl::Now();
    // StepReport::times: lap(phase) adds the time since the last lap to it.
    StepReport::Times times;
    absl::Time mark = start;
    auto lap = [&mark](double& phase) {
      const absl::Time now = absl::Now();
      phase += absl::ToDoubleSeconds(now - mark);
      mark = now;
    };
    torch::Tensor tokens, targets;
    MakeBatch(corpus, o.model, step, o.global_batch, o.rank, o.world_size, &tokens, &targets);
    tickets.clear();
    float loss = 0;
    if (o.stage < 3) {
      std::vector<std::vector<torch::Tensor>> layer_params(num_layers);
      torch::Tensor x = tokens;
      for (int l = 0; l < num_layers; ++l) {
        layer_params[l] = LayerParams(layout, l, full_params.data(), 0, true);
        x = ForwardLayer(o.model, l, layer_params[l], x, targets);
      }
      loss = x.item<float>();
      lap(times.forward);
      x.backward();
      lap(times.backward);
      // Push layer by layer, last layer first, as backward produces them.
      // full_grads is not touched again before the tickets complete, so the
      // client may send from it directly.
      for (int l = num_layers - 1; l >= 0; --l) {
        ASSIGN_OR_RETURN(FlatRange r, layout.LayerRange(l));
        FlattenGrads(layout, l, layer_params[l], full_grads.data(), 0);
        ASSIGN_OR_RETURN(PushTicket t,
                         client->PushGradients(r, full_grads.data() + r.begin, DType::kFp32,
                                               /*micro_batch=*/0, BufferUse::kBorrow));
        tickets.push_back(std::move(t));
        RETURN_IF_ERROR(MaybeKillForDrill(o, step, l, num_layers, tickets));
      }
      lap(times.push);
    } else if (o.activations == "keep") {
      activations_used = "keep";
      // Forward with autograd: each layer's parameters in storage of their
      // own, freed once the layer ran (autograd keeps the tensors).
      std::vector<std::vector<torch::Tensor>> lp(num_layers);
      absl::Status refill_error;
      // Gathers layer l into its tensors' storage again (a hook in
      // backward: errors are thrown to backward's caller).
      auto refill = [&](int l) -> absl::Status {
        ASSIGN_OR_RETURN(FlatRange r, layout.LayerRange(l));
        ASSIGN_OR_RETURN(const void* view, client->GatherView(l));
        const float* p = AsFloat(view, wire, r.size(), &layer_scratch);
        FillLayerStorage(layout, l, p, r.begin, lp[l]);
        return client->Release(l);
      };
      torch::Tensor x = tokens;
      for (int l = 0; l < num_layers; ++l) {
        ASSIGN_OR_RETURN(FlatRange r, layout.LayerRange(l));
        lap(times.forward);
        ASSIGN_OR_RETURN(const void* view, client->GatherView(l));
        lap(times.gather);
        const float* p = AsFloat(view, wire, r.size(), &layer_scratch);
        lp[l] = OwnedLayerParams(layout, l, p, r.begin);
        RETURN_IF_ERROR(client->Release(l));
        torch::Tensor y = ForwardLayer(o.model, l, lp[l], x, targets);
        FreeLayerStorage(lp[l]);
        if (l + 1 < num_layers) {
          // Runs when the gradient of this layer's output is ready: before
          // autograd runs the layer's own backward.
          y.register_hook([&, l](torch::Tensor g) {
            absl::Status s = refill(l);
            if (!s.ok()) {
              if (refill_error.ok()) refill_error = s;
              throw std::runtime_error(std::string(s.message()));
            }
            return g;
          });
        }
        x = y;
      }
      loss = x.item<float>();
      lap(times.forward);
      if (on_backward) on_backward(step, *client);
      RETURN_IF_ERROR(refill(num_layers - 1));
      lap(times.gather);
      try {
        x.backward();
      } catch (const std::exception& e) {
        return refill_error.ok() ? absl::InternalError(absl::StrCat("backward: ", e.what()))
                                 : refill_error;
      }
      lap(times.backward);
      // Push layer by layer, last layer first; PushGradients copies into the
      // client's staging pool before it returns.
      for (int l = num_layers - 1; l >= 0; --l) {
        ASSIGN_OR_RETURN(FlatRange r, layout.LayerRange(l));
        grad_scratch.assign(r.size(), 0.0f);
        FlattenGrads(layout, l, lp[l], grad_scratch.data(), r.begin);
        lp[l].clear();
        ASSIGN_OR_RETURN(PushTicket t,
                         client->PushGradients(r, grad_scratch.data(), DType::kFp32));
        tickets.push_back(std::move(t));
        RETURN_IF_ERROR(MaybeKillForDrill(o, step, l, num_layers, tickets));
      }
      lap(times.push);
    } else {
      ActivationStore& checkpoints =
          o.activations == "local" || (o.activations == "both" && step % 2 == 0)
              ? static_cast<ActivationStore&>(local_checkpoints)
              : *daemon_checkpoints;
      activations_used = &checkpoints == &local_checkpoints ? "local" : "daemon";
      RETURN_IF_ERROR(checkpoints.BeginStep(static_cast<uint64_t>(step)));
      // Forward: gather each layer, run it without autograd, keep its input
      // (a daemon store starts offloading it at once, behind this layer's
      // forward).
      torch::Tensor x = tokens;
      {
        torch::NoGradGuard no_grad;
        for (int l = 0; l < num_layers; ++l) {
          ASSIGN_OR_RETURN(FlatRange r, layout.LayerRange(l));
          lap(times.forward);
          ASSIGN_OR_RETURN(const void* view, client->GatherView(l));
          lap(times.gather);
          float* p = AsFloat(view, wire, r.size(), &layer_scratch);
          RETURN_IF_ERROR(checkpoints.Save(l, x));
          x = ForwardLayer(o.model, l, LayerParams(layout, l, p, r.begin, false), x, targets);
          RETURN_IF_ERROR(client->Release(l));
        }
      }
      loss = x.item<float>();
      lap(times.forward);
      if (on_backward) on_backward(step, *client);
      // Backward loads the checkpoints last layer first.
      std::vector<int> order(num_layers);
      for (int l = 0; l < num_layers; ++l) order[l] = num_layers - 1 - l;
      RETURN_IF_ERROR(checkpoints.BeginBackward(order));
      // Backward: gather again, recompute the layer from its checkpoint,
      // backpropagate, push its gradients, release.
      torch::Tensor grad_out;
      for (int l = num_layers - 1; l >= 0; --l) {
        ASSIGN_OR_RETURN(FlatRange r, layout.LayerRange(l));
        lap(times.backward);
        ASSIGN_OR_RETURN(const void* view, client->GatherView(l));
        lap(times.gather);
        float* p = AsFloat(view, wire, r.size(), &layer_scratch);
        std::vector<torch::Tensor> lp = LayerParams(layout, l, p, r.begin, true);
        ASSIGN_OR_RETURN(torch::Tensor input, checkpoints.Load(l));
        if (l > 0) input = input.detach().requires_grad_(true);
        torch::Tensor y = ForwardLayer(o.model, l, lp, input, targets);
        if (grad_out.defined()) {
          y.backward(grad_out);
        } else {
          y.backward();
        }
        lap(times.backward);
        grad_scratch.assign(r.size(), 0.0f);
        FlattenGrads(layout, l, lp, grad_scratch.data(), r.begin);
        RETURN_IF_ERROR(client->Release(l));
        // PushGradients copies the gradients into the client's staging pool
        // before it returns, so the scratch buffer is free for the next layer.
        ASSIGN_OR_RETURN(PushTicket t,
                         client->PushGradients(r, grad_scratch.data(), DType::kFp32));
        tickets.push_back(std::move(t));
        RETURN_IF_ERROR(MaybeKillForDrill(o, step, l, num_layers, tickets));
        lap(times.push);
        if (l > 0) grad_out = input.grad();
      }
      RETURN_IF_ERROR(checkpoints.EndStep());
      lap(times.backward);
    }
    for (const PushTicket& t : tickets) RETURN_IF_ERROR(t.Wait(absl::Now() + absl::Minutes(5)));
    lap(times.push_wait);
    ASSIGN_OR_RETURN(StepResult sr, client->Step(o.lr));
    lap(times.step);
    std::optional<absl::StatusOr<CheckpointStarted>> saving;
    if (saves && step % o.checkpoint_every == 0) {
      // Blocks for the daemons' snapshots (and for the previous save to
      // complete, up to ClientConfig::checkpoint_wait); the write goes on
      // during the next steps. A save a hung or slow checkpoint disk keeps
      // from starting or completing (Unavailable) is reported with the
      // step, and training goes on.
      saving = client->SaveCheckpoint(absl::StrCat("step-", step));
      if (saving->ok()) {
        saved = true;
      } else if (!absl::IsAlreadyExists(saving->status()) &&
                 !absl::IsUnavailable(saving->status())) {
        return saving->status();
      }
    }
    mark = absl::Now();  // a checkpoint save is in none of the times
    if (o.stage < 3) {
      if (wire == DType::kFp32) {
        RETURN_IF_ERROR(client->GatherAll(full_params.data(), DType::kFp32));
      } else {
        RETURN_IF_ERROR(client->GatherAll(half_params.data(), wire));
        ToFloat(wire, half_params.data(), full_params.data(), total);
      }
      lap(times.gather);
    }
    result.losses.push_back(loss);
    if (on_step) {
      const ClientTrafficReport t = client->TrafficReport();
      on_step({step, loss, absl::ToDoubleSeconds(absl::Now() - start), t.last_step.total(),
               sr.grad_norm, std::move(saving), activations_used, times});
    }
  }
  if (saved) {
    ASSIGN_OR_RETURN(CheckpointCompleted done, client->AwaitCheckpoint());
    result.last_checkpoint = std::move(done);
  }
  result.client_memory = client->MemoryReport();
  result.traffic = client->TrafficReport();
  if (o.stage == 3) {
    const ActivationStore& main_store =
        daemon_checkpoints != nullptr ? static_cast<const ActivationStore&>(*daemon_checkpoints)
                                      : local_checkpoints;
    result.activation_store = main_store.name();
    result.activation_bytes = main_store.peak_bytes();
    result.activation_step_bytes =
        std::max(main_store.peak_step_bytes(), local_checkpoints.peak_step_bytes());
    if (daemon_checkpoints != nullptr) {
      result.activation_stats = daemon_checkpoints->stats();
      result.activations_refused = daemon_checkpoints->refused();
    }
  }
  if (o.final_params) {
    result.params.resize(total);
    RETURN_IF_ERROR(client->GatherAll(result.params.data(), DType::kFp32));
  }
  if (on_finish) on_finish(*client);
  RETURN_IF_ERROR(client->Leave());
  return result;
}

// Failures a new connection may get past: a daemon gone or replaced (one
// restarted so fast that the next call reaches it, empty: NOT_FOUND "job
// ... is not registered on this daemon", server/job/job_manager.cc), a call
// or a step out of time, a step the daemons could not take.
bool Reconnectable(const absl::Status& s) {
  return absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s) || absl::IsFailedPrecondition(s) ||
         absl::IsAborted(s) || absl::IsCancelled(s) ||
         (absl::IsNotFound(s) &&
          absl::StrContains(s.message(), "is not registered on this daemon"));
}

}  // namespace

absl::StatusOr<TrainResult> TrainRank(const TrainOptions& o, const StepCallback& on_step,
                                      const FinishCallback& on_finish,
                                      const StartCallback& on_start,
                                      const BackwardCallback& on_backward) {
  RETURN_IF_ERROR(CheckOptions(o));
  // What earlier connections trained: each step's loss, and the last step
  // seen committed.
  std::map<int, float> losses;
  uint64_t committed = 0;
  const StepCallback track = [&](const StepReport& r) {
    losses[r.step] = r.loss;
    committed = static_cast<uint64_t>(r.step);
    if (on_step) on_step(r);
  };
  for (int attempt = 0;; ++attempt) {
    absl::StatusOr<TrainResult> r =
        TrainConnected(o, committed, track, on_finish, on_start, on_backward);
    if (r.ok()) {
      // The steps of earlier connections come first.
      std::vector<float> all;
      int first = r->first_step;
      for (const auto& [step, loss] : losses) {
        if (step >= r->first_step) break;
        if (all.empty()) first = step;
        all.push_back(loss);
      }
      all.insert(all.end(), r->losses.begin(), r->losses.end());
      r->losses = std::move(all);
      r->first_step = first;
      return r;
    }
    if (attempt >= o.reconnects || !Reconnectable(r.status())) return r.status();
    std::fprintf(stderr, "rank %u: %s\nrank %u: reconnecting (%d of %d) after step %llu\n", o.rank,
                 r.status().ToString().c_str(), o.rank, attempt + 1, o.reconnects,
                 static_cast<unsigned long long>(committed));
    std::fflush(stderr);
  }
}

}  // namespace zeroshard::examples
