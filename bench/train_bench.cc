// Training throughput of the libtorch GPT (examples/gpt.h) on 2 data-parallel
// ranks, zeroshard against plain data parallelism the way PyTorch's DDP does
// it, in one run, for each model size of --presets:
//   demo  gpt_train's defaults: 4 blocks, width 64, 4 heads, seq_len 32,
//         global batch 8;
//   50m   16 blocks, width 512, 8 heads, seq_len 32, global batch 2
//         (50.7M parameters; a small batch and 1 warm-up + 3 timed steps:
//         a step takes seconds on 2 shared cores, and the median of three
//         is steadier than one step, whose backward alone swings by a
//         third from one run to the next).
//
// The contenders, each for the same steps on the same batches (MakeBatch)
// from the same initial parameters (GptInitialParams, one seed):
//   ddp           2 ranks as threads of this process, each with a full replica
//                 and a c10d::ProcessGroupGloo (libtorch's, over a shared
//                 HashStore, TCP on 127.0.0.1). As DDP: gradients are copied
//                 into buckets (reverse parameter order, the first 1 MiB, the
//                 rest 25 MiB) by autograd hooks as backward produces them,
//                 each full bucket divided by the world size and all-reduced
//                 asynchronously (in bucket order) while backward goes on;
//                 then clip_grad_norm_ and torch::optim::AdamW on every rank,
//                 as TrainSingleProcess does.
//   zeroshard s1, s2, s3, s3 keep
//                 examples::TrainRank at stage 1, 2 and 3, ranks as threads,
//                 stage 3 with activation checkpoints in the trainer (each
//                 layer recomputed in backward) and, "s3 keep", with
//                 autograd's activations kept (TrainOptions::activations
//                 "keep": no recomputation; parameters still freed after each
//                 layer's forward and gathered again for its backward),
//                 against 2 daemons in this process (1 optimizer thread each)
//                 serving the "ucx" bulk transport over shared memory
//                 (UCX_TLS=posix,cma,self); when the daemons cannot start UCX,
//                 the streaming RPCs instead, and the header says so.
// Every rank thread runs torch with 1 intra-op thread (2 ranks on 2 cores).
//
// Every contender runs in turn, and at the demo preset the whole turn three
// times (--rounds): a shared machine's speed drifts over seconds, so each
// round's ratios are to that round's ddp, run seconds before, and the
// median of the rounds' ratios is reported (each round's printed too).
// Per preset: tokens/s of each contender (global batch x seq_len tokens per
// step over the median of rank 0's timed step times, every round's) and its
// ratio to ddp; each contender's per-step breakdown on rank 0 (the mean
// over the timed steps; StepReport::times for zeroshard); and how far each
// zeroshard stage's final parameters and per-step losses are from ddp's in
// the worst round, against the oracle tests' tolerance
// (examples/oracle_diff.h; with --precision=bf16 printed, not judged). The last two lines are for the largest preset that
// ran:
//   <preset>, zeroshard in <precision>:
//   stage1_vs_ddp=X stage2_vs_ddp=Y stage3_vs_ddp=Z stage3_keep_vs_ddp=W
//
//   bazel run -c opt --config=clang //bench:train_bench -- --presets=demo,50m
//   ... -- --precision=bf16   # the zeroshard jobs in bf16 (ddp stays fp32)

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "bench/stats.h"
#include "common/dtype.h"
#include "common/status_macros.h"
#include "examples/gpt.h"
#include "examples/oracle_diff.h"
#include "examples/trainer.h"
#include "server/daemon.h"

ABSL_FLAG(std::string, presets, "demo,50m", "model sizes to run, in order: demo, 50m");
ABSL_FLAG(int, steps, -1, "timed steps per contender (-1: the preset's, demo 20, 50m 3)");
ABSL_FLAG(int, warmup, -1, "untimed steps before them (-1: the preset's, demo 2, 50m 1)");
ABSL_FLAG(int, rounds, -1,
          "times every contender runs, in turn (-1: the preset's, demo 3, 50m 1); each "
          "round's ratios are to that round's ddp, and their median is reported");
