#pragma once

// The tensors of a job's layout that overlap the flat range one daemon owns,
// with what the optimizer needs of each: its parameter group, whether it is
// frozen, and where its optimizer moments live. Frozen tensors hold no
// moments, so the moment arrays cover the owned range minus the frozen
// tensors' elements ("moment space"): alignment gaps and partition padding
// keep their places there, which keeps every stretch without a frozen
// tensor contiguous in both spaces.
//
// Immutable after construction; wire-free; safe to share between threads.

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/types/span.h"
#include "common/flat_range.h"
#include "common/layout.h"

namespace zeroshard {

class OwnedTensors {
 public:
  struct Entry {
    uint32_t index = 0;  // in the layout
    FlatRange range;     // the tensor's elements inside the owned range
    uint32_t group = 0;
    bool frozen = false;
  };

  OwnedTensors() = default;
  OwnedTensors(const Layout& layout, FlatRange owned);

  FlatRange owned() const { return owned_; }
  // In layout order: consecutive layout indices.
  const std::vector<Entry>& entries() const { return entries_; }
  // The position in entries() of layout tensor `index`, or -1 when it does
  // not overlap the owned range.
  int64_t Find(uint32_t index) const;
  // Positions [first, last) of the entries that overlap `range`.
  std::pair<size_t, size_t> In(const FlatRange& range) const;
  // Elements of frozen tensors inside the owned range.
  uint64_t frozen_elements() const { return frozen_elements_; }
  // Elements of the moment space: owned().size() - frozen_elements().
  uint64_t moment_elements() const { return owned_.size() - frozen_elements_; }
  // The moment-space index of flat element `pos` (in the owned range, not
  // inside a frozen tensor).
  uint64_t MomentIndex(uint64_t pos) const;
  // Calls fn(FlatRange) for each maximal stretch of `range` (inside the
  // owned range) that holds no frozen element, in order.
  template <typename Fn>
  void ForEachUnfrozen(const FlatRange& range, Fn fn) const {
    uint64_t pos = range.begin;
    const auto [first, last] = In(range);
    for (size_t i = first; i < last; ++i) {
      if (!entries_[i].frozen) continue;
      const FlatRange f = entries_[i].range.Intersect(range);
      if (f.begin > pos) fn(FlatRange{pos, f.begin});
      pos = f.end;
    }
    if (pos < range.end) fn(FlatRange{pos, range.end});
  }

 private:
  FlatRange owned_;
  std::vector<Entry> entries_;
  // frozen_before_[i]: frozen elements of entries [0, i); one more entry
  // than entries_.
  std::vector<uint64_t> frozen_before_;
  uint64_t frozen_elements_ = 0;
};

}  // namespace zeroshard
