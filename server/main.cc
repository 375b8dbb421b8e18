// zeroshardd: the per-node shard daemon. Owns partitions of model states for
// the jobs registered with it and serves them over gRPC.

#include <csignal>
#include <cstdio>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/time/time.h"
#include "server/daemon.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:0",
          "HOST:PORT to serve gRPC on; port 0 picks a free port (printed at start).");
ABSL_FLAG(int, metrics_port, -1,
          "Port of the Prometheus /metrics endpoint, on the --listen host; 0 picks a free "
          "port (printed at start); -1 = off.");
ABSL_FLAG(uint64_t, memory_limit, 0, "Bytes this daemon may hold for all jobs; 0 = unlimited.");
ABSL_FLAG(int, optimizer_threads, 1, "Threads running the optimizer step.");
ABSL_FLAG(std::string, bulk_transport, "ucx",
          "Bulk transport served to trainers (ExchangeEndpoint): ucx, grpc or inproc; empty = "
          "none. When it cannot initialise, trainers use the streaming (\"stream\") path.");
ABSL_FLAG(int, rank_timeout_seconds, 30,
          "A joined rank not heard from (heartbeat, push) this long is no longer connected.");
ABSL_FLAG(uint64_t, reduction_buffer_bytes, 256ull << 20,
          "Out-of-order gradient bytes each job may buffer; pushes past it wait.");
ABSL_FLAG(std::string, ucx_tls, "",
          "UCX_TLS for the UCX data path, e.g. \"posix,cma,self\" or \"tcp\"; empty = UCX's "
          "choice (or the UCX_TLS environment variable).");
ABSL_FLAG(std::string, checkpoint_dir, "",
          "Directory for checkpoints (created if missing); empty: checkpoints are refused. "
          "Resharding reads other daemons' parts: share it between the daemons of a job.");
ABSL_FLAG(uint64_t, activation_arena_bytes, 256ull << 20,
          "Bytes of the activation-checkpoint arena, allocated (and booked against "
          "--memory_limit) at start; 0 = no Activation service.");
ABSL_FLAG(std::string, spill_dir, "",
          "Directory for activation slices that do not fit the arena (created if missing; spill "
          "files of killed daemons are removed at start); empty = no spilling.");
ABSL_FLAG(uint64_t, spill_bytes, 4ull << 30, "Bytes of spill files at most (with --spill_dir).");
ABSL_FLAG(int, drain_seconds, 10, "On SIGTERM, how long in-flight requests may finish.");

namespace {
volatile std::sig_atomic_t g_signal = 0;
void OnSignal(int sig) { g_signal = sig; }
}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("zeroshardd --listen=HOST:PORT [--memory_limit=BYTES] ...");
  absl::ParseCommandLine(argc, argv);
  zeroshard::DaemonOptions options;
  options.listen = absl::GetFlag(FLAGS_listen);
  options.memory_limit_bytes = absl::GetFlag(FLAGS_memory_limit);
  options.optimizer_threads = absl::GetFlag(FLAGS_optimizer_threads);
  options.bulk_transport = absl::GetFlag(FLAGS_bulk_transport);
  options.rank_timeout = absl::Seconds(absl::GetFlag(FLAGS_rank_timeout_seconds));
  options.reduction_buffer_bytes = absl::GetFlag(FLAGS_reduction_buffer_bytes);
  options.ucx_tls = absl::GetFlag(FLAGS_ucx_tls);
  options.checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  options.activation_arena_bytes = absl::GetFlag(FLAGS_activation_arena_bytes);
  options.spill_dir = absl::GetFlag(FLAGS_spill_dir);
  options.spill_bytes = absl::GetFlag(FLAGS_spill_bytes);
  if (absl::GetFlag(FLAGS_metrics_port) >= 0) {
    options.metrics_listen = options.listen.substr(0, options.listen.rfind(':') + 1) +
                             std::to_string(absl::GetFlag(FLAGS_metrics_port));
  }
  auto daemon = zeroshard::Daemon::Start(options);
  if (!daemon.ok()) {
    std::fprintf(stderr, "zeroshardd: %s\n", daemon.status().ToString().c_str());
    return 1;
  }
  std::printf("zeroshardd listening on %s\n", (*daemon)->address().c_str());
  if ((*daemon)->metrics_port() != 0) {
    std::printf("zeroshardd metrics on port %d\n", (*daemon)->metrics_port());
  }
  std::fflush(stdout);
  // A file-size limit makes writes past it fail (EFBIG: a checkpoint save
  // reports ResourceExhausted) instead of killing the daemon.
  std::signal(SIGXFSZ, SIG_IGN);
  std::signal(SIGTERM, OnSignal);
  std::signal(SIGINT, OnSignal);
  while (g_signal == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  std::fprintf(stderr, "zeroshardd: signal %d, draining for up to %ds\n", static_cast<int>(g_signal),
               absl::GetFlag(FLAGS_drain_seconds));
  (*daemon)->Shutdown(absl::Seconds(absl::GetFlag(FLAGS_drain_seconds)));
  (*daemon)->Wait();
  std::fprintf(stderr, "zeroshardd: stopped\n");
  return 0;
}
