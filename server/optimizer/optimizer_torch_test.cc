// ShardOptimizer against libtorch's torch::optim::AdamW / Adam / SGD on the
// same fp32 inputs: a flat shard on our side, a few tensors on torch's.

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "gtest/gtest.h"
#include "server/optimizer/optimizer.h"

namespace zeroshard {
namespace {

// Tensor sizes: odd lengths, one spanning several blocks.
const std::vector<int64_t> kSizes = {1000, 4099, 2 * 16384 + 333};

struct Diff {
  double max_abs = 0;
  double max_ref = 0;    // max |torch|
  double max_rel = 0;    // max |ours - torch| / |torch| over single elements
  size_t unequal = 0;    // elements whose bits differ
  size_t count = 0;
  // max |ours - torch| / max |torch|: the difference relative to the
  // tensor's scale (elements near zero make max_rel meaningless).
  double scaled() const { return max_ref > 0 ? max_abs / max_ref : max_abs; }
  void Add(float ours, float ref) {
    ++count;
    max_ref = std::max(max_ref, std::fabs(static_cast<double>(ref)));
    if (std::memcmp(&ours, &ref, 4) == 0) return;
    ++unequal;
    const double d = std::fabs(static_cast<double>(ours) - ref);
    max_abs = std::max(max_abs, d);
    if (ref != 0) max_rel = std::max(max_rel, d / std::fabs(static_cast<double>(ref)));
    else max_rel = std::max(max_rel, d == 0 ? 0.0 : HUGE_VAL);
  }
  std::string ToString() const {
    char buf[200];
    std::snprintf(buf, sizeof(buf),
                  "max_abs/max_ref=%.3g max_abs=%.3g elementwise_max_rel=%.3g "
                  "unequal=%zu/%zu",
                  scaled(), max_abs, max_rel, unequal, count);
    return buf;
  }
};

// A model of kSizes tensors on torch's side and the same values as one flat
// shard on ours.
class Harness {
 public:
  explicit Harness(uint32_t seed) : rng_(seed) {
    size_t total = 0;
    for (int64_t n : kSizes) {
      offsets_.push_back(total);
      total += n;
    }
    n_ = total;
    p_.resize(n_);
    g_.resize(n_);
    m_.assign(n_, 0.0f);
    v_.assign(n_, 0.0f);
    copy_.assign(n_, 0);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    for (float& x : p_) x = dist(rng_);
    for (size_t t = 0; t < kSizes.size(); ++t) {
      params_.push_back(torch::from_blob(p_.data() + offsets_[t], {kSizes[t]})
                            .clone()
                            .requires_grad_(true));
    }
    auto opt = ShardOptimizer::Create(ShardOptimizer::Options{2, KernelPath::kAuto});
    EXPECT_TRUE(opt.ok()) << opt.status();
    optimizer_ = std::move(*opt);
  }

  // New random gradients, `scale` times a unit normal, on both sides.
  void NewGradients(float scale) {
    std::normal_distribution<float> dist(0.0f, scale);
    for (float& x : g_) x = dist(rng_);
    for (size_t t = 0; t < kSizes.size(); ++t) {
      params_[t].mutable_grad() =
          torch::from_blob(g_.data() + offsets_[t], {kSizes[t]}).clone();
    }
  }

  // torch.nn.utils.clip_grad_norm_'s coefficient, computed by torch in fp32
  // from the current torch gradients (before clipping them).
  float TorchClipCoef(double max_norm) {
    std::vector<torch::Tensor> norms;
    for (auto& p : params_) norms.push_back(p.grad().norm(2.0));
    const torch::Tensor total = torch::stack(norms).norm(2.0);
    return torch::clamp(max_norm / (total + 1e-6), c10::nullopt, 1.0).item<float>();
  }

  // The coefficient the daemon computes: the shard's sum of squares from
  // SumSquaresAndFinite, in double.
  double OurClipCoef(double max_norm) {
    const GradStats stats = optimizer_->SumSquaresAndFinite(g_.data(), n_, 1.0f);
    EXPECT_FALSE(stats.found_inf_nan);
    const double total_norm = std::sqrt(stats.sum_sq);
    return std::min(1.0, max_norm / (total_norm + 1e-6));
  }

  void OurStep(StepHyperParams hp) {
    ShardBuffers b;
    b.param = p_.data();
    b.grad = g_.data();
    b.exp_avg = m_.data();
    b.exp_avg_sq = v_.data();
    b.model_copy = copy_.data();
    b.model_copy_type = DType::kBf16;
    b.size = n_;
    ASSERT_TRUE(optimizer_->Step(hp, b).ok());
  }

