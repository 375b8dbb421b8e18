#pragma once

// Where a stage-3 trainer keeps each layer's input between the forward pass
// and the layer's recomputation in backward (activation checkpointing). The
// trainer's loop talks only to this interface, so the checkpoints can move to
// the daemons (ZeRO-R's P_a+cpu) without touching it.

#include <map>

#include <torch/torch.h>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace zeroshard::examples {

class ActivationStore {
 public:
  virtual ~ActivationStore() = default;
  // Keeps `input` (detached) as the checkpoint of `layer` for this step.
  virtual absl::Status Save(int layer, const torch::Tensor& input) = 0;
  // The checkpoint of `layer`; NotFound when none was saved.
  virtual absl::StatusOr<torch::Tensor> Load(int layer) = 0;
  // Drops every checkpoint (end of a step).
  virtual void Clear() = 0;
  // Bytes held now.
  virtual uint64_t bytes() const = 0;
};

// Checkpoints in the trainer's own memory.
class InMemoryActivationStore final : public ActivationStore {
 public:
  absl::Status Save(int layer, const torch::Tensor& input) override {
    saved_[layer] = input.detach();
    return absl::OkStatus();
  }
  absl::StatusOr<torch::Tensor> Load(int layer) override {
    auto it = saved_.find(layer);
    if (it == saved_.end()) {
      return absl::NotFoundError(absl::StrCat("no activation checkpoint for layer ", layer));
    }
    return it->second;
  }
  void Clear() override { saved_.clear(); }
  uint64_t bytes() const override {
    uint64_t b = 0;
    for (const auto& [l, t] : saved_) b += t.numel() * t.element_size();
    return b;
  }

 private:
  std::map<int, torch::Tensor> saved_;
};

}  // namespace zeroshard::examples
