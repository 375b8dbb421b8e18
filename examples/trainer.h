#pragma once

// The GPT trainer's loops: the single-process baseline (ZeRO stage 0, plain
// torch::optim::AdamW on the full global batch) and the data-parallel rank
// that trains through zeroshard at stage 1, 2 or 3. Blocking; one rank per
// call (run ranks in threads or processes).

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/activation_store.h"
#include "client/client.h"
#include "examples/gpt.h"

namespace zeroshard::examples {

struct TrainOptions {
  GptConfig model;
  int steps = 30;
  int global_batch = 12;  // sequences per step over all ranks; divisible by world
  float lr = 3e-3f;
  float weight_decay = 0.01f;
  float max_grad_norm = 1.0f;  // 0: no clipping
  uint64_t seed = 1;
  std::string corpus_dir = "/usr/share/common-licenses";

  // Sharded training (stage 1..3).
  uint32_t stage = 3;
  uint32_t rank = 0;
  uint32_t world_size = 1;
  std::vector<std::string> daemons;
  std::string job_id = "gpt";
  DType precision = DType::kFp32;
  uint64_t bucket_bytes = 1 << 20;
  uint32_t prefetch_depth = 2;
  std::string transport = "stream";  // data path: "stream", "ucx", "grpc" or "inproc"
  // Gradient reduction (ClientConfig.reduction):
  //   "daemon"   every rank pushes its whole gradient; the daemons sum them;
  //   "trainer"  the ranks reduce-scatter among themselves over Gloo's TCP
  //              transport and each pushes only its own partition
  //              (client/gloo_collective.h). Parameters are still gathered
  //              from the daemons. Needs `collective_dir`; no reconnects.
  std::string reduction = "daemon";
  // "trainer": the Gloo rendezvous directory, the same for every rank (one
  // host, or a shared filesystem) and free of an earlier run's files of the
  // same job id; and the address this rank's Gloo transport listens on.
  std::string collective_dir;
  std::string collective_hostname = "127.0.0.1";
  std::string ucx_tls;               // UCX_TLS for "ucx" ("" = UCX's choice)
  // ClientConfig.rpc_timeout and .step_timeout.
  absl::Duration rpc_timeout = absl::Seconds(60);
  // ClientConfig.liveness_timeout.
  absl::Duration liveness_timeout = absl::Seconds(4);
  absl::Duration step_timeout = absl::Minutes(5);
  // ClientConfig.job_token and .tls (empty: ZS_JOB_TOKEN, ZS_TLS_*).
  std::string job_token;
  TlsFiles tls;

  // Checkpoints (the daemons need --checkpoint_dir). Every this many
  // committed steps rank 0 saves checkpoint "step-<k>" (k the committed
  // step); 0: never. The last save is awaited before the rank leaves. A
  // save that fails ends the training with its error, except AlreadyExists
  // and Unavailable (a hung or slow checkpoint disk), which are reported
  // (StepReport::checkpoint) and training goes on.
  int checkpoint_every = 0;
  // ClientConfig.checkpoint_wait.
  absl::Duration checkpoint_wait = absl::Seconds(10);
  // Stage 3: where each layer's activation checkpoint (its input) lives
  // between the forward pass and the layer's recomputation in backward
  // (examples/activation_store.h):
  //   "local"   the trainer's memory (grows with the model's depth);
  //   "daemon"  the Activation service of daemon rank * daemons / world_size
  //             (ZeRO-R P_a+cpu), over this rank's data path (`transport`):
  //             offloaded as each layer's forward begins, fetched
  //             activation_prefetch_depth layers ahead in backward;
  //   "both"    odd steps "daemon", even steps "local" (to compare step
  //             times in one run; StepReport::activations says which);
  //   "keep"    no checkpoints and no recomputation: autograd keeps every
  //             layer's activations, as DDP and FSDP without activation
  //             checkpointing do. Each layer's parameters are still gathered
  //             for its forward into tensors of its own whose bytes are
  //             freed after it (autograd keeps the tensors, not their
  //             storage), gathered again into the same storage just before
  //             autograd reaches the layer's backward, and freed once its
  //             gradient is pushed (after the whole backward): 3Ψ of traffic
  //             as with checkpoints, one forward less.
  // Training is bit for bit the same with each. Stages 1-2 keep autograd's
  // activations and take "local" only.
  std::string activations = "local";
  uint32_t activation_prefetch_depth = 2;
  uint32_t activation_offloads_in_flight = 2;
  // "daemon": the latest checkpoints kept in the trainer, not offloaded
  // (DaemonActivationStore::Options::keep_last); those still kept when
  // backward begins never leave it.
  uint32_t activation_keep_last = 1;
  // "daemon" over a bulk transport: checksum every slice both ways
  // (DaemonSliceStore::Options::checksums).
  bool activation_checksums = false;

  // A failure drill: in step `kill_at_step` (0: never) the rank kills its
  // own process with SIGKILL once the gradients of half of its layers (the
  // last ones, as backward produces them) are applied on the daemons, leaving
  // the step open with part of its contributions in. A restarted process
  // (zsrun --max_restarts) continues at the committed step.
  int kill_at_step = 0;

