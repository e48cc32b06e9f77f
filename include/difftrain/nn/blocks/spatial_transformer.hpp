#pragma once
// latent diffusion's SpatialTransformer: GroupNorm(32) → proj_in (1×1 conv, or Linear with
// use_linear) → `depth` BasicTransformerBlocks over the H·W tokens → proj_out (zero-initialised, so
// a new block starts as the identity) → + input. `context_dim` is one dimension or one per block;
// a single context is shared by every block, a list gives each block its own. With another
// `norm_num_groups` and a plainly initialised proj_out it is diffusers' Transformer2DModel (the
// same parameter names and arithmetic; models/transformer_2d.hpp).

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/nn/blocks/transformer_block.hpp"

namespace difftrain::nn::blocks {

struct SpatialTransformerOptions {
  std::int64_t in_channels = 0;
  std::int64_t n_heads = 8;
  std::int64_t d_head = 64;
  std::int64_t depth = 1;
  double dropout = 0.0;
  std::vector<std::int64_t> context_dim;  // empty: self-attention only; one value: every block
  bool disable_self_attn = false;
  bool use_linear = false;
  bool use_checkpoint = false;
  std::int64_t norm_num_groups = 32;
  bool zero_init_proj_out = true;  // false: torch's default init, as diffusers'
};

template <attention::AttentionBackend Backend = attention::Sdpa<attention::Auto>,
          ElementwiseActivation Act = activation::GELU>
class SpatialTransformerImpl : public torch::nn::Module {
 public:
  explicit SpatialTransformerImpl(const SpatialTransformerOptions& o)
      : in_channels_(o.in_channels), use_linear_(o.use_linear) {
    const std::string where = "SpatialTransformer";
    if (o.norm_num_groups <= 0 || o.in_channels <= 0 || o.in_channels % o.norm_num_groups != 0)
      throw ConfigError("in_channels must be a positive multiple of " +
                            std::to_string(o.norm_num_groups) + " (GroupNorm of " +
                            std::to_string(o.norm_num_groups) + " groups), got " +
                            std::to_string(o.in_channels),
                        where);
    if (o.depth <= 0 || o.n_heads <= 0 || o.d_head <= 0)
      throw ConfigError("depth, n_heads and d_head must be positive", where);
    std::vector<std::int64_t> dims = o.context_dim;
    if (dims.size() > 1 && static_cast<std::int64_t>(dims.size()) != o.depth) {
      for (auto d : dims)
        if (d != dims[0])
          throw ConfigError("context_dim has " + std::to_string(dims.size()) +
                                " different entries but depth is " + std::to_string(o.depth),
                            where);
      dims.resize(1);  // homogeneous: one dimension for every block, as the reference
    }
    const std::int64_t inner = o.n_heads * o.d_head;
    norm = register_module(
        "norm", torch::nn::GroupNorm(
                    torch::nn::GroupNormOptions(o.norm_num_groups, o.in_channels).eps(1e-6)));
    if (o.use_linear)
      proj_in =
          torch::nn::AnyModule(register_module("proj_in", torch::nn::Linear(o.in_channels, inner)));
    else
      proj_in = torch::nn::AnyModule(register_module(
          "proj_in", torch::nn::Conv2d(torch::nn::Conv2dOptions(o.in_channels, inner, 1))));
    transformer_blocks = register_module("transformer_blocks", torch::nn::ModuleList());
    for (std::int64_t d = 0; d < o.depth; ++d) {
      TransformerBlockOptions b;
      b.dim = inner;
      b.n_heads = o.n_heads;
      b.d_head = o.d_head;
      b.dropout = o.dropout;
      if (!dims.empty()) b.context_dim = dims[dims.size() == 1 ? 0 : static_cast<std::size_t>(d)];
      b.disable_self_attn = o.disable_self_attn;
      b.checkpoint = o.use_checkpoint;
      blocks_.push_back(BasicTransformerBlock<Backend, Act>(b));
      transformer_blocks->push_back(blocks_.back());
    }
    if (o.use_linear)
      proj_out = torch::nn::AnyModule(
          register_module("proj_out", torch::nn::Linear(inner, o.in_channels)));
    else
      proj_out = torch::nn::AnyModule(register_module(
          "proj_out", torch::nn::Conv2d(torch::nn::Conv2dOptions(inner, o.in_channels, 1))));
    if (o.zero_init_proj_out) {
      at::NoGradGuard no_grad;
      for (auto& p : proj_out.ptr()->parameters()) p.zero_();
    }
  }

  /// `contexts`: none, one shared by every block, or one per block; `context_mask` (B, Lk), bool
  /// or an additive bias, masks the context's tokens in every block's attention to it.
  at::Tensor forward(const at::Tensor& x, const std::vector<at::Tensor>& contexts = {},
                     const at::Tensor& context_mask = {}) {
    if (x.dim() != 4 || x.size(1) != in_channels_)
      throw ShapeError(
          "expects (B, " + std::to_string(in_channels_) + ", H, W), got " + c10::str(x.sizes()),
          "SpatialTransformer");
    if (contexts.size() > 1 && contexts.size() != blocks_.size())
      throw ShapeError("got " + std::to_string(contexts.size()) + " contexts for " +
                           std::to_string(blocks_.size()) + " blocks",
                       "SpatialTransformer");
    const auto b = x.size(0), h = x.size(2), w = x.size(3);
    at::Tensor t = norm->forward(x);
    if (!use_linear_) t = proj_in.forward<at::Tensor>(t);
    t = t.flatten(2).transpose(1, 2).contiguous();  // "b c h w -> b (h w) c"
    if (use_linear_) t = proj_in.forward<at::Tensor>(t);
    for (std::size_t i = 0; i < blocks_.size(); ++i) {
      const at::Tensor ctx =
          contexts.empty() ? at::Tensor() : contexts[contexts.size() == 1 ? 0 : i];
      t = blocks_[i]->forward(t, ctx, {}, 0, context_mask);
    }
    if (use_linear_) t = proj_out.forward<at::Tensor>(t);
    t = t.transpose(1, 2).reshape({b, t.size(2), h, w}).contiguous();
    if (!use_linear_) t = proj_out.forward<at::Tensor>(t);
    return t + x;
  }

  at::Tensor forward(const at::Tensor& x, const at::Tensor& context,
                     const at::Tensor& context_mask = {}) {
    return context.defined() ? forward(x, std::vector<at::Tensor>{context}, context_mask)
                             : forward(x);
  }

  void set_checkpointing(bool on) {
    for (auto& blk : blocks_) blk->set_checkpointing(on);
  }
  [[nodiscard]] const std::vector<BasicTransformerBlock<Backend, Act>>& blocks() const {
    return blocks_;
  }

  torch::nn::GroupNorm norm{nullptr};
  torch::nn::AnyModule proj_in, proj_out;
  torch::nn::ModuleList transformer_blocks{nullptr};

 private:
  std::int64_t in_channels_;
  bool use_linear_;
  std::vector<BasicTransformerBlock<Backend, Act>> blocks_;
};

template <attention::AttentionBackend Backend = attention::Sdpa<attention::Auto>,
          ElementwiseActivation Act = activation::GELU>
using SpatialTransformer = torch::nn::ModuleHolder<SpatialTransformerImpl<Backend, Act>>;

}  // namespace difftrain::nn::blocks
