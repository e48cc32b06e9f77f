#pragma once
// The down, middle and up blocks of diffusers' UNets and VAE, named as diffusers names their
// parameters (resnets.N, attentions.N, downsamplers.0.conv, upsamplers.0.conv). One class per role;
// the diffusers block type decides its parts:
//   DownBlock:  "DownBlock2D", "CrossAttnDownBlock2D" (a Transformer2DModel after each resnet),
//               "DownEncoderBlock2D" (no time embedding)
//   MidBlock:   "UNetMidBlock2DCrossAttn", "UNetMidBlock2D" (the VAE's, with self-attention)
//   UpBlock:    "UpBlock2D", "CrossAttnUpBlock2D" (each resnet also takes a skip from the down
//               path), "UpDecoderBlock2D" (no skips, no time embedding)

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/models/resnet.hpp"
#include "difftrain/models/transformer_2d.hpp"

namespace difftrain::models {

/// What every resnet of a block shares.
struct ResnetSettings {
  std::optional<std::int64_t> temb_channels;
  std::int64_t groups = 32;
  double eps = 1e-6;
  double dropout = 0.0;
  TimeEmbeddingNorm time_embedding_norm = TimeEmbeddingNorm::shift;
  double output_scale_factor = 1.0;
};

/// The transformers of a cross-attention block.
struct CrossAttentionSettings {
  std::int64_t num_attention_heads = 1;
  std::int64_t transformer_layers = 1;
  std::int64_t cross_attention_dim = 0;
  bool use_linear_projection = false;
  bool only_cross_attention = false;
};

namespace unet_detail {
inline ResnetBlock2DOptions resnet(const ResnetSettings& s, std::int64_t in, std::int64_t out) {
  ResnetBlock2DOptions o;
  o.in_channels = in;
  o.out_channels = out;
  o.temb_channels = s.temb_channels;
  o.groups = s.groups;
  o.eps = s.eps;
  o.dropout = s.dropout;
  o.time_embedding_norm = s.time_embedding_norm;
  o.output_scale_factor = s.output_scale_factor;
  return o;
}
inline nn::blocks::SpatialTransformerOptions transformer(const CrossAttentionSettings& a,
                                                         std::int64_t channels,
                                                         std::int64_t groups) {
  if (channels % a.num_attention_heads != 0)
    throw ConfigError(std::to_string(channels) + " channels do not split into " +
                          std::to_string(a.num_attention_heads) + " attention heads",
                      "attention_head_dim");
  return transformer_2d_options(a.num_attention_heads, channels / a.num_attention_heads, channels,
                                a.transformer_layers, a.cross_attention_dim, groups,
                                a.use_linear_projection, a.only_cross_attention);
}
}  // namespace unet_detail

struct DownBlockOptions {
  std::int64_t in_channels = 0, out_channels = 0;
  std::int64_t num_layers = 1;
  ResnetSettings resnet;
  std::optional<CrossAttentionSettings> attention;  // CrossAttnDownBlock2D
  bool add_downsample = true;
  std::int64_t downsample_padding = 1;
};

template <nn::attention::AttentionBackend Backend, nn::ElementwiseActivation Act>
class DownBlockImpl : public torch::nn::Module {
 public:
  explicit DownBlockImpl(const DownBlockOptions& o) {
    resnets = register_module("resnets", torch::nn::ModuleList());
    if (o.attention) attentions = register_module("attentions", torch::nn::ModuleList());
    for (std::int64_t i = 0; i < o.num_layers; ++i) {
      res_.push_back(ResnetBlock2D<Act>(
          unet_detail::resnet(o.resnet, i == 0 ? o.in_channels : o.out_channels, o.out_channels)));
      resnets->push_back(res_.back());
      if (o.attention) {
        attn_.push_back(Transformer2DModel<Backend>(
            unet_detail::transformer(*o.attention, o.out_channels, o.resnet.groups)));
        attentions->push_back(attn_.back());
      }
    }
    if (o.add_downsample) {
      down_ = Downsample2D(o.out_channels, true, o.downsample_padding);
      downsamplers = register_module("downsamplers", torch::nn::ModuleList(down_));
    }
  }

