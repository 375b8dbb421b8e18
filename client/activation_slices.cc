#include "client/activation_slices.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/activation_protocol.h"
#include "common/status_macros.h"

namespace zeroshard {

absl::StatusOr<ActivationSliceRange> ActivationSlice(uint64_t bytes, size_t element_size,
                                                     uint32_t mp_rank, uint32_t mp_size) {
  if (element_size == 0) return absl::InvalidArgumentError("element_size: must be >= 1");
  if (bytes % element_size != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("bytes: ", bytes, " is not a multiple of element_size ", element_size));
  }
  RETURN_IF_ERROR(ValidateModelParallelRank(mp_rank, mp_size, ""));
  const uint64_t elements = bytes / element_size;
  const uint64_t base = elements / mp_size, extra = elements % mp_size;
  const uint64_t first = mp_rank * base + std::min<uint64_t>(mp_rank, extra);
  const uint64_t count = base + (mp_rank < extra ? 1 : 0);
  return ActivationSliceRange{first * element_size, count * element_size};
}

absl::Status ReassembleActivation(absl::Span<const absl::Span<const uint8_t>> slices,
                                  size_t element_size, void* whole, uint64_t bytes) {
  const uint32_t m = static_cast<uint32_t>(slices.size());
  if (m == 0) return absl::InvalidArgumentError("slices: none given");
  if (whole == nullptr && bytes > 0) return absl::InvalidArgumentError("whole: null");
  for (uint32_t r = 0; r < m; ++r) {
    ASSIGN_OR_RETURN(ActivationSliceRange range, ActivationSlice(bytes, element_size, r, m));
    if (slices[r].size() != range.bytes) {
      return absl::InvalidArgumentError(absl::StrCat("slices[", r, "]: ", slices[r].size(),
                                                     " bytes, the slice of MP rank ", r, " of ", m,
                                                     " has ", range.bytes));
    }
  }
  for (uint32_t r = 0; r < m; ++r) {
    const ActivationSliceRange range = *ActivationSlice(bytes, element_size, r, m);
    if (range.bytes > 0) {
      std::memcpy(static_cast<uint8_t*>(whole) + range.offset, slices[r].data(), range.bytes);
    }
  }
  return absl::OkStatus();
}

}  // namespace zeroshard
