// Activation checkpoints on a daemon (client/activation_store.h), in one
// process, against what the machine does without zeroshard:
//   offload+fetch  a zeroshard::Client (transport "ucx", UCX_TLS=--ucx_tls)
//                  offloads --bytes of checkpoints in slices of
//                  --slice_bytes to an in-process daemon whose arena holds
//                  them all, then fetches them back (freeing each), the way
//                  a trainer does: offloads behind each other on the store's
//                  workers, fetches --prefetch_depth ahead. Figure: (bytes
//                  offloaded + bytes fetched) / (offload time + fetch
//                  time), median of --reps after one warm-up; as the
//                  store does by default (no checksums on the bulk
//                  transport), then again with DaemonSliceStore::Options::
//                  checksums for what they cost;
//   memcpy         the same slices copied into a buffer of --bytes and
//                  back out, on one thread: the copy the offloads and
//                  fetches do, touching as much memory (printed beside,
//                  not in the summary);
//   perftest       `ucx_perftest -t ucp_put_bw` between two processes on
//                  loopback, message size --slice_bytes, same UCX_TLS
//                  (every message into the same buffer, which the caches
//                  partly hold), run right after each timed repetition of
//                  offload+fetch (default options), so that each pair sees
//                  the same state of this shared host;
//   spill write    a second daemon with an arena of --spill_arena_bytes and
//                  spill files under --dir: the client offloads
//                  --spill_factor times the arena, so the daemon writes all
//                  but the arena's worth to spill files to make room (after
//                  a warm-up step that fits the arena); figure: bytes
//                  spilled / time of the offloads; --reps steps;
//   spill read     the same slices fetched back, last first, with the
//                  prefetch hint a trainer gives: bytes read back from spill
//                  files / time of the fetches;
//   O_DIRECT       a plain sequential O_DIRECT write, then read, of the same
//                  bytes in --slice_bytes pieces to a file in --dir, right
//                  after each spill step.
// The last line is the summary:
//   offload_fraction=X spill_write_fraction=Y spill_read_fraction=Z
// (X = the median over repetitions of offload+fetch, default options, /
// the perftest run right after it; Y, Z = the medians of spill / the O_DIRECT
// run right after it).

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/perftest.h"
#include "bench/stats.h"
#include "client/activation_store.h"
#include "client/client.h"
#include "metrics/registry.h"
#include "server/daemon.h"

ABSL_FLAG(uint64_t, slice_bytes, 32ull << 20,
          "bytes of one checkpoint slice (and perftest's message size)");
ABSL_FLAG(uint64_t, bytes, 256ull << 20, "bytes offloaded and fetched per repetition");
ABSL_FLAG(int, reps, 5, "timed repetitions after one warm-up (the median is reported)");
ABSL_FLAG(int, prefetch_depth, 2, "fetches in flight ahead of the one waited for");
ABSL_FLAG(uint64_t, spill_arena_bytes, 64ull << 20, "arena of the spilling daemon");
ABSL_FLAG(int, spill_factor, 10, "the spilling job offloads this many times its daemon's arena");
ABSL_FLAG(int, threads, 2, "the activation store's worker threads (DaemonSliceStore::Options)");
ABSL_FLAG(std::string, dir, "",
          "directory for spill files and the O_DIRECT baseline "
          "(default: $TMPDIR or /var/tmp)");
ABSL_FLAG(std::string, ucx_tls, "posix,cma,self", "UCX_TLS for the client, daemons and perftest");
ABSL_FLAG(std::string, perftest, "ucx_perftest", "the ucx_perftest binary (PATH is searched)");

extern char** environ;

