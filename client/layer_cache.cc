#include "client/layer_cache.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace zeroshard {

struct LayerCache::Slot {
  enum class State { kFree, kFetching, kReady, kHeld };
  std::unique_ptr<uint8_t[]> data;
  State state = State::kFree;
  size_t index = 0;         // position in layout.layers()
  uint64_t after_step = 0;  // parameters as of this committed step
  bool discard = false;     // dropped while fetching: free it when done
  std::shared_ptr<CountDown> done;  // of the fetch (its status)
};

LayerCache::LayerCache(const Layout* layout, Options options, FetchFn fetch)
    : layout_(layout), options_(options), fetch_(std::move(fetch)) {
  uint64_t largest = 0;
  for (uint32_t l : layout_->layers()) largest = std::max(largest, layout_->LayerRange(l)->size());
  buffer_bytes_ = largest * DTypeSize(options_.dtype);
  slots_count_ = options_.buffers;
  absl::MutexLock lock(&mu_);
  for (uint32_t i = 0; i < options_.buffers; ++i) {
    auto slot = std::make_unique<Slot>();
    slot->data.reset(new uint8_t[buffer_bytes_]);
    slots_.push_back(std::move(slot));
  }
  prefetcher_ = std::make_unique<Executor>(1);
}

LayerCache::~LayerCache() { prefetcher_.reset(); }

FlatRange LayerCache::RangeOf(size_t index) const {
  return *layout_->LayerRange(layout_->layers()[index]);
}

LayerCache::Slot* LayerCache::FindSlot(size_t index, uint64_t step) {
  for (const auto& s : slots_) {
    if (s->state != Slot::State::kFree && !s->discard && s->index == index &&
        s->after_step == step) {
      return s.get();
    }
  }
  return nullptr;
}

LayerCache::Slot* LayerCache::StartFetch(size_t index, uint64_t step) {
  auto it = std::find_if(slots_.begin(), slots_.end(),
                         [](const auto& s) { return s->state == Slot::State::kFree; });
  if (it == slots_.end()) return nullptr;
  Slot* slot = it->get();
  slot->state = Slot::State::kFetching;
  slot->index = index;
  slot->after_step = step;
  slot->discard = false;
  slot->done = std::make_shared<CountDown>(1);
  prefetcher_->Submit([this, slot, range = RangeOf(index), step, done = slot->done] {
    const absl::Status s = fetch_(range, step, slot->data.get());
    {
      absl::MutexLock lock(&mu_);
      // A failed fetch stays visible (kReady with its error in `done`) to
      // whoever asks for the layer; a discarded one goes back to the pool.
      slot->state = slot->discard ? Slot::State::kFree : Slot::State::kReady;
      slot->discard = false;
    }
    done->Done(s);
  });
  return slot;
}

absl::StatusOr<LayerCache::Slot*> LayerCache::ClaimSlot(size_t index, uint64_t step,
                                                        std::shared_ptr<CountDown>* wait_for) {
  if (Slot* slot = FindSlot(index, step)) {
    ++hits_;
    return slot;
  }
  // Evict a prefetched layer nobody has asked for yet.
  for (const auto& s : slots_) {
    if (s->state == Slot::State::kReady && s->index != index) {
      s->state = Slot::State::kFree;
      break;
    }
  }
  if (Slot* slot = StartFetch(index, step)) {
    ++misses_;
    return slot;
  }
  // Every buffer is held or being filled: wait for a fill to end.
  for (const auto& s : slots_) {
    if (s->state == Slot::State::kFetching) *wait_for = s->done;
  }
  if (*wait_for == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "GatherView: all ", slots_.size(), " layer buffers are held; Release a layer first"));
  }
  return nullptr;
}

