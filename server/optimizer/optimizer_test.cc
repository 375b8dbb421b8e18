#include "server/optimizer/optimizer.h"

#include <dirent.h>
#include <sched.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/ledger/system_resources.h"

namespace zeroshard {

// Readable test parameters.
void PrintTo(KernelPath path, std::ostream* os) { *os << KernelPathName(path); }
void PrintTo(OptimizerKind kind, std::ostream* os) { *os << OptimizerKindName(kind); }

namespace {

using ::testing::HasSubstr;

constexpr size_t kBlock = ShardOptimizer::kBlockElems;

// A 64-byte aligned array whose data starts `offset` elements past the
// aligned base, to exercise both the streaming and the unaligned stores.
template <typename T>
class Buffer {
 public:
  Buffer(size_t n, size_t offset) : n_(n) {
    const size_t bytes = ((n + offset) * sizeof(T) + 63) / 64 * 64 + 64;
    base_.reset(static_cast<T*>(std::aligned_alloc(64, bytes)));
    std::memset(base_.get(), 0, bytes);
    data_ = base_.get() + offset;
  }
  T* data() { return data_; }
  const T* data() const { return data_; }
  size_t size() const { return n_; }
  T& operator[](size_t i) { return data_[i]; }
  const T& operator[](size_t i) const { return data_[i]; }

 private:
  struct Free {
    void operator()(T* p) const { std::free(p); }
  };
  size_t n_;
  std::unique_ptr<T, Free> base_;
  T* data_;
};

ShardOptimizer::Options MakeOptions(KernelPath path, int threads) {
  ShardOptimizer::Options options;
  options.num_threads = threads;
  options.path = path;
  return options;
}

std::unique_ptr<ShardOptimizer> MakeOptimizer(KernelPath path, int threads) {
  absl::StatusOr<std::unique_ptr<ShardOptimizer>> opt =
      ShardOptimizer::Create(MakeOptions(path, threads));
  EXPECT_TRUE(opt.ok()) << opt.status();
  return opt.ok() ? std::move(*opt) : nullptr;
}

void FillNormal(float* x, size_t n, uint32_t seed, float scale, bool abs) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  for (size_t i = 0; i < n; ++i) {
    const float v = dist(rng);
    x[i] = abs ? std::fabs(v) : v;
  }
}

// One shard with its state, initialised identically for a given seed.
struct Shard {
  Shard(size_t n, size_t offset, DType copy_type, bool with_copy, uint32_t seed)
      : param(n, offset),
        grad(n, offset),
        exp_avg(n, offset),
        exp_avg_sq(n, offset),
        copy(n * 2, offset * 2),
        copy_type(copy_type),
        with_copy(with_copy) {
    FillNormal(param.data(), n, seed, 1.0f, false);
    FillNormal(exp_avg.data(), n, seed + 1, 0.01f, false);
    FillNormal(exp_avg_sq.data(), n, seed + 2, 1e-4f, true);
  }
  ShardBuffers buffers() {
    ShardBuffers b;
    b.param = param.data();
    b.grad = grad.data();
    b.exp_avg = exp_avg.data();
    b.exp_avg_sq = exp_avg_sq.data();
    b.model_copy = with_copy ? static_cast<void*>(copy.data()) : nullptr;
    b.model_copy_type = copy_type;
    b.size = param.size();
    return b;
  }
  size_t size() const { return param.size(); }

  Buffer<float> param, grad, exp_avg, exp_avg_sq;
  Buffer<uint16_t> copy;  // big enough for an fp32 copy too
  DType copy_type;
  bool with_copy;
};

StepHyperParams ParamsFor(OptimizerKind kind, int64_t step) {
  StepHyperParams hp;
  hp.kind = kind;
  hp.step = step;
  switch (kind) {
    case OptimizerKind::kAdamW:
      hp.lr = 1e-2;
      hp.weight_decay = 0.1;
      hp.grad_scale = 0.37;
      break;
    case OptimizerKind::kAdam:
      hp.lr = 3e-3;
      hp.beta1 = 0.8;
      hp.beta2 = 0.99;
      hp.eps = 1e-6;
      hp.weight_decay = 0.05;
      hp.grad_scale = 1.0 / 1024;
      break;
    case OptimizerKind::kSgdMomentum:
      hp.lr = 0.1;
      hp.momentum = 0.9;
      hp.dampening = 0.1;
      hp.weight_decay = 1e-3;
      hp.grad_scale = 0.5;
      break;
  }
  return hp;
}

// Runs `steps` steps with fresh random gradients on `shard`.
void RunSteps(ShardOptimizer& opt, OptimizerKind kind, Shard& shard, int steps,
              uint32_t seed) {
  for (int s = 1; s <= steps; ++s) {
    FillNormal(shard.grad.data(), shard.size(), seed * 1000 + s, 1.0f, false);
    ASSERT_TRUE(opt.Step(ParamsFor(kind, s), shard.buffers()).ok());
  }
}

template <typename T>
void ExpectBitsEqual(const T* a, const T* b, size_t n, const std::string& what) {
  size_t mismatches = 0, first = 0;
  for (size_t i = 0; i < n; ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0 && mismatches++ == 0) first = i;
  }
  EXPECT_EQ(mismatches, 0u) << what << ": first at " << first;
}

