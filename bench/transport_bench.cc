// Push+gather bandwidth of the client's bulk data path, in one process:
//   ucx       zeroshard::Client with transport "ucx" over shared memory
//             (UCX_TLS=posix,cma,self) against an in-process daemon serving
//             --bulk_transport=ucx;
//   stream    the same client and daemon with transport "stream" (the Shard
//             streaming RPCs);
//   perftest  `ucx_perftest -t ucp_put_bw` between two processes on
//             loopback, same UCX_TLS, message size = the client's bucket C_B:
//             what UCX itself moves with these settings.
// A job of --bytes fp32 parameters (one rank, stage 2) pushes its whole
// gradient and gathers all parameters per repetition; a repetition's figure
// is (pushed + gathered bytes) / (push time + gather time), the optimizer
// step in between not counted. Each path reports the median of --reps
// repetitions after one warm-up, perftest the median of --perftest_runs
// runs: the host is shared, and medians keep one noisy moment from deciding
// the ratio. The
// gradient buffer is borrowed (BufferUse::kBorrow, as a trainer with a
// persistent gradient buffer pushes); the UCX path is also measured with
// copied pushes (BufferUse::kCopy: one more sweep through the client's
// staging pool) for comparison. The last line is the summary:
//   ucx_gbps=X stream_gbps=Y perftest_gbps=Z ucx_fraction=X/Z

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/perftest.h"
#include "bench/stats.h"
#include "client/client.h"
#include "server/daemon.h"

ABSL_FLAG(uint64_t, bytes, 268435456, "bytes of fp32 parameters in the job (Ψ * 4)");
ABSL_FLAG(uint64_t, bucket_bytes, 32ull << 20, "the client's bucket C_B (and perftest's message)");
ABSL_FLAG(int, reps, 5, "timed repetitions after one warm-up (the median is reported)");
ABSL_FLAG(int, perftest_runs, 3, "ucx_perftest runs (the median is reported)");
ABSL_FLAG(std::string, ucx_tls, "posix,cma,self", "UCX_TLS for the client, daemon and perftest");
ABSL_FLAG(std::string, perftest, "ucx_perftest", "the ucx_perftest binary (PATH is searched)");

extern char** environ;

