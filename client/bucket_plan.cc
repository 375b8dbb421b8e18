#include "client/bucket_plan.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace zeroshard {

uint64_t BucketPlan::StagingBytes(uint64_t bucket_bytes, DType wire_dtype) {
  const uint64_t esize = DTypeSize(wire_dtype);
  return std::min(bucket_bytes, kMaxChunkBytes) / esize * esize;
}

absl::StatusOr<BucketPlan> BucketPlan::Create(const Layout& layout, const PartitionMap& map,
                                              uint64_t bucket_bytes, DType wire_dtype,
                                              BucketCut cut, bool at_layers) {
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
  const FlatRange real{0, layout.total_elements()};
  // The pieces cut every `elements` from their start: the spans, or with
  // `at_layers` the spans cut at the layer boundaries (the layer ranges tile
  // the flat space).
  std::vector<FlatRange> layer_ranges;
  if (at_layers) {
    for (uint32_t layer : layout.layers()) layer_ranges.push_back(*layout.LayerRange(layer));
  } else {
    layer_ranges.push_back(real);
  }
  const uint32_t spans = cut == BucketCut::kPartition ? map.world_size() : map.num_daemons();
  size_t first_layer = 0;
  for (uint32_t i = 0; i < spans; ++i) {
    const FlatRange span =
        (cut == BucketCut::kPartition ? map.Partition(i) : map.DaemonRange(i)).Intersect(real);
    while (first_layer < layer_ranges.size() && layer_ranges[first_layer].end <= span.begin) {
      ++first_layer;
    }
    for (size_t l = first_layer; l < layer_ranges.size() && layer_ranges[l].begin < span.end;
         ++l) {
      const FlatRange piece = span.Intersect(layer_ranges[l]);
      for (uint64_t b = piece.begin; b < piece.end; b += elements) {
        Bucket bucket;
        bucket.range = {b, std::min(piece.end, b + elements)};
        bucket.partition = static_cast<uint32_t>(b / map.partition_elements());
        bucket.daemon = map.DaemonOf(bucket.partition);
        bucket.real_elements = plan.RealElements(bucket.range);
        plan.buckets_.push_back(bucket);
      }
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
