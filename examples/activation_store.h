#pragma once

// Where a stage-3 trainer keeps each layer's input between the forward pass
// and the layer's recomputation in backward (activation checkpointing). The
// trainer's loop talks only to this interface:
//
//   BeginStep(step)
//   forward, for each layer l:  Save(l, input of l)   ... run l ...
//   BeginBackward(layers in the order backward loads them)
//   backward, in that order:    Load(l)   ... recompute l, backpropagate ...
//   EndStep()
//
// Two implementations:
//  - InMemoryActivationStore keeps every checkpoint of the step in the
//    trainer (what a trainer holds grows with the model's depth);
//  - DaemonActivationStore moves them through a client activation store
//    (client/activation_store.h; on a daemon: ZeRO-R's P_a+cpu). A layer's
//    checkpoint is offloaded as soon as it is saved and the offload runs
//    behind the next layers' forward (at most `max_offloads_in_flight` of
//    them); backward fetches ahead, in the order given, `prefetch_depth`
//    layers deep, and each slice is freed on the store once fetched. The
//    trainer then holds at most max(max_offloads_in_flight,
//    prefetch_depth + 1) checkpoints (the +1: the one being recomputed),
//    however deep the model is.
//
// Both return the very bytes saved, so training is bit for bit the same with
// either. Not thread-safe: the training thread calls them.

#include <torch/torch.h>

#include <algorithm>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/activation_store.h"

namespace zeroshard::examples {

class ActivationStore {
 public:
  virtual ~ActivationStore() = default;
  // "local", or the client store's name.
  virtual std::string name() const = 0;
  // Checkpoints saved from now on belong to `step`.
  virtual absl::Status BeginStep(uint64_t step) = 0;
  // Keeps `input` (detached) as the checkpoint of `layer` for this step.
  virtual absl::Status Save(int layer, const torch::Tensor& input) = 0;
  // The forward pass is over; backward loads the layers in `order`.
  virtual absl::Status BeginBackward(const std::vector<int>& order) = 0;
  // The checkpoint of `layer` (the bytes saved, same shape and dtype);
  // NotFound when none was saved this step.
  virtual absl::StatusOr<torch::Tensor> Load(int layer) = 0;
  // Drops every checkpoint of the step (waiting for what is in flight).
  virtual absl::Status EndStep() = 0;
  // Bytes of checkpoints the trainer holds now, and the most it held.
  virtual uint64_t bytes() const = 0;
  virtual uint64_t peak_bytes() const = 0;
  // The most bytes of checkpoints one step saved: what keeping them all in
  // the trainer would hold.
  virtual uint64_t peak_step_bytes() const = 0;
};

// Checkpoints in the trainer's own memory.
class InMemoryActivationStore final : public ActivationStore {
 public:
  std::string name() const override { return "local"; }
  absl::Status BeginStep(uint64_t step) override;
  absl::Status Save(int layer, const torch::Tensor& input) override;
  absl::Status BeginBackward(const std::vector<int>&) override { return absl::OkStatus(); }
  absl::StatusOr<torch::Tensor> Load(int layer) override;
  absl::Status EndStep() override;
  uint64_t bytes() const override { return bytes_; }
  uint64_t peak_bytes() const override { return peak_; }
  uint64_t peak_step_bytes() const override { return peak_; }

 private:
  std::map<int, torch::Tensor> saved_;
  uint64_t bytes_ = 0;
  uint64_t peak_ = 0;
};

// Checkpoints in a client activation store (a daemon's, or any other).
class DaemonActivationStore final : public ActivationStore {
 public:
  struct Options {
    // Fetches started ahead of the layer backward asks for (>= 1).
    uint32_t prefetch_depth = 2;
    // Offloads the trainer lets run behind its forward pass (>= 1); Save
    // waits for the oldest before starting one more. BeginBackward waits
    // for all of them.
    uint32_t max_offloads_in_flight = 2;
    // The latest checkpoints kept in the trainer, not offloaded: each is
    // offloaded when this many newer ones are saved. Those still kept at
    // BeginBackward, the first that backward needs, never leave the trainer
    // (no offload, no fetch, no wait at the start of backward).
    uint32_t keep_last = 1;
    uint32_t micro_batch = 0;  // ActivationKey.micro_batch of the saves
    // Bounds each wait for an offload or a fetch.
    absl::Duration timeout = absl::Minutes(5);
  };

