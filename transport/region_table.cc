#include "transport/region_table.h"

#include <utility>
#include <vector>

namespace zeroshard::transport {

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