  [[nodiscard]] bool has_cross_attention() const { return !attn_.empty(); }

  /// The output, and every hidden state the up path takes as a skip (appended to `skips`).
  at::Tensor forward(at::Tensor h, const at::Tensor& temb, const at::Tensor& context,
                     std::vector<at::Tensor>* skips, const at::Tensor& context_mask = {}) {
    for (std::size_t i = 0; i < res_.size(); ++i) {
      h = res_[i]->forward(h, temb);
      if (!attn_.empty()) h = attn_[i]->forward(h, context, context_mask);
      if (skips) skips->push_back(h);
    }
    if (down_) {
      h = down_->forward(h);
      if (skips) skips->push_back(h);
    }
    return h;
  }

  void set_checkpointing(bool on) {
    for (auto& r : res_) r->set_checkpointing(on);
    for (auto& a : attn_) a->set_checkpointing(on);
  }
  [[nodiscard]] std::size_t num_resnets() const { return res_.size(); }
  [[nodiscard]] const std::vector<Transformer2DModel<Backend>>& transformers() const {
    return attn_;
  }

  torch::nn::ModuleList resnets{nullptr}, attentions{nullptr}, downsamplers{nullptr};

 private:
  std::vector<ResnetBlock2D<Act>> res_;
  std::vector<Transformer2DModel<Backend>> attn_;
  Downsample2D down_{nullptr};
};
template <nn::attention::AttentionBackend Backend, nn::ElementwiseActivation Act>
using DownBlock = torch::nn::ModuleHolder<DownBlockImpl<Backend, Act>>;

struct MidBlockOptions {
  std::int64_t channels = 0;
  std::int64_t num_layers = 1;  // (attention, resnet) pairs after the first resnet
  ResnetSettings resnet;
  std::optional<CrossAttentionSettings> attention;  // UNetMidBlock2DCrossAttn
  /// UNetMidBlock2D: a SelfAttention2D of this head size per layer (none: no attention).
  std::optional<std::int64_t> self_attention_head_dim;
};

template <nn::attention::AttentionBackend Backend, nn::ElementwiseActivation Act>
class MidBlockImpl : public torch::nn::Module {
 public:
  explicit MidBlockImpl(const MidBlockOptions& o) {
    if (o.attention && o.self_attention_head_dim)
      throw ConfigError("a mid block has cross-attention or self-attention, not both", "MidBlock");
    attentions = register_module("attentions", torch::nn::ModuleList());
    resnets = register_module("resnets", torch::nn::ModuleList());
    auto add_resnet = [&] {
      res_.push_back(ResnetBlock2D<Act>(unet_detail::resnet(o.resnet, o.channels, o.channels)));
      resnets->push_back(res_.back());
    };
    add_resnet();
    for (std::int64_t i = 0; i < o.num_layers; ++i) {
      if (o.attention) {
        cross_.push_back(Transformer2DModel<Backend>(
            unet_detail::transformer(*o.attention, o.channels, o.resnet.groups)));
        attentions->push_back(cross_.back());
      } else if (o.self_attention_head_dim) {
        SelfAttention2DOptions s;
        s.channels = o.channels;
        s.head_dim = *o.self_attention_head_dim;
        s.norm_num_groups = o.resnet.groups;
        s.eps = o.resnet.eps;
        s.rescale_output_factor = o.resnet.output_scale_factor;
        self_.push_back(SelfAttention2D<Backend>(s));
        attentions->push_back(self_.back());
      }
      add_resnet();
    }
  }

  [[nodiscard]] bool has_cross_attention() const { return !cross_.empty(); }

  at::Tensor forward(at::Tensor h, const at::Tensor& temb = {}, const at::Tensor& context = {},
                     const at::Tensor& context_mask = {}) {
    h = res_[0]->forward(h, temb);
    for (std::size_t i = 1; i < res_.size(); ++i) {
      if (!cross_.empty()) h = cross_[i - 1]->forward(h, context, context_mask);
      if (!self_.empty()) h = self_[i - 1]->forward(h);
      h = res_[i]->forward(h, temb);
    }
    return h;
  }

