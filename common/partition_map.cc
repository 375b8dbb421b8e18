#include "common/partition_map.h"

#include "absl/strings/str_cat.h"
#include "common/layout.h"

namespace zeroshard {

absl::StatusOr<PartitionMap> PartitionMap::Create(uint64_t total_elements, uint32_t world_size,
                                                  uint32_t num_daemons) {
  if (total_elements == 0 || total_elements > Layout::kMaxElements) {
    return absl::InvalidArgumentError(absl::StrCat(
        "total_elements: must be in 1..2^48, got ", total_elements));
  }
  if (world_size == 0 || world_size > kMaxWorldSize) {
    return absl::InvalidArgumentError(absl::StrCat(
        "world_size: N_d must be in 1..", kMaxWorldSize, ", got ", world_size));
  }
  if (num_daemons == 0 || num_daemons > world_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_daemons: must be in 1..world_size (", world_size, "), got ", num_daemons));
  }
  PartitionMap map;
  map.total_elements_ = total_elements;
  map.world_size_ = world_size;
  map.num_daemons_ = num_daemons;
  uint64_t per = (total_elements + world_size - 1) / world_size;
  per = (per + kPartitionAlignment - 1) / kPartitionAlignment * kPartitionAlignment;
  map.partition_elements_ = per;
  return map;
}

std::vector<uint32_t> PartitionMap::PartitionsOfDaemon(uint32_t daemon) const {
  std::vector<uint32_t> out;
  for (uint32_t i = 0; i < world_size_; ++i) {
    if (DaemonOf(i) == daemon) out.push_back(i);
  }
  return out;
}

FlatRange PartitionMap::DaemonRange(uint32_t daemon) const {
  std::vector<uint32_t> parts = PartitionsOfDaemon(daemon);
  if (parts.empty()) return {};
  return {Partition(parts.front()).begin, Partition(parts.back()).end};
}

absl::StatusOr<std::vector<PartitionMap::Piece>> PartitionMap::Split(
    const FlatRange& range) const {
  if (range.begin > range.end || range.end > padded_elements()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "range: [", range.begin, ", ", range.end, ") is not inside the padded flat space [0, ",
        padded_elements(), ")"));
  }
  std::vector<Piece> pieces;
  uint64_t pos = range.begin;
  while (pos < range.end) {
    const uint32_t p = static_cast<uint32_t>(pos / partition_elements_);
    const uint64_t end = std::min(range.end, Partition(p).end);
    pieces.push_back({p, {pos, end}});
    pos = end;
  }
  return pieces;
}

}  // namespace zeroshard
