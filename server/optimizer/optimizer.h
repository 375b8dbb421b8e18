#pragma once

// The daemon's optimizer kernels: a fused, vectorised optimizer step over one
// contiguous fp32 shard, and the reductions around it (gradient accumulation,
// conversion, gradient norm).
//
// One Step reads param, grad, exp_avg, exp_avg_sq once and writes param,
// exp_avg, exp_avg_sq and, optionally, a model copy of the new parameters
// (bf16, fp16 or fp32) in the same pass. The arithmetic follows PyTorch 1.13's
// single-tensor torch.optim.AdamW / Adam / SGD (and libtorch's
// torch::optim::AdamW / Adam / SGD, which do the same tensor operations)
// operation by operation, including where its vectorised CPU kernels fuse a
// multiply-add, so a step matches libtorch 1.13's (AVX2 dispatch) to the last
// bit on the same fp32 inputs. Every kernel path (scalar, AVX2, AVX-512)
// produces the same bits, for any thread count.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "common/dtype.h"
#include "common/job_spec.h"

namespace zeroshard {

namespace optimizer_internal {
struct KernelSet;
}  // namespace optimizer_internal


// The instruction set the kernels run with.
enum class KernelPath : uint8_t {
  kAuto = 0,  // the best this CPU supports
  kScalar = 1,
  kAvx2 = 2,    // AVX2 + FMA + F16C
  kAvx512 = 3,  // AVX-512F (+ F16C)
};
absl::string_view KernelPathName(KernelPath path);
// Whether this CPU and build can run `path` (kAuto and kScalar: always).
bool KernelPathSupported(KernelPath path);
// The path kAuto resolves to on this CPU.
KernelPath BestKernelPath();

// Hyper-parameters of one step. Doubles, as Python floats are; each is
// rounded to fp32 where PyTorch rounds it.
struct StepHyperParams {
  OptimizerKind kind = OptimizerKind::kAdamW;
  double lr = 1e-3;
  // Adam, AdamW.
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  // AdamW: decoupled; Adam and SGD: added to the gradient. 0 disables.
  double weight_decay = 0.0;
  // SGD. momentum 0: no momentum buffer is read or written.
  double momentum = 0.0;
  double dampening = 0.0;
  // The optimizer's step count including this update (torch's state.step
  // after its increment), >= 1. Adam(W): bias corrections 1 - beta^step.
  // SGD: step 1 sets the momentum buffer to the gradient, as torch does when
  // the buffer does not exist yet.
  int64_t step = 1;
  // Every gradient element is multiplied by float(grad_scale) before use
  // (e.g. clip_coef / loss_scale); the gradient buffer is not modified.
  double grad_scale = 1.0;
};

// InvalidArgument naming the field: lr < 0 or non-finite; beta1/beta2
// outside [0, 1); eps <= 0 or non-finite; weight_decay < 0 or non-finite;
// momentum < 0 or non-finite; dampening outside [0, 1]; step < 1;
// grad_scale < 0 or non-finite. lr, step and grad_scale are always checked,
// the others only for the kinds that use them.
absl::Status ValidateHyperParams(const StepHyperParams& hp);

// Non-owning views of one shard of `size` elements. The caller owns the
// buffers and keeps them alive and untouched by others until Step returns.
// Buffers must not overlap each other.
struct ShardBuffers {
  float* param = nullptr;             // fp32 master weights, updated
  const float* grad = nullptr;        // fp32 gradient, read only
  float* exp_avg = nullptr;           // Adam(W) m; SGD momentum buffer
  float* exp_avg_sq = nullptr;        // Adam(W) v; unused (may be null) for SGD
  void* model_copy = nullptr;         // optional: the new param as model_copy_type
  DType model_copy_type = DType::kBf16;
  size_t size = 0;
};

// Result of SumSquaresAndFinite.
struct GradStats {
  // Sum of (double)(g[i] * scale)^2, with (g[i] * scale) computed in fp32.
  // +inf or NaN when found_inf_nan.
  double sum_sq = 0.0;
  // Some g[i] * scale (in fp32) is +-inf or NaN.
  bool found_inf_nan = false;
};

// Runs the kernels for one daemon shard on a fixed set of threads.
//
// Threads: Create starts num_threads - 1 worker threads that live until the
// ShardOptimizer is destroyed; every call also works on the calling thread,
// so num_threads threads run it. With Options::cpus, Create starts one
// worker per listed CPU instead, each pinned to its CPU, and a call's
// thread only waits for them: every call then runs on all those CPUs (the
// scheduler may otherwise queue a woken worker behind the calling thread on
// one CPU while another stays idle, for milliseconds at a time). A call splits its range into blocks of
// kBlockElems elements (each block's streams fit in L2), threads take runs
// of consecutive blocks in turn (about eight runs per thread, so that each
// streams through contiguous memory) and stream through them, and the call
// blocks until every block is done; ranges of one block or less run on the calling thread alone.
// Nothing is allocated per call, except that SumSquaresAndFinite and SumContributions grow a
// scratch array of one double per block to the largest range it has seen.
//
// Thread-safe: calls from several threads are run one at a time (an internal
// lock, not fair). Results never depend on num_threads.
//
// Streaming stores: the model copy is written, never read, by a step. With
// Options::streaming_stores, a Step of at least kStreamMinElems elements
// whose model copy is aligned to one vector of its elements (AVX2: 16 bytes
// for 16-bit copies, 32 for fp32; AVX-512: twice that) writes the copy with
// non-temporal stores: it skips the read-for-ownership and leaves the copy
// out of the caches. Parameters and moments, which the step has just read,
// always take plain stores (streaming them measured slower). ConvertIn of at
// least kStreamMinElems elements into a vector-aligned `dst` streams too: a
// bucket's first gradient contribution, written whole and read later (by the
// next rank's Accumulate or the step) when a bucket that large has mostly
// left the caches anyway; it measured 1.4x faster on a 32 MiB bucket. So
// does a SumContributions of that size that overwrites `dst` with at most 8
// sources of one type and takes the norm (from the registers, in the same
// pass).
class ShardOptimizer {
 public:
  static constexpr size_t kBlockElems = 16384;
  static constexpr size_t kStreamMinElems = size_t{1} << 20;

