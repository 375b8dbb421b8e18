#include "examples/gpt.h"

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <random>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace zeroshard::examples {
namespace {

int64_t HeadLayer(const GptConfig& c) { return c.layers + 1; }

}  // namespace

absl::Status ValidateConfig(const GptConfig& c) {
  const struct {
    const char* name;
    int value;
  } fields[] = {{"layers", c.layers}, {"width", c.width},   {"heads", c.heads},
                {"seq_len", c.seq_len}, {"vocab", c.vocab}};
  for (const auto& f : fields) {
    if (f.value < 1) {
      return absl::InvalidArgumentError(absl::StrCat(f.name, ": must be >= 1, got ", f.value));
    }
  }
  if (c.width % c.heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("heads: must divide width (", c.width, "), got ", c.heads));
  }
  return absl::OkStatus();
}

int NumModelLayers(const GptConfig& c) { return c.layers + 2; }

absl::StatusOr<Layout> GptLayout(const GptConfig& c) {
  if (absl::Status s = ValidateConfig(c); !s.ok()) return s;
  const int64_t w = c.width;
  std::vector<TensorSpec> t;
  t.push_back({"tok_emb", {c.vocab, w}, DType::kFp32, 0});
  t.push_back({"pos_emb", {c.seq_len, w}, DType::kFp32, 0});
  for (int l = 1; l <= c.layers; ++l) {
    const uint32_t id = static_cast<uint32_t>(l);
    const std::string p = absl::StrCat("block", l, ".");
    t.push_back({p + "ln1.w", {w}, DType::kFp32, id});
    t.push_back({p + "ln1.b", {w}, DType::kFp32, id});
    t.push_back({p + "attn.qkv.w", {3 * w, w}, DType::kFp32, id});
    t.push_back({p + "attn.qkv.b", {3 * w}, DType::kFp32, id});
    t.push_back({p + "attn.proj.w", {w, w}, DType::kFp32, id});
    t.push_back({p + "attn.proj.b", {w}, DType::kFp32, id});
    t.push_back({p + "ln2.w", {w}, DType::kFp32, id});
    t.push_back({p + "ln2.b", {w}, DType::kFp32, id});
    t.push_back({p + "mlp.fc1.w", {4 * w, w}, DType::kFp32, id});
    t.push_back({p + "mlp.fc1.b", {4 * w}, DType::kFp32, id});
    t.push_back({p + "mlp.fc2.w", {w, 4 * w}, DType::kFp32, id});
    t.push_back({p + "mlp.fc2.b", {w}, DType::kFp32, id});
  }
  const uint32_t head = static_cast<uint32_t>(HeadLayer(c));
  t.push_back({"ln_f.w", {w}, DType::kFp32, head});
  t.push_back({"ln_f.b", {w}, DType::kFp32, head});
  t.push_back({"head.w", {c.vocab, w}, DType::kFp32, head});
  t.push_back({"head.logit_scale", {1}, DType::kFp32, head});
  return Layout::Create(std::move(t));
}

std::vector<float> GptInitialParams(const GptConfig& c, const Layout& layout, uint64_t seed) {
  std::vector<float> flat(layout.total_elements(), 0.0f);
  std::mt19937_64 rng(seed);
  const float std_dev = 0.02f;
  const float proj_std = 0.02f / std::sqrt(2.0f * c.layers);
  for (const TensorPlacement& t : layout.tensors()) {
    const std::string& n = t.spec.name;
    float* p = flat.data() + t.offset;
    auto ends_with = [&](const char* s) {
      const size_t k = std::strlen(s);
      return n.size() >= k && n.compare(n.size() - k, k, s) == 0;
    };
    if (ends_with("ln1.w") || ends_with("ln2.w") || n == "ln_f.w" || n == "head.logit_scale") {
      std::fill(p, p + t.numel, 1.0f);
    } else if (ends_with(".b")) {
      std::fill(p, p + t.numel, 0.0f);
    } else {
      std::normal_distribution<float> dist(
          0.0f, ends_with("proj.w") || ends_with("fc2.w") ? proj_std : std_dev);
      for (uint64_t i = 0; i < t.numel; ++i) p[i] = dist(rng);
    }
  }
  return flat;
}

std::vector<torch::Tensor> LayerParams(const Layout& layout, int layer, float* flat,
                                       uint64_t flat_begin, bool requires_grad) {
  std::vector<torch::Tensor> out;
  for (const TensorPlacement& t : layout.tensors()) {
    if (t.spec.layer != static_cast<uint32_t>(layer)) continue;
    torch::Tensor v = torch::from_blob(flat + (t.offset - flat_begin), t.spec.shape,
                                       torch::kFloat32);
    if (requires_grad) v = v.detach().requires_grad_(true);
    out.push_back(v);
  }
  return out;
}

