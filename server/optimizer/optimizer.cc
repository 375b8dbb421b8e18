#include "server/optimizer/optimizer.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/optimizer/kernels.h"

#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace zeroshard {

using optimizer_internal::CopyKind;
using optimizer_internal::KernelSet;
using optimizer_internal::kBlockElems;
using optimizer_internal::StepBuffers;
using optimizer_internal::StepConstants;
using optimizer_internal::StepFn;
using optimizer_internal::StepKind;

static_assert(ShardOptimizer::kBlockElems == kBlockElems,
              "public and kernel block sizes differ");

// ---------------------------------------------------------------------------
// Paths.

absl::string_view KernelPathName(KernelPath path) {
  switch (path) {
    case KernelPath::kAuto: return "auto";
    case KernelPath::kScalar: return "scalar";
    case KernelPath::kAvx2: return "avx2";
    case KernelPath::kAvx512: return "avx512";
  }
  return "unknown";
}

namespace {

const KernelSet* KernelsFor(KernelPath path) {
  switch (path) {
    case KernelPath::kScalar:
      return &optimizer_internal::ScalarKernels();
    case KernelPath::kAvx2:
      return optimizer_internal::Avx2Kernels();
    case KernelPath::kAvx512:
      return optimizer_internal::Avx512Kernels();
    case KernelPath::kAuto:
      break;
  }
  return nullptr;
}

#if defined(__x86_64__)
// F16C from CPUID leaf 1 (ECX bit 29): clang 14's __builtin_cpu_supports does
// not know "f16c". The AVX2 check below already covers the OS saving YMM state.
bool CpuHasF16c() {
  unsigned int eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return false;
  return (ecx & bit_F16C) != 0;
}
#endif

bool CpuSupports(KernelPath path) {
#if defined(__x86_64__)
  switch (path) {
    case KernelPath::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             CpuHasF16c();
    case KernelPath::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") &&
             __builtin_cpu_supports("fma") && CpuHasF16c();
    default:
      return true;
  }
#else
  return path == KernelPath::kScalar || path == KernelPath::kAuto;
#endif
}

}  // namespace

bool KernelPathSupported(KernelPath path) {
  if (path == KernelPath::kAuto) return true;
  return KernelsFor(path) != nullptr && CpuSupports(path);
}

KernelPath BestKernelPath() {
  if (KernelPathSupported(KernelPath::kAvx512)) return KernelPath::kAvx512;
  if (KernelPathSupported(KernelPath::kAvx2)) return KernelPath::kAvx2;
  return KernelPath::kScalar;
}

// ---------------------------------------------------------------------------
// Validation and step constants.

