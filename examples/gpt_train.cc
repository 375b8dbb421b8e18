// gpt_train: trains the GPT example data-parallel through zeroshard.
//
// Under zsrun every rank reads ZS_RANK, ZS_WORLD_SIZE, ZS_DAEMONS and
// ZS_JOB_ID from its environment (flags override them). --stage=0 trains in
// one process with torch::optim::AdamW (the baseline). Rank 0 draws a
// progress bar and, with --report, prints the memory, traffic and loss
// report at the end (and trains the single-process reference to compare).
//
// --reduction=trainer --collective_dir=DIR: the ranks reduce-scatter their
// gradients among themselves over Gloo (client/gloo_collective.h) and each
// pushes only its own partition, and the ranks all-gather the parameters
// among themselves (per layer in stage 3); the report shows the daemon and
// the rank-to-rank traffic side by side.
//
// Checkpoints (the daemons need --checkpoint_dir): --checkpoint_every=N has
// rank 0 save "step-<k>" after every N committed steps; --resume=NAME|latest
// continues the job from a checkpoint to --steps in all. --dump_params=PATH
// writes the final parameters (rank 0) as raw little-endian fp32.
//
// Activation checkpoints (stage 3): --activations=daemon keeps each layer's
// checkpoint on the Activation service of the rank's daemon (rank * daemons /
// world_size) instead of in the trainer; the report then shows what the
// trainer held beside what local checkpoints hold, and the daemons'
// activation bytes during the last step. --activation_timing_steps=N then
// trains a second job of N steps that alternates daemon and local
// checkpoints step by step and prints the median step time of each.

#include <netdb.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/rpc.h"
#include "common/auth.h"
#include "common/channel.h"
#include "common/estimator.h"
#include "common/format.h"
#include "common/tls_flags.h"
#include "examples/trainer.h"
#include "proto/zeroshard/v1/admin.grpc.pb.h"
#include "tools/zsctl_commands.h"

ABSL_FLAG(int, stage, 3, "ZeRO stage: 0 (single-process baseline), 1, 2 or 3.");
ABSL_FLAG(int, steps, 200, "Training steps.");
ABSL_FLAG(int, layers, 4, "Transformer blocks.");
ABSL_FLAG(int, width, 64, "Model width.");
ABSL_FLAG(int, heads, 4, "Attention heads.");
ABSL_FLAG(int, seq_len, 32, "Tokens per sequence.");
ABSL_FLAG(int, batch, 8, "Global batch (sequences per step over all ranks).");
ABSL_FLAG(std::string, preset, "",
          "A model size in place of --layers/--width/--heads/--seq_len: 1b (20 blocks, width "
          "2048, 16 heads, 32 tokens: 1.01B parameters; stage 3 with --report=false keeps the "
          "trainers to a few layers' worth of memory) or 3b (39 blocks, width 2560, 20 heads, "
          "32 tokens: 3.07B parameters; its model states need daemons with --state_dir on a "
          "24 GB machine).");
ABSL_FLAG(double, lr, 3e-3, "Learning rate.");
ABSL_FLAG(double, weight_decay, 0.01, "AdamW weight decay.");
ABSL_FLAG(double, max_grad_norm, 1.0, "Gradient clipping norm (0 = off).");
ABSL_FLAG(std::string, precision, "fp32", "fp32, bf16 or fp16.");
ABSL_FLAG(int64_t, bucket_bytes, 1 << 20, "Constant bucket size C_B in bytes.");
ABSL_FLAG(std::string, corpus, "/usr/share/common-licenses", "Directory of training text.");
ABSL_FLAG(int, rank, -1, "Rank (default: $ZS_RANK).");
ABSL_FLAG(int, world_size, -1, "N_d (default: $ZS_WORLD_SIZE).");
ABSL_FLAG(std::string, daemons, "", "Daemon addresses (default: $ZS_DAEMONS).");
ABSL_FLAG(std::string, job_id, "", "Job id (default: $ZS_JOB_ID, else gpt).");
ABSL_FLAG(std::string, transport, "ucx",
          "Data path to the daemons: ucx, grpc or inproc (a bulk transport, which must be the "
          "daemons' --bulk_transport), or stream (the Shard streaming RPCs).");
ABSL_FLAG(std::string, ucx_tls, "", "UCX_TLS for --transport=ucx (empty: UCX's choice).");
ABSL_FLAG(std::string, reduction, "daemon",
          "Gradient reduction: daemon (every rank pushes its whole gradient; the daemons sum the "
          "N_d contributions) or trainer (the ranks reduce-scatter their gradients among "
          "themselves over Gloo's TCP transport and each pushes only its own partition, Ψ/N_d; "
          "each also fetches only its partition of the parameters from the daemons and the ranks "
          "all-gather the rest, per layer in stage 3, without prefetching). trainer needs "
          "--collective_dir and takes no reconnects.");
ABSL_FLAG(std::string, collective_dir, "",
          "--reduction=trainer (required unless ZS_COLLECTIVE_DIR is set, as zsrun sets it): "
          "the Gloo rendezvous directory, the same path for every rank: on one host any directory, across nodes one on a filesystem they all "
          "mount. Created if missing. Each rank removes its files once connected; files left by "
          "a run of the same job id whose rendezvous failed make this one fail: remove them, or "
          "use a fresh directory.");