  std::vector<torch::Tensor>& params() { return params_; }

  Diff CompareParams() const {
    Diff d;
    for (size_t t = 0; t < kSizes.size(); ++t) Compare(params_[t], p_, t, &d);
    for (size_t i = 0; i < n_; ++i) {
      EXPECT_EQ(copy_[i], FloatToBf16(p_[i])) << i;
      if (copy_[i] != FloatToBf16(p_[i])) break;
    }
    return d;
  }
  // `get` returns the torch state tensor of a parameter.
  template <typename Get>
  Diff CompareState(const std::vector<float>& ours, Get get) const {
    Diff d;
    for (size_t t = 0; t < kSizes.size(); ++t) Compare(get(params_[t]), ours, t, &d);
    return d;
  }
  const std::vector<float>& m() const { return m_; }
  const std::vector<float>& v() const { return v_; }

 private:
  void Compare(const torch::Tensor& ref, const std::vector<float>& ours,
               size_t t, Diff* d) const {
    const torch::Tensor c = ref.detach().contiguous();
    const float* r = c.data_ptr<float>();
    for (int64_t i = 0; i < kSizes[t]; ++i) d->Add(ours[offsets_[t] + i], r[i]);
  }

  std::mt19937 rng_;
  size_t n_ = 0;
  std::vector<size_t> offsets_;
  std::vector<float> p_, g_, m_, v_;
  std::vector<uint16_t> copy_;
  std::vector<torch::Tensor> params_;
  std::unique_ptr<ShardOptimizer> optimizer_;
};

template <typename State>
const State& StateOf(torch::optim::Optimizer& opt, const torch::Tensor& p) {
  return static_cast<const State&>(
      *opt.state().at(c10::guts::to_string(p.unsafeGetTensorImpl())));
}

constexpr double kMaxNorm = 40.0;  // total gradient norms here: ~20 to ~400

// Gradient scale for step s: most steps are clipped, some are not.
float GradScaleForStep(int s) { return s % 4 == 0 ? 0.05f : 1.0f + (s % 7); }

// The daemon's flow: its own norm (double, over the flat shard) and
// grad_scale = clip_coef, against torch's clip_grad_norm_ + AdamW.
TEST(TorchAdamWTest, HundredStepsWithClippingMatchTorch) {
  Harness h(1);
  const double lr = 1e-2, wd = 0.1;
  torch::optim::AdamW torch_opt(
      h.params(), torch::optim::AdamWOptions(lr).betas({0.9, 0.999}).eps(1e-8).weight_decay(wd));
  double worst_coef_diff = 0;
  for (int s = 1; s <= 100; ++s) {
    h.NewGradients(GradScaleForStep(s));
    const double ours = h.OurClipCoef(kMaxNorm);
    worst_coef_diff = std::max(
        worst_coef_diff, std::fabs(ours - h.TorchClipCoef(kMaxNorm)) / ours);
    torch::nn::utils::clip_grad_norm_(h.params(), kMaxNorm);
    torch_opt.step();
    StepHyperParams hp;
    hp.kind = OptimizerKind::kAdamW;
    hp.lr = lr;
    hp.weight_decay = wd;
    hp.step = s;
    hp.grad_scale = ours;
    h.OurStep(hp);
  }
  const Diff p = h.CompareParams();
  const Diff m = h.CompareState(h.m(), [&](const torch::Tensor& t) {
    return StateOf<torch::optim::AdamWParamState>(torch_opt, t).exp_avg();
  });
  const Diff v = h.CompareState(h.v(), [&](const torch::Tensor& t) {
    return StateOf<torch::optim::AdamWParamState>(torch_opt, t).exp_avg_sq();
  });
  std::printf("AdamW 100 steps, own clip coefficient (max rel diff to torch's: %.3g)\n"
              "  param:      %s\n  exp_avg:    %s\n  exp_avg_sq: %s\n",
              worst_coef_diff, p.ToString().c_str(), m.ToString().c_str(),
              v.ToString().c_str());
  // The only difference in the inputs is the clip coefficient: ours is
  // summed in double, torch's in fp32 (worst_coef_diff above).
  EXPECT_LE(p.scaled(), 1e-6) << p.ToString();
  EXPECT_LE(m.scaled(), 1e-5) << m.ToString();
  EXPECT_LE(v.scaled(), 1e-5) << v.ToString();
}

// With torch's own fp32 clip coefficient as grad_scale the inputs are equal
// bit for bit, and so are the results.
TEST(TorchAdamWTest, SameClipCoefficientIsBitExact) {
  Harness h(2);
  const double lr = 3e-3, wd = 0.01;
  torch::optim::AdamW torch_opt(
      h.params(), torch::optim::AdamWOptions(lr).betas({0.9, 0.95}).eps(1e-8).weight_decay(wd));
  for (int s = 1; s <= 100; ++s) {
    h.NewGradients(GradScaleForStep(s));
    const float coef = h.TorchClipCoef(kMaxNorm);
    torch::nn::utils::clip_grad_norm_(h.params(), kMaxNorm);
    torch_opt.step();
    StepHyperParams hp;
    hp.kind = OptimizerKind::kAdamW;
    hp.lr = lr;
    hp.beta2 = 0.95;
    hp.weight_decay = wd;
    hp.step = s;
    hp.grad_scale = coef;
    h.OurStep(hp);
  }
  const Diff p = h.CompareParams();
  const Diff m = h.CompareState(h.m(), [&](const torch::Tensor& t) {
    return StateOf<torch::optim::AdamWParamState>(torch_opt, t).exp_avg();
  });
  const Diff v = h.CompareState(h.v(), [&](const torch::Tensor& t) {
    return StateOf<torch::optim::AdamWParamState>(torch_opt, t).exp_avg_sq();
  });
  std::printf("AdamW 100 steps, torch's clip coefficient\n"
              "  param:      %s\n  exp_avg:    %s\n  exp_avg_sq: %s\n",
              p.ToString().c_str(), m.ToString().c_str(), v.ToString().c_str());
  EXPECT_EQ(p.unequal, 0u) << p.ToString();
  EXPECT_EQ(m.unequal, 0u) << m.ToString();
  EXPECT_EQ(v.unequal, 0u) << v.ToString();
}

TEST(TorchAdamTest, L2WeightDecayMatchesTorch) {
  Harness h(3);
  torch::optim::Adam torch_opt(
      h.params(),
      torch::optim::AdamOptions(3e-3).betas({0.8, 0.99}).eps(1e-6).weight_decay(0.05));
  for (int s = 1; s <= 5; ++s) {
    h.NewGradients(1.0f);
    torch_opt.step();
    StepHyperParams hp;
    hp.kind = OptimizerKind::kAdam;
    hp.lr = 3e-3;
    hp.beta1 = 0.8;
    hp.beta2 = 0.99;
    hp.eps = 1e-6;
    hp.weight_decay = 0.05;
    hp.step = s;
    h.OurStep(hp);
  }
  const Diff p = h.CompareParams();
  const Diff m = h.CompareState(h.m(), [&](const torch::Tensor& t) {
    return StateOf<torch::optim::AdamParamState>(torch_opt, t).exp_avg();
  });
  std::printf("Adam 5 steps\n  param:   %s\n  exp_avg: %s\n", p.ToString().c_str(),
              m.ToString().c_str());
  EXPECT_EQ(p.unequal, 0u) << p.ToString();
  EXPECT_EQ(m.unequal, 0u) << m.ToString();
}

TEST(TorchSgdTest, MomentumMatchesTorch) {
  Harness h(4);
  torch::optim::SGD torch_opt(
      h.params(),
      torch::optim::SGDOptions(0.05).momentum(0.9).dampening(0.1).weight_decay(1e-3));
  for (int s = 1; s <= 5; ++s) {
    h.NewGradients(1.0f);
    torch_opt.step();
    StepHyperParams hp;
    hp.kind = OptimizerKind::kSgdMomentum;
    hp.lr = 0.05;
    hp.momentum = 0.9;
    hp.dampening = 0.1;
    hp.weight_decay = 1e-3;
    hp.step = s;
    h.OurStep(hp);
  }
  const Diff p = h.CompareParams();
  const Diff m = h.CompareState(h.m(), [&](const torch::Tensor& t) {
    return StateOf<torch::optim::SGDParamState>(torch_opt, t).momentum_buffer();
  });
  std::printf("SGD momentum 5 steps\n  param:           %s\n  momentum_buffer: %s\n",
              p.ToString().c_str(), m.ToString().c_str());
  EXPECT_EQ(p.unequal, 0u) << p.ToString();
  EXPECT_EQ(m.unequal, 0u) << m.ToString();
}

}  // namespace
}  // namespace zeroshard