namespace {

absl::Status FieldError(absl::string_view field, absl::string_view rule,
                        double value) {
  return absl::InvalidArgumentError(
      absl::StrCat(field, " must be ", rule, ", got ", value));
}

absl::Status CheckNonNegative(absl::string_view field, double value) {
  if (!std::isfinite(value) || value < 0) {
    return FieldError(field, "finite and >= 0", value);
  }
  return absl::OkStatus();
}

absl::Status CheckBeta(absl::string_view field, double value) {
  if (!(value >= 0 && value < 1)) return FieldError(field, "in [0, 1)", value);
  return absl::OkStatus();
}

StepConstants MakeConstants(const StepHyperParams& hp) {
  // Python floats become fp32 where torch passes them to an fp32 tensor op;
  // everything before that is double, as in Python.
  StepConstants c;
  c.grad_scale = static_cast<float>(hp.grad_scale);
  c.apply_weight_decay = hp.weight_decay != 0;
  c.weight_decay = static_cast<float>(hp.weight_decay);
  switch (hp.kind) {
    case OptimizerKind::kAdamW:
    case OptimizerKind::kAdam: {
      c.decay = static_cast<float>(1.0 - hp.lr * hp.weight_decay);
      c.beta1 = static_cast<float>(hp.beta1);
      c.one_minus_beta1 = static_cast<float>(1.0 - hp.beta1);
      c.beta2 = static_cast<float>(hp.beta2);
      c.one_minus_beta2 = static_cast<float>(1.0 - hp.beta2);
      const double step = static_cast<double>(hp.step);
      const double bias_correction1 = 1.0 - std::pow(hp.beta1, step);
      const double bias_correction2 = 1.0 - std::pow(hp.beta2, step);
      c.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
      c.neg_step_size = static_cast<float>(-(hp.lr / bias_correction1));
      c.eps = static_cast<float>(hp.eps);
      break;
    }
    case OptimizerKind::kSgdMomentum:
      c.use_momentum = hp.momentum != 0;
      c.first_step = hp.step == 1;
      c.momentum = static_cast<float>(hp.momentum);
      c.one_minus_dampening = static_cast<float>(1.0 - hp.dampening);
      c.neg_lr = static_cast<float>(-1.0 * hp.lr);
      break;
  }
  return c;
}

absl::StatusOr<CopyKind> CopyKindOf(DType type) {
  switch (type) {
    case DType::kFp32: return CopyKind::kFp32;
    case DType::kBf16: return CopyKind::kBf16;
    case DType::kFp16: return CopyKind::kFp16;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("model_copy_type: unknown dtype ", static_cast<int>(type)));
}

int CopyIndex(DType type) {
  switch (type) {
    case DType::kFp32: return static_cast<int>(CopyKind::kFp32);
    case DType::kBf16: return static_cast<int>(CopyKind::kBf16);
    case DType::kFp16: return static_cast<int>(CopyKind::kFp16);
  }
  return static_cast<int>(CopyKind::kFp32);
}

bool Aligned(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

size_t NumBlocks(size_t n) { return (n + kBlockElems - 1) / kBlockElems; }

}  // namespace

absl::Status ValidateHyperParams(const StepHyperParams& hp) {
  if (!std::isfinite(hp.lr) || hp.lr < 0) {
    return FieldError("lr", "finite and >= 0", hp.lr);
  }
  if (hp.step < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("step must be >= 1, got ", hp.step));
  }
  if (!std::isfinite(hp.grad_scale) || hp.grad_scale < 0) {
    return FieldError("grad_scale", "finite and >= 0", hp.grad_scale);
  }
  auto check_weight_decay = [&]() {
    return CheckNonNegative("weight_decay", hp.weight_decay);
  };
  switch (hp.kind) {
    case OptimizerKind::kAdamW:
    case OptimizerKind::kAdam:
      if (absl::Status s = CheckBeta("beta1", hp.beta1); !s.ok()) return s;
      if (absl::Status s = CheckBeta("beta2", hp.beta2); !s.ok()) return s;
      if (!std::isfinite(hp.eps) || hp.eps <= 0) {
        return FieldError("eps", "finite and > 0", hp.eps);
      }
      return check_weight_decay();
    case OptimizerKind::kSgdMomentum:
      if (absl::Status s = CheckNonNegative("momentum", hp.momentum); !s.ok()) {
        return s;
      }
      if (!(hp.dampening >= 0 && hp.dampening <= 1)) {
        return FieldError("dampening", "in [0, 1]", hp.dampening);
      }
      return check_weight_decay();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("kind: unknown optimizer ", static_cast<int>(hp.kind)));
}

// ---------------------------------------------------------------------------
// Thread pool: num_threads - 1 workers plus the calling thread, or (pinned)
// num_threads workers while the calling thread waits, take block indices
// from a shared counter.

class ShardOptimizer::Pool {
 public:
  static constexpr size_t kRunsPerThread = 8;

  // `pinned`: num_threads workers, and the caller of Run only waits (Pin
  // binds them); else num_threads - 1 workers and the caller works too.
  Pool(int num_threads, bool pinned) : caller_works_(!pinned) {
    const int workers = pinned ? num_threads : num_threads - 1;
    threads_.reserve(workers);
    for (int t = 0; t < workers; ++t) {
      threads_.emplace_back([this] { WorkerLoop(); });
    }
  }

