#include "server/step/owned_tensors.h"

#include <algorithm>

namespace zeroshard {

OwnedTensors::OwnedTensors(const Layout& layout, FlatRange owned) : owned_(owned) {
  const auto [first, last] = layout.TensorsIn(owned);
  frozen_before_.push_back(0);
  for (size_t i = first; i < last; ++i) {
    const TensorPlacement& t = layout.tensors()[i];
    Entry e;
    e.index = static_cast<uint32_t>(i);
    e.range = t.range().Intersect(owned);
    e.group = t.spec.group;
    e.frozen = t.spec.frozen;
    if (e.frozen) frozen_elements_ += e.range.size();
    entries_.push_back(e);
    frozen_before_.push_back(frozen_elements_);
  }
}

int64_t OwnedTensors::Find(uint32_t index) const {
  if (entries_.empty() || index < entries_.front().index || index > entries_.back().index) {
    return -1;
  }
  return static_cast<int64_t>(index - entries_.front().index);
}

std::pair<size_t, size_t> OwnedTensors::In(const FlatRange& range) const {
  auto first = std::upper_bound(entries_.begin(), entries_.end(), range.begin,
                                [](uint64_t pos, const Entry& e) { return pos < e.range.end; });
  auto last = std::lower_bound(first, entries_.end(), range.end,
                               [](const Entry& e, uint64_t pos) { return e.range.begin < pos; });
  return {static_cast<size_t>(first - entries_.begin()),
          static_cast<size_t>(last - entries_.begin())};
}

uint64_t OwnedTensors::MomentIndex(uint64_t pos) const {
  // Entries ending at or before pos are wholly before it.
  const size_t before = static_cast<size_t>(
      std::upper_bound(entries_.begin(), entries_.end(), pos,
                       [](uint64_t p, const Entry& e) { return p < e.range.end; }) -
      entries_.begin());
  return (pos - owned_.begin) - frozen_before_[before];
}

}  // namespace zeroshard
