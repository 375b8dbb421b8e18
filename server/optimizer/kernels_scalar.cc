// The scalar kernels: the reference every vector path is tested against, and
// the path used where the CPU has neither AVX2 nor AVX-512.

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"
#include "server/optimizer/kernels.h"

#define ZS_ISA_NAMESPACE scalar
#define ZS_KERNEL_TARGET
#include "server/optimizer/kernels_inl.h"

namespace zeroshard::optimizer_internal {
namespace scalar {
namespace {

double SumSquares(const float* g, size_t n, float scale) {
  double lanes[kSumLanes] = {};
  SumSquaresTail(g, 0, n, scale, lanes);
  return ReduceLanes(lanes);
}

}  // namespace
}  // namespace scalar

const KernelSet& ScalarKernels() {
  static const KernelSet kSet = scalar::MakeKernelSet<scalar::ScalarIsa>(
      "scalar", sizeof(float), &scalar::SumSquares);
  return kSet;
}

}  // namespace zeroshard::optimizer_internal