namespace zeroshard {
namespace {

using bench::Median;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

constexpr absl::Duration kWait = absl::Seconds(300);

// Page-aligned memory (what O_DIRECT needs, and what a trainer's pinned
// buffers would be).
struct Aligned {
  explicit Aligned(uint64_t n) : bytes(n) {
    void* p = nullptr;
    if (posix_memalign(&p, 4096, std::max<uint64_t>(n, 4096)) != 0) std::abort();
    data = static_cast<char*>(p);
    std::memset(data, 0, n);
  }
  ~Aligned() { std::free(data); }
  Aligned(const Aligned&) = delete;
  Aligned& operator=(const Aligned&) = delete;
  char* data = nullptr;
  uint64_t bytes = 0;
};

// A one-layer job joined by one rank: what an activation store needs.
absl::StatusOr<std::unique_ptr<Client>> JoinedClient(const Daemon& daemon, const std::string& job) {
  absl::StatusOr<Layout> layout = Layout::Create({{"w", {1024}, DType::kFp32, 0}});
  if (!layout.ok()) return layout.status();
  ClientConfig c;
  c.job_token = "activation-bench-job-token";
  c.daemons = {daemon.address()};
  c.job_id = job;
  c.stage = 3;
  c.precision = DType::kFp32;
  c.max_grad_norm = 0;
  c.transport = "ucx";
  c.ucx_tls = absl::GetFlag(FLAGS_ucx_tls);
  c.rpc_timeout = absl::Seconds(120);
  c.step_timeout = absl::Seconds(300);
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(c);
  if (!client.ok()) return client.status();
  std::vector<float> params(layout->total_elements(), 0.5f);
  if (absl::Status s = (*client)->RegisterModel(*layout, params.data()); !s.ok()) return s;
  return client;
}

struct Phase {
  double offload_seconds = 0, fetch_seconds = 0;
  SliceStoreStats stats;
};

// Offloads `slices` slices of `sources` (cycled; each source is lent until
// its offload completes) as step `step`, then fetches them back last first
// into `sinks` (cycled, `depth` ahead) with a prefetch hint, freeing each.
// Checks that each fetched slice carries its index.
absl::StatusOr<Phase> OffloadAndFetch(ActivationSliceStore& store, uint64_t step, int slices,
                                      std::vector<std::unique_ptr<Aligned>>& sources,
                                      std::vector<std::unique_ptr<Aligned>>& sinks, int depth) {
  const uint64_t bytes = sources[0]->bytes;
  auto key = [&](int i) { return ActivationKey{step, 0, static_cast<uint32_t>(i), 0, 1}; };
  Phase p;
  std::deque<ActivationTicket> offloads;
  double t0 = Now();
  for (int i = 0; i < slices; ++i) {
    if (offloads.size() == sources.size()) {
      if (absl::Status s = offloads.front().Wait(absl::Now() + kWait); !s.ok()) return s;
      offloads.pop_front();
    }
    Aligned& src = *sources[i % sources.size()];
    std::memcpy(src.data, &i, sizeof i);  // the slice's index, checked on fetch
    absl::StatusOr<ActivationTicket> t = store.Offload(key(i), src.data, bytes);
    if (!t.ok()) return t.status();
    offloads.push_back(*t);
  }
  for (const ActivationTicket& t : offloads) {
    if (absl::Status s = t.Wait(absl::Now() + kWait); !s.ok()) return s;
  }
  p.offload_seconds = Now() - t0;
  std::vector<ActivationKey> hint;
  for (int i = slices - 1 - depth; i >= 0; --i) hint.push_back(key(i));
  t0 = Now();
  if (!hint.empty()) {
    absl::StatusOr<ActivationTicket> h = store.Prefetch(hint);
    if (!h.ok()) return h.status();
  }
  std::deque<std::pair<int, ActivationTicket>> fetches;
  int next = slices - 1;
  auto start_fetch = [&]() -> absl::Status {
    Aligned& dst = *sinks[next % sinks.size()];
    absl::StatusOr<ActivationTicket> t =
        store.StartFetch(key(next), dst.data, bytes, AfterFetch::kFree);
    if (!t.ok()) return t.status();
    fetches.push_back({next--, *t});
    return absl::OkStatus();
  };
  while (next >= 0 || !fetches.empty()) {
    while (next >= 0 && static_cast<int>(fetches.size()) < std::max(1, depth)) {
      if (absl::Status s = start_fetch(); !s.ok()) return s;
    }
    auto [i, t] = fetches.front();
    fetches.pop_front();
    if (absl::Status s = t.Wait(absl::Now() + kWait); !s.ok()) return s;
    int got = -1;
    std::memcpy(&got, sinks[i % sinks.size()]->data, sizeof got);
    if (got != i) {
      return absl::DataLossError(absl::StrCat("slice ", i, " came back as slice ", got));
    }
  }
  p.fetch_seconds = Now() - t0;
  p.stats = store.Stats();
  return p;
}

// Plain sequential O_DIRECT write, then read, of `total` bytes in pieces of
// `piece` to a fresh file in `dir`; GB/s of each, or NaN with `why`.
std::pair<double, double> DirectIo(const std::string& dir, uint64_t total, uint64_t piece,
                                   std::string* why) {
  const std::string path = absl::StrCat(dir, "/activation_bench.direct.", getpid());
  Aligned buf(piece);
  std::memset(buf.data, 0x5a, piece);
  int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_DIRECT, 0600);
  if (fd < 0) {
    *why = absl::StrCat("O_DIRECT open of ", path, ": ", std::strerror(errno));
    return {NAN, NAN};
  }
  double t0 = Now();
  for (uint64_t off = 0; off < total; off += piece) {
    if (pwrite(fd, buf.data, piece, static_cast<off_t>(off)) != static_cast<ssize_t>(piece)) {
      *why = absl::StrCat("O_DIRECT write: ", std::strerror(errno));
      close(fd);
      unlink(path.c_str());
      return {NAN, NAN};
    }
  }
  const double write_s = Now() - t0;
  close(fd);
  fd = open(path.c_str(), O_RDONLY | O_DIRECT);
  t0 = Now();
  for (uint64_t off = 0; fd >= 0 && off < total; off += piece) {
    if (pread(fd, buf.data, piece, static_cast<off_t>(off)) != static_cast<ssize_t>(piece)) break;
  }
  const double read_s = Now() - t0;
  if (fd >= 0) close(fd);
  unlink(path.c_str());
  return {total / write_s / 1e9, total / read_s / 1e9};
}

absl::StatusOr<std::unique_ptr<Daemon>> StartDaemon(uint64_t arena, const std::string& spill_dir,
                                                    uint64_t spill_bytes) {
  DaemonOptions o;
  o.bulk_transport = "ucx";
  o.ucx_tls = absl::GetFlag(FLAGS_ucx_tls);
  // Loopback, and every peer is this process: UCX keys may go out over tcp.
  o.ucx_trust_peers = true;
  o.activation_arena_bytes = arena;
  o.spill_dir = spill_dir;
  o.spill_bytes = spill_bytes;
  absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
  if (d.ok() && (*d)->bulk_transport() == nullptr) {
    return absl::UnavailableError("the daemon could not initialise UCX");
  }
  return d;
}

// The value of counter `name` of `job` in the daemon's registry, or 0.
double DaemonCounter(const Daemon& daemon, const std::string& name, const std::string& job) {
  return metrics::SumOf(daemon.registry().Collect(), name, {{"job", job}});
}

std::vector<std::unique_ptr<Aligned>> Buffers(int n, uint64_t bytes) {
  std::vector<std::unique_ptr<Aligned>> v;
  for (int i = 0; i < n; ++i) v.push_back(std::make_unique<Aligned>(bytes));
  return v;
}

int Main() {
  const uint64_t slice = absl::GetFlag(FLAGS_slice_bytes);
  const int slices = static_cast<int>(std::max<uint64_t>(1, absl::GetFlag(FLAGS_bytes) / slice));
  const uint64_t total = slices * slice;
  const int depth = std::max(1, absl::GetFlag(FLAGS_prefetch_depth));
  std::string dir = absl::GetFlag(FLAGS_dir);
  if (dir.empty()) dir = std::getenv("TMPDIR") != nullptr ? std::getenv("TMPDIR") : "/var/tmp";
  const std::string spill_dir = absl::StrCat(dir, "/activation_bench_spill.", getpid());
  std::printf("slices of %s, %d per repetition (%s), UCX_TLS=%s, prefetch depth %d\n",
              absl::StrFormat("%.1f MiB", slice / 1048576.0).c_str(), slices,
              absl::StrFormat("%.0f MiB", total / 1048576.0).c_str(),
              absl::GetFlag(FLAGS_ucx_tls).c_str(), depth);
  std::printf("%s\n", bench::DescribeCopyThreshold().c_str());
  // Sources and sinks: offloads in flight and fetches ahead, like a trainer.
  auto sources = Buffers(depth + 1, slice);
  auto sinks = Buffers(depth + 1, slice);

  // ---- offload + fetch, everything in the arena ----
  // First as the store is configured by default (no checksums on the bulk
  // transport: the summary's figure), then with checksums, for their cost.
  double offload_gbps = NAN;
  std::vector<double> perftest_runs;  // one after each timed default repetition
  std::vector<double> paired;         // each repetition / the perftest run after it
  std::string why;
  for (const bool checksums : {false, true}) {
    const std::string label = checksums ? "offload+fetch with checksums" : "offload+fetch";
    absl::StatusOr<std::unique_ptr<Daemon>> daemon = StartDaemon(total + (64 << 20), "", 0);
    if (!daemon.ok()) {
      std::printf("%s: %s\n", label.c_str(), daemon.status().ToString().c_str());
      continue;
    }
    absl::StatusOr<std::unique_ptr<Client>> client = JoinedClient(**daemon, "bench-arena");
    DaemonSliceStore::Options so;
    so.checksums = checksums;
    so.threads = absl::GetFlag(FLAGS_threads);
    absl::StatusOr<std::unique_ptr<DaemonSliceStore>> store =
        client.ok() ? (*client)->OpenActivationStore(0, so) : client.status();
    std::vector<double> both, off, fetch;
    for (int rep = 0; store.ok() && rep <= absl::GetFlag(FLAGS_reps); ++rep) {
      absl::StatusOr<Phase> p = OffloadAndFetch(**store, rep + 1, slices, sources, sinks, depth);
      if (!p.ok()) {
        std::printf("%s: %s\n", label.c_str(), p.status().ToString().c_str());
        break;
      }
      if (rep == 0) continue;  // warm-up
      off.push_back(total / p->offload_seconds / 1e9);
      fetch.push_back(total / p->fetch_seconds / 1e9);
      both.push_back(2 * total / (p->offload_seconds + p->fetch_seconds) / 1e9);
      if (!checksums && why.empty()) {  // stops after a failed perftest
        const double put = bench::PerftestPutGbps(slice, absl::GetFlag(FLAGS_perftest),
                                                  absl::GetFlag(FLAGS_ucx_tls), &why);
        if (!std::isnan(put)) {
          perftest_runs.push_back(put);
          paired.push_back(both.back() / put);
        }
      }
    }
    if (!store.ok()) std::printf("%s: %s\n", label.c_str(), store.status().ToString().c_str());
    if (!checksums) offload_gbps = Median(both);
    std::printf("%s (%s): offload %.2f GB/s, fetch %.2f GB/s, both %.2f GB/s (medians of %zu)\n",
                label.c_str(), store.ok() ? (*store)->name().c_str() : "-", Median(off),
                Median(fetch), Median(both), both.size());
    store = absl::CancelledError("done");  // destroyed before the client
    if (client.ok()) (*client)->Leave().IgnoreError();
  }
  // The same traffic as plain copies on this thread: each slice copied into
  // a buffer the size of the arena's slices, then back out into a sink.
  // perftest puts every message into one buffer, which the caches partly
  // hold; these copies touch as much memory as the offloads do.
  std::vector<double> copy_runs;
  {
    Aligned arena(total);
    for (int rep = 0; rep <= absl::GetFlag(FLAGS_reps); ++rep) {
      const double t0 = Now();
      for (int i = 0; i < slices; ++i) {
        std::memcpy(arena.data + i * slice, sources[i % sources.size()]->data, slice);
      }
      for (int i = slices - 1; i >= 0; --i) {
        std::memcpy(sinks[i % sinks.size()]->data, arena.data + i * slice, slice);
      }
      bench::KeepWrites(arena.data);
      if (rep > 0) copy_runs.push_back(2 * total / (Now() - t0) / 1e9);
    }
  }
  const double copy_gbps = Median(copy_runs);
  std::printf(
      "memcpy of the same slices in and out of %s: %.2f GB/s (median of %zu); "
      "offload+fetch at %.3f of it\n",
      absl::StrFormat("%.0f MiB", total / 1048576.0).c_str(), copy_gbps, copy_runs.size(),
      offload_gbps / copy_gbps);
  const double perftest = Median(perftest_runs);
  const double offload_fraction = Median(paired);
  if (std::isnan(perftest)) {
    std::printf("perftest: %s\n", why.c_str());
  } else {
    std::string each;
    for (double r : paired) absl::StrAppend(&each, each.empty() ? "" : " ", absl::StrFormat("%.3f", r));
    std::printf(
        "perftest ucp_put_bw, %llu B messages: %.2f GB/s (median of %zu, each right after a "
        "repetition of offload+fetch); offload+fetch / perftest per repetition: %s "
        "(median %.3f; medians' ratio %.3f)\n",
        static_cast<unsigned long long>(slice), perftest, perftest_runs.size(), each.c_str(),
        offload_fraction, offload_gbps / perftest);
  }

  // ---- spill write and read against O_DIRECT ----
  double spill_write = NAN, spill_read = NAN, direct_write = NAN, direct_read = NAN;
  double write_fraction = NAN, read_fraction = NAN;
  {
    const uint64_t arena = absl::GetFlag(FLAGS_spill_arena_bytes);
    const int spill_slices =
        static_cast<int>(std::max<uint64_t>(2, arena * absl::GetFlag(FLAGS_spill_factor) / slice));
    const uint64_t spill_total = spill_slices * slice;
    mkdir(spill_dir.c_str(), 0700);
    {
      absl::StatusOr<std::unique_ptr<Daemon>> daemon =
          StartDaemon(arena, spill_dir, spill_total + slice);
      if (!daemon.ok()) {
        std::printf("spill: %s\n", daemon.status().ToString().c_str());
      } else {
        absl::StatusOr<std::unique_ptr<Client>> client = JoinedClient(**daemon, "bench-spill");
        absl::StatusOr<std::unique_ptr<DaemonSliceStore>> store =
            client.ok() ? (*client)->OpenActivationStore(0, {}) : client.status();
        // Warm-up: a step that fits the arena, so that the figures are the
        // spill's and not the first touch of the daemon's fresh arena pages.
        const int warm_slices = static_cast<int>(std::max<uint64_t>(1, arena / slice));
        absl::StatusOr<Phase> warm =
            store.ok() ? OffloadAndFetch(**store, 1, warm_slices, sources, sinks, depth)
                       : absl::StatusOr<Phase>(store.status());
        // Each repetition a step of spill_slices, then the same bytes
        // written and read with O_DIRECT right after it: each pair sees
        // the same state of the disk.
        std::vector<double> writes, reads, direct_writes, direct_reads, write_ratios, read_ratios;
        uint64_t seen_fetches = warm.ok() ? warm->stats.spilled_fetches : 0;
        for (int rep = 0; warm.ok() && rep < absl::GetFlag(FLAGS_reps); ++rep) {
          const double spilled_before =
              DaemonCounter(**daemon, "zeroshard_activation_spill_bytes_total", "bench-spill");
          absl::StatusOr<Phase> p =
              OffloadAndFetch(**store, 2 + rep, spill_slices, sources, sinks, depth);
          if (!p.ok()) {
            std::printf("spill: %s\n", p.status().ToString().c_str());
            break;
          }
          // What the daemon wrote to spill files (its counter), and what came
          // back from them (the fetches that missed the arena).
          const uint64_t spilled = static_cast<uint64_t>(
              DaemonCounter(**daemon, "zeroshard_activation_spill_bytes_total", "bench-spill") -
              spilled_before);
          const uint64_t read_back = (p->stats.spilled_fetches - seen_fetches) * slice;
          seen_fetches = p->stats.spilled_fetches;
          const auto [dw, dr] = DirectIo(dir, spilled, slice, &why);
          if (std::isnan(dw)) {
            std::printf("O_DIRECT: %s\n", why.c_str());
            break;
          }
          writes.push_back(spilled / p->offload_seconds / 1e9);
          reads.push_back(read_back / p->fetch_seconds / 1e9);
          direct_writes.push_back(dw);
          direct_reads.push_back(dr);
          write_ratios.push_back(writes.back() / dw);
          read_ratios.push_back(reads.back() / dr);
          std::printf(
              "spill (arena %.0f MiB, %d slices = %.0f MiB): %.0f MiB spilled in %.2f s "
              "(%.2f GB/s), %llu slices read back (%.0f MiB) in %.2f s (%.2f GB/s); O_DIRECT "
              "sequential, same bytes, same directory: write %.2f GB/s, read %.2f GB/s\n",
              arena / 1048576.0, spill_slices, spill_total / 1048576.0, spilled / 1048576.0,
              p->offload_seconds, writes.back(),
              static_cast<unsigned long long>(read_back / slice), read_back / 1048576.0,
              p->fetch_seconds, reads.back(), dw, dr);
        }
        if (!warm.ok()) std::printf("spill: %s\n", warm.status().ToString().c_str());
        spill_write = Median(writes);
        spill_read = Median(reads);
        direct_write = Median(direct_writes);
        direct_read = Median(direct_reads);
        write_fraction = Median(write_ratios);
        read_fraction = Median(read_ratios);
        std::printf(
            "spill: write %.2f GB/s against O_DIRECT %.2f, read %.2f against %.2f (medians of "
            "%zu); per repetition write %.3f, read %.3f (medians of the ratios)\n",
            spill_write, direct_write, spill_read, direct_read, writes.size(), write_fraction,
            read_fraction);
        store = absl::CancelledError("done");
        if (client.ok()) (*client)->Leave().IgnoreError();
      }
    }  // the daemon has removed its spill files and lock
    rmdir(spill_dir.c_str());
  }
  std::printf("offload_fraction=%.3f spill_write_fraction=%.3f spill_read_fraction=%.3f\n",
              offload_fraction, write_fraction, read_fraction);
  return 0;
}

}  // namespace
}  // namespace zeroshard

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return zeroshard::Main();
}
