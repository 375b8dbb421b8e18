#pragma once

// A small GPT-style byte-level language model in libtorch, written layer by
// layer so a trainer can hold only one layer's parameters at a time (ZeRO
// stage 3): layer 0 is the embeddings, layers 1..L the transformer blocks,
// layer L+1 the final norm and the output head (which also computes the
// loss). Parameters live in one flat fp32 space laid out by GptLayout(); the
// model reads them through tensor views, never owning them.

#include <string>
#include <vector>

#include <torch/torch.h>

#include "absl/status/statusor.h"
#include "common/layout.h"

namespace zeroshard::examples {

struct GptConfig {
  int layers = 4;     // transformer blocks
  int width = 128;    // model dimension
  int heads = 4;      // attention heads; width % heads == 0
  int seq_len = 64;   // tokens per sequence
  int vocab = 256;    // bytes
};

// InvalidArgument naming the field for non-positive sizes or width % heads.
absl::Status ValidateConfig(const GptConfig& config);

// The model's tensors in order, with layer ids: 0 embeddings, 1..L blocks,
// L+1 head. Includes a one-element logit scale (a size no N_d divides).
absl::StatusOr<Layout> GptLayout(const GptConfig& config);

// Deterministic initial parameters for the whole flat space (padding zero).
std::vector<float> GptInitialParams(const GptConfig& config, const Layout& layout, uint64_t seed);

int NumModelLayers(const GptConfig& config);  // layers + 2

// Tensor views of `layer`'s parameters over `flat`, whose element 0 is flat
// element `flat_begin` of the layout (so a buffer holding only the layer's
// range works too). The views alias `flat`; with requires_grad they are
// autograd leaves whose .grad() the caller reads after backward.
std::vector<torch::Tensor> LayerParams(const Layout& layout, int layer, float* flat,
                                       uint64_t flat_begin, bool requires_grad);

// Layer 0: tokens [B, T] int64 -> hidden [B, T, W]. Blocks: hidden -> hidden.
// Last layer: hidden + targets [B, T] -> mean cross-entropy (scalar).
torch::Tensor ForwardLayer(const GptConfig& config, int layer,
                           const std::vector<torch::Tensor>& params, const torch::Tensor& input,
                           const torch::Tensor& targets);

// The whole model at once on a full flat parameter tensor.
torch::Tensor ForwardAll(const GptConfig& config, const Layout& layout, float* flat,
                         bool requires_grad, const torch::Tensor& tokens,
                         const torch::Tensor& targets, std::vector<torch::Tensor>* params_out);

// Byte-level text: every regular file of `dir` in name order, concatenated.
absl::StatusOr<std::string> LoadCorpus(const std::string& dir);

// The global batch of step `step` (1-based): `batch` sequences of seq_len+1
// bytes at deterministic pseudo-random offsets. Rank r of `world` takes
// sequences [r*batch/world, (r+1)*batch/world). tokens/targets: [b, T] int64.
void MakeBatch(const std::string& corpus, const GptConfig& config, uint64_t step, int batch,
               int rank, int world, torch::Tensor* tokens, torch::Tensor* targets);

}  // namespace zeroshard::examples
