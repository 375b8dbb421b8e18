// The optimizer step of a job whose fp32 masters and Adam moments live on
// disk (ShardState with a DiskResidence, the daemon's --state_dir), in one
// process, against what the disk does without zeroshard:
//   disk step   a bf16 AdamW job of --params elements (16 tensors), owned
//               whole by one ShardState on disk: each step reads the state
//               file once and writes it back once (12 bytes per element
//               each way), streaming it through the fused kernel on
//               --threads threads. Figure: median step seconds, and the
//               file traffic (2 x disk_bytes) per second;
//   fio         `fio` in the same directory moving the same bytes: a file
//               the size of the state file, O_DIRECT where the directory
//               has it, io_uring, blocks of one chunk, as many transfers in
//               flight as the step has buffers, reads and writes mixed
//               half and half (see RunFio). Figure: the seconds fio needs
//               for one step's bytes (median of --steps runs, one after
//               each timed step: the disk's mood drifts, both see it);
//   RAM vs disk the same model at --ram_params elements with its states in
//               RAM and on disk, steps alternating: what putting the states
//               on disk costs at a size where both fit.
// With --verbose, a copy of the step's disk pass (ShardState::DiskPass, the
// same order of reads, updates and writes over a StateFile of the same
// shape) times each chunk's read wait, update and write wait.
// The last line is the summary:
//   disk_step_s=X fio_s=Y step_vs_disk=Y/X ram_step_s=A disk_small_step_s=B
//   disk_vs_ram=A/B
// (step_vs_disk >= 1: the step moves its bytes as fast as fio does).

#include <fcntl.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "bench/stats.h"
#include "common/job_spec.h"
#include "common/layout.h"
#include "nlohmann/json.hpp"
#include "server/disk/instance_directory.h"
#include "server/disk/state_file.h"
#include "server/ledger/memory_ledger.h"
#include "server/optimizer/optimizer.h"
#include "server/step/shard_state.h"

ABSL_FLAG(std::string, dir, "",
          "directory for the state files and fio's file; it must be on the disk to measure "
          "(default: a new directory under /var/tmp, removed at the end)");
ABSL_FLAG(int64_t, params, 100000000, "elements of the disk-resident job (12 bytes each on disk)");
ABSL_FLAG(int64_t, ram_params, 20000000,
          "elements of the job stepped in RAM and on disk for the comparison");
ABSL_FLAG(int, steps, 3, "timed steps (and fio runs); the median is reported");
ABSL_FLAG(int, warmup, 1, "untimed steps first");
ABSL_FLAG(int, threads, 2, "optimizer threads");
ABSL_FLAG(uint64_t, chunk_elements, zeroshard::DiskResidence{}.chunk_elements,
          "DiskResidence::chunk_elements");
ABSL_FLAG(uint64_t, buffers, zeroshard::DiskResidence{}.buffers, "DiskResidence::buffers");
ABSL_FLAG(uint32_t, queue_depth, zeroshard::DiskResidence{}.queue_depth,
          "DiskResidence::queue_depth");
ABSL_FLAG(std::string, fio, "fio", "the fio binary (PATH is searched)");
ABSL_FLAG(bool, verbose, false,
          "also time a copy of the step's disk pass chunk by chunk: read wait, update, write "
          "wait");

extern char** environ;

