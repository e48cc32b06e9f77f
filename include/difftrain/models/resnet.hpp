#pragma once
// diffusers' ResnetBlock2D, Downsample2D and Upsample2D, with its parameter names (norm1, conv1,
// time_emb_proj, norm2, conv2, conv_shortcut; conv of the resamplers), so a diffusers state dict
// loads by name.

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/nn/activation/concepts.hpp"
#include "difftrain/nn/activation/elementwise.hpp"
#include "difftrain/nn/blocks/checkpoint.hpp"
#include "difftrain/nn/layers/adaptable.hpp"

namespace difftrain::models {

/// How the time embedding enters a ResnetBlock2D: added after conv1 ("default"), or as a scale
/// and shift after norm2 ("scale_shift").
enum class TimeEmbeddingNorm { shift, scale_shift };

inline TimeEmbeddingNorm time_embedding_norm_from(const std::string& name,
                                                  const std::string& where) {
  if (name == "default") return TimeEmbeddingNorm::shift;
  if (name == "scale_shift") return TimeEmbeddingNorm::scale_shift;
  throw ConfigError("'resnet_time_scale_shift' = \"" + name +
                        "\" is not supported (\"default\" or \"scale_shift\")",
                    where);
}

inline std::string to_string(TimeEmbeddingNorm n) {
  return n == TimeEmbeddingNorm::shift ? "default" : "scale_shift";
}

/// A stride-2 convolution (or 2×2 average pool); padding 0 pads right and bottom by one first.
class Downsample2DImpl : public torch::nn::Module {
 public:
  Downsample2DImpl(std::int64_t channels, bool use_conv, std::int64_t padding = 1)
      : channels_(channels), use_conv_(use_conv), padding_(padding) {
    if (use_conv)
      conv = register_module(
          "conv", nn::AdaptableConv2d(
                      torch::nn::Conv2dOptions(channels, channels, 3).stride(2).padding(padding)));
  }
  at::Tensor forward(const at::Tensor& x) {
    if (x.dim() != 4 || x.size(1) != channels_)
      throw ShapeError(
          "expects (B, " + std::to_string(channels_) + ", H, W), got " + c10::str(x.sizes()),
          "Downsample2D");
    if (!use_conv_) return at::avg_pool2d(x, {2, 2}, {2, 2});
    if (padding_ == 0) return conv->forward(at::constant_pad_nd(x, {0, 1, 0, 1}, 0));
    return conv->forward(x);
  }
  nn::AdaptableConv2d conv{nullptr};  // kohya's LoCon can target it

 private:
  std::int64_t channels_;
  bool use_conv_;
  std::int64_t padding_;
};
TORCH_MODULE(Downsample2D);

/// Nearest-neighbour ×2 (or to `output_size`, for inputs whose size does not halve evenly), then
/// an optional 3×3 convolution.
class Upsample2DImpl : public torch::nn::Module {
 public:
  Upsample2DImpl(std::int64_t channels, bool use_conv) : channels_(channels) {
    if (use_conv)
      conv = register_module(
          "conv", nn::AdaptableConv2d(torch::nn::Conv2dOptions(channels, channels, 3).padding(1)));
  }
  at::Tensor forward(const at::Tensor& x,
                     std::optional<std::vector<std::int64_t>> output_size = {}) {
    if (x.dim() != 4 || x.size(1) != channels_)
      throw ShapeError(
          "expects (B, " + std::to_string(channels_) + ", H, W), got " + c10::str(x.sizes()),
          "Upsample2D");
    // As diffusers: nearest upsampling of large channels-last batches needs a contiguous input.
    const at::Tensor in = x.size(0) >= 64 ? x.contiguous() : x;
    at::Tensor h = output_size
                       ? at::upsample_nearest2d(in, *output_size)
                       : at::upsample_nearest2d(in, c10::nullopt, std::vector<double>{2.0, 2.0});
    return conv ? conv->forward(h) : h;
  }
  nn::AdaptableConv2d conv{nullptr};  // kohya's LoCon can target it

