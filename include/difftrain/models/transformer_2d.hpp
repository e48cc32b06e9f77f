#pragma once
// diffusers' Transformer2DModel on continuous inputs (GroupNorm → proj_in, a 1×1 conv or Linear →
// BasicTransformerBlocks over the H·W tokens → proj_out → + input: nn::blocks::SpatialTransformer
// configured as diffusers builds it), and the VAE's self-attention over an image (diffusers'
// Attention with group_norm and a residual). Both run on difftrain's
// attention backends and carry diffusers' parameter names, so LoRA targets (to_q, to_k, to_v,
// to_out.0) are where diffusers' and the web UI's files expect them.

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <optional>
#include <string>

#include "difftrain/core/error.hpp"
#include "difftrain/nn/attention/concepts.hpp"
#include "difftrain/nn/attention/sdpa.hpp"
#include "difftrain/nn/blocks/cross_attention.hpp"
#include "difftrain/nn/blocks/spatial_transformer.hpp"

namespace difftrain::models {

/// diffusers' Transformer2DModel on continuous inputs is latent diffusion's SpatialTransformer with
/// GEGLU blocks, diffusers' group count and torch's default init of proj_out (the parameter names
/// and the arithmetic are the same); `transformer_2d_options` maps diffusers' arguments onto it.
template <nn::attention::AttentionBackend Backend = nn::attention::Sdpa<nn::attention::Auto>>
using Transformer2DModelImpl = nn::blocks::SpatialTransformerImpl<Backend, nn::activation::GELU>;
template <nn::attention::AttentionBackend Backend = nn::attention::Sdpa<nn::attention::Auto>>
using Transformer2DModel = nn::blocks::SpatialTransformer<Backend, nn::activation::GELU>;

/// diffusers' Transformer2DModel(num_attention_heads, attention_head_dim, in_channels, num_layers,
/// cross_attention_dim, norm_num_groups, use_linear_projection, only_cross_attention) as options.
inline nn::blocks::SpatialTransformerOptions transformer_2d_options(
    std::int64_t num_attention_heads, std::int64_t attention_head_dim, std::int64_t in_channels,
    std::int64_t num_layers, std::optional<std::int64_t> cross_attention_dim,
    std::int64_t norm_num_groups, bool use_linear_projection, bool only_cross_attention) {
  nn::blocks::SpatialTransformerOptions o;
  o.in_channels = in_channels;
  o.n_heads = num_attention_heads;
  o.d_head = attention_head_dim;
  o.depth = num_layers;
  if (cross_attention_dim) o.context_dim = {*cross_attention_dim};
  o.disable_self_attn = only_cross_attention;
  o.use_linear = use_linear_projection;
  o.norm_num_groups = norm_num_groups;
  o.zero_init_proj_out = false;
  return o;
}

struct SelfAttention2DOptions {
  std::int64_t channels = 0;
  std::int64_t head_dim = 0;  // the VAE uses one head of all channels
  std::int64_t norm_num_groups = 32;
  double eps = 1e-6;
  double rescale_output_factor = 1.0;
};

/// Self-attention over the pixels of an image, as the VAE's mid block has it: group_norm →
/// to_q/to_k/to_v (with biases) → attention → to_out → + input, / rescale_output_factor.
template <nn::attention::AttentionBackend Backend = nn::attention::Sdpa<nn::attention::Auto>>
class SelfAttention2DImpl : public nn::blocks::CrossAttentionImpl<Backend> {
 public:
  explicit SelfAttention2DImpl(const SelfAttention2DOptions& o)
      : nn::blocks::CrossAttentionImpl<Backend>(options(o)), o_(o) {
    group_norm = this->register_module(
        "group_norm", torch::nn::GroupNorm(
                          torch::nn::GroupNormOptions(o.norm_num_groups, o.channels).eps(o.eps)));
  }

  at::Tensor forward(const at::Tensor& x) {
    if (x.dim() != 4 || x.size(1) != o_.channels)
      throw ShapeError(
          "expects (B, " + std::to_string(o_.channels) + ", H, W), got " + c10::str(x.sizes()),
          "SelfAttention2D");
    const auto b = x.size(0), c = x.size(1), h = x.size(2), w = x.size(3);
    at::Tensor t = group_norm->forward(x).view({b, c, h * w}).transpose(1, 2);
    t = nn::blocks::CrossAttentionImpl<Backend>::forward(t);
    t = t.transpose(1, 2).reshape({b, c, h, w});
    at::Tensor out = t + x;
    return o_.rescale_output_factor == 1.0 ? out : out / o_.rescale_output_factor;
  }

  torch::nn::GroupNorm group_norm{nullptr};

 private:
  static nn::blocks::CrossAttentionOptions options(const SelfAttention2DOptions& o) {
    if (o.channels <= 0 || o.head_dim <= 0 || o.channels % o.head_dim != 0)
      throw ConfigError("channels " + std::to_string(o.channels) +
                            " must be a positive multiple of head_dim " +
                            std::to_string(o.head_dim),
                        "SelfAttention2D");
    if (o.norm_num_groups <= 0 || o.channels % o.norm_num_groups != 0)
      throw ConfigError("channels " + std::to_string(o.channels) +
                            " are not divisible by norm_num_groups " +
                            std::to_string(o.norm_num_groups),
                        "SelfAttention2D");
    nn::blocks::CrossAttentionOptions a;
    a.query_dim = o.channels;
    a.heads = o.channels / o.head_dim;
    a.dim_head = o.head_dim;
    a.qkv_bias = true;
    return a;
  }
  SelfAttention2DOptions o_;
};

template <nn::attention::AttentionBackend Backend = nn::attention::Sdpa<nn::attention::Auto>>
using SelfAttention2D = torch::nn::ModuleHolder<SelfAttention2DImpl<Backend>>;

}  // namespace difftrain::models