namespace zeroshard {
namespace {

using bench::Median;

constexpr uint32_t kTensors = 16;
constexpr uint64_t kGranule = StateFile::kAlignment / sizeof(float);  // ShardState's chunk unit

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

[[noreturn]] void Fail(const std::string& what, const absl::Status& status) {
  std::fprintf(stderr, "%s: %s\n", what.c_str(), status.ToString().c_str());
  std::exit(1);
}

template <typename T>
T Check(const std::string& what, absl::StatusOr<T> v) {
  if (!v.ok()) Fail(what, v.status());
  return *std::move(v);
}

void Check(const std::string& what, const absl::Status& s) {
  if (!s.ok()) Fail(what, s);
}

// The file system holding `dir` (the longest mount point above it in
// /proc/self/mounts): its type and source.
std::pair<std::string, std::string> FileSystemOf(const std::string& dir) {
  std::error_code ec;
  const std::string path = std::filesystem::canonical(dir, ec).string();
  std::ifstream mounts("/proc/self/mounts");
  std::string line, best_type = "unknown", best_source = "?";
  size_t best = 0;
  while (std::getline(mounts, line)) {
    std::vector<std::string> f = absl::StrSplit(line, ' ');
    if (f.size() < 3) continue;
    const std::string& at = f[1];
    const bool above = path == at || (path.rfind(at, 0) == 0 &&
                                      (at == "/" || (path.size() > at.size() &&
                                                     path[at.size()] == '/')));
    if (above && at.size() >= best) {
      best = at.size();
      best_source = f[0];
      best_type = f[2];
    }
  }
  return {best_type, best_source};
}

// One bf16 AdamW job of n elements in kTensors tensors, all owned here.
JobConfig MakeConfig(uint64_t n) {
  std::vector<TensorSpec> specs;
  const uint64_t per = std::max<uint64_t>(1, n / kTensors);
  uint64_t placed = 0;
  for (uint32_t i = 0; i < kTensors && placed < n; ++i) {
    TensorSpec t;
    t.name = absl::StrCat("layer", i, ".weight");
    t.shape = {static_cast<int64_t>(i + 1 == kTensors ? n - placed : std::min(per, n - placed))};
    t.layer = i;
    placed += static_cast<uint64_t>(t.shape[0]);
    specs.push_back(t);
  }
  JobConfig c;
  c.job_id = "nvme-step-bench";
  c.stage = 3;
  c.precision = DType::kBf16;
  c.optimizer.kind = OptimizerKind::kAdamW;
  c.layout = Check("Layout::Create", Layout::Create(std::move(specs)));
  return c;
}

FlatRange Owned(const JobConfig& c) { return {0, c.layout.total_elements()}; }

// Pseudo-random values in [-scale/2, scale/2) where the layout has tensors
// (zeros in the alignment gaps, as trainers push them).
void Fill(const Layout& layout, float scale, uint32_t seed, float* out) {
  for (const auto& t : layout.tensors()) {
    uint32_t x = seed * 2654435761u + static_cast<uint32_t>(t.offset);
    for (uint64_t i = t.offset; i < t.offset + t.numel; ++i) {
      x = x * 1664525u + 1013904223u;
      out[i] = (static_cast<float>(x >> 8) * (1.0f / 16777216.0f) - 0.5f) * scale;
    }
  }
}

// A ShardState of config `c` (on disk with `disk.dir`), its bytes booked in
// `ledger`, masters initialised from `scratch` (which Fill overwrites).
struct Job {
  JobConfig config;
  std::unique_ptr<LedgerReservation> booked;
  std::unique_ptr<ShardState> state;
  std::vector<StepHyperParams> groups;
};

Job MakeJob(uint64_t n, MemoryLedger* ledger, const DiskResidence& disk, ShardOptimizer* opt,
            float* scratch, const std::string& name) {
  Job j;
  j.config = MakeConfig(n);
  j.config.job_id = name;
  const FlatRange owned = Owned(j.config);
  j.booked = std::make_unique<LedgerReservation>(
      Check("LedgerReservation::Create",
            LedgerReservation::Create(ledger, name,
                                      ShardState::Footprint(j.config, owned, false, disk))));
  j.state = Check("ShardState::Create",
                  ShardState::Create(j.config, owned, j.booked.get(), nullptr, false, disk));
  std::fill(scratch, scratch + owned.size(), 0.0f);
  Fill(j.config.layout, 1.0f, 7, scratch);
  Check("WriteMasters",
        j.state->WriteMasters(opt, owned.begin, scratch, DType::kFp32, owned.size()));
  Check("RefreshHalfCopy", j.state->RefreshHalfCopy(opt));
  j.groups = GroupHyperParams(j.config);
  return j;
}

double StepSeconds(Job& j, ShardOptimizer* opt, const float* grad) {
  const double t0 = Now();
  Check("Step", j.state->Step(opt, j.groups, grad, Owned(j.config), {}));
  return Now() - t0;
}

// ---- fio ----

struct FioResult {
  bool ran = false;
  std::string why;  // when !ran
  double read_bytes = 0, write_bytes = 0;
  double seconds = 0;            // the job's runtime
  double read_bw = 0, write_bw = 0;  // bytes/s as fio reports them
};

// Runs `argv` (argv[0] searched in PATH), stdout to `out_path`; its exit
// status, or -1 when it could not be started.
int Spawn(const std::vector<std::string>& args, const std::string& out_path) {
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                   0600);
  pid_t pid;
  const int rc = posix_spawnp(&pid, argv[0], &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) return -1;
  int status = 0;
  if (waitpid(pid, &status, 0) < 0) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// Whether `name` (no slash) is an executable in PATH, or `name` with a
// slash is executable.
bool OnPath(const std::string& name) {
  if (name.find('/') != std::string::npos) return access(name.c_str(), X_OK) == 0;
  const char* path = std::getenv("PATH");
  if (path == nullptr) return false;
  for (absl::string_view d : absl::StrSplit(path, ':')) {
    if (access(absl::StrCat(d.empty() ? "." : d, "/", name).c_str(), X_OK) == 0) return true;
  }
  return false;
}

// One fio run over `file` of `file_bytes`, moving 2 x file_bytes.
//
// The pattern: the step's pass reads the file sequentially, chunk after
// chunk, buffers - 2 chunks ahead of the update, and writes each chunk back
// right after its update, so its reads and writes alternate, one write per
// read, both sweeping the file front to back with the writes a few chunks
// behind the reads. fio's --rw=readwrite --rwmixread=50 is that: one job,
// sequential reads and sequential writes (fio keeps a position per
// direction) mixed half and half, each over the whole file, as many in
// flight as --iodepth. --io_size = 2 x the file makes each direction cover
// it about once, like one step. Two sequential jobs (all reads, then all
// writes) would measure something the step never does: a disk that is only
// read, then only written.
FioResult RunFio(const std::string& fio, const std::string& file, uint64_t file_bytes,
                 uint64_t block_bytes, size_t iodepth, bool direct, const std::string& json_path,
                 const std::string& err_path) {
  FioResult r;
  const std::vector<std::string> args = {
      fio,
      "--name=nvme_step",
      absl::StrCat("--filename=", file),
      absl::StrCat("--size=", file_bytes),
      absl::StrCat("--io_size=", 2 * file_bytes),
      "--rw=readwrite",
      "--rwmixread=50",
      absl::StrCat("--bs=", block_bytes),
      absl::StrCat("--iodepth=", iodepth),
      "--ioengine=io_uring",
      absl::StrCat("--direct=", direct ? 1 : 0),
      "--output-format=json",
      absl::StrCat("--output=", json_path),
  };
  const int rc = Spawn(args, err_path);
  if (rc != 0) {
    std::ifstream err(err_path);
    std::stringstream ss;
    ss << err.rdbuf();
    std::ifstream js(json_path);
    std::stringstream jss;
    jss << js.rdbuf();
    r.why = absl::StrCat("fio exited with ", rc, ": ", ss.str(), jss.str());
    return r;
  }
  std::ifstream in(json_path);
  std::stringstream ss;
  ss << in.rdbuf();
  std::string text = ss.str();
  const size_t brace = text.find('{');  // fio may print notices before the JSON
  if (brace == std::string::npos) {
    r.why = "no JSON in fio's output";
    return r;
  }
  nlohmann::json j = nlohmann::json::parse(text.substr(brace), nullptr, false);
  if (j.is_discarded() || !j.contains("jobs") || j["jobs"].empty()) {
    r.why = "unreadable JSON from fio";
    return r;
  }
  const nlohmann::json& job = j["jobs"][0];
  auto num = [](const nlohmann::json& o, const char* k) {
    return o.contains(k) && o[k].is_number() ? o[k].get<double>() : 0.0;
  };
  r.read_bytes = num(job["read"], "io_bytes");
  r.write_bytes = num(job["write"], "io_bytes");
  r.read_bw = num(job["read"], "bw_bytes");
  r.write_bw = num(job["write"], "bw_bytes");
  double runtime_ms = num(job, "job_runtime");
  if (runtime_ms <= 0) {
    runtime_ms = std::max(num(job["read"], "runtime"), num(job["write"], "runtime"));
  }
  if (runtime_ms <= 0 || r.read_bytes + r.write_bytes <= 0) {
    r.why = "fio reported no bytes or no runtime";
    return r;
  }
  r.seconds = runtime_ms / 1e3;
  r.ran = true;
  return r;
}

// ---- --verbose: the disk pass, timed chunk by chunk ----

struct PassTimes {
  double total = 0;
  double start = 0;       // StartRead/StartWrite calls (they block while queue_depth are busy)
  double write_wait = 0;  // waiting for a buffer's write before reading into it
  double read_wait = 0;   // waiting for the chunk's read before its update
  double compute = 0;     // the kernel
  double drain = 0;       // the last writes
  std::vector<double> chunk_read_wait, chunk_compute, chunk_write_wait;
};

// ShardState::DiskPass's order over `file` (chunks of `chunk_elements`,
// masters, m and v one after the other in each chunk), with an AdamW update
// of each chunk in between: reads of the next buffers - 2 chunks queued
// ahead, a buffer read into only after its previous chunk's write, each
// chunk's write queued after its update.
PassTimes TimedPass(StateFile& file, uint64_t n, uint64_t chunk_elements, ShardOptimizer* opt,
                    StepHyperParams hp, const float* grad, uint16_t* half) {
  PassTimes t;
  const uint64_t chunks = (n + chunk_elements - 1) / chunk_elements;
  const size_t buffers = file.buffers();
  const size_t ahead = buffers - 2;
  const size_t bytes = file.buffer_bytes();
  const absl::Duration timeout = absl::Seconds(120);
  auto timed = [](double* into, const std::function<absl::Status()>& fn) {
    const double t0 = Now();
    Check("transfer", fn());
    const double dt = Now() - t0;
    *into += dt;
    return dt;
  };
  const double t0 = Now();
  uint64_t next_read = 0;
  for (uint64_t c = 0; c < chunks; ++c) {
    double write_wait = 0;
    while (next_read < chunks && next_read <= c + ahead) {
      const size_t b = next_read % buffers;
      if (next_read >= buffers) {
        write_wait += timed(&t.write_wait, [&] {
          return file.Wait(2 * (next_read - buffers) + 1, absl::Now() + timeout);
        });
      }
      timed(&t.start, [&] {
        return file.StartRead(2 * next_read, next_read * bytes, b, 0, bytes,
                              absl::Now() + timeout);
      });
      ++next_read;
    }
    t.chunk_write_wait.push_back(write_wait);
    t.chunk_read_wait.push_back(
        timed(&t.read_wait, [&] { return file.Wait(2 * c, absl::Now() + timeout); }));
    float* buffer = reinterpret_cast<float*>(file.buffer(c % buffers));
    const uint64_t begin = c * chunk_elements;
    ShardBuffers sb;
    sb.param = buffer;
    sb.exp_avg = buffer + chunk_elements;
    sb.exp_avg_sq = buffer + 2 * chunk_elements;
    sb.grad = grad + begin;
    sb.model_copy = half + begin;
    sb.model_copy_type = DType::kBf16;
    sb.size = std::min(chunk_elements, n - begin);
    t.chunk_compute.push_back(timed(&t.compute, [&] { return opt->Step(hp, sb); }));
    timed(&t.start, [&] {
      return file.StartWrite(2 * c + 1, c * bytes, c % buffers, 0, bytes,
                             absl::Now() + timeout);
    });
  }
  timed(&t.drain, [&] { return file.WaitAll(absl::Now() + timeout); });
  t.total = Now() - t0;
  return t;
}

double Max(const std::vector<double>& v) {
  return v.empty() ? 0 : *std::max_element(v.begin(), v.end());
}

void VerbosePass(InstanceDirectory* dir, uint64_t n, const DiskResidence& disk,
                 ShardOptimizer* opt, const float* grad) {
  const uint64_t rounded = (n + kGranule - 1) / kGranule * kGranule;
  const uint64_t ce = std::min<uint64_t>(disk.chunk_elements, rounded);
  const uint64_t chunks = (n + ce - 1) / ce;
  const size_t chunk_bytes = 3 * ce * sizeof(float);
  std::unique_ptr<StateFile> file =
      Check("StateFile::Create", StateFile::Create(dir, chunks * chunk_bytes, chunk_bytes,
                                                   disk.buffers, disk.queue_depth));
  std::vector<uint16_t> half(n);
  StepHyperParams hp;
  hp.kind = OptimizerKind::kAdamW;
  hp.weight_decay = 0.01;
  // The first pass writes every block of the file (fallocate leaves them
  // unwritten: reading those costs the disk nothing), the second is timed.
  hp.step = 1;
  TimedPass(*file, n, ce, opt, hp, grad, half.data());
  hp.step = 2;
  const PassTimes t = TimedPass(*file, n, ce, opt, hp, grad, half.data());
  const double mb = static_cast<double>(chunk_bytes) / (1 << 20);
  std::printf(
      "  --verbose: the step's disk pass re-created over a StateFile (%s, %s), %llu chunks of "
      "%.2f MiB, %zu buffers, queue depth %u\n",
      file->direct() ? "O_DIRECT" : "page cache", file->io_uring() ? "io_uring" : "synchronous",
      static_cast<unsigned long long>(chunks), mb, disk.buffers, disk.queue_depth);
  std::printf("    pass %.3f s = read wait %.3f + update %.3f + write wait %.3f + start calls "
              "%.3f + final drain %.3f (other %.3f); %.2f GB/s of file traffic\n",
              t.total, t.read_wait, t.compute, t.write_wait, t.start, t.drain,
              t.total - t.read_wait - t.compute - t.write_wait - t.start - t.drain,
              2.0 * chunks * chunk_bytes / t.total / 1e9);
  std::printf("    per chunk (ms): read wait median %.3f max %.3f; update median %.3f max %.3f; "
              "write wait median %.3f max %.3f\n",
              Median(t.chunk_read_wait) * 1e3, Max(t.chunk_read_wait) * 1e3,
              Median(t.chunk_compute) * 1e3, Max(t.chunk_compute) * 1e3,
              Median(t.chunk_write_wait) * 1e3, Max(t.chunk_write_wait) * 1e3);
  std::printf("    per chunk, the disk alone would allow %.3f ms for %.2f MiB read + written at "
              "the pass's rate; the update alone takes %.3f ms\n",
              t.total / chunks * 1e3, 2 * mb, Median(t.chunk_compute) * 1e3);
}

int Main() {
  const uint64_t params = static_cast<uint64_t>(std::max<int64_t>(1, absl::GetFlag(FLAGS_params)));
  const uint64_t ram_params =
      static_cast<uint64_t>(std::max<int64_t>(1, absl::GetFlag(FLAGS_ram_params)));
  const int steps = std::max(1, absl::GetFlag(FLAGS_steps));
  const int warmup = std::max(0, absl::GetFlag(FLAGS_warmup));
  const int threads = absl::GetFlag(FLAGS_threads);
  DiskResidence disk;
  disk.chunk_elements = absl::GetFlag(FLAGS_chunk_elements);
  disk.buffers = absl::GetFlag(FLAGS_buffers);
  disk.queue_depth = absl::GetFlag(FLAGS_queue_depth);

  // ---- The directory ----
  std::string dir_path = absl::GetFlag(FLAGS_dir);
  bool remove_dir = false;
  if (dir_path.empty()) {
    char tmpl[] = "/var/tmp/nvme_step_bench.XXXXXX";
    if (mkdtemp(tmpl) == nullptr) {
      std::perror("mkdtemp under /var/tmp");
      return 1;
    }
    dir_path = tmpl;
    remove_dir = true;
  }
  std::unique_ptr<InstanceDirectory> dir = Check(
      "InstanceDirectory::Open",
      InstanceDirectory::Open(dir_path, InstanceDirectory::StateNaming()));
  disk.dir = dir.get();
  const auto [fs_type, fs_source] = FileSystemOf(dir_path);
  const bool in_ram = fs_type == "tmpfs" || fs_type == "ramfs";
  bool io_uring = false;
  {
    std::unique_ptr<StateFile> probe = Check(
        "StateFile::Create (probe)",
        StateFile::Create(dir.get(), StateFile::kAlignment, StateFile::kAlignment, 1, 1));
    io_uring = probe->io_uring();
  }

  ShardOptimizer::Options options;
  options.num_threads = threads;
  std::unique_ptr<ShardOptimizer> opt =
      Check("ShardOptimizer::Create", ShardOptimizer::Create(options));

  std::printf("nvme_step_bench: bf16 AdamW, %d optimizer threads (kernel path %s), %d warm-up + "
              "%d timed steps (median)\n",
              threads, std::string(KernelPathName(opt->path())).c_str(), warmup, steps);
  std::printf("  dir %s%s: %s on %s (%s); %s; %s\n", dir_path.c_str(),
              remove_dir ? " (new, removed at the end)" : "", fs_type.c_str(),
              fs_source.c_str(),
              in_ram ? "IN RAM, NOT A DISK: the figures below are memory figures" : "real disk",
              dir->direct() ? "O_DIRECT" : "no O_DIRECT (page cache)",
              io_uring ? "io_uring" : "no io_uring (synchronous pread/pwrite)");
  std::printf("  chunks of %llu elements, %zu buffers, queue depth %u\n",
              static_cast<unsigned long long>(disk.chunk_elements), disk.buffers,
              disk.queue_depth);

  MemoryLedger ledger(0);
  // The gradient of the large job; its prefix serves the small one.
  const uint64_t grad_elements =
      std::max(MakeConfig(params).layout.total_elements(),
               MakeConfig(ram_params).layout.total_elements());
  std::vector<float> grad(grad_elements, 0.0f);

  // ---- 1. and 2.: the disk-resident step and fio, in turn in every repetition ----
  double disk_step = NAN, fio_s = NAN;
  uint64_t disk_bytes = 0, chunk_bytes = 0;
  const std::string fio = absl::GetFlag(FLAGS_fio);
  const bool have_fio = OnPath(fio);
  const std::string fio_file = absl::StrCat(dir_path, "/nvme_step_bench.fio.", getpid());
  const std::string fio_json = fio_file + ".json";
  const std::string fio_err = fio_file + ".out";
  {
    Job big = MakeJob(params, &ledger, disk, opt.get(), grad.data(), "nvme-step-bench");
    disk_bytes = big.state->disk_bytes();
    const uint64_t n = Owned(big.config).size();
    const uint64_t rounded = (n + kGranule - 1) / kGranule * kGranule;
    chunk_bytes = 3 * std::min<uint64_t>(disk.chunk_elements, rounded) * sizeof(float);
    std::fill(grad.begin(), grad.end(), 0.0f);
    Fill(big.config.layout, 0.02f, 11, grad.data());
    std::vector<double> t, fio_runs;
    std::vector<FioResult> fio_results;
    std::string fio_failed = have_fio ? "" : "not on PATH";
    // fio's first run also lays its file out (untimed by fio), as the
    // warm-up step and the masters' initialisation wrote every block of the
    // state file.
    for (int s = 0; s < warmup + steps; ++s) {
      const double dt = StepSeconds(big, opt.get(), grad.data());
      if (s < warmup) continue;
      t.push_back(dt);
      if (!fio_failed.empty()) continue;
      const FioResult f = RunFio(fio, fio_file, disk_bytes, chunk_bytes, disk.buffers,
                                 dir->direct(), fio_json, fio_err);
      if (!f.ran) {
        fio_failed = f.why;
        continue;
      }
      fio_results.push_back(f);
      fio_runs.push_back(2.0 * disk_bytes / ((f.read_bytes + f.write_bytes) / f.seconds));
    }
    disk_step = Median(t);
    std::printf("1. disk-resident step, %llu elements in %u tensors: state file %.3f GB "
                "(12 bytes/element), RAM %.3f GB (gradient + bf16 copy + %.1f MiB buffers)\n",
                static_cast<unsigned long long>(n), kTensors, disk_bytes / 1e9,
                (n * 4.0 + n * 2.0 + disk.buffers * chunk_bytes) / 1e9,
                disk.buffers * chunk_bytes / 1048576.0);
    for (size_t i = 0; i < t.size(); ++i) {
      std::printf("  step %zu: %.3f s, %.3f GB/s\n", i + 1, t[i], 2.0 * disk_bytes / t[i] / 1e9);
    }
    std::printf("  step %.3f s median: %.3f GB/s of file traffic (%.3f GB read + %.3f GB "
                "written per step)\n",
                disk_step, 2.0 * disk_bytes / disk_step / 1e9, disk_bytes / 1e9,
                disk_bytes / 1e9);
    std::printf("2. fio in the same directory, after each timed step: ");
    if (!have_fio) {
      std::printf("'%s' is not on PATH: no disk baseline\n", fio.c_str());
    } else {
      std::printf("%s, file of %.3f GB, --rw=readwrite --rwmixread=50 --io_size=%.3f GB "
                  "--bs=%llu --iodepth=%zu --ioengine=io_uring --direct=%d\n",
                  fio.c_str(), disk_bytes / 1e9, 2.0 * disk_bytes / 1e9,
                  static_cast<unsigned long long>(chunk_bytes), disk.buffers,
                  dir->direct() ? 1 : 0);
      for (size_t i = 0; i < fio_results.size(); ++i) {
        const FioResult& f = fio_results[i];
        std::printf("  run %zu: read %.3f GB at %.3f GB/s, write %.3f GB at %.3f GB/s in %.3f s: "
                    "%.3f GB/s together, %.3f s for one step's bytes\n",
                    i + 1, f.read_bytes / 1e9, f.read_bw / 1e9, f.write_bytes / 1e9,
                    f.write_bw / 1e9, f.seconds,
                    (f.read_bytes + f.write_bytes) / f.seconds / 1e9, fio_runs[i]);
      }
      if (!fio_failed.empty()) {
        std::printf("  fio failed: %s\n", fio_failed.c_str());
      } else {
        fio_s = Median(fio_runs);
        std::printf("  fio %.3f s median for one step's %.3f GB: %.3f GB/s\n", fio_s,
                    2.0 * disk_bytes / 1e9, 2.0 * disk_bytes / fio_s / 1e9);
      }
    }
  }
  for (const std::string& p : {fio_file, fio_json, fio_err}) unlink(p.c_str());
  if (absl::GetFlag(FLAGS_verbose)) {
    VerbosePass(dir.get(), MakeConfig(params).layout.total_elements(), disk, opt.get(),
                grad.data());
  }

  // ---- 3. RAM against disk at --ram_params ----
  double ram_step = NAN, small_step = NAN;
  {
    Job ram = MakeJob(ram_params, &ledger, {}, opt.get(), grad.data(), "nvme-step-bench-ram");
    Job small =
        MakeJob(ram_params, &ledger, disk, opt.get(), grad.data(), "nvme-step-bench-small");
    std::fill(grad.begin(), grad.end(), 0.0f);
    Fill(ram.config.layout, 0.02f, 11, grad.data());
    std::vector<double> tr, td;
    for (int s = 0; s < warmup + steps; ++s) {
      const double a = StepSeconds(ram, opt.get(), grad.data());
      const double b = StepSeconds(small, opt.get(), grad.data());
      if (s < warmup) continue;
      tr.push_back(a);
      td.push_back(b);
    }
    ram_step = Median(tr);
    small_step = Median(td);
    std::printf("3. %llu elements, states in RAM against on disk (state file %.3f GB), steps "
                "alternating\n",
                static_cast<unsigned long long>(Owned(ram.config).size()),
                small.state->disk_bytes() / 1e9);
    std::printf("  RAM  step %.4f s median\n", ram_step);
    std::printf("  disk step %.3f s median: %.3f GB/s of file traffic, %.2fx the RAM step\n",
                small_step, 2.0 * small.state->disk_bytes() / small_step / 1e9,
                small_step / ram_step);
  }

  dir.reset();
  if (remove_dir) {
    std::error_code ec;
    std::filesystem::remove_all(dir_path, ec);
  }
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  std::printf("  peak RSS %.2f GB\n", ru.ru_maxrss / 1048576.0);

  char fio_part[128];
  if (std::isnan(fio_s)) {
    std::snprintf(fio_part, sizeof fio_part, "fio_s=n/a step_vs_disk=n/a");
  } else {
    std::snprintf(fio_part, sizeof fio_part, "fio_s=%.4f step_vs_disk=%.3f", fio_s,
                  fio_s / disk_step);
  }
  std::printf("disk_step_s=%.4f %s ram_step_s=%.4f disk_small_step_s=%.4f disk_vs_ram=%.3f\n",
              disk_step, fio_part, ram_step, small_step, ram_step / small_step);
  return 0;
}

}  // namespace
}  // namespace zeroshard

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return zeroshard::Main();
}
