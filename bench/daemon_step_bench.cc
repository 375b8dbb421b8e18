// The whole daemon step, not just the optimizer kernel, in one process and on
// the same thread count:
//   daemon    a real Job (stage 2, one daemon owning all N_d = --ranks
//             partitions, fp32 masters, AdamW; with --precision=bf16 the
//             contributions arrive as bf16 and the job keeps a bf16 half
//             copy) is fed every rank's gradient as staged bulk pushes
//             deliver it: the daemon's range cut every --chunk_bytes, as
//             the client cuts it, one chunk per push, without CRC-32C, rank after
//             rank (in order: nothing waits in the out-of-order buffer) with
//             --hold_ms=0; with --hold_ms (the daemon's --reduction_hold_ms,
//             50 by default as there) every rank pushes from its own thread,
//             each chunk waits in place for the other ranks' and the last
//             sums all of them in one pass.
//             Then PrepareStep and CommitStep, as the leader calls them.
//             Called on the Job directly: no RPC, no network, so the figure
//             is the daemon's compute and memory traffic. The payloads are
//             built once, before any timing.
//   roofline  plain vectorised loops over buffers of the same sizes that
//             touch only the minimum bytes such a step must touch, split
//             over the same number of threads: what the memory system
//             allows.
//
// The minimum-bytes model, per parameter (w: wire bytes of a contribution,
// 2 for bf16 and 4 for fp32; h: half-copy bytes, 2 for bf16 and 0 for fp32,
// whose jobs serve the masters):
//   reduce  read the N_d contributions once                  N_d * w
//           write the fp32 reduced gradient once             4
//           (its squared norm is summed in the same pass)
//   step    read p, g, m, v (fp32)                           16
//           write p, m, v (fp32) and the half copy           12 + h
// The gradient is written out once and read back once because the step is
// two-phase: the clip coefficient needs every daemon's norm before any
// parameter may change, so the reduction cannot be fused into the update.
// With N_d = 4: 42 bytes per parameter for bf16, 48 for fp32.
//
// The roofline's reduce pass sums the contributions in rank order (the
// daemon's order; the rank loop unrolled for N_d = 2, 4, 8) into the
// gradient and its squared norm; its step pass is optimizer_bench's copy
// kernel (one add per stream). Each runs once with
// plain stores and once with streaming stores for the write-only streams
// (the gradient, the half copy); the faster is the roofline. The roofline's
// squared norm is checked against PrepareStep's, so both compute the same
// gradient.
//
// Every repetition times a daemon step, then the two rooflines; after
// --warmup untimed repetitions, each figure is the median over --steps.
// The last line is the summary (fraction <= 1: the daemon step is slower):
//   daemon_step_seconds=A roofline_seconds=B step_roofline_fraction=B/A
//   bazel run -c opt --config=clang //bench:daemon_step_bench -- --precision=fp32

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "bench/stats.h"
#include "common/dtype.h"
#include "common/host_memory.h"
#include "common/job_spec.h"
#include "common/layout.h"
#include "common/protocol.h"
#include "server/job/job.h"
#include "server/ledger/memory_ledger.h"
#include "server/optimizer/optimizer.h"

ABSL_FLAG(int64_t, params, 50000000, "parameters of the job (Ψ), all owned by the one daemon");
ABSL_FLAG(int, ranks, 4, "ranks N_d (world size), each pushing its whole gradient per step");
ABSL_FLAG(std::string, precision, "bf16",
          "the job's precision: bf16 (bf16 contributions, a bf16 half copy) or fp32");
ABSL_FLAG(uint64_t, chunk_bytes, 32ull << 20,
          "payload bytes of one pushed chunk (the client's bucket C_B)");
ABSL_FLAG(int, optimizer_threads, 2, "threads of the daemon's optimizer and of the roofline");
ABSL_FLAG(int, steps, 5, "timed repetitions (the median is reported)");
ABSL_FLAG(int, warmup, 1, "untimed repetitions first");
ABSL_FLAG(int, hold_ms, 50,
          "the daemon's --reduction_hold_ms (its default): > 0: every rank pushes from its own "
          "thread, and each chunk waits in place for the other ranks' so that the last sums "
          "them in one pass; 0: rank after rank, each summed as it comes");

namespace zeroshard {
namespace {

using bench::Median;

constexpr char kJobId[] = "bench";
constexpr uint64_t kIncarnation = 1;

void Check(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "daemon_step_bench: %s: %s\n", what, s.ToString().c_str());
    std::exit(1);
  }
}

