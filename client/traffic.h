#pragma once

// Payload bytes a client moved, per operation, counted where the client sends
// or receives them (chunk data only: no headers, no control RPCs). Traffic
// with the daemons and traffic with the other trainer ranks (the trainer
// collective's exchange, REDUCTION_MODE_TRAINER_COLLECTIVE) are kept apart.

#include <atomic>
#include <cstdint>

namespace zeroshard {

struct TrafficBytes {
  uint64_t push = 0;    // gradient bytes sent to daemons
  uint64_t gather = 0;  // parameter bytes received from daemons
  uint64_t init = 0;    // initial parameter bytes sent (rank 0, once)
  // Gradient bytes sent to / received from the other trainer ranks by a
  // trainer collective (0 in daemon reduction).
  uint64_t collective_sent = 0;
  uint64_t collective_received = 0;

  // Daemon traffic only.
  uint64_t sent() const { return push + init; }
  uint64_t received() const { return gather; }
  uint64_t total() const { return sent() + received(); }
  // Trainer-to-trainer traffic.
  uint64_t collective() const { return collective_sent + collective_received; }
};

// Lock-free counters, shared by the client's threads. A window is the
// traffic between two CloseWindow() calls (the client closes one per step).
class TrafficCounters {
 public:
  void AddPush(uint64_t bytes) { Add(kPush, bytes); }
  void AddGather(uint64_t bytes) { Add(kGather, bytes); }
  void AddInit(uint64_t bytes) { Add(kInit, bytes); }
  void AddCollectiveSent(uint64_t bytes) { Add(kCollectiveSent, bytes); }
  void AddCollectiveReceived(uint64_t bytes) { Add(kCollectiveReceived, bytes); }

  TrafficBytes Total() const { return Read(total_); }
  TrafficBytes CurrentWindow() const { return Read(window_); }
  // Returns the window's counts and starts a new one.
  TrafficBytes CloseWindow() {
    TrafficBytes b;
    b.push = window_[kPush].exchange(0);
    b.gather = window_[kGather].exchange(0);
    b.init = window_[kInit].exchange(0);
    b.collective_sent = window_[kCollectiveSent].exchange(0);
    b.collective_received = window_[kCollectiveReceived].exchange(0);
    return b;
  }

 private:
  enum Op {
    kPush = 0,
    kGather = 1,
    kInit = 2,
    kCollectiveSent = 3,
    kCollectiveReceived = 4,
    kNumOps = 5
  };
  void Add(Op op, uint64_t bytes) {
    total_[op].fetch_add(bytes, std::memory_order_relaxed);
    window_[op].fetch_add(bytes, std::memory_order_relaxed);
  }
  static TrafficBytes Read(const std::atomic<uint64_t> (&c)[kNumOps]) {
    TrafficBytes b;
    b.push = c[kPush].load();
    b.gather = c[kGather].load();
    b.init = c[kInit].load();
    b.collective_sent = c[kCollectiveSent].load();
    b.collective_received = c[kCollectiveReceived].load();
    return b;
  }

  std::atomic<uint64_t> total_[kNumOps] = {};
  std::atomic<uint64_t> window_[kNumOps] = {};
};

}  // namespace zeroshard
