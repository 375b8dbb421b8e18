#include "common/layout.h"

#include <algorithm>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/fnv.h"

namespace zeroshard {
namespace {

// The fingerprint's starting value (part of the wire contract: client and
// daemon compare fingerprints).
constexpr uint64_t kFingerprintSeed = 1469598103934665603ull;

void Mix(uint64_t& h, const void* data, size_t n) { Fnv1aMix(h, data, n); }
void MixU64(uint64_t& h, uint64_t v) {
  unsigned char b[8];
  for (int i = 0; i < 8; ++i) b[i] = static_cast<unsigned char>(v >> (8 * i));
  Mix(h, b, 8);
}

uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

// `field` is e.g. "tensors[3].name" or "tensors[3].aliases[0]".
absl::Status CheckName(const std::string& name, const std::string& field) {
  if (name.empty() || name.size() > Layout::kMaxNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": must be 1..", Layout::kMaxNameBytes, " bytes, got ", name.size()));
  }
  for (unsigned char c : name) {
    if (c < 0x20 || c > 0x7e) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": only printable ASCII is allowed"));
    }
  }
  return absl::OkStatus();
}

// Marks the fields added after the first layouts: mixed only when a tensor
// has a group, a frozen flag or aliases, so older layouts keep their
// fingerprints (and their checkpoints stay loadable).
constexpr uint64_t kExtendedTensorMarker = 0x7a73'6772'6f75'7073ull;

}  // namespace

absl::StatusOr<Layout> Layout::Create(std::vector<TensorSpec> tensors, uint64_t alignment) {
  if (alignment == 0) alignment = kDefaultAlignment;
  if (alignment > 4096 || (alignment & (alignment - 1)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "alignment_elements: must be a power of two in 1..4096, got ", alignment));
  }
  if (tensors.empty()) {
    return absl::InvalidArgumentError("tensors: the layout has no tensors");
  }
  Layout layout;
  layout.alignment_ = alignment;
  absl::flat_hash_set<std::string> names;
  uint64_t h = kFingerprintSeed;
  MixU64(h, alignment);
  uint64_t cursor = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    TensorSpec& t = tensors[i];
    if (absl::Status s = CheckName(t.name, absl::StrCat("tensors[", i, "].name")); !s.ok()) {
      return s;
    }
    if (!names.insert(t.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensors[", i, "].name: \"", t.name, "\" appears twice"));
    }
    if (t.aliases.size() > kMaxAliases) {
      return absl::InvalidArgumentError(absl::StrCat("tensors[", i, "].aliases (", t.name,
                                                     "): at most ", kMaxAliases, ", got ",
                                                     t.aliases.size()));
    }
    for (size_t a = 0; a < t.aliases.size(); ++a) {
      const std::string field = absl::StrCat("tensors[", i, "].aliases[", a, "]");
      if (absl::Status s = CheckName(t.aliases[a], field); !s.ok()) return s;
      if (!names.insert(t.aliases[a]).second) {
        return absl::InvalidArgumentError(absl::StrCat(
            field, " (", t.name, "): \"", t.aliases[a], "\" is already a name in the layout"));
      }
    }
    if (t.group >= kMaxParamGroups) {
      return absl::InvalidArgumentError(absl::StrCat("tensors[", i, "].group (", t.name,
                                                     "): must be < ", kMaxParamGroups, ", got ",
                                                     t.group));
    }
    if (t.shape.empty() || t.shape.size() > kMaxDims) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensors[", i, "].shape (", t.name, "): needs 1..", kMaxDims,
          " dimensions, got ", t.shape.size()));
    }
    if (t.dtype != DType::kFp32 && t.dtype != DType::kBf16 && t.dtype != DType::kFp16) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensors[", i, "].dtype (", t.name, "): unknown dtype ", static_cast<int>(t.dtype)));
    }
    uint64_t numel = 1;
    for (size_t d = 0; d < t.shape.size(); ++d) {
      const int64_t dim = t.shape[d];
      if (dim < 1) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensors[", i, "].shape[", d, "] (", t.name, "): must be >= 1, got ", dim));
      }
      if (static_cast<uint64_t>(dim) > kMaxElements ||
          numel > kMaxElements / static_cast<uint64_t>(dim)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensors[", i, "].shape (", t.name, "): more than 2^48 elements"));
      }
      numel *= static_cast<uint64_t>(dim);
    }
    if (i > 0 && t.layer < tensors[i - 1].layer) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensors[", i, "].layer (", t.name, "): layer ids must not decrease, got ",
          t.layer, " after ", tensors[i - 1].layer));
    }
    const uint64_t offset = AlignUp(cursor, alignment);
    if (offset + numel > kMaxElements) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensors[", i, "] (", t.name, "): the layout exceeds 2^48 elements"));
    }
    cursor = offset + numel;
    layout.parameter_count_ += numel;

    MixU64(h, t.name.size());
    Mix(h, t.name.data(), t.name.size());
    MixU64(h, t.shape.size());
    for (int64_t dim : t.shape) MixU64(h, static_cast<uint64_t>(dim));
    MixU64(h, static_cast<uint64_t>(t.dtype));
    MixU64(h, t.layer);
    if (t.group != 0 || t.frozen || !t.aliases.empty()) {
      MixU64(h, kExtendedTensorMarker);
      MixU64(h, t.group);
      MixU64(h, t.frozen ? 1 : 0);
      MixU64(h, t.aliases.size());
      for (const std::string& a : t.aliases) {
        MixU64(h, a.size());
        Mix(h, a.data(), a.size());
      }
    }
    layout.group_count_ = std::max(layout.group_count_, t.group + 1);
    if (t.frozen) layout.frozen_elements_ += numel;

    if (layout.layers_.empty() || layout.layers_.back() != t.layer) {
      layout.layers_.push_back(t.layer);
      layout.layer_ranges_.push_back({offset, offset + numel});
    }
    layout.layer_ranges_.back().end = AlignUp(offset + numel, alignment);
    layout.tensors_.push_back(TensorPlacement{std::move(t), offset, numel});
  }
  layout.total_elements_ = AlignUp(cursor, alignment);
  layout.fingerprint_ = h;
  return layout;
}

std::pair<size_t, size_t> Layout::TensorsIn(const FlatRange& range) const {
  // Tensors are in flat order and do not overlap: the first one ending after
  // range.begin, then every one starting before range.end.
  auto first = std::upper_bound(
      tensors_.begin(), tensors_.end(), range.begin,
      [](uint64_t pos, const TensorPlacement& t) { return pos < t.offset + t.numel; });
  auto last = std::lower_bound(
      first, tensors_.end(), range.end,
      [](const TensorPlacement& t, uint64_t pos) { return t.offset < pos; });
  return {static_cast<size_t>(first - tensors_.begin()),
          static_cast<size_t>(last - tensors_.begin())};
}

absl::StatusOr<FlatRange> Layout::LayerRange(uint32_t layer) const {
  auto it = std::lower_bound(layers_.begin(), layers_.end(), layer);
  if (it == layers_.end() || *it != layer) {
    return absl::NotFoundError(absl::StrCat("layer ", layer, " has no tensors"));
  }
  return layer_ranges_[it - layers_.begin()];
}

}  // namespace zeroshard