ABSL_FLAG(std::string, collective_host, "127.0.0.1",
          "--reduction=trainer: the address this rank's Gloo transport listens on and gives its "
          "peers (loopback for ranks on one host; across nodes this host's address on the "
          "network the ranks share).");
ABSL_FLAG(std::string, job_token_file, "",
          "File holding the job's secret (mode 0600); default: $ZS_JOB_TOKEN, which zsrun sets.");
ABSL_FLAG(int, threads, 0, "Torch threads per rank; 0 = the cores shared among the ranks.");
ABSL_FLAG(bool, report, true, "Rank 0: print the memory/traffic/loss report at the end.");
ABSL_FLAG(std::string, progress, "bar",
          "Rank 0's progress: bar (one line redrawn), lines (\"step K/N loss L ...\" per step) "
          "or none.");
ABSL_FLAG(int, checkpoint_every, 0,
          "Rank 0 saves checkpoint step-<k> after every this many committed steps and waits for "
          "the last one to complete before exiting (the daemons need --checkpoint_dir); 0 = "
          "never.");
ABSL_FLAG(std::string, resume, "",
          "Checkpoint to resume the job from: a name, or latest (the complete one with the "
          "highest step; none: start fresh). Training runs on to --steps in all.");
ABSL_FLAG(std::string, activations, "local",
          "Stage 3: where activation checkpoints live between forward and backward: local (the "
          "trainer's memory) or daemon (the Activation service of daemon rank*daemons/"
          "world_size, over --transport); or keep: no checkpoints, autograd keeps every "
          "layer's activations and backward recomputes nothing (each layer's parameters are "
          "still freed after its forward and gathered again for its backward).");
ABSL_FLAG(int, activation_prefetch_depth, 2,
          "--activations=daemon: checkpoints fetched ahead of the layer backward needs.");
ABSL_FLAG(int, activation_offloads_in_flight, 2,
          "--activations=daemon: offloads left running behind the forward pass.");
ABSL_FLAG(int, activation_keep_last, 1,
          "--activations=daemon: the latest checkpoints kept in the trainer, each offloaded "
          "once this many newer ones are saved; those still kept when backward begins, the "
          "first it needs, are never offloaded.");
ABSL_FLAG(bool, activation_checksums, false,
          "--activations=daemon over a bulk transport: send a CRC-32C with every checkpoint, "
          "which the daemon checks, and check every fetch against it (one more read of each "
          "byte on each side; the streaming RPCs check every chunk either way).");
ABSL_FLAG(int, activation_timing_steps, 0,
          "After training, every rank trains a second job of this many steps alternating daemon "
          "and local activation checkpoints step by step; rank 0 prints the median step time of "
          "each (needs stage 3). 0 = off.");
ABSL_FLAG(double, rpc_timeout_s, 60, "Seconds a single call to a daemon may take.");
ABSL_FLAG(double, liveness_timeout_s, 4,
          "Seconds a daemon may answer no keepalive ping before every call to it fails and a "
          "replicated job fails over from it (0: off; else at least 2).");
ABSL_FLAG(double, step_timeout_s, 300,
          "Seconds a wait on the other ranks may take (a step's barrier, the start-up barrier).");
ABSL_FLAG(double, checkpoint_wait_s, 10,
          "Seconds a checkpoint save waits for the previous one to complete; past it the save "
          "is skipped (reported) and training goes on.");
ABSL_FLAG(int, kill_at_step, 0,
          "Failure drill: in this step, the rank named by --kill_rank kills its own process "
          "(SIGKILL) once half of its layers' gradients are pushed; only in a process that was "
          "not restarted ($ZS_RESTART_COUNT unset or 0). 0: never.");
ABSL_FLAG(int, kill_rank, 0, "The rank --kill_at_step kills.");
ABSL_FLAG(int, replicas, 1,
          "Copies of each daemon's partitions: 1, or 2 for a primary and a backup on the next "
          "daemon (needs 2 or more daemons); with 2, a daemon may die without losing a step.");
ABSL_FLAG(bool, node_cache, false,
          "The node cache: each rank gathers other daemons' partitions through its host's "
          "daemon, which fetches them once per step for all its ranks (JobSpec.node_cache).");
ABSL_FLAG(int, local_daemon, -1,
          "With --node_cache: the index in --daemons of this rank's host daemon; -1: the first "
          "daemon whose address is this machine's.");
ABSL_FLAG(int, reconnects, -1,
          "After a failed step (a daemon died, a call timed out), reconnect in this process and "
          "continue at the committed step, at most this many times. -1: 8 with --replicas=2, "
          "else 0.");
ABSL_FLAG(std::string, dump_params, "",
          "Rank 0: after the last step, write every fp32 parameter (the flat layout, gaps as "
          "zeros) to this file as raw little-endian floats.");

