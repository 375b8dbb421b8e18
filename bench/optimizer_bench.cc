// Optimizer step throughput, in one process and on the same thread count:
//   zeroshard  ShardOptimizer AdamW over fp32 p, g, m, v plus a bf16 copy;
//   torch      libtorch's torch::optim::AdamW on one tensor of the same size;
//   roofline   a copy kernel with the step's memory traffic (reads 4 fp32
//              streams, writes 3 fp32 and 1 16-bit stream), a plain
//              vectorised loop: what the memory system allows.
// The three are measured in turn in every repetition, after a warm-up, and
// each figure is the median over repetitions. The last line is the summary:
//   zeroshard_mparams_per_s=X torch_mparams_per_s=Y roofline_mparams_per_s=Z
//   speedup_vs_torch=X/Y roofline_fraction=X/Z

#include <torch/torch.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "bench/stats.h"
#include "common/host_memory.h"
#include "server/optimizer/optimizer.h"

ABSL_FLAG(int64_t, params, 50000000, "parameters in the shard");
ABSL_FLAG(int, threads, 2, "threads for every contender");
ABSL_FLAG(int, steps, 5, "timed repetitions (the median is reported)");
ABSL_FLAG(int, warmup, 1, "untimed repetitions first");

namespace zeroshard {
namespace {

using bench::Median;

double Seconds(const std::function<void()>& fn) {
  const auto start = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
      .count();
}

// Runs fn(begin, end) over `threads` contiguous parts of [0, n), in parallel.
void Split(size_t n, int threads, const std::function<void(size_t, size_t)>& fn) {
  std::vector<std::thread> workers;
  const size_t part = (n / threads + 15) / 16 * 16;
  for (int t = 1; t < threads; ++t) {
    const size_t begin = std::min(n, t * part);
    const size_t end = t + 1 == threads ? n : std::min(n, (t + 1) * part);
    workers.emplace_back([&fn, begin, end] { fn(begin, end); });
  }
  fn(0, std::min(n, part));
  for (std::thread& w : workers) w.join();
}

// The roofline kernel: p += g, m += g, v += g, copy = high half of p. The
// arithmetic is one add per stream, so the loop runs at memory speed.
void RooflineScalar(float* p, const float* g, float* m, float* v, uint16_t* copy,
                    size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) {
    const float gi = g[i];
    p[i] += gi;
    m[i] += gi;
    v[i] += gi;
    uint32_t bits;
    std::memcpy(&bits, &p[i], 4);
    copy[i] = static_cast<uint16_t>(bits >> 16);
  }
}

#if defined(__x86_64__)
template <bool kStream>
__attribute__((target("avx2"))) void RooflineAvx2(float* p, const float* g, float* m,
                                                  float* v, uint16_t* copy,
                                                  size_t begin, size_t end) {
  size_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const __m256 gi = _mm256_loadu_ps(g + i);
    const __m256 pi = _mm256_add_ps(_mm256_loadu_ps(p + i), gi);
    const __m256 mi = _mm256_add_ps(_mm256_loadu_ps(m + i), gi);
    const __m256 vi = _mm256_add_ps(_mm256_loadu_ps(v + i), gi);
    const __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(pi), 16);
    const __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(hi),
                                       _mm256_extracti128_si256(hi, 1));
    if constexpr (kStream) {
      _mm256_stream_ps(p + i, pi);
      _mm256_stream_ps(m + i, mi);
      _mm256_stream_ps(v + i, vi);
      _mm_stream_si128(reinterpret_cast<__m128i*>(copy + i), h);
    } else {
      _mm256_storeu_ps(p + i, pi);
      _mm256_storeu_ps(m + i, mi);
      _mm256_storeu_ps(v + i, vi);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(copy + i), h);
    }
  }
  if constexpr (kStream) _mm_sfence();
  RooflineScalar(p, g, m, v, copy, i, end);
}
#endif

void Roofline(bool stream, float* p, const float* g, float* m, float* v,
              uint16_t* copy, size_t begin, size_t end) {
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx2")) {
    if (stream) {
      RooflineAvx2<true>(p, g, m, v, copy, begin, end);
    } else {
      RooflineAvx2<false>(p, g, m, v, copy, begin, end);
    }
    return;
  }
#endif
  RooflineScalar(p, g, m, v, copy, begin, end);
}

