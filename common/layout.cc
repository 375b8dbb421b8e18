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

absl::Status CheckName(const std::string& name, size_t index) {
  if (name.empty() || name.size() > Layout::kMaxNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensors[", index, "].name: must be 1..", Layout::kMaxNameBytes,
        " bytes, got ", name.size()));
  }
  for (unsigned char c : name) {
    if (c < 0x20 || c > 0x7e) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensors[", index, "].name: only printable ASCII is allowed"));
    }
  }
  return absl::OkStatus();
}

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
    if (absl::Status s = CheckName(t.name, i); !s.ok()) return s;
    if (!names.insert(t.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensors[", i, "].name: \"", t.name, "\" appears twice"));
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

absl::StatusOr<FlatRange> Layout::LayerRange(uint32_t layer) const {
  auto it = std::lower_bound(layers_.begin(), layers_.end(), layer);
  if (it == layers_.end() || *it != layer) {
    return absl::NotFoundError(absl::StrCat("layer ", layer, " has no tensors"));
  }
  return layer_ranges_[it - layers_.begin()];
}

}  // namespace zeroshard