  // Binds worker i to cpus[i] (one CPU per worker).
  absl::Status Pin(const std::vector<int>& cpus) {
    for (size_t t = 0; t < threads_.size() && t < cpus.size(); ++t) {
      if (cpus[t] < 0 || cpus[t] >= CPU_SETSIZE) {
        return absl::InvalidArgumentError(absl::StrCat("cpus: CPU ", cpus[t], " out of range"));
      }
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(cpus[t], &set);
      if (int e = pthread_setaffinity_np(threads_[t].native_handle(), sizeof(set), &set); e != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("cpus: pinning optimizer thread ", t, " to CPU ", cpus[t], ": ",
                         strerror(e), " (is the CPU offline or outside this process's cpuset?)"));
      }
    }
    return absl::OkStatus();
  }

  ~Pool() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
      start_cv_.SignalAll();
    }
    for (std::thread& t : threads_) t.join();
  }

  // Runs task(i) for every i < num_tasks; returns when all have returned.
  // One Run at a time (the caller holds ShardOptimizer::call_mu_).
  void Run(size_t num_tasks, absl::FunctionRef<void(size_t)> task) {
    if (threads_.empty() || num_tasks <= 1) {
      for (size_t i = 0; i < num_tasks; ++i) task(i);
      return;
    }
    const size_t run = RunLength(num_tasks, threads_.size() + (caller_works_ ? 1 : 0));
    {
      absl::MutexLock lock(&mu_);
      task_ = &task;
      num_tasks_ = num_tasks;
      run_ = run;
      next_.store(0, std::memory_order_relaxed);
      busy_ = static_cast<int>(threads_.size());
      ++generation_;
      start_cv_.SignalAll();
    }
    if (caller_works_) Work(task, num_tasks, run);
    // Workers hold a reference to `task` until they check out.
    absl::MutexLock lock(&mu_);
    while (busy_ > 0) done_cv_.Wait(&mu_);
    task_ = nullptr;
  }

 private:
  // Tasks are claimed in runs of consecutive ones, so that a thread streams
  // through a contiguous stretch of every buffer (the hardware prefetchers
  // follow it) while each thread still gets several runs to even out.
  static size_t RunLength(size_t num_tasks, size_t threads) {
    return std::max<size_t>(1, num_tasks / (threads * kRunsPerThread));
  }

  void Work(absl::FunctionRef<void(size_t)> task, size_t num_tasks, size_t run) {
    for (size_t i = next_.fetch_add(run, std::memory_order_relaxed); i < num_tasks;
         i = next_.fetch_add(run, std::memory_order_relaxed)) {
      for (size_t j = i; j < std::min(num_tasks, i + run); ++j) task(j);
    }
  }

  void WorkerLoop() {
    uint64_t seen = 0;
    for (;;) {
      const absl::FunctionRef<void(size_t)>* task;
      size_t num_tasks;
      size_t run;
      {
        absl::MutexLock lock(&mu_);
        while (!stop_ && generation_ == seen) start_cv_.Wait(&mu_);
        if (stop_) return;
        seen = generation_;
        task = task_;
        num_tasks = num_tasks_;
        run = run_;
      }
      Work(*task, num_tasks, run);
      absl::MutexLock lock(&mu_);
      if (--busy_ == 0) done_cv_.Signal();
    }
  }

  absl::Mutex mu_;
  absl::CondVar start_cv_;
  absl::CondVar done_cv_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  int busy_ ABSL_GUARDED_BY(mu_) = 0;
  const absl::FunctionRef<void(size_t)>* task_ ABSL_GUARDED_BY(mu_) = nullptr;
  size_t num_tasks_ ABSL_GUARDED_BY(mu_) = 0;
  size_t run_ ABSL_GUARDED_BY(mu_) = 1;
  std::atomic<size_t> next_{0};
  const bool caller_works_;
  std::vector<std::thread> threads_;
};

// ---------------------------------------------------------------------------
// ShardOptimizer.

absl::StatusOr<std::unique_ptr<ShardOptimizer>> ShardOptimizer::Create(
    const Options& options) {
  if (options.num_threads < 1 || options.num_threads > 256) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_threads must be in [1, 256], got ", options.num_threads));
  }
  KernelPath path = options.path;
  if (path == KernelPath::kAuto) path = BestKernelPath();
  if (!KernelPathSupported(path)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "path: kernel path ", KernelPathName(path),
        " is not supported by this CPU or build"));
  }
  const bool pinned = !options.cpus.empty();
  if (pinned && options.cpus.size() != static_cast<size_t>(options.num_threads)) {
    return absl::InvalidArgumentError(absl::StrCat("cpus: ", options.cpus.size(),
                                                   " CPUs for num_threads ", options.num_threads,
                                                   "; give one CPU per thread"));
  }
  std::unique_ptr<ShardOptimizer> optimizer(new ShardOptimizer(
      path, KernelsFor(path), options.num_threads, options.streaming_stores, pinned));
  if (pinned) RETURN_IF_ERROR(optimizer->pool_->Pin(options.cpus));
  return optimizer;
}