double Seconds(const std::function<void()>& fn) {
  const auto start = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Runs fn(thread, begin, end) over `threads` contiguous parts of [0, n), in
// parallel; each part starts on a multiple of 16 elements.
void Split(size_t n, int threads, const std::function<void(int, size_t, size_t)>& fn) {
  std::vector<std::thread> workers;
  const size_t part = (n / threads + 15) / 16 * 16;
  for (int t = 1; t < threads; ++t) {
    const size_t begin = std::min(n, t * part);
    const size_t end = t + 1 == threads ? n : std::min(n, (t + 1) * part);
    workers.emplace_back([&fn, t, begin, end] { fn(t, begin, end); });
  }
  fn(0, 0, std::min(n, part));
  for (std::thread& w : workers) w.join();
}

// Pseudo-random values in [-0.5, 0.5) * scale, a different stream per seed.
float Noise(uint64_t i, uint32_t seed) {
  uint32_t x = static_cast<uint32_t>(i) * 2654435761u + seed * 40503u + 1;
  x ^= x >> 15;
  x *= 2246822519u;
  x ^= x >> 13;
  return static_cast<float>(x >> 8) * (1.0f / 16777216.0f) - 0.5f;
}

// ---- The roofline kernels ----

// The reduce pass over [begin, end): g = c[0] + c[1] + ... in rank order,
// each converted to fp32; returns the sum of g^2 (fp32 within blocks of
// ShardOptimizer::kBlockElems, blocks added in double).
template <typename Wire>
double ReduceScalar(const Wire* const* c, int ranks, float* g, size_t begin, size_t end) {
  auto load = [](const Wire* p, size_t i) {
    if constexpr (sizeof(Wire) == 2) {
      return Bf16ToFloat(p[i]);
    } else {
      return p[i];
    }
  };
  double total = 0;
  for (size_t b = begin; b < end; b += ShardOptimizer::kBlockElems) {
    const size_t e = std::min(end, b + ShardOptimizer::kBlockElems);
    float acc = 0;
    for (size_t i = b; i < e; ++i) {
      float s = load(c[0], i);
      for (int r = 1; r < ranks; ++r) s += load(c[r], i);
      g[i] = s;
      acc += s * s;
    }
    total += acc;
  }
  return total;
}

// The step pass (optimizer_bench's roofline kernel): p += g, m += g,
// v += g, copy = high half of p when there is a copy. One add per stream,
// so the loop runs at memory speed.
void StepScalar(float* p, const float* g, float* m, float* v, uint16_t* copy, size_t begin,
                size_t end) {
  for (size_t i = begin; i < end; ++i) {
    const float gi = g[i];
    p[i] += gi;
    m[i] += gi;
    v[i] += gi;
    if (copy != nullptr) copy[i] = static_cast<uint16_t>(FloatBits(p[i]) >> 16);
  }
}

#if defined(__x86_64__)
template <typename Wire>
__attribute__((target("avx2"))) inline __m256 Load8(const Wire* p, size_t i) {
  if constexpr (sizeof(Wire) == 2) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    return _mm256_loadu_ps(p + i);
  }
}

// kRanks > 0: the rank loop unrolled for that many ranks (`ranks` ignored).
template <typename Wire, bool kStream, int kRanks>
__attribute__((target("avx2,fma"))) double ReduceAvx2(const Wire* const* c, int ranks, float* g,
                                                      size_t begin, size_t end) {
  const int nr = kRanks > 0 ? kRanks : ranks;
  double total = 0;
  size_t i = begin;
  while (i + 8 <= end) {
    const size_t block_end = std::min(end, i + ShardOptimizer::kBlockElems);
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= block_end; i += 8) {
      __m256 s = Load8(c[0], i);
      for (int r = 1; r < nr; ++r) s = _mm256_add_ps(s, Load8(c[r], i));
      if constexpr (kStream) {
        _mm256_stream_ps(g + i, s);
      } else {
        _mm256_storeu_ps(g + i, s);
      }
      acc = _mm256_fmadd_ps(s, s, acc);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc);
    float block = 0;
    for (float l : lanes) block += l;
    total += block;
  }
  if constexpr (kStream) _mm_sfence();
  return total + ReduceScalar(c, nr, g, i, end);
}

