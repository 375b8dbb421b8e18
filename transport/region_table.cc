#include "transport/region_table.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace zeroshard::transport {

absl::Status CheckAccess(const RegionRecord& record, uint64_t offset,
                         uint64_t length, Access needed,
                         absl::string_view owner) {
  if (!RangeWithin(record.length, offset, length)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bytes [", offset, ", ", offset, "+", length, ") lie outside region ",
        record.id, " of ", owner, " (", record.length, " bytes)"));
  }
  if (!Allows(record.access, needed)) {
    return absl::PermissionDeniedError(absl::StrCat(
        "region ", record.id, " of ", owner, " does not allow remote ",
        needed == Access::kRemoteWrite ? "writes" : "reads"));
  }
  return absl::OkStatus();
}

std::shared_ptr<RegionRecord> RegionTable::Add(uint64_t owner, char* base,
                                               size_t length, Access access) {
  auto record = std::make_shared<RegionRecord>();
  record->owner = owner;
  record->base = base;
  record->length = length;
  record->access = access;
  absl::MutexLock lock(&mu_);
  record->id = next_id_++;
  record->token = absl::Uniform<uint64_t>(bitgen_);
  regions_[record->id] = record;
  return record;
}

std::shared_ptr<RegionRecord> RegionTable::Find(uint64_t id) {
  absl::MutexLock lock(&mu_);
  auto it = regions_.find(id);
  return it == regions_.end() ? nullptr : it->second;
}

void RegionTable::Revoke(RegionRecord& record) {
  {
    absl::MutexLock lock(&mu_);
    regions_.erase(record.id);
  }
  Kill(record);
}

void RegionTable::RevokeOwnedBy(uint64_t owner) {
  std::vector<std::shared_ptr<RegionRecord>> owned;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = regions_.begin(); it != regions_.end();) {
      if (it->second->owner == owner) {
        owned.push_back(std::move(it->second));
        regions_.erase(it++);
      } else {
        ++it;
      }
    }
  }
  for (auto& record : owned) Kill(*record);
}

void RegionTable::Kill(RegionRecord& record) {
  absl::MutexLock lock(&record.mu);
  record.live = false;
}

}  // namespace zeroshard::transport