  // Replicated partitions (ClientConfig.replicas: 1, or 2 for a primary and
  // a backup of each daemon's partitions).
  uint32_t replicas = 1;
  // The node cache (ClientConfig.node_cache): each rank gathers other
  // daemons' ranges through its host's daemon (ClientConfig.local_daemon:
  // -1 finds it).
  bool node_cache = false;
  int local_daemon = -1;
  // When a step fails (a daemon died, a call timed out), the rank drops its
  // client and reconnects in the same process, at most this many times in
  // the whole run: a new client (a new incarnation) reads where each replica
  // group is served (promoting backups, rank 0), and training continues at
  // the committed step. 0: a failure ends the run.
  int reconnects = 0;

  // Gather the final parameters into TrainResult::params (fp32, Ψ elements
  // on every rank). Off for a model too large to hold that copy.
  bool final_params = true;

  // ClientConfig.resume: a checkpoint name or "latest"; empty: start fresh.
  // Training continues at the committed step the job resumed at and runs
  // until `steps` in all. The batch of step k depends only on k (MakeBatch),
  // so a resumed run takes the same steps as one that was never stopped.
  std::string resume;
};

struct StepReport {
  int step = 0;
  float loss = 0;          // this rank's loss on its share of the batch
  double seconds = 0;      // wall time of the step
  uint64_t bytes = 0;      // bytes this rank moved to and from daemons this step
  float grad_norm = 0;     // known on rank 0
  // Rank 0 with checkpoint_every, after a step it saved at: the save
  // started (the daemons write it in the background), or AlreadyExists when
  // a complete checkpoint of that name was there before (it is left as it
  // is and training goes on).
  std::optional<absl::StatusOr<CheckpointStarted>> checkpoint;
  // Stage 3: where the step kept its activation checkpoints ("local",
  // "daemon").
  std::string activations;
  // TrainRank: where this rank's step time went, in seconds. gather: waiting
  // for parameters (stages 1-2 GatherAll after the step, stage 3 each
  // GatherView); forward and backward: the passes without their gathers
  // (stage 3's backward includes the recomputation); push: flattening the
  // gradients and the PushGradients calls; push_wait: waiting for the pushes'
  // tickets; step: Client::Step (every rank's gradients reduced, the
  // daemons' optimizer step committed).
  struct Times {
    double forward = 0, backward = 0, push = 0, push_wait = 0, step = 0, gather = 0;
  } times;
};

struct TrainResult {
  // Per step trained by this run (first_step onwards), this rank's share (or
  // the global batch).
  std::vector<float> losses;
  int first_step = 1;         // the committed step at the start, plus one
  std::vector<float> params;  // final parameters, flat fp32 (empty without final_params)
  ClientMemoryReport client_memory;
  ClientTrafficReport traffic;
  // Activation checkpoints (stage 3): the most bytes of them the trainer
  // held at once, and the most one step saved (what keeping them all in the
  // trainer holds; equal for "local").
  uint64_t activation_bytes = 0;
  uint64_t activation_step_bytes = 0;
  std::string activation_store;  // the store's name
  // The daemon store's counters ("daemon", "both").
  std::optional<SliceStoreStats> activation_stats;
  // Checkpoints the daemon store had no room for, kept in the trainer
  // (DaemonActivationStore::refused).
  uint64_t activations_refused = 0;
  // The checkpoint the job resumed from (TrainOptions::resume).
  std::optional<v1::LoadCheckpointResponse> resumed_from;
  // Rank 0 with checkpoint_every: the last save, completed.
  std::optional<CheckpointCompleted> last_checkpoint;
};

using StepCallback = std::function<void(const StepReport&)>;
// Called by TrainRank once the rank has registered the model (and the job
// resumed, if it did), before its first step, with the rank's client.
using StartCallback = std::function<void(Client&)>;
// Called by TrainRank after the last step, before the rank leaves the job
// (the daemons still hold its states), with the rank's client.
using FinishCallback = std::function<void(Client&)>;
// Stage 3: called by TrainRank after the forward pass of every step, before
// its backward (the step's checkpoints are saved, daemon offloads may still
// be running), with the step and the rank's client.
using BackwardCallback = std::function<void(int step, Client&)>;

// Stage 0: one process, the whole global batch, torch AdamW, clip_grad_norm_.
absl::StatusOr<TrainResult> TrainSingleProcess(const TrainOptions& options,
                                               const StepCallback& on_step = nullptr);

// One data-parallel rank training through zeroshard at options.stage, from
// the job's committed step (0, or the step of the checkpoint it resumed
// from) to options.steps, reconnecting after failures as
// options.reconnects allows (the callbacks run again on the new client:
// on_start once per connection). The callbacks run on the calling thread.
absl::StatusOr<TrainResult> TrainRank(const TrainOptions& options,
                                      const StepCallback& on_step = nullptr,
                                      const FinishCallback& on_finish = nullptr,
                                      const StartCallback& on_start = nullptr,
                                      const BackwardCallback& on_backward = nullptr);

// Mean cross-entropy of `params` (flat fp32) on the global batch of step
// `step`, for comparing runs on data none of them trained on.
absl::StatusOr<float> EvaluateLoss(const TrainOptions& options, const std::vector<float>& params,
                                   uint64_t step);

}  // namespace zeroshard::examples