namespace zeroshard::examples {
namespace {

std::string Env(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : fallback;
}

int EnvInt(const char* name, int flag, int fallback) {
  if (flag >= 0) return flag;
  int v;
  return absl::SimpleAtoi(Env(name, ""), &v) ? v : fallback;
}

// Writes `params` to `path` as little-endian fp32.
absl::Status DumpParams(const std::string& path, const std::vector<float>& params) {
  std::vector<unsigned char> bytes(params.size() * 4);
  for (size_t i = 0; i < params.size(); ++i) {
    uint32_t bits;
    std::memcpy(&bits, &params[i], 4);
    for (int b = 0; b < 4; ++b) bytes[4 * i + b] = static_cast<unsigned char>(bits >> (8 * b));
  }
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("dump_params: cannot open ", path, ": ", std::strerror(errno)));
  }
  const bool written = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
  const int write_errno = errno;
  if (std::fclose(f) != 0 || !written) {
    return absl::InternalError(absl::StrCat("dump_params: writing ", path, ": ",
                                            std::strerror(written ? errno : write_errno)));
  }
  return absl::OkStatus();
}

void ProgressLine(const StepReport& r, int steps) {
  std::printf("step %d/%d loss %.6f %.1f ms/step %s moved\n", r.step, steps, r.loss,
              r.seconds * 1e3, FormatBytes(static_cast<double>(r.bytes)).c_str());
  std::fflush(stdout);
}

// After a step's progress: the checkpoint saved after it, on a line of its
// own (`midline`: a progress bar is on the current line).
void CheckpointLine(const StepReport& r, bool midline) {
  if (!r.checkpoint.has_value()) return;
  const std::string name = absl::StrCat("step-", r.step);
  if (midline) std::printf("\n");
  if (r.checkpoint->ok()) {
    const CheckpointStarted& c = **r.checkpoint;
    if (!c.previous.ok()) std::printf("%s\n", c.previous.ToString().c_str());
    std::printf("checkpoint %s: step %llu, %s, snapshot %.3g ms\n", c.name.c_str(),
                static_cast<unsigned long long>(c.step),
                FormatBytes(static_cast<double>(c.bytes)).c_str(), c.snapshot_seconds * 1e3);
  } else {
    std::printf("checkpoint %s not saved: %s\n", name.c_str(),
                r.checkpoint->status().ToString().c_str());
  }
  std::fflush(stdout);
}

// `job`'s activation checkpoints in each daemon's arena, as its ledger books
// them (Admin.MemoryReport, category `activation`); the error text if a
// daemon does not answer.
std::string ArenaLines(const std::vector<std::string>& daemons, const std::string& job,
                       const ChannelSecurity& security) {
  std::string out;
  for (const std::string& address : daemons) {
    auto stub = v1::Admin::NewStub(MakeDaemonChannel(address, security));
    grpc::ClientContext context;
    SetDeadline(&context, absl::Now() + absl::Seconds(10));
    v1::MemoryReportRequest req;
    req.set_job_id(job);
    v1::MemoryReportResponse resp;
    const grpc::Status s = stub->MemoryReport(&context, req, &resp);
    if (!s.ok()) {
      absl::StrAppend(&out, "    daemon ", address, ": ",
                      DaemonError(s, address, "MemoryReport").ToString(), "\n");
      continue;
    }
    uint64_t bytes = 0;
    for (const v1::JobMemory& j : resp.jobs()) {
      for (const v1::CategoryBytes& c : j.categories()) {
        if (j.job_id() == job && c.category() == "activation") bytes = c.bytes();
      }
    }
    absl::StrAppend(&out, "    daemon ", address, ": activation ",
                    FormatBytes(static_cast<double>(bytes)), " in its arena\n");
  }
  return out;
}

// GET http://host:port/metrics (host: the daemon's), bounded by 5 s per
// read; empty on any error.
std::string ScrapeMetrics(const std::string& daemon, int port) {
  const std::string host = daemon.substr(0, daemon.rfind(':'));
  addrinfo hints{}, *found = nullptr;
  hints.ai_socktype = SOCK_STREAM;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) return "";
  std::string body;
  const int fd = socket(found->ai_family, SOCK_STREAM, 0);
  timeval timeout{5, 0};
  if (fd >= 0) {
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
  }
  if (fd >= 0 && connect(fd, found->ai_addr, found->ai_addrlen) == 0) {
    const std::string request = "GET /metrics HTTP/1.0\r\nHost: " + host + "\r\n\r\n";
    if (send(fd, request.data(), request.size(), MSG_NOSIGNAL) ==
        static_cast<ssize_t>(request.size())) {
      char buf[16384];
      ssize_t n;
      while ((n = recv(fd, buf, sizeof buf, 0)) > 0) body.append(buf, n);
    }
  }
  if (fd >= 0) close(fd);
  freeaddrinfo(found);
  return body;
}

// The value of `name{job="<job>"}` in a Prometheus text exposition, or 0.
double MetricValue(const std::string& text, const std::string& name, const std::string& job) {
  const std::string prefix = absl::StrCat(name, "{job=\"", job, "\"} ");
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (!absl::StartsWith(line, prefix)) continue;
    double v = 0;
    if (absl::SimpleAtod(line.substr(prefix.size()), &v)) return v;
  }
  return 0;
}