ABSL_FLAG(std::string, ucx_tls, "posix,cma,self", "UCX_TLS of the daemons and the trainers");
ABSL_FLAG(std::string, corpus, "/usr/share/common-licenses", "directory of training text");
ABSL_FLAG(std::string, precision, "fp32",
          "the zeroshard jobs' precision, fp32 or bf16 (ddp stays fp32: libtorch 1.13's Gloo "
          "has no bf16 all-reduce)");

namespace zeroshard {
namespace {

using bench::Median;
using examples::StepReport;
using examples::TrainOptions;
using examples::TrainResult;

constexpr char kJobToken[] = "train-bench-job-token";
constexpr uint32_t kWorld = 2;
constexpr int kTorchThreads = 1;  // per rank
// DDP's defaults: bucket_cap_mb=25, and a first bucket of 1 MiB so that the
// first all-reduce starts early in backward.
constexpr int64_t kDdpFirstBucketBytes = 1 << 20;
constexpr int64_t kDdpBucketBytes = 25 << 20;

struct Preset {
  std::string name;
  examples::GptConfig model;
  int global_batch = 8;
  int steps = 0;   // timed
  int warmup = 0;  // untimed, before them
  int rounds = 1;  // every contender in turn, this many times
};

absl::StatusOr<Preset> GetPreset(const std::string& name) {
  Preset p;
  p.name = name;
  if (name == "demo") {
    p.model.layers = 4;
    p.model.width = 64;
    p.model.heads = 4;
    p.model.seq_len = 32;
    p.steps = 20;
    p.warmup = 2;
    p.rounds = 3;
  } else if (name == "50m") {
    p.model.layers = 16;
    p.model.width = 512;
    p.model.heads = 8;
    p.model.seq_len = 32;
    p.global_batch = 2;
    p.steps = 3;
    p.warmup = 1;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("--presets: demo or 50m, got \"", name, "\""));
  }
  if (absl::GetFlag(FLAGS_steps) > 0) p.steps = absl::GetFlag(FLAGS_steps);
  if (absl::GetFlag(FLAGS_warmup) >= 0) p.warmup = absl::GetFlag(FLAGS_warmup);
  if (absl::GetFlag(FLAGS_rounds) > 0) p.rounds = absl::GetFlag(FLAGS_rounds);
  return p;
}

double Seconds(absl::Time since) { return absl::ToDoubleSeconds(absl::Now() - since); }

// One rank's step in the ddp contender.
struct DdpStepTimes {
  double total = 0;
  double forward = 0;         // batch, zero_grad, forward pass
  double backward = 0;        // with the bucket copies and all-reduces started in it
  double allreduce_wait = 0;  // the buckets' all-reduces finishing, gradients copied back
  double optimizer = 0;       // clip_grad_norm_ and AdamW
};

// DDP's gradient buckets over one rank's parameters: each parameter's
// gradient is copied into its bucket by an autograd hook; a bucket whose
// gradients are all in is divided by the world size and all-reduced
// asynchronously, buckets in index order (the same order on every rank, as
// Gloo matches collectives by order). Used by one rank thread (autograd's
// CPU hooks run on the thread calling backward).
class DdpBuckets {
 public:
  DdpBuckets(const std::vector<torch::Tensor>& params, c10d::ProcessGroup& group)
      : params_(params), group_(group), slot_(params.size()) {
    int64_t cap = kDdpFirstBucketBytes;
    for (size_t i = params.size(); i-- > 0;) {
      const int64_t bytes = params[i].numel() * static_cast<int64_t>(sizeof(float));
      if (buckets_.empty() || (buckets_.back().bytes > 0 && buckets_.back().bytes + bytes > cap)) {
        if (!buckets_.empty()) cap = kDdpBucketBytes;
        buckets_.emplace_back();
      }
      Bucket& b = buckets_.back();
      slot_[i] = {buckets_.size() - 1, b.bytes / static_cast<int64_t>(sizeof(float))};
      b.params.push_back(i);
      b.bytes += bytes;
    }
    for (Bucket& b : buckets_) {
      b.buffer = {torch::zeros({b.bytes / static_cast<int64_t>(sizeof(float))})};
    }
    written_.assign(params.size(), false);
    for (size_t i = 0; i < params.size(); ++i) {
      params_[i].register_hook([this, i](torch::Tensor grad) { OnGradient(i, grad); });
    }
  }

  size_t size() const { return buckets_.size(); }

