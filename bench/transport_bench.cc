// Push+gather bandwidth of the client's bulk data path, in one process:
//   ucx       zeroshard::Client with transport "ucx" over shared memory
//             (UCX_TLS=posix,cma,self) against an in-process daemon serving
//             --bulk_transport=ucx;
//   stream    the same client and daemon with transport "stream" (the Shard
//             streaming RPCs);
//   perftest  `ucx_perftest -t ucp_put_bw` between two processes on
//             loopback, same UCX_TLS, message size = the client's bucket C_B:
//             what UCX itself moves with these settings (each side one
//             buffer of C_B, which the caches can hold);
//   memcpy    one copy of the same bytes between two buffers of --bytes,
//             in C_B pieces, on one thread: the least a push or a gather
//             does (printed beside, not in the summary).
// The daemon runs with zeroshardd's defaults (--optimizer_threads: the CPUs
// this process may use; 4 staging slots per rank), the client with its own
// (4 sender threads).
// A job of --bytes fp32 parameters (one rank, stage 2) pushes its whole
// gradient and gathers all parameters per repetition; a repetition's figure
// is (pushed + gathered bytes) / (push time + gather time), the optimizer
// step in between not counted. Each path reports the median of --reps
// repetitions after one warm-up. The UCX path (borrowed pushes) and
// perftest are measured in --rounds rounds, one ucx_perftest run and one
// UCX measurement each, their order swapped each round: the host is
// shared and its memory's speed drifts over seconds, so each round's
// ratios compare figures taken seconds apart, and the median of the
// rounds' ratios is reported (each round's printed too). The
// gradient buffer is borrowed (BufferUse::kBorrow, as a trainer with a
// persistent gradient buffer pushes); the UCX path is also measured with
// copied pushes (BufferUse::kCopy: one more sweep through the client's
// staging pool) for comparison, once. The last line is the summary (the
// figures the medians of every round's, the fractions the medians of the
// rounds' ratios):
//   ucx_gbps=X stream_gbps=Y perftest_gbps=Z gather_fraction=G ucx_fraction=F
// where G is the UCX gather's GB/s over perftest's and F the UCX
// push+gather's.
//
// --tls_compare measures instead what mutual TLS costs on the gRPC data
// paths: the same job (borrowed pushes, then gathers) over "stream" (the
// Shard streaming RPCs) and over the "grpc" bulk transport, against two
// daemons in this process serving --bulk_transport=grpc, one plaintext and
// one with DaemonOptions::tls (client certificates required); each client
// uses ClientConfig::tls for the TLS one. The certificates are a throwaway
// PKI from common/testing/make_test_certs.sh (found in the runfiles, or
// next to the working directory) written into a temporary directory that
// is removed at exit, or the files of --certs_dir (ca.crt, server.{crt,key}
// with subjectAltName IP:127.0.0.1, client.{crt,key}). Plaintext and TLS
// are measured in turn, --tls_rounds rounds with the order swapped each
// round, and each figure is the median of all their repetitions. The last
// line is the summary, ratios TLS / plaintext of push+gather GB/s:
//   stream_plain_gbps=A stream_tls_gbps=B stream_tls_ratio=B/A
//   grpc_plain_gbps=C grpc_tls_gbps=D grpc_tls_ratio=D/C

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
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
ABSL_FLAG(int, rounds, 4,
          "rounds of one ucx_perftest run and one UCX measurement (order swapped each "
          "round: an even number puts each first as often); the ratios are the median of the "
          "rounds'");
ABSL_FLAG(std::string, ucx_tls, "posix,cma,self", "UCX_TLS for the client, daemon and perftest");
ABSL_FLAG(std::string, perftest, "ucx_perftest", "the ucx_perftest binary (PATH is searched)");
ABSL_FLAG(bool, tls_compare, false,
          "measure the gRPC data paths (stream, grpc) against a plaintext and a mutual-TLS "
          "daemon instead; the last line is then the TLS/plaintext ratios");
ABSL_FLAG(std::string, certs_dir, "",
          "--tls_compare: a directory with ca.crt, server.{crt,key} (SAN IP:127.0.0.1) and "
          "client.{crt,key}; empty: make a throwaway PKI with make_test_certs.sh");
ABSL_FLAG(int, tls_rounds, 2,
          "--tls_compare: rounds of plaintext and TLS measurements, order swapped each round");

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
  // Each timed repetition's figures, GB/s.
  std::vector<double> push, gather, both;
};

