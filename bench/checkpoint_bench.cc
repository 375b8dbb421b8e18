// Checkpoint cost, in one process: an in-process daemon holds a job of
// --params fp32 AdamW parameters (12 bytes each are saved: masters, m, v)
// and saves it --saves times into --dir, one training step between saves.
// Each save is measured next to the baselines below, on the same bytes;
// printed are medians (stalls over the saves after the first, which
// allocates the snapshot buffers and is shown apart):
//   stall     how long a save holds the job's steps (the snapshot copy);
//   memcpy    a plain single-threaded memcpy of the same bytes into warm
//             memory, the floor of any in-memory snapshot;
//   write     the background write's throughput (CRCs, fsync, rename);
//   dd        `dd bs=8M conv=fsync` of the same bytes into the same
//             directory: what the disk allows a sequential writer;
//   commit    a step's commit while a write runs (two more saves), against
//             one without.
// The last line: stall_vs_memcpy=X write_vs_dd=Y
//   bazel run -c opt //bench:checkpoint_bench -- --dir=/var/tmp/zs-bench

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "bench/stats.h"
#include "common/job_spec.h"
#include "common/layout.h"
#include "server/daemon.h"
#include "server/job/job.h"
#include "server/rpc/services.h"

ABSL_FLAG(int64_t, params, 96 << 20, "parameters of the job (12 bytes each are saved)");
ABSL_FLAG(int, saves, 4, "checkpoint saves (the first is reported apart)");
ABSL_FLAG(std::string, dir, "", "checkpoint directory (default: a new one under $TMPDIR or /tmp)");
ABSL_FLAG(int, optimizer_threads, 2, "threads of the daemon's optimizer");

