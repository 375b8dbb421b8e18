// How close the gradient push comes to its own limit, in one process run:
//   put       N_d = --ranks ranks (threads of this process), each with its
//             own zeroshard::Client with transport "ucx" over shared memory
//             (UCX_TLS=posix,cma,self), against ONE in-process daemon
//             serving --bulk_transport=ucx with zeroshardd's defaults
//             (--optimizer_threads: the CPUs this process may use, which
//             also sum the staged gradients; 4 staging slots per rank;
//             50 ms reduction hold) except that its optimizer threads are
//             pinned, one per CPU of --optimizer_cpus (zeroshardd's flag;
//             "all" by default: every CPU of this process, which the rank
//             threads share; empty: unpinned, zeroshardd's default), all in
//             one job of --elements fp32 parameters, stage 2, world_size =
//             N_d, daemon reduction.
//             Each rank's gradient lies in plain memory
//             (ClientConfig::push_memory off): every bucket is Put into a
//             staging slot of the daemon, which then sums the slot.
//             Each repetition every rank pushes its whole gradient at once
//             (borrowed: BufferUse::kBorrow, each rank its own buffer), and
//             the figure is N_d * 4 * elements bytes / (the time from the
//             first rank's PushGradients call until the last rank's ticket
//             completes). A bulk push's ticket completes when the daemon has
//             answered the push of its last bucket, and the daemon answers a
//             staged push once it has summed it into the job's gradient, so
//             this is the time to move and reduce every rank's gradient. The
//             optimizer step between repetitions (Step on every rank, as a
//             trainer ends a step) is not counted.
//   push      the same with each rank's gradient in its client's push memory
//             (Client::AllocatePushMemory): the daemon maps it once and sums
//             every bucket straight from the trainer's memory, announced by
//             the same staged PushGradient (no Put, no slot write).
//   one_pass  the roofline of the reduction alone, in the same process: as
//             many threads as the daemon's optimizer threads read N_d
//             distinct contribution buffers of --elements fp32 each (already
//             in memory) and read-modify-write one fp32 accumulator of
//             --elements (acc[i] += c_r[i] for every rank r), the elements
//             split across the threads in contiguous ranges, each thread
//             summing all ranks for its range in one sweep (16 elements at a
//             time in registers). Figure: N_d * 4 * elements / time. This is
//             the least the daemon must do per step: one pass over the bytes
//             pushed. (The daemon's first sum of a step overwrites the
//             gradient, with non-temporal stores, instead of reading it: a
//             little less traffic than this read-modify-write.)
//   perftest  `ucx_perftest -t ucp_put_bw` between two processes on
//             loopback, same UCX_TLS, message size = the client's bucket C_B
//             (bench/perftest.h): what UCX itself moves with these settings.
// put and push report the median of --reps repetitions after one warm-up.
// one_pass runs one repetition right after each of theirs (after the Step,
// while the ranks wait), so that each repetition is compared with a roofline
// measured on the same machine state: this host's memory bandwidth swings
// by a third from one minute to the next. perftest reports the median of
// --perftest_runs runs. The last line is the summary:
//   put_gbps=P push_gbps=A one_pass_gbps=B perftest_gbps=C
//   put_vs_one_pass=P' push_vs_perftest=A/C push_vs_one_pass=A'
// where P' and A' are the medians of the repetitions' own ratios, and B the
// median of every one_pass repetition.
// What the ratios mean: a put moves every byte twice (the Put reads the
// rank's gradient and writes the slot, then the daemon's sum reads the slot)
// where one_pass moves it once, so put_vs_one_pass cannot pass about 0.5;
// the push from push memory is one pass, and what separates it from 1 is the
// design's own overheads (RPCs, slot turnover, holds, threads). On a shared
// host the figures, though from the same run, are not measured at the same
// moment (run it several times).
// push_vs_perftest compares the push with UCX's bare put bandwidth, whose
// message sits in the caches (each side one buffer of C_B).
//
//   bazel run -c opt --config=clang //bench:push_bench -- --ranks=4 --elements=67108864

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "bench/perftest.h"
#include "bench/stats.h"
#include "client/client.h"
#include "server/daemon.h"
#include "server/ledger/system_resources.h"
#include "transport/shm/push_memory.h"

