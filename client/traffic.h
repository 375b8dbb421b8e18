#pragma once

// Payload bytes a client moved, per operation, counted where the client sends
// or receives them (chunk data only: no headers, no control RPCs).

#include <atomic>
#include <cstdint>

namespace zeroshard {

struct TrafficBytes {
  uint64_t push = 0;    // gradient bytes sent to daemons
  uint64_t gather = 0;  // parameter bytes received from daemons
  uint64_t init = 0;    // initial parameter bytes sent (rank 0, once)

  uint64_t sent() const { return push + init; }
  uint64_t received() const { return gather; }
  uint64_t total() const { return sent() + received(); }
};

// Lock-free counters, shared by the client's threads. A window is the
// traffic between two CloseWindow() calls (the client closes one per step).
class TrafficCounters {
 public:
  void AddPush(uint64_t bytes) { Add(kPush, bytes); }
  void AddGather(uint64_t bytes) { Add(kGather, bytes); }
  void AddInit(uint64_t bytes) { Add(kInit, bytes); }

  TrafficBytes Total() const { return Read(total_); }
  TrafficBytes CurrentWindow() const { return Read(window_); }
  // Returns the window's counts and starts a new one.
  TrafficBytes CloseWindow() {
    TrafficBytes b;
    b.push = window_[kPush].exchange(0);
    b.gather = window_[kGather].exchange(0);
    b.init = window_[kInit].exchange(0);
    return b;
  }

 private:
  enum Op { kPush = 0, kGather = 1, kInit = 2, kNumOps = 3 };
  void Add(Op op, uint64_t bytes) {
    total_[op].fetch_add(bytes, std::memory_order_relaxed);
    window_[op].fetch_add(bytes, std::memory_order_relaxed);
  }
  static TrafficBytes Read(const std::atomic<uint64_t> (&c)[kNumOps]) {
    TrafficBytes b;
    b.push = c[kPush].load();
    b.gather = c[kGather].load();
    b.init = c[kInit].load();
    return b;
  }

  std::atomic<uint64_t> total_[kNumOps] = {};
  std::atomic<uint64_t> window_[kNumOps] = {};
};

}  // namespace zeroshard