namespace zeroshard {
namespace {

using bench::Median;

double Seconds(const std::function<void()>& fn) {
  const auto start = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void Check(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "checkpoint_bench: %s: %s\n", what, s.ToString().c_str());
    std::exit(1);
  }
}

// Pushes a gradient for every element and commits the next step.
double TrainStep(Job& job, uint64_t total) {
  const uint64_t step = job.committed_step() + 1;
  const uint64_t chunk = 1 << 20;
  std::string payload(chunk * sizeof(float), '\0');
  for (uint64_t i = 0; i < chunk; ++i) {
    const float g = 1e-3f * static_cast<float>((i * 2654435761u) % 1000) - 0.5f;
    std::memcpy(&payload[i * 4], &g, 4);
  }
  for (uint64_t b = 0; b < total; b += chunk) {
    const uint64_t e = std::min(total, b + chunk);
    GradientChunkIn c;
    c.step = step;
    c.rank = 0;
    c.incarnation = 1;
    c.range = {b, e};
    c.dtype = DTypeToProto(DType::kFp32);
    c.payload = absl::string_view(payload.data(), (e - b) * 4);
    Check(job.PushGradient({c}, absl::Now() + absl::Minutes(5)).status(), "PushGradient");
  }
  return Seconds([&] {
    Check(job.PrepareStep(step).status(), "PrepareStep");
    CommitRequest commit;
    commit.step = step;
    commit.lr = 1e-3f;
    commit.rank = 0;
    commit.incarnation = 1;
    Check(job.CommitStep(commit).status(), "CommitStep");
  });
}

// `dd` of `bytes` into dir with fsync; its seconds.
double DdSeconds(const std::string& dir, uint64_t bytes) {
  const uint64_t blocks = (bytes + (8 << 20) - 1) / (8 << 20);
  const std::string file = dir + "/dd.bin";
  const std::string cmd = absl::StrCat("dd if=/dev/zero of=", file,
                                       " bs=8M conv=fsync status=none count=", blocks);
  const double s = Seconds([&] {
    if (std::system(cmd.c_str()) != 0) Check(absl::InternalError(cmd), "dd");
  });
  std::filesystem::remove(file);
  return s * static_cast<double>(bytes) / static_cast<double>(blocks * (8 << 20));
}

int Main() {
  std::string dir = absl::GetFlag(FLAGS_dir);
  bool own_dir = false;
  if (dir.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    std::string tmpl = std::string(tmp != nullptr ? tmp : "/tmp") + "/zs-checkpoint-bench-XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr) Check(absl::InternalError("mkdtemp"), "--dir");
    dir = tmpl;
    own_dir = true;
  }
  const uint64_t params = static_cast<uint64_t>(absl::GetFlag(FLAGS_params));
  DaemonOptions options;
  options.optimizer_threads = absl::GetFlag(FLAGS_optimizer_threads);
  options.checkpoint_dir = dir;
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(options);
  Check(daemon.status(), "starting the daemon");

  JobSettings settings;
  settings.job_id = "bench";
  settings.stage = 3;
  settings.world_size = 1;
  settings.precision = DType::kFp32;
  settings.daemons = {(*daemon)->address()};
  absl::StatusOr<Layout> layout = Layout::Create({{"w", {static_cast<int64_t>(params)}, DType::kFp32, 0}});
  Check(layout.status(), "layout");
  v1::RegisterJobRequest reg;
  *reg.mutable_spec() = ToJobSpec(settings, *layout);
  reg.set_daemon_index(0);
  bool created = false;
  JobManager::Registrant registrant;
  registrant.may_create = true;
  registrant.identity = "admin";
  registrant.exempt = true;
  absl::StatusOr<std::shared_ptr<Job>> job =
      (*daemon)->jobs().Register(reg, TokenDigest::Of("bench"), false, registrant, &created);
  Check(job.status(), "RegisterJob");
  JoinRequest join;
  join.rank = 0;
  join.incarnation = 1;
  join.layout_fingerprint = layout->fingerprint();
  join.stage = 3;
  join.world_size = 1;
  join.precision = DTypeToProto(DType::kFp32);
  Check((*job)->Join(join).status(), "JoinJob");
  const uint64_t total = (*job)->owned_unpadded().size();
  // One step touches every array (masters, m, v), as training does.
  const double idle_commit = TrainStep(**job, total);

  const uint64_t bytes = total * 12;
  std::printf("job: %llu parameters, %.2f GiB saved per checkpoint, into %s\n",
              static_cast<unsigned long long>(total), bytes / double(1 << 30), dir.c_str());
  // Baseline buffers, warm: each save is measured next to a memcpy and a dd
  // of the same bytes, so both see the same machine.
  std::vector<char> src(bytes, 1), dst(bytes, 2);
  std::vector<double> stalls, writes, busy_commits, copies, dds;
  double first_stall = 0;
  const int saves = absl::GetFlag(FLAGS_saves);
  // One save: snapshot, then (optionally) a training step while the write
  // runs, then the job manifest. Returns the part's status.
  auto save = [&](const std::string& name, double* stall, double* wall, double* commit) {
    absl::StatusOr<CheckpointSaved> r;
    const uint64_t step = (*job)->committed_step();
    *wall = Seconds([&] { r = (*job)->SaveCheckpoint(name, step); });
    Check(r.status(), "SaveCheckpoint");
    *stall = r->snapshot_seconds;
    if (commit != nullptr) *commit = TrainStep(**job, total);
    absl::StatusOr<CheckpointProgress> st = (*job)->CheckpointStatus(name, absl::Minutes(10));
    Check(st.status(), "GetCheckpointStatus");
    if (st->state != CheckpointProgress::State::kWritten || !st->part.has_value()) {
      Check(absl::InternalError(st->error.message()), "writing");
    }
    Check((*job)->CompleteCheckpoint(name, {*st->part}).status(), "CompleteCheckpoint");
    std::filesystem::remove_all(absl::StrCat(dir, "/bench/", name));
    return bytes / st->part->write_seconds() / 1e9;
  };
  for (int i = 0; i < saves; ++i) {
    const double copy = Seconds([&] { std::memcpy(dst.data(), src.data(), bytes); });
    const double dd_gbs = bytes / DdSeconds(dir, bytes) / 1e9;
    double stall = 0, wall = 0;
    const double write_gbs = save(absl::StrCat("save-", i), &stall, &wall, nullptr);
    std::printf("save %d: stall %.3f s (the call %.3f s), memcpy %.3f s; write %.2f GB/s, "
                "dd %.2f GB/s\n",
                i, stall, wall, copy, write_gbs, dd_gbs);
    if (i == 0) {
      first_stall = stall;
    } else {
      stalls.push_back(stall);
    }
    copies.push_back(copy);
    writes.push_back(write_gbs);
    dds.push_back(dd_gbs);
  }
  // Training during a write: a step's commit next to one with no write.
  for (int i = 0; i < 2; ++i) {
    double stall = 0, wall = 0, commit = 0;
    save(absl::StrCat("busy-", i), &stall, &wall, &commit);
    busy_commits.push_back(commit);
  }
  const double stall = stalls.empty() ? first_stall : Median(stalls);
  const double memcpy_s = Median(copies);
  const double write = Median(writes);
  const double dd = Median(dds);
  std::printf("first save stall %.3f s (its buffers are allocated before the stall)\n",
              first_stall);
  std::printf("stall %.3f s, memcpy %.3f s; write %.2f GB/s, dd %.2f GB/s\n", stall, memcpy_s,
              write, dd);
  std::printf("commit: %.3f s idle, %.3f s during a write\n", idle_commit,
              busy_commits.empty() ? 0.0 : Median(busy_commits));
  if (own_dir) std::filesystem::remove_all(dir);
  std::printf("stall_vs_memcpy=%.2f write_vs_dd=%.2f\n", stall / memcpy_s, write / dd);
  return 0;
}

}  // namespace
}  // namespace zeroshard

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return zeroshard::Main();
}