  // Before each backward.
  void BeginStep() {
    written_.assign(params_.size(), false);
    for (Bucket& b : buckets_) {
      b.pending = b.params.size();
      b.work.reset();
    }
    next_ = 0;
  }

  // After backward: starts the buckets not started yet (gradients no hook
  // delivered count as 0), waits for all, and sets every parameter's .grad()
  // to the average. Throws what c10d throws.
  void Finish() {
    for (Bucket& b : buckets_) {
      for (size_t i : b.params) {
        if (!written_[i]) Slice(i).zero_();
      }
      b.pending = 0;
    }
    LaunchReady();
    for (Bucket& b : buckets_) b.work->wait();
    for (size_t i = 0; i < params_.size(); ++i) {
      torch::Tensor avg = Slice(i).view(params_[i].sizes());
      if (params_[i].grad().defined()) {
        params_[i].mutable_grad().copy_(avg);
      } else {
        params_[i].mutable_grad() = avg.clone();
      }
    }
  }

 private:
  struct Bucket {
    std::vector<size_t> params;
    int64_t bytes = 0;
    std::vector<torch::Tensor> buffer;  // one flat fp32 tensor
    size_t pending = 0;
    c10::intrusive_ptr<c10d::Work> work;
  };
  struct Slot {
    size_t bucket = 0;
    int64_t offset = 0;  // elements
  };

  torch::Tensor Slice(size_t i) {
    return buckets_[slot_[i].bucket].buffer[0].narrow(0, slot_[i].offset, params_[i].numel());
  }

  void OnGradient(size_t i, const torch::Tensor& grad) {
    torch::NoGradGuard no_grad;
    Slice(i).copy_(grad.reshape({-1}));
    written_[i] = true;
    --buckets_[slot_[i].bucket].pending;
    LaunchReady();
  }

  void LaunchReady() {
    while (next_ < buckets_.size() && buckets_[next_].pending == 0) {
      Bucket& b = buckets_[next_++];
      b.buffer[0].div_(static_cast<double>(group_.getSize()));
      b.work = group_.allreduce(b.buffer);
    }
  }

  std::vector<torch::Tensor> params_;
  c10d::ProcessGroup& group_;
  std::vector<Slot> slot_;  // by parameter
  std::vector<Bucket> buckets_;
  std::vector<bool> written_;
  size_t next_ = 0;
};

// One ddp rank: a full replica, TrainSingleProcess's step on this rank's
// share of the batch with DdpBuckets averaging the gradients in between.
absl::StatusOr<TrainResult> TrainDdpRank(const TrainOptions& o,
                                         const c10::intrusive_ptr<c10d::Store>& store,
                                         std::vector<DdpStepTimes>* times, size_t* buckets) {
  ASSIGN_OR_RETURN(Layout layout, examples::GptLayout(o.model));
  ASSIGN_OR_RETURN(std::string corpus, examples::LoadCorpus(o.corpus_dir));
  try {
    auto gloo = c10d::ProcessGroupGloo::Options::create(std::chrono::minutes(5));
    gloo->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    auto group = c10::make_intrusive<c10d::ProcessGroupGloo>(store, static_cast<int>(o.rank),
                                                             static_cast<int>(o.world_size), gloo);
    TrainResult result;
    result.params = examples::GptInitialParams(o.model, layout, o.seed);
    const int num_layers = examples::NumModelLayers(o.model);
    std::vector<std::vector<torch::Tensor>> layer_params(num_layers);
    std::vector<torch::Tensor> params;
    for (int l = 0; l < num_layers; ++l) {
      layer_params[l] = examples::LayerParams(layout, l, result.params.data(), 0, true);
      params.insert(params.end(), layer_params[l].begin(), layer_params[l].end());
    }
    torch::optim::AdamW optimizer(params, torch::optim::AdamWOptions(o.lr)
                                              .betas({0.9f, 0.999f})
                                              .eps(1e-8f)
                                              .weight_decay(o.weight_decay));
    DdpBuckets reducer(params, *group);
    *buckets = reducer.size();
    for (int step = 1; step <= o.steps; ++step) {
      DdpStepTimes t;
      const absl::Time start = absl::Now();
      absl::Time mark = start;
      torch::Tensor tokens, targets;
      examples::MakeBatch(corpus, o.model, step, o.global_batch, o.rank, o.world_size, &tokens,
                          &targets);
      optimizer.zero_grad();
      torch::Tensor x = tokens;
      for (int l = 0; l < num_layers; ++l) {
        x = examples::ForwardLayer(o.model, l, layer_params[l], x, targets);
      }
      result.losses.push_back(x.item<float>());
      t.forward = Seconds(mark);
      mark = absl::Now();
      reducer.BeginStep();
      x.backward();
      t.backward = Seconds(mark);
      mark = absl::Now();
      reducer.Finish();
      t.allreduce_wait = Seconds(mark);
      mark = absl::Now();
      if (o.max_grad_norm > 0) torch::nn::utils::clip_grad_norm_(params, o.max_grad_norm);
      optimizer.step();
      t.optimizer = Seconds(mark);
      t.total = Seconds(start);
      times->push_back(t);
    }
    return result;
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("ddp rank ", o.rank, ": ", e.what()));
  }
}