  struct Options {
    int num_threads = 1;                  // 1..256
    KernelPath path = KernelPath::kAuto;  // force a path (tests, benchmarks)
    bool streaming_stores = true;         // see the class comment
    // CPUs to pin the workers to, one each (see the class comment); empty:
    // unpinned. When given, num_threads must be its size.
    std::vector<int> cpus;
  };

  // InvalidArgument if num_threads is out of range, differs from a
  // non-empty cpus' size, or `path` is not supported by this CPU (see
  // KernelPathSupported), or when a worker cannot be pinned (a CPU that is
  // offline or outside the process's cpuset: pthread_setaffinity_np's
  // error).
  static absl::StatusOr<std::unique_ptr<ShardOptimizer>> Create(
      const Options& options);

  // Stops and joins the worker threads; must not race with a running call.
  ~ShardOptimizer();

  ShardOptimizer(const ShardOptimizer&) = delete;
  ShardOptimizer& operator=(const ShardOptimizer&) = delete;

  // One optimizer step over the shard. Blocks until done. InvalidArgument
  // (nothing written) for bad hyper-parameters (ValidateHyperParams) or a
  // null buffer that `hp.kind` needs while size > 0. NaN/inf in the inputs
  // propagate as in torch; checking for them is SumSquaresAndFinite's job.
  absl::Status Step(const StepHyperParams& hp, const ShardBuffers& shard);

  // dst[i] += fp32(src[i]) for i < n; src has type src_type. Blocks.
  // Requires non-null, non-overlapping buffers when n > 0.
  void Accumulate(float* dst, const void* src, DType src_type, size_t n);

  // dst[i] = fp32(src[i]) for i < n (gradients or weights arriving as
  // src_type). Blocks. Requires non-null, non-overlapping buffers when n > 0.
  void ConvertIn(float* dst, const void* src, DType src_type, size_t n);

  // dst[i] = src[i] as dst_type, rounded to nearest even exactly as
  // FloatToBf16 / FloatToHalf do. Blocks. Same requirements.
  void ConvertOut(void* dst, DType dst_type, const float* src, size_t n);

  // The partial squared gradient norm of this shard and whether it holds an
  // inf or NaN. Deterministic: each kBlockElems block is summed in a fixed
  // lane order, then blocks are added in order, so the bits depend on
  // neither num_threads nor the kernel path. Blocks.
  GradStats SumSquaresAndFinite(const float* g, size_t n, float scale);

  // One contribution to SumContributions: n elements of `type` at `data`.
  struct Source {
    const void* data = nullptr;
    DType type = DType::kFp32;
  };

  // Adds the sources to dst in their order (with `overwrite`, the first
  // replaces dst instead: ConvertIn), one block at a time, so each block of
  // dst stays in the cache while every source is added to it: dst crosses
  // memory once however many sources there are. With `norm_scale`, also
  // returns SumSquaresAndFinite(dst, n, *norm_scale) of the result, taken in
  // the same pass. dst and the result are bit for bit those of the
  // one-source calls in the same order. Blocks. Requires non-null,
  // non-overlapping buffers when n > 0; srcs may be empty only without
  // `overwrite`.
  GradStats SumContributions(float* dst, absl::Span<const Source> srcs, size_t n, bool overwrite,
                             const float* norm_scale);

  KernelPath path() const { return path_; }
  int num_threads() const { return num_threads_; }

 private:
  class Pool;

  ShardOptimizer(KernelPath path, const optimizer_internal::KernelSet* kernels,
                 int num_threads, bool streaming_stores, bool pinned);

  // Runs task(block) for every block of an n-element range; see the class
  // comment.
  template <typename Task>
  void ForEachBlock(size_t n, const Task& task)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(call_mu_);
  // Adds per-block sums of squares in block order.
  static GradStats AddBlockSums(const double* sums, size_t blocks);

  const KernelPath path_;
  const optimizer_internal::KernelSet* const kernels_;
  const int num_threads_;
  const bool streaming_stores_;
  const std::unique_ptr<Pool> pool_;

  absl::Mutex call_mu_;  // serialises calls
  std::vector<double> block_sums_ ABSL_GUARDED_BY(call_mu_);
};

}  // namespace zeroshard
