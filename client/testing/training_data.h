#pragma once

// Deterministic parameters and gradients for client tests: the same values
// on every run and every rank layout, so runs can be compared bit for bit.

#include <cstdint>
#include <vector>

#include "common/layout.h"

namespace zeroshard::testing {

// total_elements() values; tensors hold a fixed pattern, alignment gaps 0.
std::vector<float> InitialParams(const Layout& layout);

// grad[i - begin] for flat elements [begin, end): a function of the
// parameters the rank holds (params[0] is element `begin`), the rank and the
// step, so a wrong gather shows up in the next step's gradient.
void ComputeGradient(const float* params, uint64_t begin, uint64_t end, uint32_t rank,
                     uint64_t step, float* grad);

}  // namespace zeroshard::testing