void ExpectShardsEqual(const Shard& a, const Shard& b, OptimizerKind kind) {
  const size_t n = a.size();
  ExpectBitsEqual(a.param.data(), b.param.data(), n, "param");
  ExpectBitsEqual(a.exp_avg.data(), b.exp_avg.data(), n, "exp_avg");
  if (kind != OptimizerKind::kSgdMomentum) {
    ExpectBitsEqual(a.exp_avg_sq.data(), b.exp_avg_sq.data(), n, "exp_avg_sq");
  }
  if (a.with_copy) {
    ExpectBitsEqual(a.copy.data(), b.copy.data(), n * DTypeSize(a.copy_type) / 2,
                    "model_copy");
  }
}

// The model copy holds exactly FloatToBf16 / FloatToHalf / the fp32 value of
// the new parameters.
void ExpectCopyMatchesParam(const Shard& s) {
  if (!s.with_copy) return;
  size_t mismatches = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    const float p = s.param[i];
    switch (s.copy_type) {
      case DType::kBf16:
        mismatches += s.copy[i] != FloatToBf16(p);
        break;
      case DType::kFp16:
        mismatches += s.copy[i] != FloatToHalf(p);
        break;
      case DType::kFp32: {
        const float* c = reinterpret_cast<const float*>(s.copy.data());
        mismatches += std::memcmp(&c[i], &p, 4) != 0;
        break;
      }
    }
  }
  EXPECT_EQ(mismatches, 0u) << DTypeName(s.copy_type);
}

std::vector<KernelPath> VectorPaths() {
  return {KernelPath::kAvx2, KernelPath::kAvx512};
}

// ---------------------------------------------------------------------------
// Every vector path gives the scalar path's bits.

using PathParam = std::tuple<KernelPath, OptimizerKind, int /*copy*/, bool /*aligned*/>;

class PathAgreementTest : public ::testing::TestWithParam<PathParam> {};

TEST_P(PathAgreementTest, MatchesScalarBitForBit) {
  const auto [path, kind, copy, aligned] = GetParam();
  if (!KernelPathSupported(path)) {
    GTEST_SKIP() << KernelPathName(path) << " not supported by this CPU";
  }
  const bool with_copy = copy != 0;
  const DType copy_type = with_copy ? static_cast<DType>(copy) : DType::kBf16;
  auto scalar = MakeOptimizer(KernelPath::kScalar, 1);
  auto vector = MakeOptimizer(path, 2);
  ASSERT_NE(scalar, nullptr);
  ASSERT_NE(vector, nullptr);
  // Lengths that are not multiples of any vector width, one spanning blocks.
  for (size_t n : {size_t{1}, size_t{7}, size_t{13}, size_t{16 * 5 + 9},
                   size_t{2 * kBlock + 1001}}) {
    SCOPED_TRACE(absl::StrCat("n=", n));
    const size_t offset = aligned ? 0 : 3;
    Shard a(n, offset, copy_type, with_copy, 11);
    Shard b(n, offset, copy_type, with_copy, 11);
    RunSteps(*scalar, kind, a, 3, 5);
    RunSteps(*vector, kind, b, 3, 5);
    ExpectShardsEqual(a, b, kind);
    ExpectCopyMatchesParam(b);
  }
}

std::string PathParamName(const ::testing::TestParamInfo<PathParam>& info) {
  const auto [path, kind, copy, aligned] = info.param;
  const char* copy_name[] = {"nocopy", "fp32", "bf16", "fp16"};
  return absl::StrCat(KernelPathName(path), "_", OptimizerKindName(kind), "_",
                      copy_name[copy], aligned ? "_aligned" : "_unaligned");
}

INSTANTIATE_TEST_SUITE_P(
    AllPaths, PathAgreementTest,
    ::testing::Combine(::testing::ValuesIn(VectorPaths()),
                       ::testing::Values(OptimizerKind::kAdamW, OptimizerKind::kAdam,
                                         OptimizerKind::kSgdMomentum),
                       ::testing::Values(0, 1, 2, 3), ::testing::Bool()),
    PathParamName);

// Large aligned shards write the model copy with streaming stores; the bits
// are the same as with plain stores and on the scalar path.
TEST(StreamingStoresTest, SameBitsAsPlainStores) {
  const size_t n = ShardOptimizer::kStreamMinElems + 37;
  for (KernelPath path : VectorPaths()) {
    if (!KernelPathSupported(path)) continue;
    for (DType copy : {DType::kBf16, DType::kFp16, DType::kFp32}) {
      SCOPED_TRACE(absl::StrCat(KernelPathName(path), " ", DTypeName(copy)));
      ShardOptimizer::Options plain_options = MakeOptions(path, 2);
      plain_options.streaming_stores = false;
      auto streaming = MakeOptimizer(path, 2);
      auto plain = ShardOptimizer::Create(plain_options);
      auto scalar = MakeOptimizer(KernelPath::kScalar, 2);
      ASSERT_TRUE(plain.ok());
      Shard a(n, 0, copy, true, 31), b(n, 0, copy, true, 31), c(n, 0, copy, true, 31);
      RunSteps(*streaming, OptimizerKind::kAdamW, a, 1, 2);
      RunSteps(**plain, OptimizerKind::kAdamW, b, 1, 2);
      RunSteps(*scalar, OptimizerKind::kAdamW, c, 1, 2);
      ExpectShardsEqual(a, b, OptimizerKind::kAdamW);
      ExpectShardsEqual(a, c, OptimizerKind::kAdamW);
      ExpectCopyMatchesParam(a);
    }
  }
}

