#pragma once

// Internal to //server/optimizer: the per-instruction-set kernel tables that
// optimizer.cc dispatches to. Every kernel works on one range of a shard on
// the calling thread; threading and blocking live in optimizer.cc.

#include <cstddef>
#include <cstdint>

namespace zeroshard::optimizer_internal {

// Elements per block. Blocks are the unit of work handed to threads, and the
// unit of the deterministic gradient-norm reduction, so this value is part of
// SumSquaresAndFinite's result and must not depend on options.
inline constexpr size_t kBlockElems = 16384;

// Lanes of the sum-of-squares accumulator: element j of a block is added to
// lane j % kSumLanes on every path, so all paths produce the same bits.
inline constexpr size_t kSumLanes = 16;

enum class StepKind : uint8_t { kAdamW = 0, kAdam = 1, kSgd = 2 };
inline constexpr int kNumStepKinds = 3;

// Element type of the model copy written beside the fp32 parameters.
enum class CopyKind : uint8_t { kNone = 0, kFp32 = 1, kBf16 = 2, kFp16 = 3 };
inline constexpr int kNumCopyKinds = 4;

// The fp32 constants of one step, rounded from the double hyper-parameters
// exactly where PyTorch rounds them (a Python float passed to a float tensor
// op becomes a float).
struct StepConstants {
  float grad_scale = 1.0f;
  bool apply_weight_decay = false;  // weight_decay != 0
  float weight_decay = 0.0f;        // Adam (L2) and SGD: g += wd * p
  float decay = 1.0f;               // AdamW: p *= 1 - lr * wd
  float beta1 = 0.0f;
  float one_minus_beta1 = 0.0f;
  float beta2 = 0.0f;
  float one_minus_beta2 = 0.0f;
  float bias_correction2_sqrt = 1.0f;
  float neg_step_size = 0.0f;       // -lr / (1 - beta1^step)
  float eps = 0.0f;
  // SGD.
  bool use_momentum = false;
  bool first_step = false;
  float momentum = 0.0f;
  float one_minus_dampening = 1.0f;
  float neg_lr = 0.0f;
};

// Non-owning views of one shard; index i addresses element i of every array.
struct StepBuffers {
  float* param = nullptr;
  const float* grad = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  void* copy = nullptr;
};

// Updates elements [begin, end). `stream` variants write the model copy with
// non-temporal stores (then fence) and require it to be aligned to the vector
// width at `begin`; param and the moments always take plain stores.
using StepFn = void (*)(const StepConstants& c, const StepBuffers& b,
                        size_t begin, size_t end);
// dst[i] (+)= fp32(src[i]) for i in [0, n).
using InFn = void (*)(float* dst, const void* src, size_t n);
// dst[i] = convert(src[i]) for i in [0, n).
using OutFn = void (*)(void* dst, const float* src, size_t n);
// dst[i] = ((dst[i] + s0[i]) + s1[i]) + ... over the k sources (all of one
// type), or (s0[i] + s1[i]) + ... with `overwrite`, for i in [0, n): the
// bits of one InFn pass per source, in one pass with the sum in registers.
// The squares variants also return what SumSquaresFn(dst, n, scale) would
// of the result, from the registers; the stream variants write dst with
// non-temporal stores (then fence) and require it aligned to the vector
// width. `n` <= kBlockElems for the squares variants.
using SumSourcesFn = double (*)(float* dst, const void* const* srcs, size_t k, size_t n,
                                bool overwrite, float scale);
// Sum over i in [0, n) of (double)(g[i] * scale)^2, element i into lane
// i % kSumLanes, lanes then added in order. `n` <= kBlockElems.
using SumSquaresFn = double (*)(const float* g, size_t n, float scale);

struct KernelSet {
  const char* name;
  size_t vector_bytes;  // bytes per vector of floats
  StepFn step[kNumStepKinds][kNumCopyKinds][2];  // [kind][copy][stream]
  InFn accumulate[kNumCopyKinds];                // by source type; kNone unused
  InFn convert_in[kNumCopyKinds][2];             // [source type][stream]
  OutFn convert_out[kNumCopyKinds];
  // [source type][stream][squares]; kNone unused
  SumSourcesFn sum_sources[kNumCopyKinds][2][2];
  SumSquaresFn sum_squares;
};

const KernelSet& ScalarKernels();
// Null when this build has no such path (not x86-64). Whether the CPU can
// run it is the caller's check.
const KernelSet* Avx2Kernels();
const KernelSet* Avx512Kernels();

}  // namespace zeroshard::optimizer_internal