template <typename Wire, bool kStream>
double ReduceAvx2Dispatch(const Wire* const* c, int ranks, float* g, size_t begin, size_t end) {
  switch (ranks) {
    case 2:
      return ReduceAvx2<Wire, kStream, 2>(c, ranks, g, begin, end);
    case 4:
      return ReduceAvx2<Wire, kStream, 4>(c, ranks, g, begin, end);
    case 8:
      return ReduceAvx2<Wire, kStream, 8>(c, ranks, g, begin, end);
    default:
      return ReduceAvx2<Wire, kStream, 0>(c, ranks, g, begin, end);
  }
}

template <bool kStream>
__attribute__((target("avx2"))) void StepAvx2(float* p, const float* g, float* m, float* v,
                                              uint16_t* copy, size_t begin, size_t end) {
  size_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const __m256 gi = _mm256_loadu_ps(g + i);
    const __m256 pi = _mm256_add_ps(_mm256_loadu_ps(p + i), gi);
    _mm256_storeu_ps(p + i, pi);
    _mm256_storeu_ps(m + i, _mm256_add_ps(_mm256_loadu_ps(m + i), gi));
    _mm256_storeu_ps(v + i, _mm256_add_ps(_mm256_loadu_ps(v + i), gi));
    if (copy != nullptr) {
      const __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(pi), 16);
      const __m128i h =
          _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
      if constexpr (kStream) {
        _mm_stream_si128(reinterpret_cast<__m128i*>(copy + i), h);
      } else {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(copy + i), h);
      }
    }
  }
  if constexpr (kStream) _mm_sfence();
  StepScalar(p, g, m, v, copy, i, end);
}

bool HasAvx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }
#endif

template <typename Wire>
double Reduce(bool stream, const Wire* const* c, int ranks, float* g, size_t begin, size_t end) {
#if defined(__x86_64__)
  if (HasAvx2()) {
    return stream ? ReduceAvx2Dispatch<Wire, true>(c, ranks, g, begin, end)
                  : ReduceAvx2Dispatch<Wire, false>(c, ranks, g, begin, end);
  }
#endif
  return ReduceScalar(c, ranks, g, begin, end);
}

void StepPass(bool stream, float* p, const float* g, float* m, float* v, uint16_t* copy,
              size_t begin, size_t end) {
#if defined(__x86_64__)
  if (HasAvx2()) {
    if (stream) {
      StepAvx2<true>(p, g, m, v, copy, begin, end);
    } else {
      StepAvx2<false>(p, g, m, v, copy, begin, end);
    }
    return;
  }
#endif
  StepScalar(p, g, m, v, copy, begin, end);
}

// ---- The job ----

JobSettings Settings(uint32_t ranks, DType precision) {
  JobSettings s;
  s.job_id = kJobId;
  s.stage = 2;
  s.world_size = ranks;
  s.precision = precision;
  s.reduction = ReductionMode::kDaemon;
  // Never dialled: the job is driven in-process.
  s.daemons = {"127.0.0.1:1"};
  return s;
}

// One push: a single staged chunk and its payload, as the bulk path applies.
struct Push {
  std::vector<GradientChunkIn> chunks;  // payloads point into the rank's gradient
};

// Rank `rank`'s pushes of its whole gradient `wire` (n elements of `dtype`
// from flat index `owned.begin`), the daemon's range cut every
// `chunk_elements` from its start, as the client cuts it for daemon
// reduction (client/bucket_plan.h, BucketCut::kDaemon).
std::vector<Push> RankPushes(const Job& job, uint32_t rank, const char* wire, DType dtype,
                             uint64_t chunk_elements) {
  const FlatRange owned = job.owned_unpadded();
  const size_t esize = DTypeSize(dtype);
  std::vector<Push> pushes;
  for (uint64_t b = owned.begin; b < owned.end; b += chunk_elements) {
    const uint64_t e = std::min(owned.end, b + chunk_elements);
    GradientChunkIn c;
    c.rank = rank;
    c.incarnation = kIncarnation;
    c.range = {b, e};
    c.dtype = DTypeToProto(dtype);
    c.staged = true;  // the payload travels beside the chunk; crc32c 0
    c.payload = absl::string_view(wire + (b - owned.begin) * esize, (e - b) * esize);
    Push push;
    push.chunks.push_back(c);
    pushes.push_back(std::move(push));
  }
  return pushes;
}

