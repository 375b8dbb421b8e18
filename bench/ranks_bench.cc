// How the per-step cost of a job grows with its number of ranks. Two daemons
// run in this process and each of R ranks is a thread of it with its own
// zeroshard::Client (transport --transport, "stream" by default), all in one
// job of --params fp32 parameters, stage 2, daemon reduction, for R in
// --ranks (4, 16 and 64 by default). A step of a rank is what a stage-2
// trainer does: GatherAll (unless --nogather), PushGradients of the whole
// gradient (borrowed: the buffer is never modified), Step.
//
// Each client runs with sender_threads=1 and io_threads=2 (plus its prefetch
// and heartbeat threads), so that 64 of them do not bring hundreds of
// threads more than the ranks need; 2 daemons x 64 ranks are 128 channels.
//
// A run of R ranks does --warmup untimed steps, then timed steps until
// --steps or until --max_seconds have passed (rank 0 decides, before it
// pushes a step, whether that step is the last, so every rank stops after
// the same step). The figure of R is 1 / (the median interval between rank
// 0's successive Step returns), the mean rate beside it; the process's CPU
// time (getrusage: daemons and clients together, as they share gRPC's
// threads) per step and in cores, its thread count, and the RPCs the daemons
// served per step, by method (zeroshard_requests_total). The rank threads,
// and the client threads they start, are named "zs-rank" for profilers.
//
// Linear scaling means a step costs c * R, so steps/s * R stays constant:
//   ratio_to_linear(R) = steps/s(R) * R / (steps/s(R0) * R0), R0 the first
// of --ranks, 1.0 when linear, below it when the cost grows faster. The last
// line compares 64 ranks with 16 (the ranks given nearest to them):
//   steps_per_s_16=A steps_per_s_64=B linear_steps_per_s_64=A*16/64
//   scaling_64_vs_16=B/(A*16/64)

#include <dirent.h>
#include <pthread.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "bench/stats.h"
#include "client/client.h"
#include "metrics/metric_names.h"
#include "metrics/registry.h"
#include "server/daemon.h"

ABSL_FLAG(std::string, ranks, "4,16,64", "comma-separated numbers of ranks, measured in order");
ABSL_FLAG(uint64_t, params, 100000, "fp32 parameters in the job");
ABSL_FLAG(int, steps, 200, "timed steps per number of ranks (fewer when --max_seconds ends it)");
ABSL_FLAG(int, warmup, 3, "untimed steps before the timed ones");
ABSL_FLAG(double, max_seconds, 60, "time budget of the timed steps per number of ranks");
ABSL_FLAG(int, min_steps, 10, "timed steps at least, whatever --max_seconds says");
ABSL_FLAG(std::string, transport, "stream", "the clients' data path (the daemons serve it)");
ABSL_FLAG(uint64_t, bucket_bytes, 32ull << 20, "the job's bucket C_B");
ABSL_FLAG(bool, gather, true, "GatherAll in every step, as a stage-2 trainer does");
ABSL_FLAG(int, daemons, 2, "daemons in this process");
ABSL_FLAG(bool, push_memory, true,
          "bulk transports: the clients' staging pools in push memory, which the daemons "
          "sum in place (ClientConfig::push_memory); false: Put into the staging slots");
ABSL_FLAG(int, optimizer_threads, 1, "each daemon's optimizer threads");
ABSL_FLAG(bool, mutex_deadlock_detection, false,
          "keep absl::Mutex deadlock detection on (absl builds without NDEBUG turn it on): "
          "every lock then updates one graph of the process's mutexes, whose cost grows with "
          "the number of clients in this process, unlike separate trainer processes");