ABSL_FLAG(int, ranks, 4, "N_d: ranks (threads of this process, each with its own client)");
ABSL_FLAG(uint64_t, elements, 64ull << 20, "fp32 parameters in the job (Ψ)");
ABSL_FLAG(uint64_t, bucket_bytes, 32ull << 20, "the client's bucket C_B (and perftest's message)");
ABSL_FLAG(int, reps, 9, "timed repetitions after one warm-up (the median is reported)");
ABSL_FLAG(int, perftest_runs, 3, "ucx_perftest runs (the median is reported)");
ABSL_FLAG(std::string, ucx_tls, "posix,cma,self", "UCX_TLS for the clients, daemon and perftest");
ABSL_FLAG(std::string, perftest, "ucx_perftest", "the ucx_perftest binary (PATH is searched)");
ABSL_FLAG(std::string, optimizer_cpus, "all",
          "the daemon's --optimizer_cpus (empty: unpinned, as zeroshardd by default)");

namespace zeroshard {
namespace {

using bench::Median;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string Each(const std::vector<double>& values) {
  std::string out;
  for (double v : values) absl::StrAppend(&out, out.empty() ? "" : ", ", absl::StrFormat("%.2f", v));
  return out;
}

// A reusable barrier of `n` threads; Abort releases every waiter (false).
class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  bool Wait() {
    absl::MutexLock lock(&mu_);
    if (aborted_) return false;
    const uint64_t generation = generation_;
    if (++arrived_ == n_) {
      arrived_ = 0;
      ++generation_;
      cv_.SignalAll();
      return true;
    }
    while (generation_ == generation && !aborted_) cv_.Wait(&mu_);
    return !aborted_;
  }
  void Abort() {
    absl::MutexLock lock(&mu_);
    aborted_ = true;
    cv_.SignalAll();
  }

 private:
  const int n_;
  absl::Mutex mu_;
  absl::CondVar cv_;
  int arrived_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  bool aborted_ ABSL_GUARDED_BY(mu_) = false;
};

// acc[begin, end) += every contribution's [begin, end), in one sweep: 16
// elements of acc at a time are loaded, every contribution's 16 added in
// registers, and stored once (the daemon's SumSources' shape; as fast as
// AVX-512 intrinsics here, and faster than summing rank by rank into an
// L1-resident block of acc).
void SumRange(const std::vector<const float*>& contributions, float* acc, uint64_t begin,
              uint64_t end) {
  typedef float V __attribute__((vector_size(64)));
  constexpr uint64_t kW = sizeof(V) / sizeof(float);
  const size_t k = contributions.size();
  const float* const* src = contributions.data();
  uint64_t i = begin;
  for (; i + kW <= end; i += kW) {
    V a;
    std::memcpy(&a, acc + i, sizeof(V));
    for (size_t r = 0; r < k; ++r) {
      V c;
      std::memcpy(&c, src[r] + i, sizeof(V));
      a += c;
    }
    std::memcpy(acc + i, &a, sizeof(V));
  }
  for (; i < end; ++i) {
    float a = acc[i];
    for (size_t r = 0; r < k; ++r) a += src[r][i];
    acc[i] = a;
  }
}

// The reduction alone: `threads` threads sum `ranks` contributions of `n`
// fp32 into one accumulator. Buffers allocated (and touched) once: the
// contributions twice, in plain memory and in shared memory mapped as the
// daemon maps a trainer's push memory (a PushMemory, taken again read-only
// through PeerMemory::Open), each repetition timing both in turn.
class OnePass {
 public:
  struct Figures {
    double plain_gbps = NAN;
    double shared_gbps = NAN;  // NaN: the shared memory could not be mapped
  };