// Stores fp32 parameters Noise(i, 7) for every owned element.
void InitMasters(Job& job, uint64_t chunk_elements) {
  const FlatRange owned = job.owned_unpadded();
  for (uint64_t b = owned.begin; b < owned.end; b += chunk_elements) {
    const uint64_t e = std::min(owned.end, b + chunk_elements);
    std::vector<ParameterChunkIn> chunks(1);
    ParameterChunkIn& c = chunks[0];
    c.range = {b, e};
    c.dtype = DTypeToProto(DType::kFp32);
    std::string data;
    data.resize((e - b) * sizeof(float));
    for (uint64_t i = b; i < e; ++i) {
      const float p = Noise(i, 7);
      std::memcpy(&data[(i - b) * sizeof(float)], &p, sizeof(float));
    }
    c.data = data;
    uint64_t elements = 0;
    Check(job.InitParameters(chunks, &elements), "InitParameters");
  }
}

int Main() {
  const uint64_t params = static_cast<uint64_t>(absl::GetFlag(FLAGS_params));
  const uint32_t ranks = static_cast<uint32_t>(std::max(1, absl::GetFlag(FLAGS_ranks)));
  const int threads = std::max(1, absl::GetFlag(FLAGS_optimizer_threads));
  const int steps = std::max(1, absl::GetFlag(FLAGS_steps));
  const int warmup = std::max(0, absl::GetFlag(FLAGS_warmup));
  const std::string precision_flag = absl::GetFlag(FLAGS_precision);
  DType precision;
  if (precision_flag == "bf16") {
    precision = DType::kBf16;
  } else if (precision_flag == "fp32") {
    precision = DType::kFp32;
  } else {
    Check(absl::InvalidArgumentError("--precision: bf16 or fp32, got " + precision_flag), "flags");
    return 1;
  }
  const bool half = precision != DType::kFp32;
  const size_t wire_bytes = DTypeSize(precision);
  const uint64_t chunk_bytes = absl::GetFlag(FLAGS_chunk_bytes);
  if (chunk_bytes < wire_bytes || chunk_bytes > kMaxChunkBytes) {
    Check(absl::InvalidArgumentError("--chunk_bytes: must be in [one element, kMaxChunkBytes]"),
          "flags");
  }
  const uint64_t chunk_elements = chunk_bytes / wire_bytes;

  // The daemon's side: the ledger, the optimizer and one job.
  MemoryLedger ledger(0);
  ShardOptimizer::Options optimizer_options;
  optimizer_options.num_threads = threads;
  absl::StatusOr<std::unique_ptr<ShardOptimizer>> optimizer =
      ShardOptimizer::Create(optimizer_options);
  Check(optimizer.status(), "ShardOptimizer::Create");
  JobResources resources;
  resources.ledger = &ledger;
  resources.optimizer = optimizer->get();
  const int hold_ms = absl::GetFlag(FLAGS_hold_ms);
  resources.reduction_hold = absl::Milliseconds(hold_ms);
  absl::StatusOr<Layout> layout =
      Layout::Create({{"w", {static_cast<int64_t>(params)}, precision, 0}});
  Check(layout.status(), "Layout::Create");
  const v1::JobSpec spec = ToJobSpec(Settings(ranks, precision), *layout);
  absl::StatusOr<JobConfig> config = ParseJobSpec(spec);
  Check(config.status(), "ParseJobSpec");
  absl::StatusOr<std::unique_ptr<Job>> created =
      Job::Create(*std::move(config), spec, /*daemon_index=*/0, resources);
  Check(created.status(), "Job::Create");
  Job& job = **created;
  for (uint32_t r = 0; r < ranks; ++r) {
    JoinRequest join;
    join.rank = r;
    join.incarnation = kIncarnation;
    join.layout_fingerprint = layout->fingerprint();
    join.stage = spec.stage();
    join.world_size = ranks;
    join.precision = spec.precision();
    Check(job.Join(join).status(), "Join");
  }
  InitMasters(job, 8 << 20);
  const size_t n = job.owned_unpadded().size();

  // Every rank's gradient in the wire type, built once; the pushes point
  // into it (constant buffers, as a trainer's persistent bucket).
  std::vector<HostArray<char>> wire;
  std::vector<const char*> wire_ptrs;
  std::vector<const uint16_t*> bf16_ptrs;
  std::vector<const float*> fp32_ptrs;
  for (uint32_t r = 0; r < ranks; ++r) {
    wire.emplace_back(n * wire_bytes);
    char* w = wire.back().get();
    Split(n, threads, [&](int, size_t begin, size_t end) {
      for (size_t i = begin; i < end; ++i) {
        const float g = 0.01f * (r + 1) * Noise(i, 100 + r);
        if (half) {
          const uint16_t h = FloatToBf16(g);
          std::memcpy(w + i * 2, &h, 2);
        } else {
          std::memcpy(w + i * 4, &g, 4);
        }
      }
    });
    wire_ptrs.push_back(w);
    bf16_ptrs.push_back(reinterpret_cast<const uint16_t*>(w));
    fp32_ptrs.push_back(reinterpret_cast<const float*>(w));
  }
  std::vector<std::vector<Push>> rank_pushes;
  size_t push_count = 0;
  for (uint32_t r = 0; r < ranks; ++r) {
    rank_pushes.push_back(RankPushes(job, r, wire_ptrs[r], precision, chunk_elements));
    push_count += rank_pushes.back().size();
  }

  // The roofline's buffers, the job's sizes.
  HostArray<float> rp(n), rg(n), rm(n), rv(n);
  HostArray<uint16_t> rcopy(half ? n : 1);
  double roofline_sq_sum = 0;
  std::vector<double> part_sums(threads);
  auto roofline_reduce = [&](bool stream) {
    Split(n, threads, [&](int t, size_t begin, size_t end) {
      part_sums[t] =
          half ? Reduce(stream, bf16_ptrs.data(), static_cast<int>(ranks), rg.get(), begin, end)
               : Reduce(stream, fp32_ptrs.data(), static_cast<int>(ranks), rg.get(), begin, end);
    });
    roofline_sq_sum = 0;
    for (double s : part_sums) roofline_sq_sum += s;
  };
  auto roofline_step = [&](bool stream) {
    Split(n, threads, [&](int, size_t begin, size_t end) {
      StepPass(stream, rp.get(), rg.get(), rm.get(), rv.get(), half ? rcopy.get() : nullptr, begin,
               end);
    });
  };

  std::printf(
      "daemon step, %zu params, %u ranks, %s contributions%s, %d optimizer threads, kernel path "
      "%s, chunks of %llu bytes (%zu pushes a step), %d warm-up + %d timed repetitions "
      "(median)\n",
      n, ranks, precision_flag.c_str(), half ? " and half copy" : ", no half copy", threads,
      std::string(KernelPathName((*optimizer)->path())).c_str(),
      static_cast<unsigned long long>(chunk_elements * wire_bytes), push_count, warmup, steps);
  if (hold_ms > 0) {
    std::printf(
        "pushes held up to %d ms for their range's other contributions, one thread per "
        "rank\n",
        hold_ms);
  }

  std::vector<double> t_reduce, t_prepare, t_commit, t_step;
  std::vector<double> t_roof_reduce[2], t_roof_step[2], t_roof[2];
  double daemon_sq_sum = 0;
  for (int rep = 0; rep < warmup + steps; ++rep) {
    const uint64_t step = job.committed_step() + 1;
    for (auto& rank : rank_pushes) {
      for (Push& p : rank) p.chunks[0].step = step;
    }
    const absl::Time deadline = absl::Now() + absl::Minutes(5);
    PushResult pushed;
    auto push_rank = [&](uint32_t r, PushResult* response) {
      for (const Push& p : rank_pushes[r]) {
        absl::StatusOr<PushResult> result = job.PushGradient(p.chunks, deadline);
        Check(result.status(), "PushGradient");
        *response = *result;
      }
    };
    const double reduce = Seconds([&] {
      if (hold_ms == 0) {
        // Rank after rank, in order: nothing waits.
        for (uint32_t r = 0; r < ranks; ++r) push_rank(r, &pushed);
        return;
      }
      std::vector<PushResult> responses(ranks);
      std::vector<std::thread> threads;
      for (uint32_t r = 0; r < ranks; ++r) threads.emplace_back(push_rank, r, &responses[r]);
      for (std::thread& t : threads) t.join();
      for (const PushResult& r : responses) {
        pushed.ranks_complete = std::max(pushed.ranks_complete, r.ranks_complete);
      }
    });
    if (pushed.ranks_complete != ranks) {
      Check(absl::InternalError("the gradient is incomplete after every rank's pushes"), "push");
    }
    absl::StatusOr<PrepareResult> prepared;
    const double prepare = Seconds([&] { prepared = job.PrepareStep(step); });
    Check(prepared.status(), "PrepareStep");
    daemon_sq_sum = prepared->grad_sq_sum;
    CommitRequest commit;
    commit.step = step;
    commit.lr = 1e-3f;
    commit.clip_coef = 1.0f;
    commit.rank = 0;
    commit.incarnation = kIncarnation;
    absl::StatusOr<CommitResult> committed;
    const double commit_s = Seconds([&] { committed = job.CommitStep(commit); });
    Check(committed.status(), "CommitStep");

    double roof_reduce[2], roof_step[2];
    for (int stream = 0; stream < 2; ++stream) {
      roof_reduce[stream] = Seconds([&] { roofline_reduce(stream != 0); });
      roof_step[stream] = Seconds([&] { roofline_step(stream != 0); });
    }
    if (rep < warmup) continue;
    t_reduce.push_back(reduce);
    t_prepare.push_back(prepare);
    t_commit.push_back(commit_s);
    t_step.push_back(reduce + prepare + commit_s);
    for (int stream = 0; stream < 2; ++stream) {
      t_roof_reduce[stream].push_back(roof_reduce[stream]);
      t_roof_step[stream].push_back(roof_step[stream]);
      t_roof[stream].push_back(roof_reduce[stream] + roof_step[stream]);
    }
  }

  // PrepareStep sums (g / N_d)^2; the roofline sums g^2 of the same g.
  const double expected_sq_sum = roofline_sq_sum / (static_cast<double>(ranks) * ranks);
  if (!(std::fabs(daemon_sq_sum - expected_sq_sum) <= 1e-4 * expected_sq_sum)) {
    std::fprintf(stderr,
                 "daemon_step_bench: the roofline's gradient differs from the daemon's: squared "
                 "norm %.9g, PrepareStep's %.9g\n",
                 expected_sq_sum, daemon_sq_sum);
    return 1;
  }

  const double reduce_bytes = static_cast<double>(n) * (ranks * wire_bytes + 4);
  const double step_bytes = static_cast<double>(n) * (16 + 12 + (half ? 2 : 0));
  const double total_bytes = reduce_bytes + step_bytes;
  std::printf(
      "minimum bytes a step: %.0f per param, %.3f GB (reduce %.3f GB: %u x %zu-byte "
      "contributions read, fp32 gradient written; step %.3f GB: p, g, m, v read, p, m, "
      "v%s written)\n",
      total_bytes / n, total_bytes / 1e9, reduce_bytes / 1e9, ranks, wire_bytes, step_bytes / 1e9,
      half ? ", half copy" : "");
  auto report = [&](const char* name, double seconds, double bytes) {
    if (bytes > 0) {
      std::printf("  %-46s %8.1f ms  %6.1f GB/s\n", name, seconds * 1e3, bytes / seconds / 1e9);
    } else {
      std::printf("  %-46s %8.1f ms  (no minimum bytes of its own)\n", name, seconds * 1e3);
    }
  };
  const double step_s = Median(t_step);
  report("daemon reduce (every rank's pushes)", Median(t_reduce), reduce_bytes);
  report("daemon PrepareStep (norm)", Median(t_prepare), 0);
  report(half ? "daemon CommitStep (AdamW + half copy)" : "daemon CommitStep (AdamW)",
         Median(t_commit), step_bytes);
  report("daemon step", step_s, total_bytes);
  const char* kind[2] = {"plain stores", "streaming stores"};
  double roof_s[2];
  for (int stream = 0; stream < 2; ++stream) {
    roof_s[stream] = Median(t_roof[stream]);
    std::string name = std::string("roofline reduce pass, ") + kind[stream];
    report(name.c_str(), Median(t_roof_reduce[stream]), reduce_bytes);
    name = std::string("roofline step pass, ") + kind[stream];
    report(name.c_str(), Median(t_roof_step[stream]), step_bytes);
    name = std::string("roofline, ") + kind[stream];
    report(name.c_str(), roof_s[stream], total_bytes);
  }
  const double roofline_s = std::min(roof_s[0], roof_s[1]);
  std::printf("squared gradient norm: PrepareStep %.9g, roofline %.9g\n", daemon_sq_sum,
              expected_sq_sum);
  std::printf("daemon_step_seconds=%.4f roofline_seconds=%.4f step_roofline_fraction=%.3f\n",
              step_s, roofline_s, roofline_s / step_s);
  return 0;
}

}  // namespace
}  // namespace zeroshard

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return zeroshard::Main();
}