struct Contender {
  std::string name;
  absl::Status status;
  TrainResult result;          // rank 0's parameters, the ranks' mean losses
  std::vector<double> losses;  // the ranks' mean losses, per step
  // Rank 0's timed steps.
  std::vector<double> step_seconds;
  std::vector<DdpStepTimes> ddp_times;
  std::vector<StepReport::Times> zs_times;
  std::string note;

  double median_step() const { return Median(step_seconds); }
};

// Stops at the first failed rank; also checks the ranks end with the same
// parameters.
absl::Status Collect(std::vector<absl::StatusOr<TrainResult>> ranks, Contender* c) {
  std::vector<TrainResult> ok;
  for (auto& r : ranks) {
    if (!r.ok()) return r.status();
    ok.push_back(*std::move(r));
  }
  for (size_t r = 1; r < ok.size(); ++r) {
    if (ok[r].params != ok[0].params) {
      return absl::InternalError(absl::StrCat("rank ", r, "'s parameters differ from rank 0's"));
    }
  }
  c->losses = examples::MeanLosses(ok);
  c->result = std::move(ok[0]);
  c->result.losses.assign(c->losses.begin(), c->losses.end());
  return absl::OkStatus();
}

Contender RunDdp(const TrainOptions& base, int warmup) {
  Contender c;
  c.name = "ddp (gloo)";
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<absl::StatusOr<TrainResult>> results(kWorld, absl::UnknownError("not run"));
  std::vector<std::vector<DdpStepTimes>> times(kWorld);
  size_t buckets = 0;
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      torch::set_num_threads(kTorchThreads);
      TrainOptions o = base;
      o.rank = r;
      size_t n = 0;
      results[r] = TrainDdpRank(o, store, &times[r], &n);
      if (r == 0) buckets = n;
    });
  }
  for (std::thread& t : threads) t.join();
  c.status = Collect(std::move(results), &c);
  c.note = absl::StrCat(buckets, " buckets");
  for (size_t s = warmup; s < times[0].size(); ++s) {
    c.step_seconds.push_back(times[0][s].total);
    c.ddp_times.push_back(times[0][s]);
  }
  return c;
}

// `keep`: stage 3 with TrainOptions::activations "keep".
Contender RunZeroshard(TrainOptions base, uint32_t stage, int warmup, const std::string& preset,
                       bool keep = false) {
  Contender c;
  c.name = absl::StrCat("zeroshard s", stage, keep ? " keep" : "");
  base.stage = stage;
  base.job_id = absl::StrCat("train-bench-", preset, "-s", stage, keep ? "-keep" : "");
  if (keep) base.activations = "keep";
  std::vector<absl::StatusOr<TrainResult>> results(kWorld, absl::UnknownError("not run"));
  std::vector<std::vector<StepReport>> reports(kWorld);
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      torch::set_num_threads(kTorchThreads);
      TrainOptions o = base;
      o.rank = r;
      results[r] = examples::TrainRank(o, [&, r](const StepReport& s) { reports[r].push_back(s); });
    });
  }
  for (std::thread& t : threads) t.join();
  c.status = Collect(std::move(results), &c);
  for (size_t s = warmup; s < reports[0].size(); ++s) {
    c.step_seconds.push_back(reports[0][s].seconds);
    c.zs_times.push_back(reports[0][s].times);
  }
  return c;
}