// ---------------------------------------------------------------------------
// The scalar path implements the documented formulas.

TEST(ScalarReferenceTest, AdamWFollowsTorchOrderOfOperations) {
  auto opt = MakeOptimizer(KernelPath::kScalar, 1);
  const size_t n = 100;
  Shard s(n, 0, DType::kBf16, false, 3);
  FillNormal(s.grad.data(), n, 4, 1.0f, false);
  std::vector<float> p(s.param.data(), s.param.data() + n);
  std::vector<float> m(s.exp_avg.data(), s.exp_avg.data() + n);
  std::vector<float> v(s.exp_avg_sq.data(), s.exp_avg_sq.data() + n);
  StepHyperParams hp = ParamsFor(OptimizerKind::kAdamW, 7);
  ASSERT_TRUE(opt->Step(hp, s.buffers()).ok());

  const double bc1 = 1 - std::pow(hp.beta1, 7.0), bc2 = 1 - std::pow(hp.beta2, 7.0);
  const float decay = static_cast<float>(1 - hp.lr * hp.weight_decay);
  const float step_size = static_cast<float>(-(hp.lr / bc1));
  const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  for (size_t i = 0; i < n; ++i) {
    const float g = s.grad[i] * static_cast<float>(hp.grad_scale);
    const float pi = p[i] * decay;
    const float mi = std::fma(g, static_cast<float>(1 - hp.beta1),
                              m[i] * static_cast<float>(hp.beta1));
    const float vi = std::fma(static_cast<float>(1 - hp.beta2) * g, g,
                              v[i] * static_cast<float>(hp.beta2));
    const float denom = std::sqrt(vi) / bc2_sqrt + static_cast<float>(hp.eps);
    const float expected = pi + (step_size * mi) / denom;
    ASSERT_EQ(s.exp_avg[i], mi) << i;
    ASSERT_EQ(s.exp_avg_sq[i], vi) << i;
    ASSERT_EQ(s.param[i], expected) << i;
  }
}

TEST(ScalarReferenceTest, SgdFirstStepSetsMomentumToGradient) {
  auto opt = MakeOptimizer(KernelPath::kScalar, 1);
  const size_t n = 33;
  Shard s(n, 0, DType::kBf16, false, 3);
  FillNormal(s.grad.data(), n, 4, 1.0f, false);
  std::vector<float> p(s.param.data(), s.param.data() + n);
  StepHyperParams hp = ParamsFor(OptimizerKind::kSgdMomentum, 1);
  ShardBuffers b = s.buffers();
  b.exp_avg_sq = nullptr;  // not used by SGD
  ASSERT_TRUE(opt->Step(hp, b).ok());
  for (size_t i = 0; i < n; ++i) {
    const float g = std::fma(p[i], static_cast<float>(hp.weight_decay),
                             s.grad[i] * static_cast<float>(hp.grad_scale));
    ASSERT_EQ(s.exp_avg[i], g) << i;
    ASSERT_EQ(s.param[i], std::fma(g, static_cast<float>(-hp.lr), p[i])) << i;
  }
}

TEST(ScalarReferenceTest, SgdWithoutMomentumTouchesNoBuffer) {
  auto opt = MakeOptimizer(BestKernelPath(), 1);
  const size_t n = 50;
  Shard s(n, 0, DType::kBf16, false, 3);
  FillNormal(s.grad.data(), n, 4, 1.0f, false);
  std::vector<float> p(s.param.data(), s.param.data() + n);
  StepHyperParams hp;
  hp.kind = OptimizerKind::kSgdMomentum;
  hp.lr = 0.5;
  ShardBuffers b = s.buffers();
  b.exp_avg = nullptr;
  b.exp_avg_sq = nullptr;
  ASSERT_TRUE(opt->Step(hp, b).ok());
  for (size_t i = 0; i < n; ++i) {
    ASSERT_EQ(s.param[i], std::fma(s.grad[i], -0.5f, p[i])) << i;
  }
}

// ---------------------------------------------------------------------------
// Threads.

TEST(ThreadingTest, MultiThreadedStepEqualsSingleThreaded) {
  const KernelPath path = BestKernelPath();
  auto one = MakeOptimizer(path, 1);
  auto three = MakeOptimizer(path, 3);
  const size_t n = 5 * kBlock + 77;
  for (OptimizerKind kind :
       {OptimizerKind::kAdamW, OptimizerKind::kAdam, OptimizerKind::kSgdMomentum}) {
    SCOPED_TRACE(OptimizerKindName(kind));
    Shard a(n, 0, DType::kBf16, true, 21);
    Shard b(n, 0, DType::kBf16, true, 21);
    RunSteps(*one, kind, a, 2, 8);
    RunSteps(*three, kind, b, 2, 8);
    ExpectShardsEqual(a, b, kind);
  }
}

