#pragma once

// P_a (ZeRO-R's partitioned activations): with model parallelism of degree
// M, each of the M ranks of an MP group keeps only its slice of a layer's
// checkpoint (ActivationKey.mp_rank / mp_size), and the trainers put the
// whole tensor together again (an all-gather among the MP ranks) before the
// layer is recomputed. These helpers are the one cut rule both directions
// use: a tensor of `bytes` bytes of `element_size`-byte elements is cut at
// element boundaries into M contiguous slices whose element counts differ
// by at most one, the first (elements % M) slices taking one more. A slice
// may be empty when M exceeds the element count.
//
// Pure functions; no threads, no allocation.

#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace zeroshard {

struct ActivationSliceRange {
  uint64_t offset = 0;  // bytes from the tensor's start
  uint64_t bytes = 0;
};

// MP rank `mp_rank`'s slice of the tensor. InvalidArgument naming the field
// for element_size 0, bytes not a multiple of element_size, or an mp_rank
// and mp_size no ActivationKey may carry (ValidateModelParallelRank:
// mp_size outside 1..kMaxModelParallel, mp_rank >= mp_size).
absl::StatusOr<ActivationSliceRange> ActivationSlice(uint64_t bytes, size_t element_size,
                                                     uint32_t mp_rank, uint32_t mp_size);

// Copies each MP rank's slice (slices[r], r < M = slices.size(), each of the
// size ActivationSlice gives) into its place in `whole` (`bytes` bytes).
// InvalidArgument (naming the rank) for a slice of the wrong size; nothing is
// written then.
absl::Status ReassembleActivation(absl::Span<const absl::Span<const uint8_t>> slices,
                                  size_t element_size, void* whole, uint64_t bytes);

}  // namespace zeroshard