// `tls`: the client's certificates (none: plaintext); `job_suffix` keeps job
// ids apart when one daemon sees several clients of the same kind.
absl::StatusOr<PathResult> Measure(Daemon& daemon, const std::string& transport, BufferUse use,
                                   const TlsFiles& tls = {}, const std::string& job_suffix = "") {
  const uint64_t n = absl::GetFlag(FLAGS_bytes) / sizeof(float);
  absl::StatusOr<Layout> layout = Layout::Create({{"w", {static_cast<int64_t>(n)}, DType::kFp32, 0}});
  if (!layout.ok()) return layout.status();
  ClientConfig c;
  c.job_token = "transport-bench-job-token";
  c.daemons = {daemon.address()};
  c.job_id = absl::StrCat("bench-", transport, use == BufferUse::kBorrow ? "-borrow" : "-copy",
                          job_suffix);
  c.tls = tls;
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
  std::vector<double>& push = r.push;
  std::vector<double>& gather = r.gather;
  std::vector<double>& both = r.both;
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

// The certificates of --tls_compare: --certs_dir's, or a throwaway PKI in a
// temporary directory that the destructor removes.
class Certs {
 public:
  static absl::StatusOr<std::unique_ptr<Certs>> Make(const std::string& certs_dir) {
    std::unique_ptr<Certs> c(new Certs);
    if (!certs_dir.empty()) {
      c->dir_ = certs_dir;
    } else {
      std::string script;
      for (const std::string& candidate : ScriptCandidates()) {
        if (::access(candidate.c_str(), R_OK) == 0) {
          script = candidate;
          break;
        }
      }
      if (script.empty()) {
        return absl::NotFoundError(
            "common/testing/make_test_certs.sh is not in the runfiles or the working directory: "
            "run through bazel, from the repository root, or pass --certs_dir");
      }
      const char* tmp = std::getenv("TMPDIR");
      std::string tmpl = absl::StrCat(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp",
                                      "/zs-transport-bench-certs-XXXXXX");
      if (::mkdtemp(tmpl.data()) == nullptr) {
        return absl::InternalError(absl::StrCat("mkdtemp ", tmpl, ": ", std::strerror(errno)));
      }
      c->dir_ = tmpl;
      c->owned_ = true;
      const std::string cmd = absl::StrCat("bash ", Quote(script), " ", Quote(c->dir_), " > ",
                                           Quote(c->dir_ + "/make.log"), " 2>&1");
      if (std::system(cmd.c_str()) != 0) {
        std::string log;
        if (FILE* f = std::fopen((c->dir_ + "/make.log").c_str(), "r")) {
          char buf[512];
          log.assign(buf, std::fread(buf, 1, sizeof(buf), f));
          std::fclose(f);
        }
        return absl::InternalError(absl::StrCat(cmd, " failed (needs openssl): ", log));
      }
    }
    for (const char* name : {"ca.crt", "server.crt", "server.key", "client.crt", "client.key"}) {
      if (::access(c->File(name).c_str(), R_OK) != 0) {
        return absl::NotFoundError(absl::StrCat(c->File(name), " is missing"));
      }
    }
    return c;
  }
  ~Certs() {
    if (!owned_) return;
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  const std::string& dir() const { return dir_; }
  TlsFiles Server() const { return {File("server.crt"), File("server.key"), File("ca.crt")}; }
  TlsFiles Client() const { return {File("client.crt"), File("client.key"), File("ca.crt")}; }

 private:
  Certs() = default;
  std::string File(const char* name) const { return absl::StrCat(dir_, "/", name); }
  static std::string Quote(const std::string& s) {
    std::string out = "'";
    for (char ch : s) {
      if (ch == '\'') {
        out += "'\\''";
      } else {
        out += ch;
      }
    }
    return out + "'";
  }
  // //common/testing:make_test_certs is a data dependency: in the runfiles
  // under bazel run / test (RUNFILES_DIR, TEST_SRCDIR, or next to the
  // binary), else relative to the working directory (the repository root).
  static std::vector<std::string> ScriptCandidates() {
    const std::string rel = "zeroshard/common/testing/make_test_certs.sh";
    std::vector<std::string> out;
    for (const char* env : {"RUNFILES_DIR", "TEST_SRCDIR"}) {
      const char* dir = std::getenv(env);
      if (dir != nullptr && *dir != '\0') out.push_back(absl::StrCat(dir, "/", rel));
    }
    std::error_code ec;
    const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
    if (!ec) out.push_back(absl::StrCat(self.string(), ".runfiles/", rel));
    out.push_back("common/testing/make_test_certs.sh");
    return out;
  }

  std::string dir_;
  bool owned_ = false;
};

// --tls_compare: push+gather over "stream" and "grpc" against a plaintext
// daemon and a mutual-TLS one, both in this process.
int TlsCompare() {
  // The plaintext client must stay plaintext: ClientConfig::tls's empty
  // fields would otherwise come from these.
  for (const char* name : {"ZS_TLS_CERT", "ZS_TLS_KEY", "ZS_TLS_CA"}) ::unsetenv(name);
  absl::StatusOr<std::unique_ptr<Certs>> certs = Certs::Make(absl::GetFlag(FLAGS_certs_dir));
  if (!certs.ok()) {
    std::fprintf(stderr, "certificates: %s\n", certs.status().ToString().c_str());
    return 1;
  }
  DaemonOptions o;
  o.bulk_transport = "grpc";
  absl::StatusOr<std::unique_ptr<Daemon>> plain = Daemon::Start(o);
  if (!plain.ok()) {
    std::fprintf(stderr, "plaintext daemon: %s\n", plain.status().ToString().c_str());
    return 1;
  }
  o.tls = (*certs)->Server();
  absl::StatusOr<std::unique_ptr<Daemon>> tls = Daemon::Start(o);
  if (!tls.ok()) {
    std::fprintf(stderr, "TLS daemon: %s\n", tls.status().ToString().c_str());
    return 1;
  }
  const uint64_t bytes = absl::GetFlag(FLAGS_bytes);
  const int rounds = std::max(1, absl::GetFlag(FLAGS_tls_rounds));
  std::printf(
      "job: %llu fp32 parameters (%.1f MiB), 1 rank, stage 2, C_B %llu B, borrowed "
      "pushes; plaintext vs mutual TLS (%s certificates), %d round(s) of %d "
      "repetition(s)\n",
      static_cast<unsigned long long>(bytes / 4), bytes / 1048576.0,
      static_cast<unsigned long long>(absl::GetFlag(FLAGS_bucket_bytes)),
      absl::GetFlag(FLAGS_certs_dir).empty() ? "throwaway P-256" : "--certs_dir", rounds,
      std::max(1, absl::GetFlag(FLAGS_reps)));
  struct Side {
    const char* label;
    Daemon* daemon;
    TlsFiles client_tls;
    std::vector<double> push, gather, both;
    double gbps = NAN;
    bool failed = false;
  };
  struct Path {
    const char* transport;
    Side sides[2];
  };
  Path paths[2] = {
      {"stream", {{"plaintext", plain->get(), {}}, {"tls", tls->get(), (*certs)->Client()}}},
      {"grpc", {{"plaintext", plain->get(), {}}, {"tls", tls->get(), (*certs)->Client()}}}};
  for (int round = 0; round < rounds; ++round) {
    for (Path& path : paths) {
      for (int i = 0; i < 2; ++i) {
        Side& side = path.sides[round % 2 == 0 ? i : 1 - i];
        if (side.failed) continue;
        if (std::string(path.transport) == "grpc" && side.daemon->bulk_transport() == nullptr) {
          std::printf("%s %s: the daemon has no grpc bulk transport; skipped\n", path.transport,
                      side.label);
          side.failed = true;
          continue;
        }
        absl::StatusOr<PathResult> r =
            Measure(*side.daemon, path.transport, BufferUse::kBorrow, side.client_tls,
                    absl::StrCat("-", side.label, "-", round));
        if (!r.ok()) {
          std::printf("%s %s: failed: %s\n", path.transport, side.label,
                      r.status().ToString().c_str());
          side.failed = true;
          continue;
        }
        side.push.insert(side.push.end(), r->push.begin(), r->push.end());
        side.gather.insert(side.gather.end(), r->gather.begin(), r->gather.end());
        side.both.insert(side.both.end(), r->both.begin(), r->both.end());
        std::printf(
            "round %d %-6s %-9s push %.3f GB/s, gather %.3f GB/s, push+gather %.3f "
            "GB/s\n",
            round, path.transport, side.label, r->push_gbps, r->gather_gbps, r->gbps);
        std::fflush(stdout);
      }
    }
  }
  for (Path& path : paths) {
    for (Side& side : path.sides) {
      if (side.failed) continue;
      side.gbps = Median(side.both);
      const double ms = 2 * static_cast<double>(bytes) / side.gbps / 1e6;
      std::printf(
          "%-6s %-9s push %.3f GB/s, gather %.3f GB/s, push+gather %.3f GB/s "
          "(%.1f ms per push+gather; median of %zu)\n",
          path.transport, side.label, Median(side.push), Median(side.gather), side.gbps, ms,
          side.both.size());
    }
  }
  std::printf(
      "stream_plain_gbps=%.3f stream_tls_gbps=%.3f stream_tls_ratio=%.3f "
      "grpc_plain_gbps=%.3f grpc_tls_gbps=%.3f grpc_tls_ratio=%.3f\n",
      paths[0].sides[0].gbps, paths[0].sides[1].gbps,
      paths[0].sides[1].gbps / paths[0].sides[0].gbps, paths[1].sides[0].gbps,
      paths[1].sides[1].gbps, paths[1].sides[1].gbps / paths[1].sides[0].gbps);
  return 0;
}

int Main() {
  if (absl::GetFlag(FLAGS_tls_compare)) return TlsCompare();
  DaemonOptions o;
  o.bulk_transport = "ucx";
  o.ucx_tls = absl::GetFlag(FLAGS_ucx_tls);
  // As zeroshardd's default; the optimizer threads also sum staged gradients.
  o.optimizer_threads = DefaultOptimizerThreads();
  // Loopback, and every peer is this process: UCX keys may go out over tcp.
  o.ucx_trust_peers = true;
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
  std::printf("%s\n", bench::DescribeCopyThreshold().c_str());
  struct Run {
    const char* transport;
    BufferUse use;
    const char* label;
    double gbps = NAN, push_gbps = NAN, gather_gbps = NAN;
  };
  Run runs[3] = {{"ucx", BufferUse::kCopy, "ucx (copied push)"},
                 {"ucx", BufferUse::kBorrow, "ucx"},
                 {"stream", BufferUse::kBorrow, "stream"}};
  const bool have_ucx = (*daemon)->bulk_transport() != nullptr;
  for (Run* run : {&runs[0], &runs[2]}) {  // measured once; runs[1] in rounds below
    if (std::string(run->transport) == "ucx" && !have_ucx) {
      std::printf("%s: the daemon could not initialise UCX; skipped\n", run->label);
      continue;
    }
    absl::StatusOr<PathResult> r = Measure(**daemon, run->transport, run->use);
    if (!r.ok()) {
      std::printf("%s: failed: %s\n", run->label, r.status().ToString().c_str());
      continue;
    }
    run->gbps = r->gbps;
    run->push_gbps = r->push_gbps;
    run->gather_gbps = r->gather_gbps;
    std::printf("%-17s push %.2f GB/s, gather %.2f GB/s, push+gather %.2f GB/s; "
                "client staging buffer %llu B\n",
                run->label, r->push_gbps, r->gather_gbps, r->gbps,
                static_cast<unsigned long long>(r->client_buffer));
    std::fflush(stdout);
  }
  // The UCX path against perftest, round by round.
  const int rounds = std::max(1, absl::GetFlag(FLAGS_rounds));
  std::vector<double> ucx_push, ucx_gather, ucx_both, perftest_runs;
  std::vector<double> gather_fractions, ucx_fractions;  // by round, where both ran
  int ucx_rounds = 0;  // rounds whose UCX measurement ran
  std::string why;
  bool ucx_failed = !have_ucx, perftest_failed = false;
  if (!have_ucx) std::printf("ucx: the daemon could not initialise UCX; skipped\n");
  for (int round = 0; round < rounds; ++round) {
    double perftest = NAN;
    const PathResult* ucx = nullptr;
    absl::StatusOr<PathResult> r = absl::UnknownError("not run");
    auto measure_ucx = [&] {
      if (ucx_failed) return;
      r = Measure(**daemon, "ucx", BufferUse::kBorrow, {}, absl::StrCat("-round-", round));
      if (!r.ok()) {
        std::printf("ucx: failed: %s\n", r.status().ToString().c_str());
        ucx_failed = true;
        return;
      }
      ucx = &*r;
      ++ucx_rounds;
      ucx_push.insert(ucx_push.end(), r->push.begin(), r->push.end());
      ucx_gather.insert(ucx_gather.end(), r->gather.begin(), r->gather.end());
      ucx_both.insert(ucx_both.end(), r->both.begin(), r->both.end());
    };
    auto measure_perftest = [&] {
      if (perftest_failed) return;
      perftest = bench::PerftestPutGbps(absl::GetFlag(FLAGS_bucket_bytes),
                                        absl::GetFlag(FLAGS_perftest),
                                        absl::GetFlag(FLAGS_ucx_tls), &why);
      if (std::isnan(perftest)) {
        std::printf("perftest: %s\n", why.c_str());
        perftest_failed = true;
      } else {
        perftest_runs.push_back(perftest);
      }
    };
    if (round % 2 == 0) {
      measure_ucx();
      measure_perftest();
    } else {
      measure_perftest();
      measure_ucx();
    }
    if (ucx != nullptr && !std::isnan(perftest)) {
      gather_fractions.push_back(ucx->gather_gbps / perftest);
      ucx_fractions.push_back(ucx->gbps / perftest);
      std::printf(
          "round %d (%s first): ucx push %.2f GB/s, gather %.2f GB/s, push+gather %.2f GB/s; "
          "perftest %.2f GB/s; gather %.3f of perftest, push+gather %.3f\n",
          round + 1, round % 2 == 0 ? "ucx" : "perftest", ucx->push_gbps, ucx->gather_gbps,
          ucx->gbps, perftest, gather_fractions.back(), ucx_fractions.back());
      std::fflush(stdout);
    }
  }
  if (!ucx_both.empty()) {
    Run& run = runs[1];
    run.push_gbps = Median(ucx_push);
    run.gather_gbps = Median(ucx_gather);
    run.gbps = Median(ucx_both);
    std::printf("%-17s push %.2f GB/s, gather %.2f GB/s, push+gather %.2f GB/s (medians of %zu "
                "repetitions over %d round%s)\n",
                run.label, run.push_gbps, run.gather_gbps, run.gbps, ucx_both.size(), ucx_rounds,
                ucx_rounds > 1 ? "s" : "");
  }
  // The least a push or a gather can do, in this process: one copy of the
  // same bytes between two buffers of --bytes, in C_B pieces, on one thread
  // (perftest puts every message into the same buffer, which the caches can
  // hold; these copies touch as much memory as the job's push and gather).
  {
    const uint64_t piece =
        std::max<uint64_t>(1, std::min<uint64_t>(bytes, absl::GetFlag(FLAGS_bucket_bytes)));
    std::vector<char> trainer(bytes, 1), daemon_side(bytes, 2);
    std::vector<double> to_daemon, to_trainer;
    for (int rep = 0; rep <= std::max(1, absl::GetFlag(FLAGS_reps)); ++rep) {
      for (const bool push : {true, false}) {
        char* dst = push ? daemon_side.data() : trainer.data();
        const char* src = push ? trainer.data() : daemon_side.data();
        const double t0 = Now();
        for (uint64_t off = 0; off < bytes; off += piece) {
          std::memcpy(dst + off, src + off, std::min(piece, bytes - off));
        }
        bench::KeepWrites(dst);
        if (rep > 0) (push ? to_daemon : to_trainer).push_back(bytes / (Now() - t0) / 1e9);
      }
    }
    std::printf(
        "memcpy of the same bytes between buffers of %.1f MiB: push side %.2f GB/s, gather side "
        "%.2f GB/s (medians of %zu); ucx push at %.3f of it, gather at %.3f\n",
        bytes / 1048576.0, Median(to_daemon), Median(to_trainer), to_daemon.size(),
        runs[1].push_gbps / Median(to_daemon), runs[1].gather_gbps / Median(to_trainer));
  }
  const double perftest = Median(perftest_runs);
  if (!perftest_runs.empty()) {
    std::string each;
    for (double g : perftest_runs) {
      absl::StrAppend(&each, each.empty() ? "" : ", ", absl::StrFormat("%.2f", g));
    }
    std::printf("perftest ucp_put_bw, %llu B messages: %.2f GB/s (median of %s)\n",
                static_cast<unsigned long long>(absl::GetFlag(FLAGS_bucket_bytes)), perftest,
                each.c_str());
  }
  std::printf(
      "ucx_gbps=%.3f stream_gbps=%.3f perftest_gbps=%.3f gather_fraction=%.3f "
      "ucx_fraction=%.3f\n",
      runs[1].gbps, runs[2].gbps, perftest, Median(gather_fractions), Median(ucx_fractions));
  return 0;
}

}  // namespace
}  // namespace zeroshard

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return zeroshard::Main();
}