template <typename T>
double MeanMs(const std::vector<T>& v, double T::*field) {
  if (v.empty()) return NAN;
  double sum = 0;
  for (const T& x : v) sum += x.*field;
  return sum / v.size() * 1e3;
}

struct PresetResult {
  std::string name;
  uint64_t params = 0;
  double ratio[5] = {NAN, NAN, NAN, NAN, NAN};  // by stage, [4] s3 keep; [0] unused
};

PresetResult RunPreset(const Preset& p, const std::vector<std::string>& daemons,
                       const std::string& transport, DType precision) {
  PresetResult out;
  out.name = p.name;
  TrainOptions base;
  base.model = p.model;
  base.steps = p.warmup + p.steps;
  base.global_batch = p.global_batch;
  base.world_size = kWorld;
  base.corpus_dir = absl::GetFlag(FLAGS_corpus);
  base.daemons = daemons;
  base.transport = transport;
  base.ucx_tls = transport == "ucx" ? absl::GetFlag(FLAGS_ucx_tls) : "";
  base.job_token = kJobToken;
  base.rpc_timeout = absl::Minutes(5);
  base.precision = precision;
  absl::StatusOr<Layout> layout = examples::GptLayout(p.model);
  if (!layout.ok()) {
    std::printf("preset %s: %s\n", p.name.c_str(), layout.status().ToString().c_str());
    return out;
  }
  out.params = layout->total_elements();
  const int tokens = p.global_batch * p.model.seq_len;
  std::printf(
      "\n== preset %s: GPT %d blocks, width %d, %d heads, seq_len %d; %.2fM parameters; "
      "zeroshard jobs in %s, ddp in fp32; global batch %d (%d per rank), %d "
      "tokens/step; %u ranks; %d warm-up + %d timed steps; torch %d thread per rank; lr %g, "
      "weight decay %g, clip %g\n",
      p.name.c_str(), p.model.layers, p.model.width, p.model.heads, p.model.seq_len,
      out.params / 1e6, std::string(DTypeName(precision)).c_str(), p.global_batch,
      p.global_batch / static_cast<int>(kWorld), tokens, kWorld,
      p.warmup, p.steps, kTorchThreads, base.lr, base.weight_decay, base.max_grad_norm);
  std::fflush(stdout);

  // Every contender in turn, round after round: a round's ratios compare
  // runs seconds apart, and their median leaves out a round the shared
  // machine slowed for one contender only. The first round's contenders
  // are kept; later rounds add their steps and are checked against their
  // own ddp.
  auto run_round = [&](int round) {
    std::vector<Contender> cs;
    for (uint32_t i = 0; i <= 4; ++i) {
      const absl::Time start = absl::Now();
      cs.push_back(i == 0   ? RunDdp(base, p.warmup)
                   : i <= 3 ? RunZeroshard(base, i, p.warmup, p.name)
                            : RunZeroshard(base, 3, p.warmup, p.name, /*keep=*/true));
      std::printf("round %d, %s: %d steps in %.1f s%s\n", round + 1, cs.back().name.c_str(),
                  base.steps, Seconds(start), cs.back().status.ok() ? "" : " (failed)");
      std::fflush(stdout);
    }
    return cs;
  };
  std::vector<Contender> cs = run_round(0);
  std::vector<std::vector<double>> ratios(cs.size());  // by contender, per round
  std::vector<examples::OracleDiff> worst(cs.size());  // by contender, over the rounds
  auto account = [&](const std::vector<Contender>& round) {
    const Contender& ddp = round[0];
    for (size_t i = 1; i < round.size(); ++i) {
      const Contender& c = round[i];
      if (!ddp.status.ok() || !c.status.ok()) continue;
      ratios[i].push_back(ddp.median_step() / c.median_step());
      const examples::OracleDiff d =
          examples::CompareWithReference(c.result.params, c.losses, ddp.result);
      // NaN (parameters gone to NaN) stays the worst.
      auto keep_worst = [](double& worst_so_far, double x) {
        if (std::isnan(x) || x > worst_so_far) worst_so_far = x;
      };
      keep_worst(worst[i].params_rel, d.params_rel);
      keep_worst(worst[i].params_max, d.params_max);
      keep_worst(worst[i].loss_max, d.loss_max);
    }
  };
  account(cs);
  for (int round = 1; round < p.rounds; ++round) {
    std::vector<Contender> more = run_round(round);
    account(more);
    for (size_t i = 0; i < cs.size(); ++i) {
      Contender& c = cs[i];
      if (!more[i].status.ok() && c.status.ok()) c.status = more[i].status;
      c.step_seconds.insert(c.step_seconds.end(), more[i].step_seconds.begin(),
                            more[i].step_seconds.end());
      c.ddp_times.insert(c.ddp_times.end(), more[i].ddp_times.begin(), more[i].ddp_times.end());
      c.zs_times.insert(c.zs_times.end(), more[i].zs_times.begin(), more[i].zs_times.end());
    }
  }
  const Contender& ddp = cs[0];

  std::printf("%-17s %12s %16s %8s  %s\n", "contender", "tokens/s", "median step ms", "vs ddp",
              p.rounds > 1 ? "vs ddp by round (the median is reported)" : "");
  for (size_t i = 0; i < cs.size(); ++i) {
    const Contender& c = cs[i];
    if (!c.status.ok()) {
      std::printf("%-17s failed: %s\n", c.name.c_str(), c.status.ToString().c_str());
      continue;
    }
    if (i > 0 && ratios[i].empty()) {
      std::printf("%-17s no ratio: ddp failed in every round\n", c.name.c_str());
      continue;
    }
    // Over every round's timed steps; the ratio is the rounds' median.
    const double tps = tokens / c.median_step();
    std::string by_round;
    if (i > 0) {
      out.ratio[i] = Median(ratios[i]);
      if (p.rounds > 1) {
        for (double r : ratios[i]) absl::StrAppend(&by_round, " ", absl::StrFormat("%.3f", r));
      }
    }
    std::printf("%-17s %12.1f %16.1f %8.3f %s\n", c.name.c_str(), tps, c.median_step() * 1e3,
                i == 0 ? 1.0 : out.ratio[i], by_round.c_str());
  }

  std::printf("per-step breakdown, rank 0, mean ms over the timed steps%s:\n",
              p.rounds > 1 ? " of every round" : "");
  if (ddp.status.ok()) {
    std::printf(
        "  %-12s forward %8.1f  backward %8.1f (all-reduces overlapped, %s)  "
        "all-reduce wait %8.1f  clip+AdamW %8.1f  total %8.1f\n",
        ddp.name.c_str(), MeanMs(ddp.ddp_times, &DdpStepTimes::forward),
        MeanMs(ddp.ddp_times, &DdpStepTimes::backward), ddp.note.c_str(),
        MeanMs(ddp.ddp_times, &DdpStepTimes::allreduce_wait),
        MeanMs(ddp.ddp_times, &DdpStepTimes::optimizer),
        MeanMs(ddp.ddp_times, &DdpStepTimes::total));
  }
  using T = StepReport::Times;
  for (size_t i = 1; i < cs.size(); ++i) {
    const Contender& c = cs[i];
    if (!c.status.ok()) continue;
    double total = 0;
    for (double s : c.step_seconds) total += s;
    total = total / c.step_seconds.size() * 1e3;
    const double fwd = MeanMs(c.zs_times, &T::forward), bwd = MeanMs(c.zs_times, &T::backward),
                 push = MeanMs(c.zs_times, &T::push), wait = MeanMs(c.zs_times, &T::push_wait),
                 step = MeanMs(c.zs_times, &T::step), gather = MeanMs(c.zs_times, &T::gather);
    std::printf(
        "  %-15s forward %8.1f  backward %8.1f  push %8.1f  push wait %8.1f  "
        "step wait %8.1f  gather %8.1f  other %6.1f  total %8.1f\n",
        c.name.c_str(), fwd, bwd, push, wait, step, gather,
        total - (fwd + bwd + push + wait + step + gather), total);
  }

  if (precision == DType::kFp32) {
    std::printf(
        "final parameters and per-step losses against ddp, the worst of %d round%s "
        "(tolerance: params relative L2 %.0e, max element %.0e of the largest parameter, "
        "loss %.0e relative):\n",
        p.rounds, p.rounds > 1 ? "s" : "", examples::kOracleParamsRel,
        examples::kOracleParamsMax, examples::kOracleLossRel);
  } else {
    std::printf("final parameters and per-step losses against fp32 ddp (not judged):\n");
  }
  if (!ddp.status.ok()) std::printf("  none: ddp failed\n");
  for (size_t i = 1; i < cs.size(); ++i) {
    const Contender& c = cs[i];
    if (!c.status.ok() || !ddp.status.ok() || ratios[i].empty()) continue;
    const examples::OracleDiff& d = worst[i];  // the worst round's
    const bool within = d.params_rel <= examples::kOracleParamsRel &&
                        d.params_max <= examples::kOracleParamsMax &&
                        d.loss_max <= examples::kOracleLossRel;
    // A bf16 job's gradients and gathered parameters are rounded to bf16:
    // its distance from fp32 ddp is printed, not judged.
    const char* verdict = precision != DType::kFp32 ? "bf16, no fp32 tolerance applies"
                          : within                  ? "within tolerance"
                                                    : "NOT within tolerance";
    std::printf(
        "  %-15s params relative L2 %.3g, max %.3g; loss max relative %.3g; final loss "
        "(round 1) %.4f vs %.4f: %s\n",
        c.name.c_str(), d.params_rel, d.params_max, d.loss_max, c.result.losses.back(),
        ddp.result.losses.back(), verdict);
  }
  std::fflush(stdout);
  return out;
}

