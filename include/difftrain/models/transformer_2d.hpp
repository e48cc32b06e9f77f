#pragma once
// diffusers' Transformer2DModel on continuous inputs (GroupNorm → proj_in, a 1×1 conv or Linear →
// BasicTransformerBlocks over the H·W tokens → proj_out → + input), and the VAE's self-attention
// over an image (diffusers' Attention with group_norm and a residual). Both run on difftrain's
// attention backends and carry diffusers' parameter names, so LoRA targets (to_q, to_k, to_v,
// to_out.0) are where diffusers' and the web UI's files expect them.

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/nn/attention/concepts.hpp"
#include "difftrain/nn/attention/sdpa.hpp"
#include "difftrain/nn/blocks/cross_attention.hpp"
#include "difftrain/nn/blocks/transformer_block.hpp"

namespace difftrain::models {

struct Transformer2DOptions {
  std::int64_t num_attention_heads = 0;
  std::int64_t attention_head_dim = 0;
  std::int64_t in_channels = 0;
  std::int64_t num_layers = 1;
  std::optional<std::int64_t> cross_attention_dim;  // none: attn2 attends to the tokens
  std::int64_t norm_num_groups = 32;
  bool use_linear_projection = false;
  bool only_cross_attention = false;  // attn1 attends to the context too
  double dropout = 0.0;
};

template <nn::attention::AttentionBackend Backend = nn::attention::Sdpa<nn::attention::Auto>>
class Transformer2DModelImpl : public torch::nn::Module {
 public:
  using Block = nn::blocks::BasicTransformerBlock<Backend, nn::activation::GELU>;

  explicit Transformer2DModelImpl(const Transformer2DOptions& o)
      : in_channels_(o.in_channels), linear_(o.use_linear_projection) {
    const std::string where = "Transformer2DModel";
    if (o.num_attention_heads <= 0 || o.attention_head_dim <= 0 || o.num_layers <= 0)
      throw ConfigError("heads, head dim and layers must be positive", where);
    if (o.norm_num_groups <= 0 || o.in_channels <= 0 || o.in_channels % o.norm_num_groups != 0)
      throw ConfigError("in_channels " + std::to_string(o.in_channels) +
                            " is not divisible by norm_num_groups " +
                            std::to_string(o.norm_num_groups),
                        where);
    const std::int64_t inner = o.num_attention_heads * o.attention_head_dim;
    using namespace torch::nn;
    norm = register_module("norm",
                           GroupNorm(GroupNormOptions(o.norm_num_groups, o.in_channels).eps(1e-6)));
    if (linear_)
      proj_in = AnyModule(register_module("proj_in", Linear(o.in_channels, inner)));
    else
      proj_in =
          AnyModule(register_module("proj_in", Conv2d(Conv2dOptions(o.in_channels, inner, 1))));
    transformer_blocks = register_module("transformer_blocks", ModuleList());
    for (std::int64_t i = 0; i < o.num_layers; ++i) {
      nn::blocks::TransformerBlockOptions b;
      b.dim = inner;
      b.n_heads = o.num_attention_heads;
      b.d_head = o.attention_head_dim;
      b.dropout = o.dropout;
      b.context_dim = o.cross_attention_dim;
      b.gated_ff = true;  // diffusers' "geglu"
      b.disable_self_attn = o.only_cross_attention;
      blocks_.push_back(Block(b));
      transformer_blocks->push_back(blocks_.back());
    }
    if (linear_)
      proj_out = AnyModule(register_module("proj_out", Linear(inner, o.in_channels)));
    else
      proj_out =
          AnyModule(register_module("proj_out", Conv2d(Conv2dOptions(inner, o.in_channels, 1))));
  }

  at::Tensor forward(const at::Tensor& x, const at::Tensor& context = {}) {
    if (x.dim() != 4 || x.size(1) != in_channels_)
      throw ShapeError(
          "expects (B, " + std::to_string(in_channels_) + ", H, W), got " + c10::str(x.sizes()),
          "Transformer2DModel");
    const auto b = x.size(0), h = x.size(2), w = x.size(3);
    at::Tensor t = norm->forward(x);
    if (!linear_) t = proj_in.forward<at::Tensor>(t);
    t = t.permute({0, 2, 3, 1}).reshape({b, h * w, t.size(1)});
    if (linear_) t = proj_in.forward<at::Tensor>(t);
    for (auto& block : blocks_) t = block->forward(t, context);
    if (linear_) t = proj_out.forward<at::Tensor>(t);
    t = t.reshape({b, h, w, t.size(2)}).permute({0, 3, 1, 2}).contiguous();
    if (!linear_) t = proj_out.forward<at::Tensor>(t);
    return t + x;
  }

  void set_checkpointing(bool on) {
    for (auto& block : blocks_) block->set_checkpointing(on);
  }
  [[nodiscard]] const std::vector<Block>& blocks() const { return blocks_; }

  torch::nn::GroupNorm norm{nullptr};
  torch::nn::AnyModule proj_in, proj_out;
  torch::nn::ModuleList transformer_blocks{nullptr};

 private:
  std::int64_t in_channels_;
  bool linear_;
  std::vector<Block> blocks_;
};

template <nn::attention::AttentionBackend Backend = nn::attention::Sdpa<nn::attention::Auto>>
using Transformer2DModel = torch::nn::ModuleHolder<Transformer2DModelImpl<Backend>>;

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
