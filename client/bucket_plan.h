#pragma once

// The constant-size buckets (C_B) that gradient pushes are cut into.
//
// The cut rule, identical on every rank of a job: the real part of each
// span, [begin, min(end, total_elements)), is cut every
// E = min(C_B, kMaxChunkBytes) / sizeof(precision) elements, counted from the
// span's first element. The spans are the partitions [p * P, (p + 1) * P)
// (BucketCut::kPartition: what trainer-collective mode pushes, one
// partition per rank) or each daemon's run of partitions
// (BucketCut::kDaemon: daemon reduction, where a daemon sums its whole range
// alike, so a rank's gradient for one daemon is at most
// ceil(range / E) buckets however many partitions the range holds). A bucket
// therefore never crosses a daemon boundary (with kPartition, nor a
// partition boundary) and never reaches into the padding. With `at_layers`
// (stage 3, which pushes layer by layer) each span is first cut at the
// layers' boundaries (Layout::LayerRange) and each piece cut every E from
// its start, so a layer's push covers whole buckets and never leaves one
// partly written for another layer to complete, whatever order the layers'
// gradients arrive in. Buckets depend only on (layout, N_d, daemons, C_B,
// precision, cut, at_layers): not on how a rank splits its PushGradients
// calls.
//
// Elements of a bucket that belong to no tensor (alignment gaps) are "gap"
// elements; a bucket is complete once all of its real elements are written.

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "common/flat_range.h"
#include "common/layout.h"
#include "common/partition_map.h"
#include "common/protocol.h"

namespace zeroshard {

// Which spans a BucketPlan cuts (see above).
enum class BucketCut {
  kPartition,  // each partition apart
  kDaemon,     // each daemon's partitions as one span
};

struct Bucket {
  FlatRange range;             // inside one span of the cut and [0, total_elements)
  uint32_t partition = 0;      // of its first element
  uint32_t daemon = 0;         // index into the job's daemon list
  uint64_t real_elements = 0;  // elements of `range` that belong to a tensor
};

class BucketPlan {
 public:
  // InvalidArgument when `bucket_bytes` is under one element or the map was
  // not made for this layout (total elements differ).
  static absl::StatusOr<BucketPlan> Create(const Layout& layout, const PartitionMap& map,
                                           uint64_t bucket_bytes, DType wire_dtype, BucketCut cut,
                                           bool at_layers = false);

  // Bytes of the largest bucket (the size of one staging buffer).
  static uint64_t StagingBytes(uint64_t bucket_bytes, DType wire_dtype);

  DType wire_dtype() const { return wire_dtype_; }
  uint64_t bucket_elements() const { return bucket_elements_; }
  uint64_t bucket_bytes() const { return bucket_elements_ * DTypeSize(wire_dtype_); }
  uint64_t total_elements() const { return total_elements_; }
  const std::vector<Bucket>& buckets() const { return buckets_; }

  // Indices [first, last) of the buckets that overlap `range`.
  std::pair<size_t, size_t> Overlapping(const FlatRange& range) const;

  // Calls fn(FlatRange) for each maximal run of real (tensor) elements inside
  // `range`, in order.
  template <typename Fn>
  void ForEachRealSegment(const FlatRange& range, Fn fn) const {
    size_t i = FirstTensorEndingAfter(range.begin);
    for (; i < tensors_.size() && tensors_[i].begin < range.end; ++i) {
      const FlatRange s = tensors_[i].Intersect(range);
      if (!s.empty()) fn(s);
    }
  }
  // The same for the gap elements inside `range`.
  template <typename Fn>
  void ForEachGapSegment(const FlatRange& range, Fn fn) const {
    uint64_t pos = range.begin;
    ForEachRealSegment(range, [&](const FlatRange& s) {
      if (s.begin > pos) fn(FlatRange{pos, s.begin});
      pos = s.end;
    });
    if (pos < range.end) fn(FlatRange{pos, range.end});
  }
  // Real elements inside `range`.
  uint64_t RealElements(const FlatRange& range) const;

 private:
  size_t FirstTensorEndingAfter(uint64_t pos) const;

  DType wire_dtype_ = DType::kFp32;
  uint64_t bucket_elements_ = 0;
  uint64_t total_elements_ = 0;
  std::vector<Bucket> buckets_;     // tile [0, total_elements) in order
  std::vector<FlatRange> tensors_;  // each tensor's range, in flat order
};

}  // namespace zeroshard