TEST(ThreadingTest, ConcurrentCallersAreSerialised) {
  auto opt = MakeOptimizer(BestKernelPath(), 2);
  const size_t n = 3 * kBlock + 5;
  Shard a(n, 0, DType::kFp16, true, 1), b(n, 0, DType::kFp16, true, 2);
  Shard a_ref(n, 0, DType::kFp16, true, 1), b_ref(n, 0, DType::kFp16, true, 2);
  FillNormal(a.grad.data(), n, 9, 1, false);
  FillNormal(b.grad.data(), n, 10, 1, false);
  FillNormal(a_ref.grad.data(), n, 9, 1, false);
  FillNormal(b_ref.grad.data(), n, 10, 1, false);
  const StepHyperParams hp = ParamsFor(OptimizerKind::kAdamW, 1);
  std::thread t([&] { ASSERT_TRUE(opt->Step(hp, a.buffers()).ok()); });
  ASSERT_TRUE(opt->Step(hp, b.buffers()).ok());
  t.join();
  auto ref = MakeOptimizer(KernelPath::kScalar, 1);
  ASSERT_TRUE(ref->Step(hp, a_ref.buffers()).ok());
  ASSERT_TRUE(ref->Step(hp, b_ref.buffers()).ok());
  ExpectShardsEqual(a, a_ref, OptimizerKind::kAdamW);
  ExpectShardsEqual(b, b_ref, OptimizerKind::kAdamW);
}

// The threads of this process whose affinity is exactly `cpu`
// (/proc/self/task/*/status, Cpus_allowed_list).
int ThreadsPinnedTo(int cpu) {
  int count = 0;
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return -1;
  while (dirent* e = readdir(dir)) {
    if (e->d_name[0] == '.') continue;
    std::FILE* f = std::fopen(absl::StrCat("/proc/self/task/", e->d_name, "/status").c_str(), "r");
    if (f == nullptr) continue;
    char line[512];
    while (std::fgets(line, sizeof(line), f) != nullptr) {
      if (std::strncmp(line, "Cpus_allowed_list:", 18) == 0) {
        if (absl::StripAsciiWhitespace(line + 18) == absl::StrCat(cpu)) ++count;
        break;
      }
    }
    std::fclose(f);
  }
  closedir(dir);
  return count;
}

// Pinned: one worker per listed CPU, pinned there, the caller only waiting;
// the same bits as unpinned threads.
TEST(ThreadingTest, PinnedWorkersRunOnTheirCpusWithTheSameBits) {
  std::vector<int> cpus = AffinityCpuList();
  cpus.resize(std::min<size_t>(cpus.size(), 2));
  if (cpus.size() < 2) {
    GTEST_SKIP() << "this process may run on one CPU only: every thread is pinned to it";
  }
  const int before = ThreadsPinnedTo(cpus[0]);
  ShardOptimizer::Options o = MakeOptions(BestKernelPath(), static_cast<int>(cpus.size()));
  o.cpus = cpus;
  absl::StatusOr<std::unique_ptr<ShardOptimizer>> pinned = ShardOptimizer::Create(o);
  ASSERT_TRUE(pinned.ok()) << pinned.status();
  EXPECT_EQ((*pinned)->num_threads(), static_cast<int>(cpus.size()));
  EXPECT_EQ(ThreadsPinnedTo(cpus[0]), before + 1);
  auto unpinned = MakeOptimizer(BestKernelPath(), 3);
  const size_t n = 7 * kBlock + 13;
  for (OptimizerKind kind : {OptimizerKind::kAdamW, OptimizerKind::kSgdMomentum}) {
    SCOPED_TRACE(OptimizerKindName(kind));
    Shard a(n, 0, DType::kBf16, true, 5);
    Shard b(n, 0, DType::kBf16, true, 5);
    RunSteps(**pinned, kind, a, 2, 8);
    RunSteps(*unpinned, kind, b, 2, 8);
    ExpectShardsEqual(a, b, kind);
  }
  std::vector<float> g(n);
  FillNormal(g.data(), n, 3, 1.0f, false);
  const GradStats x = (*pinned)->SumSquaresAndFinite(g.data(), n, 0.5f);
  const GradStats y = unpinned->SumSquaresAndFinite(g.data(), n, 0.5f);
  EXPECT_EQ(std::memcmp(&x.sum_sq, &y.sum_sq, sizeof(double)), 0);
  pinned->reset();
  EXPECT_EQ(ThreadsPinnedTo(cpus[0]), before);
}