// The daemons' activation counters for `job` from their /metrics endpoints
// (ZS_METRICS_PORTS, in daemon order, as zsrun --metrics sets it); empty
// when the ports are not known.
std::string SpillLines(const std::vector<std::string>& daemons, const std::string& job) {
  std::vector<std::string> ports = absl::StrSplit(Env("ZS_METRICS_PORTS", ""), ',',
                                                  absl::SkipEmpty());
  if (ports.size() != daemons.size()) return "";
  std::string out;
  for (size_t d = 0; d < daemons.size(); ++d) {
    int port = 0;
    const std::string text =
        absl::SimpleAtoi(ports[d], &port) ? ScrapeMetrics(daemons[d], port) : "";
    if (text.empty()) {
      absl::StrAppend(&out, "    daemon ", daemons[d], ": /metrics on port ", ports[d],
                      " did not answer\n");
      continue;
    }
    absl::StrAppendFormat(
        &out, "    daemon %s: %.0f slices spilled (%s written to spill files); fetches: %.0f from "
              "the arena, %.0f read back from spill\n",
        daemons[d], MetricValue(text, "zeroshard_activation_spills_total", job),
        FormatBytes(MetricValue(text, "zeroshard_activation_spill_bytes_total", job)),
        MetricValue(text, "zeroshard_activation_hits_total", job),
        MetricValue(text, "zeroshard_activation_misses_total", job));
  }
  return out;
}

// Median step time of the steps that used `which` activations, skipping
// each kind's first two steps (warm-up); NaN when there are none.
double MedianStepMs(const std::vector<StepReport>& steps, const std::string& which) {
  std::vector<double> ms;
  int seen = 0;
  for (const StepReport& r : steps) {
    if (r.activations != which || ++seen <= 2) continue;
    ms.push_back(r.seconds * 1e3);
  }
  if (ms.empty()) return NAN;
  std::sort(ms.begin(), ms.end());
  const size_t n = ms.size();
  return n % 2 == 1 ? ms[n / 2] : (ms[n / 2 - 1] + ms[n / 2]) / 2;
}

void ProgressBar(const StepReport& r, int steps) {
  const int width = 30, filled = r.step * width / steps;
  std::string bar(filled, '#');
  bar.append(width - filled, '.');
  std::printf("\rstep %4d/%d [%s] loss %.4f  %6.1f ms/step  %s moved%s", r.step, steps,
              bar.c_str(), r.loss, r.seconds * 1e3, FormatBytes(static_cast<double>(r.bytes)).c_str(),
              r.step == steps ? "\n" : "");
  std::fflush(stdout);
}