  void set_checkpointing(bool on) {
    for (auto& r : res_) r->set_checkpointing(on);
    for (auto& a : cross_) a->set_checkpointing(on);
  }
  [[nodiscard]] const std::vector<Transformer2DModel<Backend>>& transformers() const {
    return cross_;
  }

  torch::nn::ModuleList attentions{nullptr}, resnets{nullptr};

 private:
  std::vector<ResnetBlock2D<Act>> res_;
  std::vector<Transformer2DModel<Backend>> cross_;
  std::vector<SelfAttention2D<Backend>> self_;
};
template <nn::attention::AttentionBackend Backend, nn::ElementwiseActivation Act>
using MidBlock = torch::nn::ModuleHolder<MidBlockImpl<Backend, Act>>;

struct UpBlockOptions {
  std::int64_t in_channels = 0;           // the matching down block's input channels
  std::int64_t prev_output_channels = 0;  // what the previous up block produced
  std::int64_t out_channels = 0;
  std::int64_t num_layers = 1;
  ResnetSettings resnet;
  std::optional<CrossAttentionSettings> attention;  // CrossAttnUpBlock2D
  bool add_upsample = true;
  bool skips = true;  // false: UpDecoderBlock2D
};

template <nn::attention::AttentionBackend Backend, nn::ElementwiseActivation Act>
class UpBlockImpl : public torch::nn::Module {
 public:
  explicit UpBlockImpl(const UpBlockOptions& o) : skips_(o.skips) {
    resnets = register_module("resnets", torch::nn::ModuleList());
    if (o.attention) attentions = register_module("attentions", torch::nn::ModuleList());
    for (std::int64_t i = 0; i < o.num_layers; ++i) {
      std::int64_t in = i == 0 ? o.prev_output_channels : o.out_channels;
      if (o.skips) in += i == o.num_layers - 1 ? o.in_channels : o.out_channels;
      res_.push_back(ResnetBlock2D<Act>(unet_detail::resnet(o.resnet, in, o.out_channels)));
      resnets->push_back(res_.back());
      if (o.attention) {
        attn_.push_back(Transformer2DModel<Backend>(
            unet_detail::transformer(*o.attention, o.out_channels, o.resnet.groups)));
        attentions->push_back(attn_.back());
      }
    }
    if (o.add_upsample) {
      up_ = Upsample2D(o.out_channels, true);
      upsamplers = register_module("upsamplers", torch::nn::ModuleList(up_));
    }
  }

  [[nodiscard]] bool has_cross_attention() const { return !attn_.empty(); }
  [[nodiscard]] std::size_t num_resnets() const { return res_.size(); }

  /// Takes its skips from the back of `skips` (one per resnet) when the block has skips.
  at::Tensor forward(at::Tensor h, const at::Tensor& temb, const at::Tensor& context,
                     std::vector<at::Tensor>* skips,
                     std::optional<std::vector<std::int64_t>> upsample_size = {},
                     const at::Tensor& context_mask = {}) {
    for (std::size_t i = 0; i < res_.size(); ++i) {
      if (skips_) {
        if (skips == nullptr || skips->empty())
          throw ShapeError("an up block ran out of skip connections", "UpBlock");
        h = at::cat({h, skips->back()}, 1);
        skips->pop_back();
      }
      h = res_[i]->forward(h, temb);
      if (!attn_.empty()) h = attn_[i]->forward(h, context, context_mask);
    }
    if (up_) h = up_->forward(h, std::move(upsample_size));
    return h;
  }

  void set_checkpointing(bool on) {
    for (auto& r : res_) r->set_checkpointing(on);
    for (auto& a : attn_) a->set_checkpointing(on);
  }
  [[nodiscard]] const std::vector<Transformer2DModel<Backend>>& transformers() const {
    return attn_;
  }

  torch::nn::ModuleList resnets{nullptr}, attentions{nullptr}, upsamplers{nullptr};

 private:
  bool skips_;
  std::vector<ResnetBlock2D<Act>> res_;
  std::vector<Transformer2DModel<Backend>> attn_;
  Upsample2D up_{nullptr};
};
template <nn::attention::AttentionBackend Backend, nn::ElementwiseActivation Act>
using UpBlock = torch::nn::ModuleHolder<UpBlockImpl<Backend, Act>>;

}  // namespace difftrain::models