  OnePass(int ranks, uint64_t n, int threads) : n_(n), threads_(threads), acc_(n, 0.0f) {
    for (int r = 0; r < ranks; ++r) {
      const float value = static_cast<float>(r + 1) / 1024.0f;
      plain_.emplace_back(n, value);
      plain_pointers_.push_back(plain_.back().data());
      absl::StatusOr<std::unique_ptr<transport::PushMemory>> m =
          transport::PushMemory::Create(n * sizeof(float));
      absl::StatusOr<std::unique_ptr<transport::PeerMemory>> peer =
          m.ok() ? transport::PeerMemory::Open((*m)->pid(), (*m)->fd(), (*m)->name(),
                                               n * sizeof(float))
                 : m.status();
      if (!peer.ok()) {
        shared_error_ = peer.status().ToString();
        continue;
      }
      std::fill_n(static_cast<float*>((*m)->data()), n, value);
      shared_pointers_.push_back(reinterpret_cast<const float*>((*peer)->bytes().data()));
      shared_.push_back(*std::move(m));
      peers_.push_back(*std::move(peer));
    }
    if (shared_error_.empty()) {
      // Every page mapped before the first timed pass, as the daemon's
      // mapping is after the first step.
      Sweep(shared_pointers_);
    }
  }
  // One repetition of each, the order alternating from one call to the next.
  Figures Rep() {
    Figures f;
    const bool shared_first = (reps_++ % 2) == 1;
    if (shared_first && shared_error_.empty()) f.shared_gbps = Sweep(shared_pointers_);
    f.plain_gbps = Sweep(plain_pointers_);
    if (!shared_first && shared_error_.empty()) f.shared_gbps = Sweep(shared_pointers_);
    return f;
  }
  // Why there is no shared figure ("" when there is).
  const std::string& shared_error() const { return shared_error_; }

 private:
  double Sweep(const std::vector<const float*>& contributions) {
    const double bytes =
        static_cast<double>(contributions.size()) * sizeof(float) * static_cast<double>(n_);
    const double t0 = Now();
    std::vector<std::thread> pool;
    for (int t = 0; t < threads_; ++t) {
      const uint64_t begin = n_ * t / threads_, end = n_ * (t + 1) / threads_;
      pool.emplace_back(SumRange, std::cref(contributions), acc_.data(), begin, end);
    }
    for (std::thread& t : pool) t.join();
    bench::KeepWrites(acc_.data());
    return bytes / (Now() - t0) / 1e9;
  }

