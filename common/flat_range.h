#pragma once

#include <algorithm>
#include <cstdint>
#include <ostream>

namespace zeroshard {

// A half-open range [begin, end) of the flat element index space.
struct FlatRange {
  uint64_t begin = 0;
  uint64_t end = 0;

  uint64_t size() const { return end > begin ? end - begin : 0; }
  bool empty() const { return end <= begin; }
  bool Contains(const FlatRange& o) const { return begin <= o.begin && o.end <= end; }
  // Empty when the two do not overlap.
  FlatRange Intersect(const FlatRange& o) const {
    FlatRange r{std::max(begin, o.begin), std::min(end, o.end)};
    if (r.end < r.begin) r.end = r.begin;
    return r;
  }
  friend bool operator==(const FlatRange& a, const FlatRange& b) {
    return a.begin == b.begin && a.end == b.end;
  }
  friend bool operator!=(const FlatRange& a, const FlatRange& b) { return !(a == b); }
  friend std::ostream& operator<<(std::ostream& os, const FlatRange& r) {
    return os << "[" << r.begin << ", " << r.end << ")";
  }
};

}  // namespace zeroshard
