#include "client/bucket_plan.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace zeroshard {

uint64_t BucketPlan::StagingBytes(uint64_t bucket_bytes, DType wire_dtype) {
  const uint64_t esize = DTypeSize(wire_dtype);
  return std::min(bucket_bytes, kMaxChunkBytes) / esize * esize;
}

absl::StatusOr<BucketPlan> BucketPlan::Create(const Layout& layout, const PartitionMap& map,
                                              uint64_t bucket_bytes, DType wire_dtype) {
  const uint64_t elements = StagingBytes(bucket_bytes, wire_dtype) / DTypeSize(wire_dtype);
  if (elements == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bucket_bytes: ", bucket_bytes, " holds no ", DTypeName(wire_dtype), " element"));
  }
  if (map.total_elements() != layout.total_elements()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the partition map covers ", map.total_elements(), " elements, the layout ",
        layout.total_elements()));
  }
  BucketPlan plan;
  plan.wire_dtype_ = wire_dtype;
  plan.bucket_elements_ = elements;
  plan.total_elements_ = layout.total_elements();
  plan.tensors_.reserve(layout.tensors().size());
  for (const TensorPlacement& t : layout.tensors()) plan.tensors_.push_back(t.range());
  for (uint32_t p = 0; p < map.world_size(); ++p) {
    const FlatRange part = map.UnpaddedPartition(p);
    for (uint64_t b = part.begin; b < part.end; b += elements) {
      Bucket bucket;
      bucket.range = {b, std::min(part.end, b + elements)};
      bucket.partition = p;
      bucket.daemon = map.DaemonOf(p);
      bucket.real_elements = plan.RealElements(bucket.range);
      plan.buckets_.push_back(bucket);
    }
  }
  return plan;
}

size_t BucketPlan::FirstTensorEndingAfter(uint64_t pos) const {
  auto it = std::upper_bound(tensors_.begin(), tensors_.end(), pos,
                             [](uint64_t p, const FlatRange& t) { return p < t.end; });
  return static_cast<size_t>(it - tensors_.begin());
}

uint64_t BucketPlan::RealElements(const FlatRange& range) const {
  uint64_t n = 0;
  ForEachRealSegment(range, [&n](const FlatRange& s) { n += s.size(); });
  return n;
}

std::pair<size_t, size_t> BucketPlan::Overlapping(const FlatRange& range) const {
  if (range.empty()) return {0, 0};
  auto first = std::upper_bound(buckets_.begin(), buckets_.end(), range.begin,
                                [](uint64_t p, const Bucket& b) { return p < b.range.end; });
  auto last = std::lower_bound(first, buckets_.end(), range.end,
                               [](const Bucket& b, uint64_t p) { return b.range.begin < p; });
  return {static_cast<size_t>(first - buckets_.begin()),
          static_cast<size_t>(last - buckets_.begin())};
}

}  // namespace zeroshard