ShardOptimizer::ShardOptimizer(KernelPath path, const KernelSet* kernels,
                               int num_threads, bool streaming_stores, bool pinned)
    : path_(path),
      kernels_(kernels),
      num_threads_(num_threads),
      streaming_stores_(streaming_stores),
      pool_(std::make_unique<Pool>(num_threads, pinned)) {}

ShardOptimizer::~ShardOptimizer() = default;

template <typename Task>
void ShardOptimizer::ForEachBlock(size_t n, const Task& task) {
  pool_->Run(NumBlocks(n), [&](size_t block) {
    const size_t begin = block * kBlockElems;
    task(block, begin, std::min(n, begin + kBlockElems));
  });
}

absl::Status ShardOptimizer::Step(const StepHyperParams& hp,
                                  const ShardBuffers& shard) {
  if (absl::Status s = ValidateHyperParams(hp); !s.ok()) return s;
  const size_t n = shard.size;
  if (n == 0) return absl::OkStatus();
  if (shard.param == nullptr) return absl::InvalidArgumentError("param is null");
  if (shard.grad == nullptr) return absl::InvalidArgumentError("grad is null");
  const bool adam = hp.kind != OptimizerKind::kSgdMomentum;
  if ((adam || hp.momentum != 0) && shard.exp_avg == nullptr) {
    return absl::InvalidArgumentError("exp_avg is null");
  }
  if (adam && shard.exp_avg_sq == nullptr) {
    return absl::InvalidArgumentError("exp_avg_sq is null");
  }
  CopyKind copy = CopyKind::kNone;
  if (shard.model_copy != nullptr) {
    absl::StatusOr<CopyKind> kind = CopyKindOf(shard.model_copy_type);
    if (!kind.ok()) return kind.status();
    copy = *kind;
  }

  const StepConstants constants = MakeConstants(hp);
  const size_t vec = kernels_->vector_bytes;
  const size_t copy_vec = copy == CopyKind::kFp32 ? vec : vec / 2;
  const bool stream = streaming_stores_ && copy != CopyKind::kNone &&
                      n >= kStreamMinElems &&
                      Aligned(shard.model_copy, copy_vec);
  // OptimizerKind numbers from 1 (the wire's), StepKind from 0.
  const StepFn fn = kernels_->step[static_cast<int>(hp.kind) - 1]
                                  [static_cast<int>(copy)][stream ? 1 : 0];
  StepBuffers buffers;
  buffers.param = shard.param;
  buffers.grad = shard.grad;
  buffers.exp_avg = shard.exp_avg;
  buffers.exp_avg_sq = adam ? shard.exp_avg_sq : nullptr;
  buffers.copy = shard.model_copy;

  absl::MutexLock lock(&call_mu_);
  ForEachBlock(n, [&](size_t, size_t begin, size_t end) {
    fn(constants, buffers, begin, end);
  });
  return absl::OkStatus();
}

void ShardOptimizer::Accumulate(float* dst, const void* src, DType src_type,
                                size_t n) {
  if (n == 0) return;
  const auto fn = kernels_->accumulate[CopyIndex(src_type)];
  const size_t elem = DTypeSize(src_type);
  const char* s = static_cast<const char*>(src);
  absl::MutexLock lock(&call_mu_);
  ForEachBlock(n, [&](size_t, size_t begin, size_t end) {
    fn(dst + begin, s + begin * elem, end - begin);
  });
}

void ShardOptimizer::ConvertIn(float* dst, const void* src, DType src_type,
                               size_t n) {
  if (n == 0) return;
  const bool stream =
      streaming_stores_ && n >= kStreamMinElems && Aligned(dst, kernels_->vector_bytes);
  const auto fn = kernels_->convert_in[CopyIndex(src_type)][stream ? 1 : 0];
  const size_t elem = DTypeSize(src_type);
  const char* s = static_cast<const char*>(src);
  absl::MutexLock lock(&call_mu_);
  ForEachBlock(n, [&](size_t, size_t begin, size_t end) {
    fn(dst + begin, s + begin * elem, end - begin);
  });
}