int Main() {
  torch::set_num_threads(kTorchThreads);
  absl::StatusOr<DType> precision = ParseDType(absl::GetFlag(FLAGS_precision));
  if (!precision.ok() || (*precision != DType::kFp32 && *precision != DType::kBf16)) {
    std::fprintf(stderr, "--precision: fp32 or bf16, got \"%s\"\n",
                 absl::GetFlag(FLAGS_precision).c_str());
    return 1;
  }
  std::vector<Preset> presets;
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_presets), ',', absl::SkipEmpty())) {
    absl::StatusOr<Preset> p = GetPreset(std::string(s));
    if (!p.ok()) {
      std::fprintf(stderr, "%s\n", p.status().ToString().c_str());
      return 1;
    }
    presets.push_back(*std::move(p));
  }
  if (presets.empty()) {
    std::fprintf(stderr, "--presets: none given\n");
    return 1;
  }
  DaemonOptions o;
  o.bulk_transport = "ucx";
  o.ucx_tls = absl::GetFlag(FLAGS_ucx_tls);
  std::vector<std::unique_ptr<Daemon>> daemons;
  std::vector<std::string> addresses;
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
    if (!d.ok()) {
      std::fprintf(stderr, "daemon %d: %s\n", i, d.status().ToString().c_str());
      return 1;
    }
    addresses.push_back((*d)->address());
    daemons.push_back(*std::move(d));
  }
  const bool ucx =
      daemons[0]->bulk_transport() != nullptr && daemons[1]->bulk_transport() != nullptr;
  const std::string transport = ucx ? "ucx" : "stream";
  std::printf(
      "zeroshard: 2 daemons in this process (1 optimizer thread each), data path %s%s; "
      "ddp: c10d ProcessGroupGloo, TCP on 127.0.0.1; every contender's ranks are "
      "threads of this process (%u CPUs), torch::set_num_threads(%d) in each\n",
      transport.c_str(),
      ucx ? absl::StrCat(" (UCX_TLS=", absl::GetFlag(FLAGS_ucx_tls), ")").c_str()
          : " (the daemons could not start UCX: streaming RPCs instead)",
      std::thread::hardware_concurrency(), kTorchThreads);
  std::fflush(stdout);

  std::vector<PresetResult> results;
  for (const Preset& p : presets) {
    results.push_back(RunPreset(p, addresses, transport, *precision));
  }
  const PresetResult* largest = nullptr;
  for (const PresetResult& r : results) {
    if (largest == nullptr || r.params > largest->params) largest = &r;
  }
  std::printf("\n%s, zeroshard in %s:\n", largest->name.c_str(),
              std::string(DTypeName(*precision)).c_str());
  std::printf("stage1_vs_ddp=%.3f stage2_vs_ddp=%.3f stage3_vs_ddp=%.3f stage3_keep_vs_ddp=%.3f\n",
              largest->ratio[1], largest->ratio[2], largest->ratio[3], largest->ratio[4]);
  return 0;
}

}  // namespace
}  // namespace zeroshard

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return zeroshard::Main();
}