absl::StatusOr<const void*> LayerCache::View(size_t index, uint64_t step) {
  const absl::Time deadline = absl::Now() + options_.timeout;
  Slot* slot = nullptr;
  std::shared_ptr<CountDown> done;
  while (slot == nullptr) {
    std::shared_ptr<CountDown> busy;
    {
      absl::MutexLock lock(&mu_);
      absl::StatusOr<Slot*> claimed = ClaimSlot(index, step, &busy);
      if (!claimed.ok()) return claimed.status();
      slot = *claimed;
      if (slot != nullptr) done = slot->done;
    }
    if (slot == nullptr &&
        absl::IsDeadlineExceeded(busy->Wait(deadline, "layer prefetch"))) {
      return absl::DeadlineExceededError(
          "GatherView: no layer buffer became free within step_timeout");
    }
  }
  const absl::Status s = done->Wait(deadline, "layer gather");
  {
    absl::MutexLock lock(&mu_);
    if (!s.ok()) {
      if (slot->state == Slot::State::kReady) slot->state = Slot::State::kFree;
      return s;
    }
    slot->state = Slot::State::kHeld;
  }
  PrefetchAfter(index, step);
  return static_cast<const void*>(slot->data.get());
}

absl::Status LayerCache::Gather(size_t index, uint64_t step, void* dst) {
  const FlatRange range = RangeOf(index);
  return GatherWith(
      index, step,
      [&](const void* src) {
        std::memcpy(dst, src, range.size() * DTypeSize(options_.dtype));
        return absl::OkStatus();
      },
      [&] { return fetch_(range, step, dst); });
}

absl::Status LayerCache::GatherWith(size_t index, uint64_t step,
                                    absl::FunctionRef<absl::Status(const void* src)> deliver,
                                    absl::FunctionRef<absl::Status()> fetch_miss) {
  std::shared_ptr<CountDown> done;
  Slot* slot = nullptr;
  {
    absl::MutexLock lock(&mu_);
    slot = FindSlot(index, step);
    if (slot != nullptr) done = slot->done;
  }
  if (slot == nullptr) {
    ++misses_;
    if (absl::Status s = fetch_miss(); !s.ok()) return s;
  } else {
    ++hits_;
    absl::Status s = done->Wait(absl::Now() + options_.timeout, "layer prefetch");
    absl::MutexLock lock(&mu_);
    if (s.ok()) s = deliver(slot->data.get());
    if (slot->state == Slot::State::kReady) slot->state = Slot::State::kFree;
    if (!s.ok()) return s;
  }
  PrefetchAfter(index, step);
  return absl::OkStatus();
}

void LayerCache::PrefetchAfter(size_t index, uint64_t step) {
  absl::MutexLock lock(&mu_);
  const bool backward = last_index_ >= 0 && static_cast<int64_t>(index) <= last_index_;
  last_index_ = static_cast<int64_t>(index);
  const int64_t layers = static_cast<int64_t>(layout_->layers().size());
  for (uint32_t k = 1; k <= options_.prefetch_depth; ++k) {
    const int64_t j = backward ? static_cast<int64_t>(index) - k : static_cast<int64_t>(index) + k;
    if (j < 0 || j >= layers) break;
    if (FindSlot(static_cast<size_t>(j), step) != nullptr) continue;
    if (StartFetch(static_cast<size_t>(j), step) == nullptr) break;
  }
}

void LayerCache::Release(size_t index) {
  absl::MutexLock lock(&mu_);
  for (const auto& s : slots_) {
    if (s->state == Slot::State::kFree || s->index != index) continue;
    if (s->state == Slot::State::kFetching) {
      s->discard = true;
    } else {
      s->state = Slot::State::kFree;
    }
  }
}

void LayerCache::Prefetch(size_t index, uint64_t step) {
  absl::MutexLock lock(&mu_);
  if (FindSlot(index, step) == nullptr) StartFetch(index, step);
}

absl::Status LayerCache::CheckNoneHeld() const {
  absl::MutexLock lock(&mu_);
  for (const auto& s : slots_) {
    if (s->state == Slot::State::kHeld) {
      return absl::FailedPreconditionError(
          absl::StrCat("Step: layer ", layout_->layers()[s->index],
                       " is still held by GatherView; Release it first"));
    }
  }
  return absl::OkStatus();
}

void LayerCache::DiscardAll() {
  absl::MutexLock lock(&mu_);
  for (const auto& s : slots_) {
    if (s->state == Slot::State::kFetching) {
      s->discard = true;
    } else {
      s->state = Slot::State::kFree;
    }
  }
  last_index_ = -1;
}

}  // namespace zeroshard
