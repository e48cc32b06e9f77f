#pragma once
// --model flux-mini: a small Flux-style transformer (difftrain's models::FluxTransformer2DModel,
// diffusers' FluxTransformer2DModel parameter for parameter: double-stream blocks with joint
// attention over [text; image], single-stream blocks, 3-axis rotary positions, adaLN modulation)
// on 4×4 patches of the 28×28 image (49 tokens of 16 values; Flux itself packs 2×2 patches of 16
// latent channels), conditioned on a caption per class ("a photo of a sneaker"): the caption's
// words are tokens of a small learned table, read by the transformer as Flux reads T5's states,
// and their mean is the pooled vector Flux takes from CLIP. The empty caption (all padding) is
// the unconditional row of classifier-free guidance. Trained with flow matching as --model dit.

#include <difftrain/models/flux_transformer_2d.hpp>

#include <algorithm>
#include <cctype>
#include <map>
#include <string>
#include <vector>

#include "data.hpp"

namespace fmnist {

using Flux = dt::models::FluxTransformer2DModel<>;

/// "a photo of a sneaker": the class caption, lower case.
inline std::string class_caption(std::int64_t label) {
  std::string name = kClassNames.at(static_cast<std::size_t>(label));
  std::transform(name.begin(), name.end(), name.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return "a photo of a " + name;
}

/// Words split at spaces and '/'.
inline std::vector<std::string> caption_words(const std::string& caption) {
  std::vector<std::string> words;
  std::string w;
  for (const char c : caption + " ") {
    if (c == ' ' || c == '/') {
      if (!w.empty()) words.push_back(w);
      w.clear();
    } else {
      w += c;
    }
  }
  return words;
}

/// The transformer's configuration (its config.json): 2 double- and 4 single-stream blocks of 4
/// heads × 32, 16 values a token, text states and pooled vectors of 64.
inline dt::models::FluxTransformer2DConfig flux_mini_config() {
  dt::models::FluxTransformer2DConfig c;
  c.in_channels = 16;
  c.num_layers = 2;
  c.num_single_layers = 4;
  c.attention_head_dim = 32;
  c.num_attention_heads = 4;
  c.joint_attention_dim = 64;
  c.pooled_projection_dim = 64;
  c.axes_dims_rope = {8, 12, 12};
  return c;
}

class FluxMiniImpl : public torch::nn::Module {
 public:
  static constexpr std::int64_t kPatch = 4, kGrid = 28 / kPatch;

  explicit FluxMiniImpl(std::int64_t classes) {
    const auto c = flux_mini_config();
    transformer = register_module("transformer", Flux(c, "fmnist::FluxMini"));
    // Token 0 pads; the vocabulary is the captions' words. Row `classes` is the empty caption.
    std::map<std::string, std::int64_t> vocabulary;
    std::vector<std::vector<std::int64_t>> rows;
    std::size_t longest = 1;
    for (std::int64_t k = 0; k < classes; ++k) {
      std::vector<std::int64_t> ids;
      for (const auto& w : caption_words(class_caption(k)))
        ids.push_back(
            vocabulary.emplace(w, static_cast<std::int64_t>(vocabulary.size()) + 1).first->second);
      longest = std::max(longest, ids.size());
      rows.push_back(std::move(ids));
    }
    rows.emplace_back();
    at::Tensor ids = at::zeros({classes + 1, static_cast<std::int64_t>(longest)}, at::kLong);
    for (std::size_t r = 0; r < rows.size(); ++r)
      for (std::size_t i = 0; i < rows[r].size(); ++i)
        ids[static_cast<std::int64_t>(r)][static_cast<std::int64_t>(i)] = rows[r][i];
    caption_ids = register_buffer("caption_ids", ids);
    token_emb = register_module(
        "token_emb", torch::nn::Embedding(static_cast<std::int64_t>(vocabulary.size()) + 1,
                                          c.joint_attention_dim));
    // adaLN-Zero as DiT's paper starts: every modulation and the output projection at zero, so
    // each block starts as the identity and the model's output as zero.
    at::NoGradGuard no_grad;
    for (auto& p : transformer->named_parameters()) {
      const std::string& n = p.key();
      if (n.find("norm1.linear.") != std::string::npos ||
          n.find("norm1_context.linear.") != std::string::npos ||
          n.find(".norm.linear.") != std::string::npos || n.starts_with("norm_out.linear.") ||
          n.starts_with("proj_out."))
        p.value().zero_();
    }
  }

  /// The velocity for images x (B, 1, 28, 28) at flow timesteps t = σ·1000 and class labels
  /// (label `classes`: the empty caption).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& t, const at::Tensor& labels) {
    if (x.dim() != 4 || x.size(1) != 1 || x.size(2) != 28 || x.size(3) != 28)
      throw dt::ShapeError("expects (B, 1, 28, 28) images, got " + c10::str(x.sizes()), "FluxMini");
    const std::int64_t b = x.size(0);
    const at::Tensor ids = caption_ids.index_select(0, labels.to(caption_ids.device(), at::kLong));
    const at::Tensor states = token_emb->forward(ids);
    const at::Tensor pooled = states.mean(1);
    const at::Tensor tokens = x.reshape({b, 1, kGrid, kPatch, kGrid, kPatch})
                                  .permute({0, 2, 4, 1, 3, 5})
                                  .reshape({b, kGrid * kGrid, kPatch * kPatch});
    const at::Tensor img_ids = dt::models::flux_latent_image_ids(kGrid, kGrid).to(x.device());
    const at::Tensor txt_ids = at::zeros({ids.size(1), 3}, x.options());
    const at::Tensor v = transformer->forward(
        tokens, states, pooled, t.to(x.device(), x.scalar_type()) / 1000, img_ids, txt_ids);
    return v.reshape({b, kGrid, kGrid, 1, kPatch, kPatch})
        .permute({0, 3, 1, 4, 2, 5})
        .reshape({b, 1, 28, 28});
  }

  Flux transformer{nullptr};
  torch::nn::Embedding token_emb{nullptr};
  at::Tensor caption_ids;
};
TORCH_MODULE(FluxMini);

}  // namespace fmnist