  const uint64_t n_;
  const int threads_;
  uint64_t reps_ = 0;
  std::vector<std::vector<float>> plain_;
  std::vector<const float*> plain_pointers_;
  std::vector<std::unique_ptr<transport::PushMemory>> shared_;
  std::vector<std::unique_ptr<transport::PeerMemory>> peers_;
  std::vector<const float*> shared_pointers_;
  std::string shared_error_;
  std::vector<float> acc_;
};

struct PushResult {
  std::vector<double> gbps;       // each timed repetition's figure
  std::vector<double> slowest_s;  // each timed repetition's longest single-rank push
  std::vector<double> step_s;     // each timed repetition's Step (rank 0), not counted
  // Each timed repetition's roofline (one_pass, run right after it) and
  // the repetition's figure over it.
  std::vector<double> one_pass_gbps, vs_one_pass;
  // The same against the roofline over shared memory (NaN: none).
  std::vector<double> one_pass_shared_gbps, vs_one_pass_shared;
  // The last step's gradient norm as the leader computed it (NaN: none),
  // against the norm of the mean of the ranks' gradients: a check that the
  // daemon summed every byte.
  double grad_norm = NAN, expected_norm = NAN;
};

// Every rank pushes its whole gradient at once, reps + 1 times (the first
// warms up), with a Step after each round.
// `in_push_memory`: each rank's gradient lies in its client's push memory
// (the daemon sums it in place); else in plain memory (Put into the slots).
// After each round's Step, rank 0 runs one repetition of `roofline` while
// the other ranks wait: each push repetition has its roofline measured
// moments later, on the same machine state.
absl::StatusOr<PushResult> MeasurePush(Daemon& daemon, int ranks, uint64_t n, int reps,
                                       bool in_push_memory, OnePass& roofline) {
  absl::StatusOr<Layout> layout =
      Layout::Create({{"w", {static_cast<int64_t>(n)}, DType::kFp32, 0}});
  if (!layout.ok()) return layout.status();
  ClientConfig base;
  base.job_token = "push-bench-job-token";
  base.daemons = {daemon.address()};
  base.job_id = "push-bench";
  base.world_size = ranks;
  base.stage = 2;
  base.precision = DType::kFp32;
  base.bucket_bytes = absl::GetFlag(FLAGS_bucket_bytes);
  base.max_grad_norm = 0;
  base.transport = "ucx";
  base.ucx_tls = absl::GetFlag(FLAGS_ucx_tls);
  base.rpc_timeout = absl::Seconds(120);
  base.step_timeout = absl::Seconds(300);
  base.push_memory = in_push_memory;

  const uint64_t total = layout->total_elements();
  const std::vector<float> init(total, 0.5f);
  // [rep][rank]: when the rank called PushGradients, when its ticket completed.
  std::vector<std::vector<double>> start(reps + 1, std::vector<double>(ranks, 0));
  std::vector<std::vector<double>> end = start;
  std::vector<double> step_s(reps + 1, 0);
  std::vector<OnePass::Figures> one_pass(reps + 1);
  double grad_norm = NAN;
  Barrier barrier(ranks);
  absl::Mutex mu;
  absl::Status first_error;
  auto fail = [&](const absl::Status& s) {
    {
      absl::MutexLock lock(&mu);
      if (first_error.ok()) first_error = s;
    }
    barrier.Abort();
  };
  auto rank_main = [&](int rank) {
    ClientConfig c = base;
    c.rank = rank;
    // Before the client: a borrowed gradient must outlive the sends, which
    // the client's destructor waits for. Multiples of 2^-10: exact sums.
    std::vector<float> heap;
    std::shared_ptr<transport::PushMemory> memory;
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(c);
    if (!client.ok()) return fail(client.status());
    float* grads = nullptr;
    if (in_push_memory) {
      absl::StatusOr<std::shared_ptr<transport::PushMemory>> m =
          (*client)->AllocatePushMemory(total * sizeof(float));
      if (!m.ok()) return fail(m.status());
      memory = *std::move(m);
      grads = static_cast<float*>(memory->data());
    } else {
      heap.resize(total);
      grads = heap.data();
    }
    std::fill(grads, grads + total, static_cast<float>(rank + 1) / 1024.0f);
    if (absl::Status s = (*client)->RegisterModel(*layout, init.data()); !s.ok()) return fail(s);
    for (int rep = 0; rep <= reps; ++rep) {
      if (!barrier.Wait()) return;
      start[rep][rank] = Now();
      absl::StatusOr<PushTicket> t =
          (*client)->PushGradients({0, total}, grads, DType::kFp32, 0, BufferUse::kBorrow);
      if (!t.ok()) return fail(t.status());
      if (absl::Status s = t->Wait(absl::Now() + absl::Seconds(300)); !s.ok()) return fail(s);
      end[rep][rank] = Now();
      const double t0 = Now();
      absl::StatusOr<StepResult> r = (*client)->Step(1e-4f);
      if (!r.ok()) return fail(r.status());
      if (rank == 0) {
        step_s[rep] = Now() - t0;
        if (r->have_norm) grad_norm = r->grad_norm;
        one_pass[rep] = roofline.Rep();
      }
    }
    // The last roofline repetition runs alone too: nobody leaves before it ends.
    if (!barrier.Wait()) return;
    (*client)->Leave().IgnoreError();
    client->reset();
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) threads.emplace_back(rank_main, r);
  for (std::thread& t : threads) t.join();
  if (!first_error.ok()) return first_error;

  PushResult out;
  out.grad_norm = grad_norm;
  // Every element of the mean gradient is (1 + ... + N_d) / N_d / 1024.
  out.expected_norm = std::sqrt(static_cast<double>(total)) * (ranks + 1) / 2.0 / 1024.0;
  const double bytes = static_cast<double>(ranks) * sizeof(float) * static_cast<double>(total);
  for (int rep = 1; rep <= reps; ++rep) {
    const double t0 = *std::min_element(start[rep].begin(), start[rep].end());
    const double t1 = *std::max_element(end[rep].begin(), end[rep].end());
    double slowest = 0;
    for (int r = 0; r < ranks; ++r) slowest = std::max(slowest, end[rep][r] - start[rep][r]);
    out.gbps.push_back(bytes / (t1 - t0) / 1e9);
    out.one_pass_gbps.push_back(one_pass[rep].plain_gbps);
    out.vs_one_pass.push_back(out.gbps.back() / one_pass[rep].plain_gbps);
    out.one_pass_shared_gbps.push_back(one_pass[rep].shared_gbps);
    out.vs_one_pass_shared.push_back(out.gbps.back() / one_pass[rep].shared_gbps);
    out.slowest_s.push_back(slowest);
    out.step_s.push_back(step_s[rep]);
  }
  return out;
}

int Main() {
  const int ranks = std::max(1, absl::GetFlag(FLAGS_ranks));
  const uint64_t n = std::max<uint64_t>(1, absl::GetFlag(FLAGS_elements));
  const int reps = std::max(1, absl::GetFlag(FLAGS_reps));
  DaemonOptions o;
  o.bulk_transport = "ucx";
  o.ucx_tls = absl::GetFlag(FLAGS_ucx_tls);
  // As zeroshardd's default; the optimizer threads also sum staged gradients.
  o.optimizer_threads = DefaultOptimizerThreads();
  if (!absl::GetFlag(FLAGS_optimizer_cpus).empty()) {
    absl::StatusOr<std::vector<int>> cpus = ParseCpuList(
        absl::GetFlag(FLAGS_optimizer_cpus), AffinityCpuList(), "--optimizer_cpus");
    if (!cpus.ok()) {
      std::fprintf(stderr, "%s\n", cpus.status().ToString().c_str());
      return 1;
    }
    o.optimizer_cpus = *std::move(cpus);
    o.optimizer_threads = static_cast<int>(o.optimizer_cpus.size());
  }
  // Loopback, and every peer is this process: UCX keys may go out over tcp.
  o.ucx_trust_peers = true;
  // A job's memory is freed when its ranks leave, not during the next
  // measurement.
  o.read_lease = absl::ZeroDuration();
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(o);
  if (!daemon.ok()) {
    std::fprintf(stderr, "daemon: %s\n", daemon.status().ToString().c_str());
    return 1;
  }
  if ((*daemon)->bulk_transport() == nullptr) {
    std::fprintf(stderr, "the daemon could not initialise UCX\n");
    return 1;
  }
  const double bytes = static_cast<double>(ranks) * sizeof(float) * static_cast<double>(n);
  std::printf(
      "job: %llu fp32 parameters (%.1f MiB), %d ranks (threads, borrowed pushes), stage 2, "
      "1 daemon with %d optimizer threads (%s), C_B %llu B, UCX_TLS=%s; %.1f MiB pushed per "
      "repetition\n",
      static_cast<unsigned long long>(n), n * 4 / 1048576.0, ranks, o.optimizer_threads,
      o.optimizer_cpus.empty()
          ? "unpinned"
          : absl::StrCat("pinned to CPUs ", FormatCpuList(o.optimizer_cpus)).c_str(),
      static_cast<unsigned long long>(absl::GetFlag(FLAGS_bucket_bytes)),
      absl::GetFlag(FLAGS_ucx_tls).c_str(), bytes / 1048576.0);
  std::printf("%s\n", bench::DescribeCopyThreshold().c_str());
  std::fflush(stdout);

  // put: gradients in plain memory, Put into the daemon's slots; push:
  // gradients in push memory, summed by the daemon in place.
  OnePass roofline(ranks, n, o.optimizer_threads);
  std::vector<double> all_one_pass, all_one_pass_shared;
  struct Figures {
    double gbps = NAN;
    double vs_one_pass = NAN;  // median of the repetitions' ratios
    double vs_one_pass_shared = NAN;
  };
  auto measure = [&](const char* what, bool in_push_memory) {
    Figures f;
    double& gbps = f.gbps;
    absl::StatusOr<PushResult> r =
        MeasurePush(**daemon, ranks, n, reps, in_push_memory, roofline);
    // The job is gone and its memory freed before anything else runs.
    for (int i = 0; i < 300 && (*daemon)->ledger().total() > 0; ++i) {
      (*daemon)->jobs().Tick();
      absl::SleepFor(absl::Milliseconds(100));
    }
    if (!r.ok()) {
      std::printf("%s: failed: %s\n", what, r.status().ToString().c_str());
    } else {
      gbps = Median(r->gbps);
      std::printf(
          "%s: %.3f GB/s (%.1f ms for all %d ranks' gradients; median of %s); longest "
          "single-rank push %.1f ms; Step (not counted) %.1f ms\n",
          what, gbps, bytes / gbps / 1e6, ranks, Each(r->gbps).c_str(),
          Median(r->slowest_s) * 1e3, Median(r->step_s) * 1e3);
      std::printf("%s: gradient norm of the last step %.6g (the ranks' mean gradient: %.6g)\n",
                  what, r->grad_norm, r->expected_norm);
      all_one_pass.insert(all_one_pass.end(), r->one_pass_gbps.begin(), r->one_pass_gbps.end());
      all_one_pass_shared.insert(all_one_pass_shared.end(), r->one_pass_shared_gbps.begin(),
                                 r->one_pass_shared_gbps.end());
      f.vs_one_pass = Median(r->vs_one_pass);
      f.vs_one_pass_shared = Median(r->vs_one_pass_shared);
      std::printf("%s: one_pass right after each repetition %s GB/s; %s_vs_one_pass %s\n", what,
                  Each(r->one_pass_gbps).c_str(), what, Each(r->vs_one_pass).c_str());
      std::printf("%s: one_pass over shared memory right after each repetition %s GB/s; "
                  "%s_vs_one_pass_shared %s\n",
                  what, Each(r->one_pass_shared_gbps).c_str(), what,
                  Each(r->vs_one_pass_shared).c_str());
      if (!(std::abs(r->grad_norm - r->expected_norm) <= 1e-3 * r->expected_norm)) {
        std::printf("%s: the daemon's gradient norm is not the ranks' mean gradient's\n", what);
        gbps = NAN;
        f.vs_one_pass = NAN;
      }
    }
    std::fflush(stdout);
    return f;
  };
  const Figures put = measure("put", false);
  const Figures push = measure("push", true);
  const double one_pass = Median(all_one_pass);
  std::printf(
      "one_pass: %.3f GB/s (%.1f ms to sum %d contributions into one accumulator on %d "
      "threads; median of the %zu repetitions above)\n",
      one_pass, bytes / one_pass / 1e6, ranks, o.optimizer_threads, all_one_pass.size());
  const double one_pass_shared = Median(all_one_pass_shared);
  if (roofline.shared_error().empty()) {
    std::printf(
        "one_pass over shared memory: %.3f GB/s (the same sum with the contributions in "
        "push memory mapped read-only, as the daemon reads them; %.3f of one_pass)\n",
        one_pass_shared, one_pass_shared / one_pass);
  } else {
    std::printf("one_pass over shared memory: not measured: %s\n",
                roofline.shared_error().c_str());
  }
  std::string why;
  const std::vector<double> perftest_runs = bench::PerftestPutRuns(
      absl::GetFlag(FLAGS_bucket_bytes), absl::GetFlag(FLAGS_perftest),
      absl::GetFlag(FLAGS_ucx_tls), absl::GetFlag(FLAGS_perftest_runs), &why);
  const double perftest = Median(perftest_runs);
  if (std::isnan(perftest)) {
    std::printf("perftest: %s\n", why.c_str());
  } else {
    std::printf("perftest ucp_put_bw, %llu B messages: %.3f GB/s (median of %s)\n",
                static_cast<unsigned long long>(absl::GetFlag(FLAGS_bucket_bytes)), perftest,
                Each(perftest_runs).c_str());
  }
  std::printf(
      "put_gbps=%.3f push_gbps=%.3f one_pass_gbps=%.3f one_pass_shared_gbps=%.3f "
      "perftest_gbps=%.3f put_vs_one_pass=%.3f push_vs_perftest=%.3f "
      "push_vs_one_pass_shared=%.3f push_vs_one_pass=%.3f\n",
      put.gbps, push.gbps, one_pass, one_pass_shared, perftest, put.vs_one_pass,
      push.gbps / perftest, push.vs_one_pass_shared, push.vs_one_pass);
  return std::isnan(push.gbps) ? 1 : 0;
}

}  // namespace
}  // namespace zeroshard

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return zeroshard::Main();
}
