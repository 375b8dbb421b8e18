#pragma once

// The model layout: an ordered list of tensors flattened into one index space
// of elements, each tensor starting at a multiple of the alignment. Every rank
// and every daemon of a job derives the same flat space from the same list.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "common/flat_range.h"

namespace zeroshard {

struct TensorSpec {
  std::string name;            // unique, 1..256 printable ASCII bytes
  std::vector<int64_t> shape;  // 1..8 dims, each >= 1
  DType dtype = DType::kFp32;  // type the trainer holds it in
  uint32_t layer = 0;          // non-decreasing in registration order
  // The parameter group whose hyper-parameters update it (an index into
  // JobSettings::param_groups), < kMaxParamGroups.
  uint32_t group = 0;
  // Never updated and holds no optimizer state (a parameter with
  // requires_grad=False, or a buffer kept with the model's states).
  bool frozen = false;
  // Other names of the same tensor (tied weights: a state dict lists it
  // under each); the name rules apply, and every name and alias of a
  // layout is unique. At most kMaxAliases.
  std::vector<std::string> aliases;
};

struct TensorPlacement {
  TensorSpec spec;
  uint64_t offset = 0;  // first flat element
  uint64_t numel = 0;   // product of shape
  FlatRange range() const { return {offset, offset + numel}; }
};

class Layout {
 public:
  static constexpr uint64_t kDefaultAlignment = 64;  // elements (256 B of fp32)
  static constexpr uint64_t kMaxElements = uint64_t{1} << 48;
  static constexpr size_t kMaxDims = 8;
  static constexpr size_t kMaxNameBytes = 256;
  static constexpr size_t kMaxAliases = 16;
  static constexpr uint32_t kMaxParamGroups = 256;

  // Validates and places `tensors`. `alignment` in elements: a power of two in
  // 1..4096, or 0 for kDefaultAlignment. InvalidArgument names the offending
  // tensor and field (empty list, empty/duplicate/non-printable name, bad
  // dimension, decreasing layer, element count over 2^48).
  static absl::StatusOr<Layout> Create(std::vector<TensorSpec> tensors,
                                       uint64_t alignment = 0);

  const std::vector<TensorPlacement>& tensors() const { return tensors_; }
  uint64_t alignment() const { return alignment_; }
  // Ψ: elements that hold parameters (no padding).
  uint64_t parameter_count() const { return parameter_count_; }
  // Size of the flat space: the last tensor's end rounded up to the alignment.
  uint64_t total_elements() const { return total_elements_; }
  // Distinct layer ids, ascending.
  const std::vector<uint32_t>& layers() const { return layers_; }
  // The flat range spanned by `layer`'s tensors (from its first tensor's
  // offset to the aligned end of its last). NotFound for an unknown layer.
  absl::StatusOr<FlatRange> LayerRange(uint32_t layer) const;
  // Stable 64-bit fingerprint of names, shapes, dtypes, layers, groups,
  // frozen flags, aliases and alignment (a layout without groups, frozen
  // tensors or aliases hashes as it did before they existed).
  uint64_t fingerprint() const { return fingerprint_; }
  // Indices [first, last) of the tensors that overlap `range`.
  std::pair<size_t, size_t> TensorsIn(const FlatRange& range) const;
  // The largest group index of any tensor, plus one.
  uint32_t group_count() const { return group_count_; }
  // Elements of frozen tensors.
  uint64_t frozen_elements() const { return frozen_elements_; }

 // An empty layout (no tensors); real ones come from Create.
  Layout() = default;

 private:
  std::vector<TensorPlacement> tensors_;
  std::vector<uint32_t> layers_;
  std::vector<FlatRange> layer_ranges_;  // parallel to layers_
  uint64_t alignment_ = kDefaultAlignment;
  uint64_t parameter_count_ = 0;
  uint64_t total_elements_ = 0;
  uint64_t fingerprint_ = 0;
  uint32_t group_count_ = 1;
  uint64_t frozen_elements_ = 0;
};

}  // namespace zeroshard