torch::Tensor ForwardLayer(const GptConfig& c, int layer, const std::vector<torch::Tensor>& p,
                           const torch::Tensor& input, const torch::Tensor& targets) {
  namespace F = torch::nn::functional;
  if (layer == 0) {
    const int64_t t = input.size(1);
    return F::embedding(input, p[0]) + p[1].slice(0, 0, t).unsqueeze(0);
  }
  if (layer == HeadLayer(c)) {
    torch::Tensor h = F::layer_norm(input, F::LayerNormFuncOptions({c.width}).weight(p[0]).bias(p[1]));
    torch::Tensor logits = F::linear(h, p[2]) * p[3];
    return F::cross_entropy(logits.reshape({-1, c.vocab}), targets.reshape({-1}));
  }
  const int64_t b = input.size(0), t = input.size(1), w = c.width, hd = w / c.heads;
  torch::Tensor h = F::layer_norm(input, F::LayerNormFuncOptions({w}).weight(p[0]).bias(p[1]));
  torch::Tensor qkv = F::linear(h, p[2], p[3]).view({b, t, 3, c.heads, hd});
  torch::Tensor q = qkv.select(2, 0).transpose(1, 2);  // [b, heads, t, hd]
  torch::Tensor k = qkv.select(2, 1).transpose(1, 2);
  torch::Tensor v = qkv.select(2, 2).transpose(1, 2);
  torch::Tensor scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(hd));
  torch::Tensor mask = torch::ones({t, t}, torch::kBool).triu(1);
  scores = scores.masked_fill(mask, -std::numeric_limits<float>::infinity());
  torch::Tensor attn = torch::matmul(torch::softmax(scores, -1), v);
  attn = attn.transpose(1, 2).reshape({b, t, w});
  torch::Tensor x = input + F::linear(attn, p[4], p[5]);
  torch::Tensor h2 = F::layer_norm(x, F::LayerNormFuncOptions({w}).weight(p[6]).bias(p[7]));
  return x + F::linear(F::gelu(F::linear(h2, p[8], p[9])), p[10], p[11]);
}

torch::Tensor ForwardAll(const GptConfig& c, const Layout& layout, float* flat,
                         bool requires_grad, const torch::Tensor& tokens,
                         const torch::Tensor& targets, std::vector<torch::Tensor>* params_out) {
  torch::Tensor x = tokens;
  for (int l = 0; l < NumModelLayers(c); ++l) {
    std::vector<torch::Tensor> p = LayerParams(layout, l, flat, 0, requires_grad);
    x = ForwardLayer(c, l, p, x, targets);
    if (params_out != nullptr) params_out->insert(params_out->end(), p.begin(), p.end());
  }
  return x;
}

absl::StatusOr<std::string> LoadCorpus(const std::string& dir) {
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return absl::NotFoundError(absl::StrCat("corpus directory ", dir, " not found"));
  std::vector<std::string> names;
  while (dirent* e = readdir(d)) {
    const std::string path = dir + "/" + e->d_name;
    struct stat st;
    if (e->d_name[0] != '.' && stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode)) {
      names.push_back(path);
    }
  }
  closedir(d);
  std::sort(names.begin(), names.end());
  std::string corpus;
  for (const auto& n : names) {
    std::ifstream in(n, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    corpus += ss.str();
  }
  if (corpus.size() < 4096) {
    return absl::FailedPreconditionError(
        absl::StrCat("corpus in ", dir, " has only ", corpus.size(), " bytes"));
  }
  return corpus;
}

void MakeBatch(const std::string& corpus, const GptConfig& c, uint64_t step, int batch, int rank,
               int world, torch::Tensor* tokens, torch::Tensor* targets) {
  const int begin = rank * batch / world, end = (rank + 1) * batch / world;
  const int n = end - begin;
  *tokens = torch::empty({n, c.seq_len}, torch::kInt64);
  *targets = torch::empty({n, c.seq_len}, torch::kInt64);
  auto tok = tokens->accessor<int64_t, 2>();
  auto tgt = targets->accessor<int64_t, 2>();
  const uint64_t span = corpus.size() - c.seq_len - 1;
  for (int i = 0; i < n; ++i) {
    // splitmix64 of (step, sequence index): the same offsets for every world size.
    uint64_t z = step * 0x9e3779b97f4a7c15ull + static_cast<uint64_t>(begin + i) + 1;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    const uint64_t off = z % span;
    for (int j = 0; j < c.seq_len; ++j) {
      tok[i][j] = static_cast<unsigned char>(corpus[off + j]) % c.vocab;
      tgt[i][j] = static_cast<unsigned char>(corpus[off + j + 1]) % c.vocab;
    }
  }
}

}  // namespace zeroshard::examples