 private:
  std::int64_t channels_;
};
TORCH_MODULE(Upsample2D);

struct ResnetBlock2DOptions {
  std::int64_t in_channels = 0;
  std::optional<std::int64_t> out_channels;   // defaults to in_channels
  std::optional<std::int64_t> temb_channels;  // none: no time embedding (the VAE's blocks)
  std::int64_t groups = 32;
  std::optional<std::int64_t> groups_out;  // defaults to groups
  double eps = 1e-6;
  double dropout = 0.0;
  TimeEmbeddingNorm time_embedding_norm = TimeEmbeddingNorm::shift;
  bool skip_time_act = false;
  double output_scale_factor = 1.0;
  bool up = false, down = false;        // resample inside the block (no parameters)
  std::optional<bool> use_in_shortcut;  // defaults to in_channels != out_channels
  bool conv_shortcut_bias = true;
};

/// GroupNorm → Act → conv1 (+ time embedding) → GroupNorm → Act → dropout → conv2, plus the
/// input (through a 1×1 conv_shortcut when the channels change), divided by output_scale_factor.
template <nn::ElementwiseActivation Act = nn::activation::SiLU>
class ResnetBlock2DImpl : public torch::nn::Module {
 public:
  explicit ResnetBlock2DImpl(const ResnetBlock2DOptions& o) : o_(o) {
    const std::string where = "ResnetBlock2D";
    const std::int64_t out = o.out_channels.value_or(o.in_channels);
    const std::int64_t groups_out = o.groups_out.value_or(o.groups);
    if (o.in_channels <= 0 || out <= 0) throw ConfigError("channels must be positive", where);
    if (o.groups <= 0 || o.in_channels % o.groups != 0 || groups_out <= 0 || out % groups_out != 0)
      throw ConfigError("GroupNorm needs channels divisible by the groups: " +
                            std::to_string(o.in_channels) + " / " + std::to_string(o.groups) +
                            ", " + std::to_string(out) + " / " + std::to_string(groups_out),
                        where);
    if (o.up && o.down) throw ConfigError("a block cannot both up- and downsample", where);
    if (o.time_embedding_norm == TimeEmbeddingNorm::scale_shift && !o.temb_channels)
      throw ConfigError("the scale_shift time embedding needs temb_channels", where);
    using namespace torch::nn;
    norm1 =
        register_module("norm1", GroupNorm(GroupNormOptions(o.groups, o.in_channels).eps(o.eps)));
    conv1 = register_module("conv1",
                            nn::AdaptableConv2d(Conv2dOptions(o.in_channels, out, 3).padding(1)));
    if (o.temb_channels)
      time_emb_proj = register_module(
          "time_emb_proj",
          nn::AdaptableLinear(
              *o.temb_channels,
              o.time_embedding_norm == TimeEmbeddingNorm::scale_shift ? 2 * out : out));
    norm2 = register_module("norm2", GroupNorm(GroupNormOptions(groups_out, out).eps(o.eps)));
    dropout = register_module("dropout", Dropout(o.dropout));
    conv2 = register_module("conv2", nn::AdaptableConv2d(Conv2dOptions(out, out, 3).padding(1)));
    if (o.up) upsample_ = register_module("upsample", Upsample2D(o.in_channels, false));
    if (o.down) downsample_ = register_module("downsample", Downsample2D(o.in_channels, false));
    if (o.use_in_shortcut.value_or(o.in_channels != out))
      conv_shortcut = register_module(
          "conv_shortcut",
          nn::AdaptableConv2d(Conv2dOptions(o.in_channels, out, 1).bias(o.conv_shortcut_bias)));
  }

  /// Recompute this block's activations in backward instead of storing them.
  void set_checkpointing(bool on) { checkpoint_ = on; }

  at::Tensor forward(const at::Tensor& x, const at::Tensor& temb = {}) {
    if (x.dim() != 4 || x.size(1) != o_.in_channels)
      throw ShapeError(
          "expects (B, " + std::to_string(o_.in_channels) + ", H, W), got " + c10::str(x.sizes()),
          "ResnetBlock2D");
    if (time_emb_proj && !temb.defined())
      throw ShapeError("this block takes a time embedding (temb_channels = " +
                           std::to_string(*o_.temb_channels) + ") and got none",
                       "ResnetBlock2D");
    if (!checkpoint_ || !is_training()) return body(x, temb);
    std::vector<at::Tensor> in{x};
    if (temb.defined() && time_emb_proj) in.push_back(temb);
    return nn::checkpoint(
        [this](const std::vector<at::Tensor>& t) {
          return body(t[0], t.size() > 1 ? t[1] : at::Tensor());
        },
        in, parameters(), true);
  }

  torch::nn::GroupNorm norm1{nullptr}, norm2{nullptr};
  // Adaptable (exactly a Conv2d / Linear until an adapter is attached): kohya's LoCon and PEFT's
  // conv LoRA target the block's convolutions, and how the condition enters it.
  nn::AdaptableConv2d conv1{nullptr}, conv2{nullptr}, conv_shortcut{nullptr};
  nn::AdaptableLinear time_emb_proj{nullptr};
  torch::nn::Dropout dropout{nullptr};

 private:
  static at::Tensor act(const at::Tensor& t) { return Act::forward(t, typename Act::Options{}); }

  at::Tensor body(at::Tensor input, const at::Tensor& temb) {
    at::Tensor h = act(norm1->forward(input));
    if (upsample_) {
      input = upsample_->forward(input);
      h = upsample_->forward(h);
    } else if (downsample_) {
      input = downsample_->forward(input);
      h = downsample_->forward(h);
    }
    h = conv1->forward(h);
    at::Tensor t;
    if (time_emb_proj && temb.defined())
      t = time_emb_proj->forward(o_.skip_time_act ? temb : act(temb)).unsqueeze(-1).unsqueeze(-1);
    if (o_.time_embedding_norm == TimeEmbeddingNorm::shift) {
      if (t.defined()) h = h + t;
      h = norm2->forward(h);
    } else {
      h = norm2->forward(h);
      const auto scale_shift = t.chunk(2, 1);
      h = h * (1 + scale_shift[0]) + scale_shift[1];
    }
    h = conv2->forward(dropout->forward(act(h)));
    if (conv_shortcut) input = conv_shortcut->forward(input.contiguous());
    at::Tensor out = input + h;
    return o_.output_scale_factor == 1.0 ? out : out / o_.output_scale_factor;
  }

  ResnetBlock2DOptions o_;
  bool checkpoint_ = false;
  Upsample2D upsample_{nullptr};
  Downsample2D downsample_{nullptr};
};

template <nn::ElementwiseActivation Act = nn::activation::SiLU>
using ResnetBlock2D = torch::nn::ModuleHolder<ResnetBlock2DImpl<Act>>;

}  // namespace difftrain::models