namespace zeroshard {
namespace {

using bench::Median;

constexpr char kJobToken[] = "ranks-bench-job-token";
// Rank threads are named this before they create their clients, whose
// threads inherit the name (perf report --sort comm).
constexpr char kRankThreadName[] = "zs-rank";

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double ProcessCpuSeconds() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_utime.tv_usec * 1e-6 + u.ru_stime.tv_sec +
         u.ru_stime.tv_usec * 1e-6;
}

// Threads of this process now.
int ThreadCount() {
  int n = 0;
  DIR* dir = ::opendir("/proc/self/task");
  if (dir == nullptr) return 0;
  while (dirent* e = ::readdir(dir)) n += e->d_name[0] != '.' ? 1 : 0;
  ::closedir(dir);
  return n;
}

// RPCs served by all daemons, by method.
std::map<std::string, double> RequestsByRpc(const std::vector<std::unique_ptr<Daemon>>& daemons) {
  std::map<std::string, double> out;
  for (const auto& d : daemons) {
    for (const prometheus::MetricFamily& f : d->registry().Collect()) {
      if (f.name != metrics::kRequestsTotal.name) continue;
      for (const prometheus::ClientMetric& m : f.metric) {
        for (const prometheus::ClientMetric::Label& label : m.label) {
          if (label.name == "rpc") out[label.value] += m.counter.value;
        }
      }
    }
  }
  return out;
}

struct RankRun {
  int ranks = 0;
  int timed_steps = 0;
  double steps_per_s = NAN;       // 1 / median step interval
  double mean_steps_per_s = NAN;  // timed steps / their time
  double median_step_ms = NAN;
  double cpu_s_per_step = NAN;
  double cpu_cores = NAN;
  int threads = 0;  // of the process, at the end of the timed steps
  std::map<std::string, double> rpcs_per_step;
};

// What rank 0 records while it measures.
struct Window {
  double t0 = 0, t1 = 0, cpu0 = 0, cpu1 = 0;
  int threads = 0;
  std::map<std::string, double> rpcs0, rpcs1;
  std::vector<double> intervals;
};

absl::StatusOr<RankRun> Measure(const std::vector<std::unique_ptr<Daemon>>& daemons, int ranks) {
  const uint64_t n = absl::GetFlag(FLAGS_params);
  absl::StatusOr<Layout> layout =
      Layout::Create({{"w", {static_cast<int64_t>(n)}, DType::kFp32, 0}});
  if (!layout.ok()) return layout.status();
  ClientConfig base;
  base.job_token = kJobToken;
  for (const auto& d : daemons) base.daemons.push_back(d->address());
  base.job_id = absl::StrCat("ranks-bench-", ranks);
  base.world_size = ranks;
  base.stage = 2;
  base.precision = DType::kFp32;
  base.bucket_bytes = absl::GetFlag(FLAGS_bucket_bytes);
  base.max_grad_norm = 0;
  base.transport = absl::GetFlag(FLAGS_transport);
  base.push_memory = absl::GetFlag(FLAGS_push_memory);
  base.sender_threads = 1;
  base.io_threads = 2;
  base.rpc_timeout = absl::Seconds(120);
  base.step_timeout = absl::Seconds(300);

  const int warmup = std::max(1, absl::GetFlag(FLAGS_warmup));
  const int last_allowed = warmup + std::max(1, absl::GetFlag(FLAGS_steps));
  const int min_last =
      warmup + std::max(1, std::min(absl::GetFlag(FLAGS_min_steps), absl::GetFlag(FLAGS_steps)));
  const double budget = absl::GetFlag(FLAGS_max_seconds);
  // The last step every rank runs: rank 0 lowers it before it pushes that
  // step, so no rank can see the step committed before it is set.
  std::atomic<int> last_step{last_allowed};
  const uint64_t total = layout->total_elements();
  std::vector<float> init(total, 0.5f);
  Window w;
  absl::Mutex mu;
  absl::Status first_error;
  auto fail = [&](const absl::Status& s) {
    absl::MutexLock lock(&mu);
    if (first_error.ok()) first_error = s;
  };

  auto rank_main = [&](int rank) {
    ::pthread_setname_np(::pthread_self(), kRankThreadName);
    ClientConfig c = base;
    c.rank = rank;
    // Multiples of 2^-10 small enough that every sum is exact in fp32.
    std::vector<float> grads(total, static_cast<float>(rank + 1) / 1024.0f);
    std::vector<float> params(total, 0.0f);
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(c);
    if (!client.ok()) return fail(client.status());
    if (absl::Status s = (*client)->RegisterModel(*layout, init.data()); !s.ok()) return fail(s);
    double prev = 0;
    for (int step = 1; step <= last_step.load(); ++step) {
      if (rank == 0 && step > min_last && Now() - w.t0 >= budget) last_step.store(step);
      if (absl::GetFlag(FLAGS_gather)) {
        if (absl::Status s = (*client)->GatherAll(params.data(), DType::kFp32); !s.ok()) {
          return fail(s);
        }
      }
      absl::StatusOr<PushTicket> t =
          (*client)->PushGradients({0, total}, grads.data(), DType::kFp32, 0, BufferUse::kBorrow);
      if (!t.ok()) return fail(t.status());
      absl::StatusOr<StepResult> r = (*client)->Step(1e-4f);
      if (!r.ok()) return fail(r.status());
      if (rank != 0) continue;
      const double now = Now();
      if (step == warmup) {
        w.t0 = now;
        w.cpu0 = ProcessCpuSeconds();
        w.rpcs0 = RequestsByRpc(daemons);
      } else if (step > warmup) {
        w.intervals.push_back(now - prev);
      }
      prev = now;
      if (step == last_step.load()) {
        w.t1 = now;
        w.cpu1 = ProcessCpuSeconds();
        w.threads = ThreadCount();
        w.rpcs1 = RequestsByRpc(daemons);
      }
    }
    // A borrowed gradient must outlive its sends: Leave and destroy first.
    (*client)->Leave().IgnoreError();
    client->reset();
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) threads.emplace_back(rank_main, r);
  for (std::thread& t : threads) t.join();
  if (!first_error.ok()) return first_error;

  RankRun out;
  out.ranks = ranks;
  out.timed_steps = static_cast<int>(w.intervals.size());
  const double steps = out.timed_steps;
  out.median_step_ms = Median(w.intervals) * 1e3;
  out.steps_per_s = 1e3 / out.median_step_ms;
  out.mean_steps_per_s = steps / (w.t1 - w.t0);
  out.cpu_s_per_step = (w.cpu1 - w.cpu0) / steps;
  out.cpu_cores = (w.cpu1 - w.cpu0) / (w.t1 - w.t0);
  out.threads = w.threads;
  for (const auto& [rpc, count] : w.rpcs1) {
    auto before = w.rpcs0.find(rpc);
    const double d = count - (before == w.rpcs0.end() ? 0 : before->second);
    if (d > 0) out.rpcs_per_step[rpc] = d / steps;
  }
  return out;
}

// The run whose rank count is nearest to `ranks`, or null.
const RankRun* Nearest(const std::vector<RankRun>& runs, int ranks) {
  const RankRun* best = nullptr;
  for (const RankRun& r : runs) {
    if (best == nullptr || std::abs(r.ranks - ranks) < std::abs(best->ranks - ranks)) best = &r;
  }
  return best;
}

int Main() {
  if (!absl::GetFlag(FLAGS_mutex_deadlock_detection)) {
    absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  }
  std::vector<int> rank_counts;
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_ranks), ',', absl::SkipEmpty())) {
    int r = 0;
    if (!absl::SimpleAtoi(s, &r) || r < 1) {
      std::fprintf(stderr, "--ranks: not a positive number: %s\n", std::string(s).c_str());
      return 1;
    }
    rank_counts.push_back(r);
  }
  if (rank_counts.empty()) {
    std::fprintf(stderr, "--ranks: none given\n");
    return 1;
  }
  DaemonOptions o;
  o.optimizer_threads = absl::GetFlag(FLAGS_optimizer_threads);
  const std::string transport = absl::GetFlag(FLAGS_transport);
  if (transport != "stream") o.bulk_transport = transport;
  if (transport == "ucx") {
    o.ucx_tls = "posix,cma,self";
    o.ucx_trust_peers = true;  // loopback, and every peer is this process
  }
  std::vector<std::unique_ptr<Daemon>> daemons;
  for (int i = 0; i < std::max(1, absl::GetFlag(FLAGS_daemons)); ++i) {
    absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
    if (!d.ok()) {
      std::fprintf(stderr, "daemon %d: %s\n", i, d.status().ToString().c_str());
      return 1;
    }
    daemons.push_back(*std::move(d));
  }
  std::printf(
      "job: %llu fp32 parameters, stage 2, daemon reduction, C_B %llu B, %zu daemons and every "
      "rank in this process (%u CPUs), transport %s, %s; clients with sender_threads=1 "
      "io_threads=2; absl mutex deadlock detection %s\n",
      static_cast<unsigned long long>(absl::GetFlag(FLAGS_params)),
      static_cast<unsigned long long>(absl::GetFlag(FLAGS_bucket_bytes)), daemons.size(),
      std::thread::hardware_concurrency(), transport.c_str(),
      absl::GetFlag(FLAGS_gather) ? "GatherAll+PushGradients+Step per step"
                                  : "PushGradients+Step per step",
      absl::GetFlag(FLAGS_mutex_deadlock_detection) ? "as built" : "off");
  std::fflush(stdout);
  std::vector<RankRun> runs;
  for (int ranks : rank_counts) {
    absl::StatusOr<RankRun> r = Measure(daemons, ranks);
    if (!r.ok()) {
      std::printf("ranks=%d: failed: %s\n", ranks, r.status().ToString().c_str());
      std::fflush(stdout);
      continue;
    }
    runs.push_back(*r);
    const RankRun& base = runs.front();
    std::string rpcs;
    for (const auto& [rpc, count] : r->rpcs_per_step) {
      absl::StrAppend(&rpcs, rpcs.empty() ? "" : " ", rpc, "=", absl::StrFormat("%.1f", count));
    }
    std::printf(
        "ranks=%-3d steps/s %8.2f (median step %.2f ms, mean rate %.2f over %d steps)  "
        "steps/s*ranks %8.1f  ratio_to_linear %.3f  process CPU %.1f ms/step (%.2f cores, %d "
        "threads)\n"
        "          RPCs served per step: %s\n",
        r->ranks, r->steps_per_s, r->median_step_ms, r->mean_steps_per_s, r->timed_steps,
        r->steps_per_s * r->ranks, (r->steps_per_s * r->ranks) / (base.steps_per_s * base.ranks),
        r->cpu_s_per_step * 1e3, r->cpu_cores, r->threads, rpcs.c_str());
    std::fflush(stdout);
  }
  const RankRun* r16 = Nearest(runs, 16);
  const RankRun* r64 = Nearest(runs, 64);
  if (r16 == nullptr) {
    std::printf("no run succeeded\n");
    return 1;
  }
  const double linear = r16->steps_per_s * r16->ranks / r64->ranks;
  std::printf(
      "steps_per_s_%d=%.3f steps_per_s_%d=%.3f linear_steps_per_s_%d=%.3f "
      "scaling_%d_vs_%d=%.3f\n",
      r16->ranks, r16->steps_per_s, r64->ranks, r64->steps_per_s, r64->ranks, linear, r64->ranks,
      r16->ranks, r64->steps_per_s / linear);
  return 0;
}

}  // namespace
}  // namespace zeroshard

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return zeroshard::Main();
}