TEST(CreateTest, RejectsCpusThatDoNotFitTheThreadsOrTheMask) {
  ShardOptimizer::Options o = MakeOptions(KernelPath::kAuto, 2);
  o.cpus = {0};
  absl::StatusOr<std::unique_ptr<ShardOptimizer>> got = ShardOptimizer::Create(o);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << got.status();
  EXPECT_THAT(std::string(got.status().message()), ::testing::HasSubstr("one CPU per thread"));
  o = MakeOptions(KernelPath::kAuto, 1);
  o.cpus = {CPU_SETSIZE};
  EXPECT_EQ(ShardOptimizer::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  const std::vector<int> allowed = AffinityCpuList();
  for (int c = CPU_SETSIZE - 1; c >= 0; --c) {
    if (std::binary_search(allowed.begin(), allowed.end(), c)) continue;
    o.cpus = {c};  // not this process's to take
    got = ShardOptimizer::Create(o);
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << got.status();
    EXPECT_THAT(std::string(got.status().message()), ::testing::HasSubstr("pinning"));
    break;
  }
}

// ---------------------------------------------------------------------------
// Gradient norm.

TEST(SumSquaresTest, IndependentOfThreadsAndPath) {
  const size_t n = 6 * kBlock + 123;
  std::vector<float> g(n);
  FillNormal(g.data(), n, 77, 3.0f, false);
  auto ref = MakeOptimizer(KernelPath::kScalar, 1);
  const GradStats expected = ref->SumSquaresAndFinite(g.data(), n, 0.25f);
  EXPECT_FALSE(expected.found_inf_nan);
  long double exact = 0;
  for (float x : g) exact += static_cast<long double>(x * 0.25f) * (x * 0.25f);
  EXPECT_NEAR(expected.sum_sq, static_cast<double>(exact), 1e-12 * exact);

  for (KernelPath path : {KernelPath::kScalar, KernelPath::kAvx2, KernelPath::kAvx512}) {
    if (!KernelPathSupported(path)) continue;
    for (int threads : {1, 2, 4}) {
      auto opt = MakeOptimizer(path, threads);
      const GradStats got = opt->SumSquaresAndFinite(g.data(), n, 0.25f);
      EXPECT_EQ(std::memcmp(&got.sum_sq, &expected.sum_sq, sizeof(double)), 0)
          << KernelPathName(path) << " threads=" << threads << ": "
          << got.sum_sq << " vs " << expected.sum_sq;
      EXPECT_FALSE(got.found_inf_nan);
    }
  }
}

// Sources of one type take the fused loop (in groups of 8): still the bits
// of one Accumulate (or ConvertIn) per contribution, in order.
TEST(SumSquaresTest, SumContributionsOfOneTypeEqualsOneCallPerContribution) {
  const size_t n = 2 * kBlock + 45;
  std::vector<float> base(n);
  FillNormal(base.data(), n, 21, 1.0f, false);
  constexpr size_t kMax = 11;
  std::vector<std::vector<float>> src32(kMax, std::vector<float>(n));
  std::vector<std::vector<uint16_t>> src16(kMax, std::vector<uint16_t>(n));
  for (size_t k = 0; k < kMax; ++k) {
    FillNormal(src32[k].data(), n, 30 + static_cast<int>(k), 3.0f, false);
    for (size_t i = 0; i < n; ++i) src16[k][i] = FloatToBf16(src32[k][i]);
  }
  for (KernelPath path : {KernelPath::kScalar, KernelPath::kAvx2, KernelPath::kAvx512}) {
    if (!KernelPathSupported(path)) continue;
    for (DType type : {DType::kFp32, DType::kBf16}) {
      for (bool overwrite : {false, true}) {
        for (size_t count : {size_t{1}, size_t{2}, size_t{4}, size_t{8}, kMax}) {
          SCOPED_TRACE(absl::StrCat(KernelPathName(path), " ", DTypeName(type),
                                    overwrite ? " overwrite " : " add ", count, " sources"));
          std::vector<ShardOptimizer::Source> srcs;
          for (size_t k = 0; k < count; ++k) {
            srcs.push_back(type == DType::kFp32 ? ShardOptimizer::Source{src32[k].data(), type}
                                                : ShardOptimizer::Source{src16[k].data(), type});
          }
          auto opt = MakeOptimizer(path, 2);
          std::vector<float> want = base;
          for (size_t k = 0; k < count; ++k) {
            if (overwrite && k == 0) {
              opt->ConvertIn(want.data(), srcs[k].data, type, n);
            } else {
              opt->Accumulate(want.data(), srcs[k].data, type, n);
            }
          }
          const float scale = 0.25f;
          const GradStats want_stats = opt->SumSquaresAndFinite(want.data(), n, scale);
          std::vector<float> got = base;
          const GradStats got_stats = opt->SumContributions(got.data(), srcs, n, overwrite, &scale);
          EXPECT_EQ(std::memcmp(got.data(), want.data(), n * sizeof(float)), 0);
          EXPECT_EQ(std::memcmp(&got_stats.sum_sq, &want_stats.sum_sq, sizeof(double)), 0);
        }
      }
    }
  }
}

// A large overwritten gradient, aligned or not (streaming stores or plain),
// summed with its norm in one pass: the bits of one call per contribution
// and SumSquaresAndFinite, on every path.
TEST(SumSquaresTest, LargeSumContributionsGiveTheSameBitsAlignedOrNot) {
  const size_t n = ShardOptimizer::kStreamMinElems + kBlock / 2 + 37;
  constexpr size_t kSources = 4;
  std::vector<std::vector<uint16_t>> src(kSources, std::vector<uint16_t>(n));
  for (size_t k = 0; k < kSources; ++k) {
    std::vector<float> f(n);
    FillNormal(f.data(), n, 70 + static_cast<int>(k), 2.0f, false);
    for (size_t i = 0; i < n; ++i) src[k][i] = FloatToBf16(f[i]);
  }
  std::vector<ShardOptimizer::Source> srcs;
  for (size_t k = 0; k < kSources; ++k) srcs.push_back({src[k].data(), DType::kBf16});
  const float scale = 0.5f;
  for (KernelPath path : {KernelPath::kScalar, KernelPath::kAvx2, KernelPath::kAvx512}) {
    if (!KernelPathSupported(path)) continue;
    auto opt = MakeOptimizer(path, 2);
    Buffer<float> want(n, 0);
    for (size_t k = 0; k < kSources; ++k) {
      if (k == 0) {
        opt->ConvertIn(want.data(), srcs[k].data, DType::kBf16, n);
      } else {
        opt->Accumulate(want.data(), srcs[k].data, DType::kBf16, n);
      }
    }
    const GradStats want_stats = opt->SumSquaresAndFinite(want.data(), n, scale);
    // Any thread count (runs of blocks claimed differently), the same bits.
    for (int threads : {1, 2, 3}) {
      auto summer = MakeOptimizer(path, threads);
      for (size_t offset : {size_t{0}, size_t{3}}) {
        SCOPED_TRACE(absl::StrCat(KernelPathName(path), " ", threads, " threads",
                                  offset == 0 ? " aligned" : " unaligned"));
        Buffer<float> got(n, offset);
        for (size_t i = 0; i < n; ++i) got[i] = 1e9f;  // overwritten
        const GradStats got_stats = summer->SumContributions(got.data(), srcs, n, true, &scale);
        EXPECT_EQ(std::memcmp(got.data(), want.data(), n * sizeof(float)), 0);
        EXPECT_EQ(std::memcmp(&got_stats.sum_sq, &want_stats.sum_sq, sizeof(double)), 0);
      }
    }
  }
}

// Several contributions added block by block, with the norm in the same
// pass, give the bits of one Accumulate (or ConvertIn) per contribution
// followed by SumSquaresAndFinite.
TEST(SumSquaresTest, SumContributionsEqualsOneCallPerContribution) {
  const size_t n = 3 * kBlock + 77;
  std::vector<float> base(n);
  FillNormal(base.data(), n, 11, 1.0f, false);
  std::vector<std::vector<float>> src32(3, std::vector<float>(n));
  std::vector<std::vector<uint16_t>> src16(3, std::vector<uint16_t>(n));
  for (int k = 0; k < 3; ++k) {
    FillNormal(src32[k].data(), n, 12 + k, 2.0f, false);
    for (size_t i = 0; i < n; ++i) src16[k][i] = FloatToBf16(src32[k][i]);
  }
  for (KernelPath path : {KernelPath::kScalar, KernelPath::kAvx2, KernelPath::kAvx512}) {
    if (!KernelPathSupported(path)) continue;
    for (bool overwrite : {false, true}) {
      for (size_t count : {size_t{1}, size_t{3}}) {
        SCOPED_TRACE(absl::StrCat(KernelPathName(path), overwrite ? " overwrite " : " add ", count,
                                  " sources"));
        // Mixed types: fp32, bf16, fp32.
        std::vector<ShardOptimizer::Source> srcs;
        for (size_t k = 0; k < count; ++k) {
          if (k % 2 == 0) {
            srcs.push_back({src32[k].data(), DType::kFp32});
          } else {
            srcs.push_back({src16[k].data(), DType::kBf16});
          }
        }
        auto opt = MakeOptimizer(path, 2);
        std::vector<float> want = base;
        for (size_t k = 0; k < count; ++k) {
          if (overwrite && k == 0) {
            opt->ConvertIn(want.data(), srcs[k].data, srcs[k].type, n);
          } else {
            opt->Accumulate(want.data(), srcs[k].data, srcs[k].type, n);
          }
        }
        const GradStats want_stats = opt->SumSquaresAndFinite(want.data(), n, 0.5f);
        const float scale = 0.5f;
        std::vector<float> got = base;
        const GradStats got_stats = opt->SumContributions(got.data(), srcs, n, overwrite, &scale);
        EXPECT_EQ(std::memcmp(got.data(), want.data(), n * sizeof(float)), 0);
        EXPECT_EQ(std::memcmp(&got_stats.sum_sq, &want_stats.sum_sq, sizeof(double)), 0)
            << got_stats.sum_sq << " vs " << want_stats.sum_sq;
        EXPECT_FALSE(got_stats.found_inf_nan);
        got = base;  // without the norm: the same sum
        opt->SumContributions(got.data(), srcs, n, overwrite, nullptr);
        EXPECT_EQ(std::memcmp(got.data(), want.data(), n * sizeof(float)), 0);
        // An inf arriving in the last contribution is found.
        std::vector<float> bad = src32[0];
        bad[kBlock + 1] = std::numeric_limits<float>::infinity();
        srcs.back() = {bad.data(), DType::kFp32};
        got = base;
        EXPECT_TRUE(opt->SumContributions(got.data(), srcs, n, overwrite, &scale).found_inf_nan);
      }
    }
  }
}

TEST(SumSquaresTest, DetectsInfAndNan) {
  const size_t n = 2 * kBlock + 9;
  std::vector<float> g(n);
  FillNormal(g.data(), n, 5, 1.0f, false);
  for (KernelPath path : {KernelPath::kScalar, KernelPath::kAvx2, KernelPath::kAvx512}) {
    if (!KernelPathSupported(path)) continue;
    SCOPED_TRACE(KernelPathName(path));
    auto opt = MakeOptimizer(path, 2);
    EXPECT_FALSE(opt->SumSquaresAndFinite(g.data(), n, 1.0f).found_inf_nan);
    for (size_t at : {size_t{0}, size_t{17}, kBlock + 3, n - 1}) {
      for (float bad : {std::numeric_limits<float>::infinity(),
                        -std::numeric_limits<float>::infinity(),
                        std::numeric_limits<float>::quiet_NaN()}) {
        std::vector<float> h = g;
        h[at] = bad;
        EXPECT_TRUE(opt->SumSquaresAndFinite(h.data(), n, 1.0f).found_inf_nan)
            << "at " << at << " value " << bad;
      }
    }
    // A finite gradient that overflows once scaled.
    std::vector<float> h = g;
    h[5] = 3e38f;
    EXPECT_FALSE(opt->SumSquaresAndFinite(h.data(), n, 1.0f).found_inf_nan);
    EXPECT_TRUE(opt->SumSquaresAndFinite(h.data(), n, 4.0f).found_inf_nan);
    EXPECT_EQ(opt->SumSquaresAndFinite(h.data(), 0, 1.0f).sum_sq, 0.0);
  }
}

// ---------------------------------------------------------------------------
// Conversions and accumulation.

std::vector<float> SpecialFloats() {
  std::vector<float> x = {
      0.0f, -0.0f, 1.0f, -1.0f, 65504.0f, 65519.0f, 65520.0f, -65520.0f,
      70000.0f, 1e-8f, -3e-7f, 6.1e-5f, 5.96e-8f, 2.98e-8f, 1e-45f, 1e-40f,
      3.4e38f, -3.4e38f,
      std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
      std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
      BitsToFloat(0x7f800001u), BitsToFloat(0xffbfffffu), BitsToFloat(0x7fe01234u),
      BitsToFloat(0x3f808000u), BitsToFloat(0x3f818000u),  // bf16 ties
      BitsToFloat(0x3f801000u), BitsToFloat(0x3f803000u),  // fp16 ties
      BitsToFloat(0x7f7fffffu), BitsToFloat(0xff7f8000u), BitsToFloat(0x387fe000u),
  };
  std::mt19937 rng(3);
  std::uniform_int_distribution<uint32_t> bits;
  while (x.size() < 1000) x.push_back(BitsToFloat(bits(rng)));  // every exponent
  return x;
}

bool SameOrBothNan(float a, float b) {
  return std::memcmp(&a, &b, 4) == 0 || (std::isnan(a) && std::isnan(b));
}

TEST(ConvertTest, ConvertOutMatchesScalarConversions) {
  const std::vector<float> x = SpecialFloats();
  for (KernelPath path : {KernelPath::kScalar, KernelPath::kAvx2, KernelPath::kAvx512}) {
    if (!KernelPathSupported(path)) continue;
    SCOPED_TRACE(KernelPathName(path));
    auto opt = MakeOptimizer(path, 1);
    std::vector<uint16_t> bf(x.size()), fp(x.size());
    std::vector<float> f32(x.size());
    opt->ConvertOut(bf.data(), DType::kBf16, x.data(), x.size());
    opt->ConvertOut(fp.data(), DType::kFp16, x.data(), x.size());
    opt->ConvertOut(f32.data(), DType::kFp32, x.data(), x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      ASSERT_EQ(bf[i], FloatToBf16(x[i])) << i << " bits " << std::hex << FloatBits(x[i]);
      ASSERT_EQ(fp[i], FloatToHalf(x[i])) << i << " bits " << std::hex << FloatBits(x[i]);
      ASSERT_EQ(FloatBits(f32[i]), FloatBits(x[i])) << i;
    }
  }
}

TEST(ConvertTest, ConvertInAndAccumulateMatchScalar) {
  const size_t n = 3 * kBlock + 29;
  std::mt19937 rng(8);
  std::uniform_int_distribution<uint32_t> bits;
  std::vector<uint16_t> bf(n), fp(n);
  std::vector<float> f32(n), base(n);
  for (size_t i = 0; i < n; ++i) {
    bf[i] = static_cast<uint16_t>(bits(rng));
    fp[i] = static_cast<uint16_t>(bits(rng));
    f32[i] = BitsToFloat(bits(rng));
  }
  FillNormal(base.data(), n, 2, 10.0f, false);
  for (KernelPath path : {KernelPath::kScalar, KernelPath::kAvx2, KernelPath::kAvx512}) {
    if (!KernelPathSupported(path)) continue;
    SCOPED_TRACE(KernelPathName(path));
    auto opt = MakeOptimizer(path, 2);
    for (DType t : {DType::kFp32, DType::kBf16, DType::kFp16}) {
      SCOPED_TRACE(DTypeName(t));
      const void* src = t == DType::kFp32 ? static_cast<const void*>(f32.data())
                        : t == DType::kBf16 ? static_cast<const void*>(bf.data())
                                            : static_cast<const void*>(fp.data());
      std::vector<float> expected(n);
      ToFloat(t, src, expected.data(), n);
      std::vector<float> got(n);
      opt->ConvertIn(got.data(), src, t, n);
      for (size_t i = 0; i < n; ++i) {
        ASSERT_TRUE(SameOrBothNan(got[i], expected[i])) << i;
      }
      std::vector<float> acc = base;
      opt->Accumulate(acc.data(), src, t, n);
      for (size_t i = 0; i < n; ++i) {
        ASSERT_TRUE(SameOrBothNan(acc[i], base[i] + expected[i])) << i;
      }
    }
  }
}

// Large ConvertIn calls into vector-aligned memory take streaming stores;
// aligned or not, every path writes the same values.
TEST(ConvertTest, LargeConvertInGivesTheSameBitsAlignedOrNot) {
  const size_t n = ShardOptimizer::kStreamMinElems + 29;
  std::mt19937 rng(9);
  std::uniform_int_distribution<uint32_t> bits;
  std::vector<uint16_t> bf(n);
  std::vector<float> f32(n);
  for (size_t i = 0; i < n; ++i) {
    bf[i] = static_cast<uint16_t>(bits(rng));
    f32[i] = BitsToFloat(bits(rng));
  }
  // One spare float in front, so that dst can be aligned or not.
  std::unique_ptr<float, decltype(&std::free)> storage(
      static_cast<float*>(std::aligned_alloc(64, (n + 16 + 63) / 64 * 64 * sizeof(float))),
      &std::free);
  ASSERT_NE(storage, nullptr);
  for (KernelPath path : {KernelPath::kScalar, KernelPath::kAvx2, KernelPath::kAvx512}) {
    if (!KernelPathSupported(path)) continue;
    auto opt = MakeOptimizer(path, 2);
    for (DType t : {DType::kFp32, DType::kBf16}) {
      const void* src = t == DType::kFp32 ? static_cast<const void*>(f32.data())
                                          : static_cast<const void*>(bf.data());
      std::vector<float> expected(n);
      ToFloat(t, src, expected.data(), n);
      for (size_t shift : {0, 1}) {
        SCOPED_TRACE(absl::StrCat(KernelPathName(path), " ", DTypeName(t), " shift ", shift));
        float* dst = storage.get() + shift;
        std::fill(dst, dst + n, -1.0f);
        opt->ConvertIn(dst, src, t, n);
        for (size_t i = 0; i < n; ++i) {
          ASSERT_TRUE(SameOrBothNan(dst[i], expected[i])) << i;
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Errors.

TEST(ValidationTest, RejectsBadHyperParametersNamingTheField) {
  struct Case {
    const char* field;
    void (*mutate)(StepHyperParams&);
  };
  const Case cases[] = {
      {"lr", [](StepHyperParams& h) { h.lr = -1; }},
      {"lr", [](StepHyperParams& h) { h.lr = std::numeric_limits<double>::infinity(); }},
      {"lr", [](StepHyperParams& h) { h.lr = std::nan(""); }},
      {"beta1", [](StepHyperParams& h) { h.beta1 = 1.0; }},
      {"beta1", [](StepHyperParams& h) { h.beta1 = -0.1; }},
      {"beta2", [](StepHyperParams& h) { h.beta2 = 1.5; }},
      {"eps", [](StepHyperParams& h) { h.eps = 0; }},
      {"eps", [](StepHyperParams& h) { h.eps = -1e-8; }},
      {"weight_decay", [](StepHyperParams& h) { h.weight_decay = -0.01; }},
      {"step", [](StepHyperParams& h) { h.step = 0; }},
      {"grad_scale", [](StepHyperParams& h) { h.grad_scale = std::nan(""); }},
      {"momentum", [](StepHyperParams& h) { h.kind = OptimizerKind::kSgdMomentum; h.momentum = -1; }},
      {"dampening", [](StepHyperParams& h) { h.kind = OptimizerKind::kSgdMomentum; h.dampening = 2; }},
  };
  auto opt = MakeOptimizer(KernelPath::kScalar, 1);
  Shard s(10, 0, DType::kBf16, false, 1);
  const std::vector<float> before(s.param.data(), s.param.data() + 10);
  for (const Case& c : cases) {
    StepHyperParams hp;
    c.mutate(hp);
    const absl::Status status = ValidateHyperParams(hp);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.field));
    EXPECT_EQ(opt->Step(hp, s.buffers()).code(), absl::StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(std::memcmp(before.data(), s.param.data(), 10 * 4), 0);
  StepHyperParams ok;
  EXPECT_TRUE(ValidateHyperParams(ok).ok());
  ok.beta1 = 0;
  ok.weight_decay = 0;
  ok.lr = 0;
  EXPECT_TRUE(ValidateHyperParams(ok).ok());
}

TEST(ValidationTest, RejectsMissingBuffers) {
  auto opt = MakeOptimizer(KernelPath::kScalar, 1);
  Shard s(10, 0, DType::kBf16, false, 1);
  StepHyperParams hp;
  ShardBuffers b = s.buffers();
  b.exp_avg_sq = nullptr;
  EXPECT_THAT(std::string(opt->Step(hp, b).message()), HasSubstr("exp_avg_sq"));
  b = s.buffers();
  b.grad = nullptr;
  EXPECT_EQ(opt->Step(hp, b).code(), absl::StatusCode::kInvalidArgument);
  hp.kind = OptimizerKind::kSgdMomentum;
  hp.momentum = 0.9;
  b = s.buffers();
  b.exp_avg = nullptr;
  EXPECT_THAT(std::string(opt->Step(hp, b).message()), HasSubstr("exp_avg"));
  b.size = 0;  // nothing to do
  EXPECT_TRUE(opt->Step(hp, b).ok());
}

TEST(CreateTest, RejectsBadOptions) {
  EXPECT_EQ(ShardOptimizer::Create(MakeOptions(KernelPath::kAuto, 0)).status().code(),
            absl::StatusCode::kInvalidArgument);
  for (KernelPath path : {KernelPath::kAvx2, KernelPath::kAvx512}) {
    const auto opt = ShardOptimizer::Create(MakeOptions(path, 1));
    EXPECT_EQ(opt.ok(), KernelPathSupported(path)) << KernelPathName(path);
  }
  auto best = ShardOptimizer::Create(MakeOptions(KernelPath::kAuto, 2));
  ASSERT_TRUE(best.ok());
  EXPECT_EQ((*best)->path(), BestKernelPath());
  EXPECT_EQ((*best)->num_threads(), 2);
}

}  // namespace
}  // namespace zeroshard