  explicit DaemonActivationStore(std::unique_ptr<ActivationSliceStore> store, Options options);
  // Waits for the operations in flight (their buffers are this object's).
  ~DaemonActivationStore() override;

  std::string name() const override { return store_->name(); }
  absl::Status BeginStep(uint64_t step) override;
  absl::Status Save(int layer, const torch::Tensor& input) override;
  absl::Status BeginBackward(const std::vector<int>& order) override;
  absl::StatusOr<torch::Tensor> Load(int layer) override;
  absl::Status EndStep() override;
  uint64_t bytes() const override { return held_; }
  uint64_t peak_bytes() const override { return peak_; }
  uint64_t peak_step_bytes() const override { return peak_step_; }

  // The client store's counters.
  SliceStoreStats stats() const { return store_->Stats(); }
  // Checkpoints the store refused for want of room (RESOURCE_EXHAUSTED: its
  // arena and spill space are full; UNAVAILABLE: a daemon whose spill disk
  // hangs), kept in the trainer instead; over all steps.
  uint64_t refused() const { return refused_count_; }

 private:
  struct Shape {
    std::vector<int64_t> sizes;
    torch::ScalarType dtype;
    uint64_t bytes = 0;
  };
  // A tensor lent to an operation in flight.
  struct InFlight {
    int layer = 0;
    torch::Tensor tensor;
    ActivationTicket ticket;
  };

  ActivationKey Key(int layer) const;
  absl::Time Deadline() const { return absl::Now() + options_.timeout; }
  void Hold(uint64_t bytes);
  // Waits for the oldest offload, or only drops those already done.
  absl::Status RetireOffload();
  absl::Status RetireDoneOffloads();
  // Starts fetches until prefetch_depth are ahead or the order is done.
  absl::Status FillFetches();
  absl::Status StartFetch(int layer);
  // Lends `t` to an offload of `layer` (waiting while max_offloads_in_flight
  // run); its bytes are counted by the caller, and uncounted once retired.
  absl::Status Offload(int layer, torch::Tensor t);
  // A checkpoint kept in the trainer, not lent to any operation.
  struct Kept {
    int layer = 0;
    torch::Tensor tensor;
  };
  static std::deque<Kept>::iterator Find(std::deque<Kept>& in, int layer) {
    return std::find_if(in.begin(), in.end(), [layer](const Kept& k) { return k.layer == layer; });
  }
  // Kept in the trainer: the latest, or refused by the store.
  bool IsKept(int layer) {
    return Find(kept_, layer) != kept_.end() || Find(refused_, layer) != refused_.end();
  }
  // Keeps `t`, which the store refused with `why`, in the trainer; its
  // bytes stay counted.
  void KeepRefused(int layer, torch::Tensor t, const absl::Status& why);
  // At the end of a step: says so when a step without refusals ends a run
  // of them.
  void NoteRefusals();
  // Waits for everything in flight (errors dropped: the first is returned).
  absl::Status Drain();

  const std::unique_ptr<ActivationSliceStore> store_;
  const Options options_;
  uint64_t step_ = 0;
  std::map<int, Shape> saved_;  // this step's checkpoints, by layer
  uint64_t step_bytes_ = 0;
  std::deque<Kept> kept_;  // saved, not offloaded, oldest first
  std::deque<Kept> refused_;  // this step's, the store had no room for them
  uint64_t refused_count_ = 0;
  uint64_t refusing_ = 0;  // refusals since a step without any
  bool refused_this_step_ = false;
  std::deque<InFlight> offloads_;
  std::map<int, InFlight> fetches_;
  std::vector<int> order_;
  size_t next_ = 0;            // next index of order_ to fetch
  uint64_t loaded_bytes_ = 0;  // the checkpoint Load returned last
  uint64_t held_ = 0;
  uint64_t peak_ = 0;
  uint64_t peak_step_ = 0;
};

}  // namespace zeroshard::examples