namespace zeroshard {
namespace {

using bench::Median;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct PathResult {
  double gbps = NAN;
  uint64_t client_buffer = 0;
  double push_gbps = NAN, gather_gbps = NAN;
};

absl::StatusOr<PathResult> Measure(Daemon& daemon, const std::string& transport,
                                   BufferUse use) {
  const uint64_t n = absl::GetFlag(FLAGS_bytes) / sizeof(float);
  absl::StatusOr<Layout> layout = Layout::Create({{"w", {static_cast<int64_t>(n)}, DType::kFp32, 0}});
  if (!layout.ok()) return layout.status();
  ClientConfig c;
  c.daemons = {daemon.address()};
  c.job_id = absl::StrCat("bench-", transport, use == BufferUse::kBorrow ? "-borrow" : "-copy");
  c.stage = 2;
  c.precision = DType::kFp32;
  c.bucket_bytes = absl::GetFlag(FLAGS_bucket_bytes);
  c.max_grad_norm = 0;
  c.transport = transport;
  c.ucx_tls = absl::GetFlag(FLAGS_ucx_tls);
  c.rpc_timeout = absl::Seconds(120);
  c.step_timeout = absl::Seconds(300);
  // Before the client: a borrowed `grads` must outlive the sends, which the
  // client's destructor waits for.
  const uint64_t total = layout->total_elements();
  std::vector<float> params(total, 0.5f), grads(total, 1e-3f);
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(c);
  if (!client.ok()) return client.status();
  if (absl::Status s = (*client)->RegisterModel(*layout, params.data()); !s.ok()) return s;
  PathResult r;
  const int reps = std::max(1, absl::GetFlag(FLAGS_reps));
  const double bytes = static_cast<double>(total) * sizeof(float);
  std::vector<double> push, gather, both;
  for (int rep = 0; rep <= reps; ++rep) {
    const double t0 = Now();
    absl::StatusOr<PushTicket> t =
        (*client)->PushGradients({0, total}, grads.data(), DType::kFp32, 0, use);
    if (!t.ok()) return t.status();
    if (absl::Status s = t->Wait(absl::Now() + absl::Seconds(300)); !s.ok()) return s;
    const double t1 = Now();
    absl::StatusOr<StepResult> step = (*client)->Step(1e-4f);
    if (!step.ok()) return step.status();
    const double t2 = Now();
    if (absl::Status s = (*client)->GatherAll(params.data(), DType::kFp32); !s.ok()) return s;
    const double t3 = Now();
    if (rep > 0) {  // rep 0 warms up
      push.push_back(bytes / (t1 - t0) / 1e9);
      gather.push_back(bytes / (t3 - t2) / 1e9);
      both.push_back(2 * bytes / ((t1 - t0) + (t3 - t2)) / 1e9);
    }
  }
  r.push_gbps = Median(push);
  r.gather_gbps = Median(gather);
  r.gbps = Median(both);
  r.client_buffer = (*client)->MemoryReport().buffer;
  (*client)->Leave().IgnoreError();
  return r;
}

int Main() {
  DaemonOptions o;
  o.bulk_transport = "ucx";
  o.ucx_tls = absl::GetFlag(FLAGS_ucx_tls);
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(o);
  if (!daemon.ok()) {
    std::fprintf(stderr, "daemon: %s\n", daemon.status().ToString().c_str());
    return 1;
  }
  const uint64_t bytes = absl::GetFlag(FLAGS_bytes);
  std::printf("job: %llu fp32 parameters (%.1f MiB), 1 rank, stage 2, C_B %llu B, UCX_TLS=%s\n",
              static_cast<unsigned long long>(bytes / 4), bytes / 1048576.0,
              static_cast<unsigned long long>(absl::GetFlag(FLAGS_bucket_bytes)),
              absl::GetFlag(FLAGS_ucx_tls).c_str());
  struct Run {
    const char* transport;
    BufferUse use;
    const char* label;
    double gbps = NAN;
  };
  Run runs[3] = {{"ucx", BufferUse::kCopy, "ucx (copied push)"},
                 {"ucx", BufferUse::kBorrow, "ucx"},
                 {"stream", BufferUse::kBorrow, "stream"}};
  for (Run& run : runs) {
    if (std::string(run.transport) == "ucx" && (*daemon)->bulk_transport() == nullptr) {
      std::printf("%s: the daemon could not initialise UCX; skipped\n", run.label);
      continue;
    }
    absl::StatusOr<PathResult> r = Measure(**daemon, run.transport, run.use);
    if (!r.ok()) {
      std::printf("%s: failed: %s\n", run.label, r.status().ToString().c_str());
      continue;
    }
    run.gbps = r->gbps;
    std::printf("%-17s push %.2f GB/s, gather %.2f GB/s, push+gather %.2f GB/s; "
                "client staging buffer %llu B\n",
                run.label, r->push_gbps, r->gather_gbps, r->gbps,
                static_cast<unsigned long long>(r->client_buffer));
  }
  const double gbps[2] = {runs[1].gbps, runs[2].gbps};
  std::string why;
  std::vector<double> perftest_runs;
  for (int i = 0; i < std::max(1, absl::GetFlag(FLAGS_perftest_runs)); ++i) {
    const double g = bench::PerftestPutGbps(absl::GetFlag(FLAGS_bucket_bytes), absl::GetFlag(FLAGS_perftest),
                                             absl::GetFlag(FLAGS_ucx_tls), &why);
    if (std::isnan(g)) break;
    perftest_runs.push_back(g);
  }
  const double perftest = Median(perftest_runs);
  if (std::isnan(perftest)) {
    std::printf("perftest: %s\n", why.c_str());
  } else {
    std::string each;
    for (double g : perftest_runs) {
      absl::StrAppend(&each, each.empty() ? "" : ", ", absl::StrFormat("%.2f", g));
    }
    std::printf("perftest ucp_put_bw, %llu B messages: %.2f GB/s (median of %s)\n",
                static_cast<unsigned long long>(absl::GetFlag(FLAGS_bucket_bytes)), perftest,
                each.c_str());
  }
  std::printf("ucx_gbps=%.3f stream_gbps=%.3f perftest_gbps=%.3f ucx_fraction=%.3f\n", gbps[0],
              gbps[1], perftest, gbps[0] / perftest);
  return 0;
}

}  // namespace
}  // namespace zeroshard

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return zeroshard::Main();
}