int Main() {
  const size_t n = static_cast<size_t>(absl::GetFlag(FLAGS_params));
  const int threads = absl::GetFlag(FLAGS_threads);
  const int steps = std::max(1, absl::GetFlag(FLAGS_steps));
  const int warmup = std::max(0, absl::GetFlag(FLAGS_warmup));
  const double mparams = static_cast<double>(n) / 1e6;

  HostArray<float> p(n), g(n), m(n), v(n);
  HostArray<uint16_t> copy(n);
  Split(n, threads, [&](size_t begin, size_t end) {
    uint32_t x = static_cast<uint32_t>(begin) * 2654435761u + 1;
    for (size_t i = begin; i < end; ++i) {
      x = x * 1664525u + 1013904223u;
      const float u = static_cast<float>(x >> 8) * (1.0f / 16777216.0f) - 0.5f;
      p.get()[i] = u;
      g.get()[i] = u * 0.01f;
    }
  });

  ShardOptimizer::Options options;
  options.num_threads = threads;
  absl::StatusOr<std::unique_ptr<ShardOptimizer>> created = ShardOptimizer::Create(options);
  if (!created.ok()) {
    std::fprintf(stderr, "ShardOptimizer::Create: %s\n", created.status().ToString().c_str());
    return 1;
  }
  ShardOptimizer& opt = **created;
  ShardBuffers shard;
  shard.param = p.get();
  shard.grad = g.get();
  shard.exp_avg = m.get();
  shard.exp_avg_sq = v.get();
  shard.model_copy = copy.get();
  shard.model_copy_type = DType::kBf16;
  shard.size = n;
  // The same kernels writing the bf16 copy with plain stores, for comparison.
  options.streaming_stores = false;
  absl::StatusOr<std::unique_ptr<ShardOptimizer>> created_plain =
      ShardOptimizer::Create(options);
  if (!created_plain.ok()) return 1;
  ShardOptimizer& opt_plain = **created_plain;
  int64_t step = 0;
  auto zeroshard_step = [&](ShardOptimizer& o) {
    StepHyperParams hp;
    hp.kind = OptimizerKind::kAdamW;
    hp.lr = 1e-3;
    hp.weight_decay = 0.01;
    hp.step = ++step;
    const absl::Status status = o.Step(hp, shard);
    if (!status.ok()) {
      std::fprintf(stderr, "Step: %s\n", status.ToString().c_str());
      std::exit(1);
    }
  };

  torch::set_num_threads(threads);
  torch::Tensor tp = torch::from_blob(p.get(), {static_cast<int64_t>(n)}).clone();
  tp.mutable_grad() = torch::from_blob(g.get(), {static_cast<int64_t>(n)}).clone();
  torch::optim::AdamW torch_opt({tp}, torch::optim::AdamWOptions(1e-3).weight_decay(0.01));

  std::printf("optimizer step, %zu params, %d threads, kernel path %s, %d warm-up + %d "
              "timed repetitions (median)\n",
              n, threads, std::string(KernelPathName(opt.path())).c_str(), warmup, steps);
  std::vector<double> t_zs, t_zs_plain, t_torch, t_roof, t_roof_nt;
  for (int rep = 0; rep < warmup + steps; ++rep) {
    const double zs = Seconds([&] { zeroshard_step(opt); });
    const double zs_plain = Seconds([&] { zeroshard_step(opt_plain); });
    const double th = Seconds([&] { torch_opt.step(); });
    const double roof = Seconds([&] {
      Split(n, threads, [&](size_t b, size_t e) {
        Roofline(false, p.get(), g.get(), m.get(), v.get(), copy.get(), b, e);
      });
    });
    const double roof_nt = Seconds([&] {
      Split(n, threads, [&](size_t b, size_t e) {
        Roofline(true, p.get(), g.get(), m.get(), v.get(), copy.get(), b, e);
      });
    });
    if (rep < warmup) continue;
    t_zs.push_back(zs);
    t_zs_plain.push_back(zs_plain);
    t_torch.push_back(th);
    t_roof.push_back(roof);
    t_roof_nt.push_back(roof_nt);
  }

  const double bytes_per_param = 4 * 4 + 3 * 4 + 2;  // 4 fp32 in, 3 fp32 + bf16 out
  auto report = [&](const char* name, double seconds) {
    const double rate = mparams / seconds;
    std::printf("  %-44s %8.1f ms  %8.1f Mparams/s  %6.1f GB/s\n", name, seconds * 1e3,
                rate, rate * 1e6 * bytes_per_param / 1e9);
    return rate;
  };
  const double zs = report("zeroshard AdamW (+bf16 copy)", Median(t_zs));
  report("zeroshard AdamW, copy with plain stores", Median(t_zs_plain));
  const double th = report("torch::optim::AdamW", Median(t_torch));
  const double roof = report("roofline copy kernel", Median(t_roof));
  report("roofline copy kernel, streaming stores", Median(t_roof_nt));
  std::printf(
      "zeroshard_mparams_per_s=%.1f torch_mparams_per_s=%.1f roofline_mparams_per_s=%.1f "
      "speedup_vs_torch=%.2f roofline_fraction=%.3f\n",
      zs, th, roof, zs / th, zs / roof);
  return 0;
}

}  // namespace
}  // namespace zeroshard

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return zeroshard::Main();
}