void ShardOptimizer::ConvertOut(void* dst, DType dst_type, const float* src,
                                size_t n) {
  if (n == 0) return;
  const auto fn = kernels_->convert_out[CopyIndex(dst_type)];
  const size_t elem = DTypeSize(dst_type);
  char* d = static_cast<char*>(dst);
  absl::MutexLock lock(&call_mu_);
  ForEachBlock(n, [&](size_t, size_t begin, size_t end) {
    fn(d + begin * elem, src + begin, end - begin);
  });
}

GradStats ShardOptimizer::SumSquaresAndFinite(const float* g, size_t n,
                                              float scale) {
  if (n == 0) return GradStats();
  const size_t blocks = NumBlocks(n);
  const auto fn = kernels_->sum_squares;
  absl::MutexLock lock(&call_mu_);
  if (block_sums_.size() < blocks) block_sums_.resize(blocks);
  double* sums = block_sums_.data();
  ForEachBlock(n, [&](size_t block, size_t begin, size_t end) {
    sums[block] = fn(g + begin, end - begin, scale);
  });
  return AddBlockSums(sums, blocks);
}

GradStats ShardOptimizer::SumContributions(float* dst, absl::Span<const Source> srcs, size_t n,
                                           bool overwrite, const float* norm_scale) {
  if (n == 0) return GradStats();
  const size_t blocks = NumBlocks(n);
  const auto sum_squares = kernels_->sum_squares;
  absl::MutexLock lock(&call_mu_);
  if (norm_scale != nullptr && block_sums_.size() < blocks) block_sums_.resize(blocks);
  double* sums = block_sums_.data();
  // Sources of one type are summed in one loop, in groups that keep the
  // running sum in registers (the same bits as one pass per source). When
  // one group takes them all, the norm comes from the registers too, and a
  // large overwritten dst, read by nothing in this pass, takes streaming
  // stores (like ConvertIn): it crosses memory once, written.
  constexpr size_t kGroup = 8;
  const bool same_type = std::all_of(srcs.begin(), srcs.end(),
                                     [&](const Source& s) { return s.type == srcs[0].type; });
  const bool one_type = same_type && srcs.size() > 1;
  const bool one_group =
      same_type && norm_scale != nullptr && !srcs.empty() && srcs.size() <= kGroup;
  const bool stream = one_group && overwrite && streaming_stores_ && n >= kStreamMinElems &&
                      Aligned(dst, kernels_->vector_bytes);
  ForEachBlock(n, [&](size_t block, size_t begin, size_t end) {
    if (one_type || one_group) {
      const size_t esize = DTypeSize(srcs[0].type);
      const auto& fns = kernels_->sum_sources[CopyIndex(srcs[0].type)];
      const void* ptrs[kGroup];
      for (size_t g = 0; g < srcs.size(); g += kGroup) {
        const size_t k = std::min(kGroup, srcs.size() - g);
        for (size_t j = 0; j < k; ++j) {
          ptrs[j] = static_cast<const char*>(srcs[g + j].data) + begin * esize;
        }
        if (one_group) {
          sums[block] =
              fns[stream ? 1 : 0][1](dst + begin, ptrs, k, end - begin, overwrite, *norm_scale);
        } else {
          fns[0][0](dst + begin, ptrs, k, end - begin, overwrite && g == 0, 0.0f);
        }
      }
      if (one_group) return;
    } else {
      for (size_t k = 0; k < srcs.size(); ++k) {
        const Source& src = srcs[k];
        // Plain stores: the block is read again at once, so it should stay cached.
        const auto fn = overwrite && k == 0 ? kernels_->convert_in[CopyIndex(src.type)][0]
                                            : kernels_->accumulate[CopyIndex(src.type)];
        fn(dst + begin, static_cast<const char*>(src.data) + begin * DTypeSize(src.type),
           end - begin);
      }
    }
    if (norm_scale != nullptr) sums[block] = sum_squares(dst + begin, end - begin, *norm_scale);
  });
  return norm_scale != nullptr ? AddBlockSums(sums, blocks) : GradStats();
}

GradStats ShardOptimizer::AddBlockSums(const double* sums, size_t blocks) {
  GradStats stats;
  double total = 0.0;
  for (size_t b = 0; b < blocks; ++b) total += sums[b];
  stats.sum_sq = total;
  // Squares of finite floats are at most ~1.2e77, so a finite sum can only
  // become inf or NaN through an inf or NaN element.
  stats.found_inf_nan = !std::isfinite(total);
  return stats;
}

}  // namespace zeroshard