int Main() {
  TrainOptions o;
  o.model.layers = absl::GetFlag(FLAGS_layers);
  o.model.width = absl::GetFlag(FLAGS_width);
  o.model.heads = absl::GetFlag(FLAGS_heads);
  o.model.seq_len = absl::GetFlag(FLAGS_seq_len);
  if (const std::string preset = absl::GetFlag(FLAGS_preset); preset == "1b") {
    o.model.layers = 20;
    o.model.width = 2048;
    o.model.heads = 16;
    o.model.seq_len = 32;
  } else if (preset == "3b") {
    o.model.layers = 39;
    o.model.width = 2560;
    o.model.heads = 20;
    o.model.seq_len = 32;
  } else if (!preset.empty()) {
    std::fprintf(stderr, "gpt_train: --preset: 1b, 3b or empty, got \"%s\"\n", preset.c_str());
    return 2;
  }
  o.steps = absl::GetFlag(FLAGS_steps);
  o.global_batch = absl::GetFlag(FLAGS_batch);
  o.lr = static_cast<float>(absl::GetFlag(FLAGS_lr));
  o.weight_decay = static_cast<float>(absl::GetFlag(FLAGS_weight_decay));
  o.max_grad_norm = static_cast<float>(absl::GetFlag(FLAGS_max_grad_norm));
  o.bucket_bytes = static_cast<uint64_t>(absl::GetFlag(FLAGS_bucket_bytes));
  o.rpc_timeout = absl::Seconds(absl::GetFlag(FLAGS_rpc_timeout_s));
  o.liveness_timeout = absl::Seconds(absl::GetFlag(FLAGS_liveness_timeout_s));
  o.step_timeout = absl::Seconds(absl::GetFlag(FLAGS_step_timeout_s));
  o.checkpoint_wait = absl::Seconds(absl::GetFlag(FLAGS_checkpoint_wait_s));
  o.replicas = static_cast<uint32_t>(std::max(absl::GetFlag(FLAGS_replicas), 0));
  o.reconnects = absl::GetFlag(FLAGS_reconnects) >= 0 ? absl::GetFlag(FLAGS_reconnects)
                 : o.replicas > 1                     ? 8
                                                      : 0;
  o.node_cache = absl::GetFlag(FLAGS_node_cache);
  o.local_daemon = absl::GetFlag(FLAGS_local_daemon);
  o.corpus_dir = absl::GetFlag(FLAGS_corpus);
  o.transport = absl::GetFlag(FLAGS_transport);
  o.ucx_tls = absl::GetFlag(FLAGS_ucx_tls);
  o.reduction = absl::GetFlag(FLAGS_reduction);
  o.collective_dir = absl::GetFlag(FLAGS_collective_dir);
  if (const char* dir = std::getenv("ZS_COLLECTIVE_DIR"); o.collective_dir.empty() && dir) {
    o.collective_dir = dir;  // zsrun's, the same for every rank of the run
  }
  o.collective_hostname = absl::GetFlag(FLAGS_collective_host);
  if (o.reduction != "daemon" && o.reduction != "trainer") {
    std::fprintf(stderr, "gpt_train: --reduction: daemon or trainer, got \"%s\"\n",
                 o.reduction.c_str());
    return 2;
  }
  if (o.reduction == "trainer") {
    if (o.collective_dir.empty()) {
      std::fprintf(stderr,
                   "gpt_train: --reduction=trainer needs --collective_dir (a directory "
                   "every rank shares) or ZS_COLLECTIVE_DIR (zsrun sets it)\n");
      return 2;
    }
    if (absl::GetFlag(FLAGS_reconnects) > 0) {
      std::fprintf(stderr, "gpt_train: --reduction=trainer takes no --reconnects\n");
      return 2;
    }
    o.reconnects = 0;
    if (mkdir(o.collective_dir.c_str(), 0700) != 0 && errno != EEXIST) {
      std::fprintf(stderr, "gpt_train: --collective_dir %s: %s\n", o.collective_dir.c_str(),
                   std::strerror(errno));
      return 2;
    }
  }
  o.tls = TlsFilesFromFlags();
  if (const std::string file = absl::GetFlag(FLAGS_job_token_file); !file.empty()) {
    absl::StatusOr<std::string> token = ReadTokenFile(file, "--job_token_file");
    if (!token.ok()) {
      std::fprintf(stderr, "gpt_train: %s\n", token.status().ToString().c_str());
      return 2;
    }
    o.job_token = *std::move(token);
  }
  o.stage = static_cast<uint32_t>(absl::GetFlag(FLAGS_stage));
  o.checkpoint_every = absl::GetFlag(FLAGS_checkpoint_every);
  o.resume = absl::GetFlag(FLAGS_resume);
  o.activations = absl::GetFlag(FLAGS_activations);
  o.activation_prefetch_depth =
      static_cast<uint32_t>(std::max(0, absl::GetFlag(FLAGS_activation_prefetch_depth)));
  o.activation_checksums = absl::GetFlag(FLAGS_activation_checksums);
  o.activation_offloads_in_flight =
      static_cast<uint32_t>(std::max(0, absl::GetFlag(FLAGS_activation_offloads_in_flight)));
  o.activation_keep_last =
      static_cast<uint32_t>(std::max(0, absl::GetFlag(FLAGS_activation_keep_last)));
  const int timing_steps = absl::GetFlag(FLAGS_activation_timing_steps);
  if (o.activations != "local" && o.activations != "daemon" && o.activations != "keep") {
    std::fprintf(stderr, "gpt_train: --activations: local, daemon or keep, got \"%s\"\n",
                 o.activations.c_str());
    return 2;
  }
  if ((o.activations != "local" || timing_steps > 0) && o.stage != 3) {
    std::fprintf(stderr, "gpt_train: --activations=%s and --activation_timing_steps need "
                         "--stage=3 (stages 0-2 keep autograd's activations)\n",
                 o.activations.c_str());
    return 2;
  }
  if (o.activations == "keep" && timing_steps > 0) {
    std::fprintf(stderr, "gpt_train: --activation_timing_steps compares checkpoints in the "
                         "daemon and the trainer; --activations=keep takes none\n");
    return 2;
  }
  const std::string progress_mode = absl::GetFlag(FLAGS_progress);
  if (progress_mode != "bar" && progress_mode != "lines" && progress_mode != "none") {
    std::fprintf(stderr, "gpt_train: --progress: bar, lines or none, got \"%s\"\n",
                 progress_mode.c_str());
    return 2;
  }
  const std::string dump_path = absl::GetFlag(FLAGS_dump_params);
  // The final parameters (Ψ fp32 on every rank) only where they are used.
  o.final_params = absl::GetFlag(FLAGS_report) || !dump_path.empty();
  if (o.stage == 0 && (o.checkpoint_every != 0 || !o.resume.empty())) {
    std::fprintf(stderr, "gpt_train: checkpoints are the daemons': --stage=0 has none\n");
    return 2;
  }
  o.rank = static_cast<uint32_t>(EnvInt("ZS_RANK", absl::GetFlag(FLAGS_rank), 0));
  o.world_size = static_cast<uint32_t>(EnvInt("ZS_WORLD_SIZE", absl::GetFlag(FLAGS_world_size), 1));
  o.job_id = absl::GetFlag(FLAGS_job_id).empty() ? Env("ZS_JOB_ID", "gpt") : absl::GetFlag(FLAGS_job_id);
  const std::string daemons =
      absl::GetFlag(FLAGS_daemons).empty() ? Env("ZS_DAEMONS", "") : absl::GetFlag(FLAGS_daemons);
  o.daemons = absl::StrSplit(daemons, ',', absl::SkipEmpty());
  absl::StatusOr<DType> precision = ParseDType(absl::GetFlag(FLAGS_precision));
  if (!precision.ok()) {
    std::fprintf(stderr, "gpt_train: --precision: %s\n", precision.status().ToString().c_str());
    return 2;
  }
  o.precision = *precision;
  absl::StatusOr<Layout> layout = GptLayout(o.model);
  if (!layout.ok()) {
    std::fprintf(stderr, "gpt_train: %s\n", layout.status().ToString().c_str());
    return 2;
  }
  const int restart_count = EnvInt("ZS_RESTART_COUNT", -1, 0);
  if (absl::GetFlag(FLAGS_kill_at_step) > 0 && restart_count == 0 &&
      absl::GetFlag(FLAGS_kill_rank) == static_cast<int>(o.rank)) {
    o.kill_at_step = absl::GetFlag(FLAGS_kill_at_step);
  }
  const bool leader = o.rank == 0;
  int threads = absl::GetFlag(FLAGS_threads);
  if (threads <= 0) {
    const int cores = static_cast<int>(std::thread::hardware_concurrency());
    threads = std::max(1, cores / static_cast<int>(std::max<uint32_t>(o.world_size, 1)));
  }
  torch::set_num_threads(threads);
  const double psi = static_cast<double>(layout->parameter_count());
  if (leader) {
    std::printf(
        "GPT: %d blocks, width %d, %d heads, %d tokens; Ψ = %s parameters (%zu layers); "
        "global batch %d; ZeRO stage %u; N_d = %u; %zu daemon(s); %s over %s; %s "
        "reduction%s\n",
        o.model.layers, o.model.width, o.model.heads, o.model.seq_len, FormatCount(psi).c_str(),
        layout->layers().size(), o.global_batch, o.stage, o.world_size, o.daemons.size(),
        std::string(DTypeName(o.precision)).c_str(), o.transport.c_str(),
        o.reduction == "trainer" ? "trainer (Gloo)" : "daemon",
        o.stage == 3 ? absl::StrCat("; activation checkpoints: ", o.activations).c_str() : "");
  }
  const StepCallback progress = [&](const StepReport& r) {
    if (!leader) return;
    if (progress_mode == "bar") {
      ProgressBar(r, o.steps);
      CheckpointLine(r, r.step != o.steps);
    } else {
      if (progress_mode == "lines") ProgressLine(r, o.steps);
      CheckpointLine(r, false);
    }
  };
  const auto dump = [&](const std::vector<float>& params) {
    if (!leader || dump_path.empty()) return true;
    const absl::Status s = DumpParams(dump_path, params);
    if (!s.ok()) {
      std::fprintf(stderr, "gpt_train: %s\n", s.ToString().c_str());
      return false;
    }
    std::printf("parameters: %zu fp32 values written to %s\n", params.size(), dump_path.c_str());
    std::fflush(stdout);
    return true;
  };
  if (o.stage == 0) {
    auto r = TrainSingleProcess(o, progress);
    if (!r.ok()) {
      std::fprintf(stderr, "gpt_train: %s\n", r.status().ToString().c_str());
      return 1;
    }
    return dump(r->params) ? 0 : 1;
  }
  if (o.daemons.empty()) {
    std::fprintf(stderr, "gpt_train: no daemons: run under zsrun or pass --daemons\n");
    return 2;
  }
  std::string daemon_report, spill_report;
  uint64_t activation_bytes = 0;
  // The report's own calls to the daemons: the trainer's TLS and token.
  const absl::StatusOr<ChannelSecurity> report_security =
      MakeChannelSecurity(o.tls, JobTokenOrEnvironment(o.job_token), "--");
  const FinishCallback report = [&](Client&) {
    if (!leader || !absl::GetFlag(FLAGS_report)) return;
    if (!report_security.ok()) {
      daemon_report = report_security.status().ToString();
      return;
    }
    tools::AdminOptions admin;
    admin.daemons = absl::StrJoin(o.daemons, ",");
    admin.job = o.job_id;
    admin.security = *report_security;
    auto memory = tools::RunMemory(admin);
    daemon_report = memory.ok() ? *memory : memory.status().ToString();
    if (o.activations == "daemon") spill_report = SpillLines(o.daemons, o.job_id);
  };
  const StartCallback started = [&](Client& client) {
    if (restart_count > 0) {
      std::fprintf(stderr, "rank %u restarted (ZS_RESTART_COUNT=%d): continuing at step %llu\n",
                   o.rank, restart_count,
                   static_cast<unsigned long long>(client.committed_step() + 1));
      std::fflush(stderr);
    }
    if (!leader || o.resume.empty()) return;
    if (client.resumed_from().has_value()) {
      const v1::LoadCheckpointResponse& r = *client.resumed_from();
      std::printf("resumed from checkpoint %s at step %llu (daemon 0 read %s in %.2f s)\n",
                  r.name().c_str(), static_cast<unsigned long long>(r.step()),
                  FormatBytes(static_cast<double>(r.bytes_read())).c_str(), r.seconds());
    } else {
      std::printf("no checkpoint of job %s to resume from: starting at step %llu\n",
                  o.job_id.c_str(), static_cast<unsigned long long>(client.committed_step() + 1));
    }
    std::fflush(stdout);
  };
  // The daemons' activation bytes while the last step's checkpoints are
  // offloaded (after its forward pass), as rank 0 sees them.
  std::string activation_memory;
  const BackwardCallback before_backward = [&](int step, Client&) {
    if (!leader || step != o.steps || o.activations != "daemon" ||
        !absl::GetFlag(FLAGS_report)) {
      return;
    }
    activation_memory = report_security.ok() ? ArenaLines(o.daemons, o.job_id, *report_security)
                                             : report_security.status().ToString();
  };
  auto result = TrainRank(o, progress, report, started, before_backward);
  if (!result.ok()) {
    std::fprintf(stderr, "gpt_train rank %u: %s\n", o.rank, result.status().ToString().c_str());
    return 1;
  }
  if (leader && result->last_checkpoint.has_value()) {
    const CheckpointCompleted& c = *result->last_checkpoint;
    std::printf("checkpoint %s complete: step %llu, %s written in %.2f s\n", c.name.c_str(),
                static_cast<unsigned long long>(c.step),
                FormatBytes(static_cast<double>(c.bytes)).c_str(), c.write_seconds);
  }
  if (!dump(result->params)) return 1;
  activation_bytes = result->activation_bytes;
  // Step times with daemon and with local checkpoints, alternating in one
  // job so that both see the same machine.
  std::string timing_line;
  if (timing_steps > 0) {
    TrainOptions t = o;
    t.steps = timing_steps;
    t.activations = "both";
    t.job_id = o.job_id + "-activation-timing";
    t.checkpoint_every = 0;
    t.resume.clear();
    std::vector<StepReport> steps;
    auto timed = TrainRank(t, [&](const StepReport& r) { steps.push_back(r); });
    if (!timed.ok()) {
      std::fprintf(stderr, "gpt_train rank %u: activation timing: %s\n", o.rank,
                   timed.status().ToString().c_str());
      return 1;
    }
    const double daemon_ms = MedianStepMs(steps, "daemon");
    const double local_ms = MedianStepMs(steps, "local");
    timing_line = absl::StrFormat(
        "Step time over %d steps alternating daemon and local activation checkpoints "
        "(job %s, prefetch depth %u): daemon %.1f ms, local %.1f ms (medians); daemon/local "
        "= %.3f\n",
        timing_steps, t.job_id, o.activation_prefetch_depth, daemon_ms, local_ms,
        daemon_ms / local_ms);
    if (leader && !absl::GetFlag(FLAGS_report)) std::printf("%s", timing_line.c_str());
  }
  if (!leader || !absl::GetFlag(FLAGS_report)) return 0;

  const double elem = static_cast<double>(DTypeSize(o.precision));
  const auto paper = EstimateModelStates(static_cast<int>(o.stage), psi, o.world_size);
  std::printf("\n==== zeroshard report: Ψ = %s, N_d = %u, ZeRO stage %u, %s ====\n\n",
              FormatCount(psi).c_str(), o.world_size, o.stage,
              std::string(DTypeName(o.precision)).c_str());
  std::printf("Daemon memory by category (ledger), with the paper's partitioned terms:\n%s\n",
              daemon_report.c_str());
  std::printf("Paper, per rank, mixed-precision Adam (K = 12): %s = %s\n",
              o.stage == 1 ? "4Ψ + KΨ/N_d" : o.stage == 2 ? "2Ψ + (2+K)Ψ/N_d" : "(4+K)Ψ/N_d",
              paper.ok() ? FormatBytes(paper->bytes_per_rank).c_str() : "?");
  std::printf(
      "Trainer rank 0 holds: staging buffers %s, layer buffers %s, activation "
      "checkpoints %s\n",
      FormatBytes(result->client_memory.buffer).c_str(),
      FormatBytes(result->client_memory.param + result->client_memory.param_half).c_str(),
      FormatBytes(static_cast<double>(activation_bytes)).c_str());
  {
    // What a plain data-parallel rank holds (16Ψ: fp32 parameters, gradients
    // and Adam's two moments) against this trainer's buffers: the staging
    // pool is constant (staging_buffers x C_B), the layer buffers grow with
    // the largest layer, so in proportion to Ψ for a model of this shape.
    const double staging = static_cast<double>(result->client_memory.buffer);
    const double layers =
        static_cast<double>(result->client_memory.param + result->client_memory.param_half);
    const double held = staging + layers;
    const double per_psi = layers / psi;  // bytes per parameter the layer buffers hold
    std::printf(
        "A plain data-parallel rank would hold 16Ψ = %s of model states; trainer rank 0 "
        "holds %s of buffers, %.2f of that. ",
        FormatBytes(16 * psi).c_str(), FormatBytes(held).c_str(), held / (16 * psi));
    if (per_psi < 16) {
      std::printf(
          "With these buffers and a model of this shape, a zeroshard trainer holds less "
          "above Ψ = %s (the constant staging pool / (16 - %.2f bytes of layer buffers "
          "per parameter))\n",
          FormatCount(staging / (16 - per_psi)).c_str(), per_psi);
    } else {
      std::printf(
          "Its layer buffers alone hold %.2f bytes per parameter: more than 16 at any "
          "size (fewer layer buffers, or more layers)\n",
          per_psi);
    }
  }
  if (o.stage == 3) {
    std::printf("Activation checkpoints (%s): rank 0 held at most %s of them at once; keeping a "
                "step's checkpoints in the trainer (--activations=local) holds %s\n",
                result->activation_store.c_str(),
                FormatBytes(static_cast<double>(result->activation_bytes)).c_str(),
                FormatBytes(static_cast<double>(result->activation_step_bytes)).c_str());
    if (result->activation_stats.has_value()) {
      const SliceStoreStats& a = *result->activation_stats;
      std::printf("  rank 0 offloaded %llu checkpoints (%s) and fetched %llu (%s), prefetch "
                  "depth %u; %llu stored straight to a spill file, %llu read back from one, "
                  "%llu over the streaming RPCs, %llu failed\n",
                  static_cast<unsigned long long>(a.offloads),
                  FormatBytes(static_cast<double>(a.offload_bytes)).c_str(),
                  static_cast<unsigned long long>(a.fetches),
                  FormatBytes(static_cast<double>(a.fetch_bytes)).c_str(),
                  o.activation_prefetch_depth, static_cast<unsigned long long>(a.spilled_offloads),
                  static_cast<unsigned long long>(a.spilled_fetches),
                  static_cast<unsigned long long>(a.streamed),
                  static_cast<unsigned long long>(a.failures));
      if (result->activations_refused > 0) {
        std::printf("  %llu checkpoints the daemon had no room for were kept in the trainer\n",
                    static_cast<unsigned long long>(result->activations_refused));
      }
    }
    if (!activation_memory.empty()) {
      std::printf("  the daemons' arenas after the last step's forward pass (ledger):\n%s",
                  activation_memory.c_str());
    }
    if (!spill_report.empty()) {
      std::printf("  the daemons' activation counters for this job (/metrics):\n%s",
                  spill_report.c_str());
    }
  }
  std::printf("%s\n", timing_line.c_str());
  const auto& t = result->traffic.last_step;
  const bool trainer = o.reduction == "trainer";
  const double nd = static_cast<double>(o.world_size);
  // Daemon traffic: the push (Ψ, or Ψ/N_d with the trainer collective) and
  // the gathers (Ψ, twice in stage 3; a rank's partition only with the
  // trainer collective, which all-gathers the rest among the ranks).
  const double gathers = o.stage == 3 ? 2.0 : 1.0;
  const double share = trainer ? 1.0 / nd : 1.0;
  const double expected = (share + gathers * share) * psi * elem;
  const char* figure =
      trainer ? (o.stage == 3 ? "3Ψ/N_d" : "2Ψ/N_d") : (o.stage == 3 ? "3Ψ" : "2Ψ");
  std::printf(
      "Traffic of rank 0 in the last step: pushed %s + gathered %s = %s with the daemons; "
      "expected %s = %s (ratio %.3f; alignment padding makes up the difference)\n",
      FormatBytes(t.push).c_str(), FormatBytes(t.gather).c_str(), FormatBytes(t.total()).c_str(),
      figure, FormatBytes(expected).c_str(), t.total() / expected);
  if (trainer) {
    // The reduce-scatter in fp32, and the parameter all-gathers (one, or
    // two in stage 3) in the job's precision.
    const double each_way = (nd - 1) / nd * psi * (4 + gathers * elem);
    std::printf(
        "  and with the other ranks (Gloo reduce-scatter in fp32, %s): sent %s + received %s = "
        "%s; expected (N_d-1)/N_d Ψ each way per collective = %s + %s (ratio %.3f)\n",
        o.stage == 3 ? "each layer all-gathered twice" : "parameter all-gather",
        FormatBytes(t.collective_sent).c_str(), FormatBytes(t.collective_received).c_str(),
        FormatBytes(t.collective()).c_str(), FormatBytes(each_way).c_str(),
        FormatBytes(each_way).c_str(), t.collective() / (2 * each_way));
  }
  std::printf("\n");
  std::printf("Training the same model in one process with torch::optim::AdamW for the reference "
              "...\n");
  std::fflush(stdout);
  auto reference = TrainSingleProcess(o);
  if (!reference.ok()) {
    std::fprintf(stderr, "reference: %s\n", reference.status().ToString().c_str());
    return 1;
  }
  auto sharded_eval = EvaluateLoss(o, result->params, o.steps + 1);
  auto reference_eval = EvaluateLoss(o, reference->params, o.steps + 1);
  if (!sharded_eval.ok() || !reference_eval.ok()) return 1;
  std::printf("Loss on a held-out batch after %d steps: zeroshard %.5f, single-process torch "
              "%.5f (difference %.2g)",
              o.steps, *sharded_eval, *reference_eval, *sharded_eval - *reference_eval);
  if (!result->losses.empty()) {
    std::printf("; step %d's loss %.4f -> last %.4f", result->first_step,
                result->losses.front(), result->losses.back());
  }
  std::printf("\n");
  return 0;
}

}  // namespace
}  // namespace zeroshard::examples

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return zeroshard::examples::Main();
}
