#include "examples/gpt.h"

#include "gtest/gtest.h"

namespace zeroshard::examples {
namespace {

GptConfig Small() {
  GptConfig c;
  c.layers = 2;
  c.width = 32;
  c.heads = 4;
  c.seq_len = 16;
  return c;
}

TEST(Gpt, LayoutHasAwkwardSizesAndABigLayer) {
  auto layout = GptLayout(Small());
  ASSERT_TRUE(layout.ok());
  EXPECT_EQ(layout->layers().size(), 4u);
  bool odd = false;
  for (const auto& t : layout->tensors()) odd |= t.numel % 2 == 1 && t.numel % 3 != 0;
  EXPECT_TRUE(odd);
  EXPECT_EQ(GptLayout(GptConfig{1, 30, 4, 8, 256}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(Gpt, LayerByLayerEqualsWholeModelAndLearns) {
  const GptConfig c = Small();
  const Layout layout = *GptLayout(c);
  std::vector<float> flat = GptInitialParams(c, layout, 1);
  auto corpus = LoadCorpus("/usr/share/common-licenses");
  ASSERT_TRUE(corpus.ok()) << corpus.status();
  torch::Tensor tokens, targets;
  MakeBatch(*corpus, c, 1, 8, 0, 1, &tokens, &targets);
  std::vector<torch::Tensor> params;
  torch::Tensor loss = ForwardAll(c, layout, flat.data(), true, tokens, targets, &params);
  EXPECT_NEAR(loss.item<float>(), std::log(256.0f), 0.5f);
  // Ranks' shares of a batch are its halves.
  torch::Tensor t0, g0, t1, g1;
  MakeBatch(*corpus, c, 1, 8, 0, 2, &t0, &g0);
  MakeBatch(*corpus, c, 1, 8, 1, 2, &t1, &g1);
  EXPECT_TRUE(torch::equal(torch::cat({t0, t1}), tokens));
  // A few AdamW steps on one batch reduce the loss; the leaves alias `flat`,
  // so a fresh forward over `flat` sees the updates.
  torch::optim::AdamW opt(params, torch::optim::AdamWOptions(3e-3));
  const float first = loss.item<float>();
  for (int s = 0; s < 20; ++s) {
    opt.zero_grad();
    torch::Tensor l = ForwardAll(c, layout, flat.data(), false, tokens, targets, nullptr);
    torch::Tensor out = tokens;
    size_t k = 0;
    for (int i = 0; i < NumModelLayers(c); ++i) {
      std::vector<torch::Tensor> lp;
      for (const auto& t : layout.tensors()) {
        if (t.spec.layer == static_cast<uint32_t>(i)) lp.push_back(params[k++]);
      }
      out = ForwardLayer(c, i, lp, out, targets);
    }
    EXPECT_NEAR(l.item<float>(), out.item<float>(), 1e-6f);
    out.backward();
    opt.step();
  }
  const float last =
      ForwardAll(c, layout, flat.data(), false, tokens, targets, nullptr).item<float>();
  EXPECT_LT(last, first - 0.5f);
}

}  // namespace
}  // namespace zeroshard::examples
