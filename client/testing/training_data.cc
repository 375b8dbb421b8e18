#include "client/testing/training_data.h"

namespace zeroshard::testing {

std::vector<float> InitialParams(const Layout& layout) {
  std::vector<float> p(layout.total_elements(), 0.0f);
  for (const TensorPlacement& t : layout.tensors()) {
    for (uint64_t i = t.offset; i < t.offset + t.numel; ++i) {
      p[i] = 0.01f * static_cast<float>(static_cast<int64_t>(i % 101) - 50);
    }
  }
  return p;
}

void ComputeGradient(const float* params, uint64_t begin, uint64_t end, uint32_t rank,
                     uint64_t step, float* grad) {
  for (uint64_t i = begin; i < end; ++i) {
    grad[i - begin] = params[i - begin] * (0.5f + 0.1f * rank) +
                      0.001f * static_cast<float>((i * 7 + step * 13 + rank * 31) % 17);
  }
}

}  // namespace zeroshard::testing
