#pragma once

// ZeRO's partitioning of the flat space: N_d equal contiguous partitions of
// the padded space (partition i belongs to data-parallel rank i), each placed
// on a daemon, and the split of any flat range into per-partition pieces.

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "common/flat_range.h"

namespace zeroshard {

class PartitionMap {
 public:
  // Partition sizes are rounded up to this many elements (256 B of fp32), so
  // each partition starts SIMD- and cache-line aligned.
  static constexpr uint64_t kPartitionAlignment = 64;
  static constexpr uint32_t kMaxWorldSize = 65536;

  struct Piece {
    uint32_t partition = 0;
    FlatRange range;  // global flat indices, inside partition `partition`
  };

  // InvalidArgument naming the field: total_elements 0 or over 2^48,
  // world_size 0 or over kMaxWorldSize, num_daemons 0 or over world_size.
  static absl::StatusOr<PartitionMap> Create(uint64_t total_elements, uint32_t world_size,
                                             uint32_t num_daemons = 1);

  uint64_t total_elements() const { return total_elements_; }
  uint64_t padded_elements() const { return partition_elements_ * world_size_; }
  uint64_t partition_elements() const { return partition_elements_; }
  uint32_t world_size() const { return world_size_; }
  uint32_t num_daemons() const { return num_daemons_; }

  // Padded range of partition i (i < world_size).
  FlatRange Partition(uint32_t i) const {
    return {i * partition_elements_, (i + 1) * partition_elements_};
  }
  // Part of partition i that holds real elements (below total_elements).
  FlatRange UnpaddedPartition(uint32_t i) const {
    return Partition(i).Intersect({0, total_elements_});
  }
  // Daemon index owning partition i: i * num_daemons / world_size, so each
  // daemon owns a contiguous run of partitions.
  uint32_t DaemonOf(uint32_t partition) const {
    return static_cast<uint32_t>(uint64_t{partition} * num_daemons_ / world_size_);
  }
  std::vector<uint32_t> PartitionsOfDaemon(uint32_t daemon) const;
  // The padded flat range covered by `daemon`'s partitions.
  FlatRange DaemonRange(uint32_t daemon) const;

  // Splits `range` into per-partition pieces, in order; they reassemble it
  // exactly. InvalidArgument if begin > end or end > padded_elements().
  absl::StatusOr<std::vector<Piece>> Split(const FlatRange& range) const;

 private:
  uint64_t total_elements_ = 0;
  uint64_t partition_elements_ = 0;
  uint32_t world_size_ = 1;
  uint32_t num_daemons_ = 1;
};

}  // namespace zeroshard
