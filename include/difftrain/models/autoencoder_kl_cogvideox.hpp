#pragma once
// diffusers' AutoencoderKLCogVideoX — CogVideoX's 3-D VAE — built from its `config.json`, with
// diffusers' parameter names. Videos are (B, C, T, H, W). Every 3×3×3 convolution is causal in
// time: it sees the current and two earlier frames, the first frame standing in for frames
// before the start. Time is compressed 2× per level up to temporal_compression_ratio, the first
// frame kept on its own, so 1 + 4k frames give 1 + k latent frames (49 → 13).
//
// Like diffusers, encode and decode run over the frames in batches (8 frames in, 2 latent frames
// out by default; the first batch takes the remainder) and carry each causal convolution's last
// two input frames from one batch to the next; the group norms see one batch at a time, so the
// batch sizes are part of the result and default to diffusers'. Slicing (one video at a time)
// and tiling (overlapping spatial tiles blended across their seams, each tile frame-batched) bound
// memory further.

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/models/autoencoder_kl.hpp"
#include "difftrain/models/config_reader.hpp"
#include "difftrain/models/embeddings.hpp"
#include "difftrain/nn/activation/concepts.hpp"
#include "difftrain/nn/activation/elementwise.hpp"
#include "difftrain/nn/blocks/checkpoint.hpp"

namespace difftrain::models {

/// The fields of diffusers' AutoencoderKLCogVideoX config, with diffusers' defaults (which are
/// CogVideoX-2b's VAE; CogVideoX-5b's differs only in scaling_factor 0.7).
struct AutoencoderKLCogVideoXConfig {
  static constexpr std::string_view class_name = "AutoencoderKLCogVideoX";
  static constexpr std::string_view down_block_type = "CogVideoXDownBlock3D";
  static constexpr std::string_view up_block_type = "CogVideoXUpBlock3D";

  std::int64_t in_channels = 3, out_channels = 3;
  std::vector<std::string> down_block_types{4, std::string(down_block_type)};
  std::vector<std::string> up_block_types{4, std::string(up_block_type)};
  std::vector<std::int64_t> block_out_channels{128, 256, 256, 512};
  std::int64_t latent_channels = 16;
  std::int64_t layers_per_block = 3;
  std::string act_fn = "silu";
  double norm_eps = 1e-6;
  std::int64_t norm_num_groups = 32;
  double temporal_compression_ratio = 4;
  std::int64_t sample_height = 480, sample_width = 720;  // the tiling sizes in diffusers
  double scaling_factor = 1.15258426;
  std::optional<double> shift_factor;
  std::optional<std::vector<double>> latents_mean, latents_std;
  bool force_upcast = true;
  bool use_quant_conv = false, use_post_quant_conv = false;
  // CogVideoX 1.5's I2V pipelines divide the image latents by scaling_factor instead of
  // multiplying (see image_latents_scaled).
  bool invert_scale_latents = false;

  /// How many levels compress time: log2(temporal_compression_ratio).
  [[nodiscard]] std::int64_t temporal_levels() const {
    return static_cast<std::int64_t>(std::log2(temporal_compression_ratio));
  }

  void resolve(const std::string& where) {
    check_vae_config(*this, std::string(down_block_type), std::string(up_block_type), where);
    const std::size_t n = block_out_channels.size();
    if (!(norm_eps > 0.0) || !std::isfinite(norm_eps))
      throw ConfigError("'norm_eps' must be positive and finite", where);
    // diffusers truncates log2 silently (3 would compress by 2) and compresses at most once per
    // downsampling level: a ratio it would not honour is refused here.
    const double levels = std::log2(temporal_compression_ratio);
    if (!(temporal_compression_ratio >= 1.0) || levels != std::floor(levels))
      throw ConfigError("'temporal_compression_ratio' must be a power of two (1, 2, 4, …), got " +
                            std::to_string(temporal_compression_ratio),
                        where);
    if (temporal_levels() > static_cast<std::int64_t>(n) - 1)
      throw ConfigError("'temporal_compression_ratio' " +
                            std::to_string(temporal_compression_ratio) + " needs " +
                            std::to_string(temporal_levels() + 1) + " blocks, the config has " +
                            std::to_string(n),
                        where);
    check_config_range("sample_height", sample_height, 1, ConfigLimits::spatial, where);
    check_config_range("sample_width", sample_width, 1, ConfigLimits::spatial, where);
    // diffusers sizes quant_conv from out_channels but runs it on the encoder's 2·latent_channels.
    if (use_quant_conv && out_channels != latent_channels)
      throw ConfigError("'use_quant_conv' with out_channels " + std::to_string(out_channels) +
                            " != latent_channels " + std::to_string(latent_channels) +
                            ": diffusers builds quant_conv for 2·out_channels and cannot run it",
                        where);
    if (use_post_quant_conv && out_channels != latent_channels)
      throw ConfigError("'use_post_quant_conv' with out_channels " + std::to_string(out_channels) +
                            " != latent_channels " + std::to_string(latent_channels) +
                            ": diffusers builds post_quant_conv for out_channels and cannot run it",
                        where);
  }

  /// What this config implies about a weight file.
  [[nodiscard]] WeightSignature weight_signature() const {
    WeightSignature s;
    const auto n = static_cast<std::int64_t>(block_out_channels.size());
    const auto& ch = block_out_channels;
    s.shapes.push_back({"encoder.conv_in.conv.weight", {ch[0], in_channels, 3, 3, 3}});
    s.shapes.push_back({"encoder.conv_out.conv.weight", {2 * latent_channels, ch.back(), 3, 3, 3}});
    s.shapes.push_back({"decoder.conv_in.conv.weight", {ch.back(), latent_channels, 3, 3, 3}});
    s.shapes.push_back({"decoder.conv_out.conv.weight", {out_channels, ch[0], 3, 3, 3}});
    s.counts.push_back({"encoder.down_blocks.", n});
    s.counts.push_back({"decoder.up_blocks.", n});
    for (std::int64_t i = 0; i < n; ++i) {
      s.counts.push_back(
          {"encoder.down_blocks." + std::to_string(i) + ".resnets.", layers_per_block});
      s.counts.push_back(
          {"decoder.up_blocks." + std::to_string(i) + ".resnets.", layers_per_block + 1});
    }
    return s;
  }

  static AutoencoderKLCogVideoXConfig from_json(const nlohmann::json& j, const std::string& where) {
    ConfigReader r(j, where);
    AutoencoderKLCogVideoXConfig c;
    read_vae_fields(r, c);
    c.norm_eps = r.get("norm_eps", c.norm_eps);
    c.temporal_compression_ratio =
        r.get("temporal_compression_ratio", c.temporal_compression_ratio);
    c.sample_height = r.get("sample_height", c.sample_height);
    c.sample_width = r.get("sample_width", c.sample_width);
    c.invert_scale_latents = r.get("invert_scale_latents", c.invert_scale_latents);
    r.finish();
    c.resolve(where);
    return c;
  }

  /// The file from_pretrained read this config from (see ConfigAsRead).
  ConfigAsRead as_read{};

  [[nodiscard]] nlohmann::json to_json() const {
    nlohmann::json j = vae_config_json(*this);
    j["norm_eps"] = norm_eps;
    j["temporal_compression_ratio"] = config_number(temporal_compression_ratio);
    j["sample_height"] = sample_height;
    j["sample_width"] = sample_width;
    j["invert_scale_latents"] = invert_scale_latents;
    return j;
  }
};

namespace cogvideox_vae_detail {

/// diffusers' CogVideoXSafeConv3d: a 3-D convolution over inputs above `limit_gib` (counted at
/// two bytes an element, as diffusers counts) runs on chunks of frames, each chunk after the
/// first prefixed with the previous chunk's last kernel − 1 frames, so the result is unchanged
/// and cuDNN never sees one huge input.
inline at::Tensor safe_conv3d(torch::nn::Conv3dImpl& conv, const at::Tensor& x,
                              double limit_gib = 2.0) {
  const double gib = static_cast<double>(x.numel()) * 2.0 / (1024.0 * 1024.0 * 1024.0);
  if (gib <= limit_gib) return conv.forward(x);
  const std::int64_t k = conv.options.kernel_size()->at(0);
  const auto parts = static_cast<std::int64_t>(gib / limit_gib) + 1;
  const std::vector<at::Tensor> chunks = x.chunk(parts, 2);
  std::vector<at::Tensor> out;
  for (std::size_t i = 0; i < chunks.size(); ++i) {
    at::Tensor in = chunks[i];
    if (i > 0 && k > 1) {
      const at::Tensor& prev = chunks[i - 1];
      in = at::cat({prev.narrow(2, prev.size(2) - (k - 1), k - 1), in}, 2);
    }
    out.push_back(conv.forward(in));
  }
  return at::cat(out, 2);
}

}  // namespace cogvideox_vae_detail

class CausalConv3dImpl;

/// What the causal convolutions carry from one frame batch to the next: each one's last
/// kernel − 1 input frames, by convolution.
using CausalConvCache = std::map<const CausalConv3dImpl*, at::Tensor>;

/// diffusers' CogVideoXCausalConv3d (pad_mode "first"): the input is prefixed with the previous
/// batch's last kernel − 1 frames, or with its own first frame repeated, and convolved without
/// time padding; height and width are padded to keep their size.
class CausalConv3dImpl : public torch::nn::Module {
 public:
  CausalConv3dImpl(std::int64_t in, std::int64_t out, std::int64_t kernel) : kernel_(kernel) {
    const std::int64_t pad = (kernel - 1) / 2;
    conv = register_module(
        "conv",
        torch::nn::Conv3d(torch::nn::Conv3dOptions(in, out, kernel).padding({0, pad, pad})));
  }

  at::Tensor forward(const at::Tensor& x, CausalConvCache& cache) {
    if (kernel_ == 1) return cogvideox_vae_detail::safe_conv3d(*conv, x);
    const std::int64_t keep = kernel_ - 1;
    const auto it = cache.find(this);
    const at::Tensor before = it != cache.end() && it->second.defined()
                                  ? it->second
                                  : x.narrow(2, 0, 1).expand({-1, -1, keep, -1, -1});
    const at::Tensor padded = at::cat({before, x}, 2);
    cache[this] = padded.narrow(2, padded.size(2) - keep, keep).clone();
    return cogvideox_vae_detail::safe_conv3d(*conv, padded);
  }

  torch::nn::Conv3d conv{nullptr};

 private:
  std::int64_t kernel_;
};
TORCH_MODULE(CausalConv3d);

/// diffusers' CogVideoXSpatialNorm3D: group norm of the features, scaled and shifted by 1×1×1
/// convolutions of the latents resized (nearest) to the features' size — the first frame resized
/// on its own when the frame count is odd, as the temporal upsampling keeps it.
class SpatialNorm3DImpl : public torch::nn::Module {
 public:
  SpatialNorm3DImpl(std::int64_t f_channels, std::int64_t zq_channels, std::int64_t groups) {
    norm_layer = register_module(
        "norm_layer",
        torch::nn::GroupNorm(torch::nn::GroupNormOptions(groups, f_channels).eps(1e-6)));
    conv_y = register_module("conv_y", CausalConv3d(zq_channels, f_channels, 1));
    conv_b = register_module("conv_b", CausalConv3d(zq_channels, f_channels, 1));
  }

  at::Tensor forward(const at::Tensor& f, const at::Tensor& zq, CausalConvCache& cache) {
    at::Tensor z;
    auto resize = [](const at::Tensor& t, const at::Tensor& like) {
      return at::upsample_nearest3d(t, {like.size(2), like.size(3), like.size(4)});
    };
    if (f.size(2) > 1 && f.size(2) % 2 == 1) {
      const at::Tensor f_rest = f.narrow(2, 1, f.size(2) - 1);
      z = at::cat({resize(zq.narrow(2, 0, 1), f.narrow(2, 0, 1)),
                   resize(zq.narrow(2, 1, zq.size(2) - 1), f_rest)},
                  2);
    } else {
      z = resize(zq, f);
    }
    return norm_layer->forward(f) * conv_y->forward(z, cache) + conv_b->forward(z, cache);
  }

  torch::nn::GroupNorm norm_layer{nullptr};
  CausalConv3d conv_y{nullptr}, conv_b{nullptr};
};
TORCH_MODULE(SpatialNorm3D);

/// diffusers' CogVideoXResnetBlock3D: norm, activation, causal 3×3×3 convolution, twice, plus a
/// 1×1×1 shortcut when the width changes. The norms are group norms (encoder) or spatial norms
/// conditioned on the latents (decoder).
template <nn::ElementwiseActivation Act = nn::activation::SiLU>
class CogVideoXResnetBlock3DImpl : public torch::nn::Module {
 public:
  CogVideoXResnetBlock3DImpl(std::int64_t in, std::int64_t out, std::int64_t groups, double eps,
                             std::optional<std::int64_t> spatial_norm_dim)
      : in_(in), out_(out) {
    using namespace torch::nn;
    if (spatial_norm_dim) {
      spatial_norm1 = register_module("norm1", SpatialNorm3D(in, *spatial_norm_dim, groups));
      spatial_norm2 = register_module("norm2", SpatialNorm3D(out, *spatial_norm_dim, groups));
    } else {
      norm1 = register_module("norm1", GroupNorm(GroupNormOptions(groups, in).eps(eps)));
      norm2 = register_module("norm2", GroupNorm(GroupNormOptions(groups, out).eps(eps)));
    }
    conv1 = register_module("conv1", CausalConv3d(in, out, 3));
    conv2 = register_module("conv2", CausalConv3d(out, out, 3));
    if (in != out)
      conv_shortcut = register_module("conv_shortcut", Conv3d(Conv3dOptions(in, out, 1)));
  }

  void set_checkpointing(bool on) { checkpoint_ = on; }

  /// The block's output; `cache` gives and receives conv1's and conv2's carried frames.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& zq, CausalConvCache& cache) {
    if (!checkpoint_ || !is_training() || !at::GradMode::is_enabled()) return body(x, zq, cache);
    // The checkpointed body returns the output and both carried-frame tensors packed into one
    // flat tensor (the checkpoint has one output); they are unpacked here.
    const auto carried = [&](const CausalConv3d& c) {
      const auto it = cache.find(c.get());
      return it == cache.end() ? at::Tensor() : it->second;
    };
    const at::Tensor c1 = carried(conv1), c2 = carried(conv2);
    std::vector<at::Tensor> in{x};
    if (zq.defined()) in.push_back(zq);
    if (c1.defined()) in.push_back(c1);
    if (c2.defined()) in.push_back(c2);
    const bool has_zq = zq.defined(), has_c1 = c1.defined(), has_c2 = c2.defined();
    // Written by the body on every run (the recompute in backward included), so held by the
    // closure rather than by this frame.
    struct Shapes {
      std::vector<std::int64_t> out, c1, c2;
    };
    const auto shapes = std::make_shared<Shapes>();
    const at::Tensor packed = nn::checkpoint(
        [this, shapes, has_zq, has_c1, has_c2](const std::vector<at::Tensor>& t) {
          std::size_t k = 1;
          const at::Tensor z = has_zq ? t[k++] : at::Tensor();
          CausalConvCache local;
          if (has_c1) local[conv1.get()] = t[k++];
          if (has_c2) local[conv2.get()] = t[k++];
          const at::Tensor h = body(t[0], z, local);
          const at::Tensor& n1 = local.at(conv1.get());
          const at::Tensor& n2 = local.at(conv2.get());
          shapes->out = h.sizes().vec();
          shapes->c1 = n1.sizes().vec();
          shapes->c2 = n2.sizes().vec();
          return at::cat({h.reshape(-1), n1.reshape(-1), n2.reshape(-1)});
        },
        in, parameters(), true);
    const auto numel = [](const std::vector<std::int64_t>& s) {
      std::int64_t n = 1;
      for (const auto d : s) n *= d;
      return n;
    };
    const std::int64_t a = numel(shapes->out), b = numel(shapes->c1);
    cache[conv1.get()] = packed.narrow(0, a, b).view(shapes->c1);
    cache[conv2.get()] = packed.narrow(0, a + b, numel(shapes->c2)).view(shapes->c2);
    return packed.narrow(0, 0, a).view(shapes->out);
  }

  torch::nn::GroupNorm norm1{nullptr}, norm2{nullptr};
  SpatialNorm3D spatial_norm1{nullptr}, spatial_norm2{nullptr};
  CausalConv3d conv1{nullptr}, conv2{nullptr};
  torch::nn::Conv3d conv_shortcut{nullptr};

 private:
  static at::Tensor act(const at::Tensor& t) { return Act::forward(t, typename Act::Options{}); }

  at::Tensor body(const at::Tensor& x, const at::Tensor& zq, CausalConvCache& cache) {
    at::Tensor h = spatial_norm1 ? spatial_norm1->forward(x, zq, cache) : norm1->forward(x);
    h = conv1->forward(act(h), cache);
    h = spatial_norm2 ? spatial_norm2->forward(h, zq, cache) : norm2->forward(h);
    h = conv2->forward(act(h), cache);  // dropout 0: diffusers' VAE never sets it
    const at::Tensor skip =
        conv_shortcut ? cogvideox_vae_detail::safe_conv3d(*conv_shortcut, x) : x;
    return h + skip;
  }

  std::int64_t in_, out_;
  bool checkpoint_ = false;
};
template <nn::ElementwiseActivation Act = nn::activation::SiLU>
using CogVideoXResnetBlock3D = torch::nn::ModuleHolder<CogVideoXResnetBlock3DImpl<Act>>;

/// diffusers' CogVideoXDownsample3D: with compress_time, frames are average-pooled in pairs
/// (the first one kept alone when their count is odd); then every frame is padded right and
/// bottom by one and convolved 3×3 with stride 2.
class CogVideoXDownsample3DImpl : public torch::nn::Module {
 public:
  CogVideoXDownsample3DImpl(std::int64_t channels, bool compress_time)
      : compress_time_(compress_time) {
    conv = register_module(
        "conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(channels, channels, 3).stride(2)));
  }
  at::Tensor forward(at::Tensor x) {
    if (compress_time_) {
      const std::int64_t b = x.size(0), c = x.size(1), t = x.size(2), h = x.size(3), w = x.size(4);
      at::Tensor seq = x.permute({0, 3, 4, 1, 2}).reshape({b * h * w, c, t});
      if (t % 2 == 1) {
        const at::Tensor first = seq.narrow(2, 0, 1);
        seq =
            t > 1 ? at::cat({first, at::avg_pool1d(seq.narrow(2, 1, t - 1), {2}, {2})}, 2) : first;
      } else {
        seq = at::avg_pool1d(seq, {2}, {2});
      }
      x = seq.reshape({b, h, w, c, seq.size(2)}).permute({0, 3, 4, 1, 2});
    }
    x = at::constant_pad_nd(x, {0, 1, 0, 1}, 0);
    return per_frame(x, [this](const at::Tensor& f) { return conv->forward(f); });
  }

  torch::nn::Conv2d conv{nullptr};

  /// `run` on every frame of (B, C, T, H, W) as a (B·T, C, H, W) batch.
  template <class Run>
  static at::Tensor per_frame(const at::Tensor& x, Run&& run) {
    const std::int64_t b = x.size(0), t = x.size(2);
    const at::Tensor frames =
        x.permute({0, 2, 1, 3, 4}).reshape({b * t, x.size(1), x.size(3), x.size(4)});
    const at::Tensor y = run(frames);
    return y.reshape({b, t, y.size(1), y.size(2), y.size(3)}).permute({0, 2, 1, 3, 4});
  }

 private:
  bool compress_time_;
};
TORCH_MODULE(CogVideoXDownsample3D);

/// diffusers' CogVideoXUpsample3D: nearest 2× in space (and with compress_time in time, the
/// first frame of an odd count kept single), then a 3×3 convolution per frame.
class CogVideoXUpsample3DImpl : public torch::nn::Module {
 public:
  CogVideoXUpsample3DImpl(std::int64_t channels, bool compress_time)
      : compress_time_(compress_time) {
    conv = register_module(
        "conv",
        torch::nn::Conv2d(torch::nn::Conv2dOptions(channels, channels, 3).stride(1).padding(1)));
  }
  at::Tensor forward(at::Tensor x) {
    auto double_2d = [](const at::Tensor& f) {
      return at::upsample_nearest2d(f, {2 * f.size(2), 2 * f.size(3)});
    };
    auto double_3d = [](const at::Tensor& v) {
      return at::upsample_nearest3d(v, {2 * v.size(2), 2 * v.size(3), 2 * v.size(4)});
    };
    const std::int64_t t = x.size(2);
    if (compress_time_ && t > 1 && t % 2 == 1) {
      x = at::cat({double_2d(x.select(2, 0)).unsqueeze(2), double_3d(x.narrow(2, 1, t - 1))}, 2);
    } else if (compress_time_ && t > 1) {
      x = double_3d(x);
    } else {
      x = CogVideoXDownsample3DImpl::per_frame(x, double_2d);
    }
    return CogVideoXDownsample3DImpl::per_frame(
        x, [this](const at::Tensor& f) { return conv->forward(f); });
  }

  torch::nn::Conv2d conv{nullptr};

 private:
  bool compress_time_;
};
TORCH_MODULE(CogVideoXUpsample3D);

/// The resnets of one level (down, mid or up) and its resampler, under diffusers' names
/// (`resnets.i`, `downsamplers.0` / `upsamplers.0`).
template <nn::ElementwiseActivation Act = nn::activation::SiLU>
class CogVideoXBlock3DImpl : public torch::nn::Module {
 public:
  enum class Resample { none, down, up };

  CogVideoXBlock3DImpl(std::int64_t in, std::int64_t out, std::int64_t layers,
                       const AutoencoderKLCogVideoXConfig& c,
                       std::optional<std::int64_t> spatial_norm_dim, Resample resample,
                       bool compress_time) {
    resnets = register_module("resnets", torch::nn::ModuleList());
    for (std::int64_t i = 0; i < layers; ++i) {
      res_.emplace_back(i == 0 ? in : out, out, c.norm_num_groups, c.norm_eps, spatial_norm_dim);
      resnets->push_back(res_.back());
    }
    if (resample == Resample::down) {
      downsample_ = CogVideoXDownsample3D(out, compress_time);
      register_module("downsamplers", torch::nn::ModuleList(downsample_));
    } else if (resample == Resample::up) {
      upsample_ = CogVideoXUpsample3D(out, compress_time);
      register_module("upsamplers", torch::nn::ModuleList(upsample_));
    }
  }

  at::Tensor forward(at::Tensor h, const at::Tensor& zq, CausalConvCache& cache) {
    for (auto& r : res_) h = r->forward(h, zq, cache);
    if (downsample_) h = downsample_->forward(h);
    if (upsample_) h = upsample_->forward(h);
    return h;
  }
  void set_checkpointing(bool on) {
    for (auto& r : res_) r->set_checkpointing(on);
  }

  torch::nn::ModuleList resnets{nullptr};

 private:
  std::vector<CogVideoXResnetBlock3D<Act>> res_;
  CogVideoXDownsample3D downsample_{nullptr};
  CogVideoXUpsample3D upsample_{nullptr};
};
template <nn::ElementwiseActivation Act = nn::activation::SiLU>
using CogVideoXBlock3D = torch::nn::ModuleHolder<CogVideoXBlock3DImpl<Act>>;

/// diffusers' CogVideoXEncoder3D: video → the posterior's moments (2·latent_channels).
template <nn::ElementwiseActivation Act = nn::activation::SiLU>
class CogVideoXEncoder3DImpl : public torch::nn::Module {
 public:
  using Block = CogVideoXBlock3DImpl<Act>;

  explicit CogVideoXEncoder3DImpl(const AutoencoderKLCogVideoXConfig& c) {
    const auto& ch = c.block_out_channels;
    conv_in = register_module("conv_in", CausalConv3d(c.in_channels, ch[0], 3));
    down_blocks = register_module("down_blocks", torch::nn::ModuleList());
    std::int64_t out = ch[0];
    for (std::size_t i = 0; i < ch.size(); ++i) {
      const std::int64_t in = out;
      out = ch[i];
      const bool last = i + 1 == ch.size();
      down_.emplace_back(in, out, c.layers_per_block, c, std::nullopt,
                         last ? Block::Resample::none : Block::Resample::down,
                         static_cast<std::int64_t>(i) < c.temporal_levels());
      down_blocks->push_back(down_.back());
    }
    mid_block =
        register_module("mid_block", CogVideoXBlock3D<Act>(ch.back(), ch.back(), 2, c, std::nullopt,
                                                           Block::Resample::none, false));
    norm_out = register_module(
        "norm_out",
        torch::nn::GroupNorm(torch::nn::GroupNormOptions(c.norm_num_groups, ch.back()).eps(1e-6)));
    conv_out = register_module("conv_out", CausalConv3d(ch.back(), 2 * c.latent_channels, 3));
  }

  at::Tensor forward(const at::Tensor& x, CausalConvCache& cache) {
    at::Tensor h = conv_in->forward(x, cache);
    for (auto& d : down_) h = d->forward(h, {}, cache);
    h = mid_block->forward(h, {}, cache);
    return conv_out->forward(at::silu(norm_out->forward(h)), cache);  // SiLU, as diffusers
  }
  void set_checkpointing(bool on) {
    for (auto& d : down_) d->set_checkpointing(on);
    mid_block->set_checkpointing(on);
  }

  CausalConv3d conv_in{nullptr}, conv_out{nullptr};
  torch::nn::ModuleList down_blocks{nullptr};
  CogVideoXBlock3D<Act> mid_block{nullptr};
  torch::nn::GroupNorm norm_out{nullptr};

 private:
  std::vector<CogVideoXBlock3D<Act>> down_;
};

/// diffusers' CogVideoXDecoder3D: latents → video, every norm conditioned on the latents.
template <nn::ElementwiseActivation Act = nn::activation::SiLU>
class CogVideoXDecoder3DImpl : public torch::nn::Module {
 public:
  using Block = CogVideoXBlock3DImpl<Act>;

  explicit CogVideoXDecoder3DImpl(const AutoencoderKLCogVideoXConfig& c) {
    const auto& ch = c.block_out_channels;
    const std::int64_t z = c.latent_channels;
    conv_in = register_module("conv_in", CausalConv3d(z, ch.back(), 3));
    mid_block = register_module("mid_block", CogVideoXBlock3D<Act>(ch.back(), ch.back(), 2, c, z,
                                                                   Block::Resample::none, false));
    up_blocks = register_module("up_blocks", torch::nn::ModuleList());
    std::int64_t out = ch.back();
    for (std::size_t i = 0; i < ch.size(); ++i) {
      const std::int64_t in = out;
      out = ch[ch.size() - 1 - i];
      const bool last = i + 1 == ch.size();
      up_.emplace_back(in, out, c.layers_per_block + 1, c, z,
                       last ? Block::Resample::none : Block::Resample::up,
                       static_cast<std::int64_t>(i) < c.temporal_levels());
      up_blocks->push_back(up_.back());
    }
    norm_out = register_module("norm_out", SpatialNorm3D(ch[0], z, c.norm_num_groups));
    conv_out = register_module("conv_out", CausalConv3d(ch[0], c.out_channels, 3));
  }

  at::Tensor forward(const at::Tensor& z, CausalConvCache& cache) {
    at::Tensor h = mid_block->forward(conv_in->forward(z, cache), z, cache);
    for (auto& u : up_) h = u->forward(h, z, cache);
    return conv_out->forward(at::silu(norm_out->forward(h, z, cache)), cache);
  }
  void set_checkpointing(bool on) {
    for (auto& u : up_) u->set_checkpointing(on);
    mid_block->set_checkpointing(on);
  }

  CausalConv3d conv_in{nullptr}, conv_out{nullptr};
  CogVideoXBlock3D<Act> mid_block{nullptr};
  torch::nn::ModuleList up_blocks{nullptr};
  SpatialNorm3D norm_out{nullptr};

 private:
  std::vector<CogVideoXBlock3D<Act>> up_;
};

/// diffusers' enable_tiling for CogVideoX's VAE: videos taller or wider than the sample tile
/// (latents than the latent tile) are encoded (decoded) in overlapping spatial tiles, each over
/// all frames in frame batches, blended across their seams. Not equal to untiled results, but
/// equal to diffusers' tiled ones.
struct CogVideoXTiling {
  std::int64_t sample_height = 0;  // 0: the config's sample_height / 2, as diffusers
  std::int64_t sample_width = 0;   // 0: sample_width / 2
  double overlap_height = 1.0 / 6.0, overlap_width = 1.0 / 5.0;  // diffusers' factors
};

/// diffusers' frame batches: how many frames each encoder (decoder) pass takes; the first pass
/// also takes the frames that do not fill a batch.
struct CogVideoXFrameBatches {
  std::int64_t sample_frames = 8, latent_frames = 2;
};

template <nn::ElementwiseActivation Act = nn::activation::SiLU>
class AutoencoderKLCogVideoXImpl : public torch::nn::Module {
 public:
  using Config = AutoencoderKLCogVideoXConfig;

  explicit AutoencoderKLCogVideoXImpl(Config config,
                                      const std::string& where = "AutoencoderKLCogVideoX")
      : c_(std::move(config)) {
    c_.resolve(where);
    check_activation<Act>("act_fn", c_.act_fn, where);
    encoder = register_module("encoder", torch::nn::ModuleHolder<CogVideoXEncoder3DImpl<Act>>(c_));
    decoder = register_module("decoder", torch::nn::ModuleHolder<CogVideoXDecoder3DImpl<Act>>(c_));
    // diffusers sizes both from out_channels (resolve() makes sure that equals latent_channels).
    const std::int64_t o = c_.out_channels;
    if (c_.use_quant_conv)
      quant_conv = register_module("quant_conv",
                                   torch::nn::Conv3d(torch::nn::Conv3dOptions(2 * o, 2 * o, 1)));
    if (c_.use_post_quant_conv)
      post_quant_conv =
          register_module("post_quant_conv", torch::nn::Conv3d(torch::nn::Conv3dOptions(o, o, 1)));
  }

  [[nodiscard]] const Config& config() const { return c_; }
  /// How many times smaller the latents are than the video in height and width.
  [[nodiscard]] std::int64_t spatial_downscale() const {
    return std::int64_t{1} << (c_.block_out_channels.size() - 1);
  }
  /// How many latent frames `frames` video frames give: 1 + (frames − 1) / ratio for 1 + k·ratio
  /// frames, and in general what the pooling gives per frame batch.
  [[nodiscard]] std::int64_t latent_frames(std::int64_t frames) const {
    std::int64_t total = 0;
    for_each_frame_batch(frames, frames_.sample_frames, [&](std::int64_t, std::int64_t n) {
      for (std::int64_t level = 0; level < c_.temporal_levels(); ++level)
        n = n % 2 == 1 ? 1 + (n - 1) / 2 : n / 2;
      total += n;
    });
    return total;
  }

  /// The posterior of a batch of videos (B, in_channels, T, H, W).
  DiagonalGaussianDistribution encode(const at::Tensor& x) {
    const std::string where = "AutoencoderKLCogVideoX::encode";
    if (x.dim() != 5 || x.size(1) != c_.in_channels)
      throw ShapeError("videos must be (B, " + std::to_string(c_.in_channels) +
                           ", frames, H, W), got " + c10::str(x.sizes()),
                       where);
    if (x.size(2) == 0 || x.size(3) == 0 || x.size(4) == 0)
      throw ShapeError("the video " + c10::str(x.sizes()) + " is empty", where);
    return DiagonalGaussianDistribution(
        vae_detail::per_image(slicing_, x, [this](const at::Tensor& one) {
          auto run = [this](const at::Tensor& tile) {
            return frame_batched(
                tile, frames_.sample_frames,
                [this](const at::Tensor& part, CausalConvCache& cache) {
                  at::Tensor m = encoder->forward(part, cache);
                  return quant_conv ? cogvideox_vae_detail::safe_conv3d(*quant_conv, m) : m;
                });
          };
          if (tiling_ &&
              (one.size(3) > tiling_->sample_height || one.size(4) > tiling_->sample_width))
            return vae_detail::tiled(one, grid(true), run);
          return run(one);
        }));
  }

  /// Videos (B, out_channels, T', H', W') from latents (B, latent_channels, t, h, w).
  at::Tensor decode(const at::Tensor& z) {
    const std::string where = "AutoencoderKLCogVideoX::decode";
    if (z.dim() != 5 || z.size(1) != c_.latent_channels)
      throw ShapeError("latents must be (B, " + std::to_string(c_.latent_channels) +
                           ", frames, h, w), got " + c10::str(z.sizes()),
                       where);
    if (z.size(2) == 0 || z.size(3) == 0 || z.size(4) == 0)
      throw ShapeError("the latents " + c10::str(z.sizes()) + " are empty", where);
    return vae_detail::per_image(slicing_, z, [this](const at::Tensor& one) {
      auto run = [this](const at::Tensor& tile) {
        return frame_batched(
            tile, frames_.latent_frames, [this](const at::Tensor& part, CausalConvCache& cache) {
              const at::Tensor p = post_quant_conv
                                       ? cogvideox_vae_detail::safe_conv3d(*post_quant_conv, part)
                                       : part;
              return decoder->forward(p, cache);
            });
      };
      if (tiling_ && (one.size(3) > latent_tile_height() || one.size(4) > latent_tile_width()))
        return vae_detail::tiled(one, grid(false), run);
      return run(one);
    });
  }

  /// Reconstruction through the posterior's mode (or a sample of it).
  at::Tensor forward(const at::Tensor& x, bool sample_posterior = false,
                     std::optional<at::Generator> generator = std::nullopt) {
    const auto posterior = encode(x);
    return decode(sample_posterior ? posterior.sample(std::move(generator)) : posterior.mode());
  }

  /// What CogVideoX trains on, as its fine-tuning scripts compute it: a posterior sample times
  /// scaling_factor (minus shift_factor first when the config has one).
  at::Tensor encode_latents(const at::Tensor& videos,
                            std::optional<at::Generator> generator = std::nullopt) {
    at::Tensor z = encode(videos).sample(std::move(generator));
    if (c_.shift_factor) z = z - *c_.shift_factor;
    return z * c_.scaling_factor;
  }
  /// An I2V pipeline's image latents: divided by scaling_factor when the config says
  /// invert_scale_latents (CogVideoX 1.5), multiplied otherwise.
  [[nodiscard]] at::Tensor image_latents_scaled(const at::Tensor& latents) const {
    return c_.invert_scale_latents ? latents / c_.scaling_factor : latents * c_.scaling_factor;
  }
  /// Videos from latents a transformer produced: the inverse scaling, then decode.
  at::Tensor decode_latents(const at::Tensor& latents) {
    at::Tensor z = latents / c_.scaling_factor;
    if (c_.shift_factor) z = z + *c_.shift_factor;
    return decode(z);
  }

  /// diffusers' enable_slicing: one video of a batch at a time.
  void enable_slicing(bool on = true) { slicing_ = on; }
  [[nodiscard]] bool slicing() const { return slicing_; }

  /// diffusers' enable_tiling (see CogVideoXTiling); the sizes default to diffusers'.
  void enable_tiling(CogVideoXTiling tiling = {}) {
    const std::string where = "AutoencoderKLCogVideoX::enable_tiling";
    if (tiling.sample_height == 0) tiling.sample_height = c_.sample_height / 2;
    if (tiling.sample_width == 0) tiling.sample_width = c_.sample_width / 2;
    for (const double o : {tiling.overlap_height, tiling.overlap_width})
      if (!(o >= 0.0 && o < 1.0))
        throw ConfigError("tile overlaps must lie in [0, 1), got " + std::to_string(o), where);
    const auto advances = [](std::int64_t tile, double overlap) {
      return tile > 0 && static_cast<std::int64_t>(static_cast<double>(tile) * (1.0 - overlap)) > 0;
    };
    const std::int64_t s = spatial_downscale();
    if (!advances(tiling.sample_height, tiling.overlap_height) ||
        !advances(tiling.sample_width, tiling.overlap_width) ||
        !advances(tiling.sample_height / s, tiling.overlap_height) ||
        !advances(tiling.sample_width / s, tiling.overlap_width))
      throw ConfigError("tiles of " + std::to_string(tiling.sample_height) + "×" +
                            std::to_string(tiling.sample_width) + " pixels (" +
                            std::to_string(tiling.sample_height / s) + "×" +
                            std::to_string(tiling.sample_width / s) +
                            " latents) with these overlaps do not advance",
                        where);
    tiling_ = tiling;
  }
  void disable_tiling() { tiling_.reset(); }
  [[nodiscard]] const std::optional<CogVideoXTiling>& tiling() const { return tiling_; }

  /// The frame batch sizes (diffusers' num_sample_frames_batch_size and
  /// num_latent_frames_batch_size); they change the result, as in diffusers.
  void set_frame_batches(CogVideoXFrameBatches batches) {
    if (batches.sample_frames < 1 || batches.latent_frames < 1)
      throw ConfigError("frame batches must hold at least one frame, got " +
                            std::to_string(batches.sample_frames) + " and " +
                            std::to_string(batches.latent_frames),
                        "AutoencoderKLCogVideoX::set_frame_batches");
    frames_ = batches;
  }
  [[nodiscard]] const CogVideoXFrameBatches& frame_batches() const { return frames_; }

  void set_gradient_checkpointing(bool on) {
    encoder->set_checkpointing(on);
    decoder->set_checkpointing(on);
  }

  torch::nn::ModuleHolder<CogVideoXEncoder3DImpl<Act>> encoder{nullptr};
  torch::nn::ModuleHolder<CogVideoXDecoder3DImpl<Act>> decoder{nullptr};
  torch::nn::Conv3d quant_conv{nullptr}, post_quant_conv{nullptr};

 private:
  /// diffusers' frame batching: max(T / batch, 1) passes, the first over batch + T % batch
  /// frames, each later one over `batch`; f(start, count) for each.
  template <class F>
  static void for_each_frame_batch(std::int64_t frames, std::int64_t batch, F&& f) {
    const std::int64_t passes = std::max<std::int64_t>(frames / batch, 1);
    const std::int64_t rest = frames % batch;
    for (std::int64_t i = 0; i < passes; ++i) {
      const std::int64_t start = batch * i + (i == 0 ? 0 : rest);
      const std::int64_t end = std::min(batch * (i + 1) + rest, frames);
      f(start, end - start);
    }
  }

  template <class Pass>
  static at::Tensor frame_batched(const at::Tensor& x, std::int64_t batch, Pass&& pass) {
    CausalConvCache cache;
    std::vector<at::Tensor> parts;
    for_each_frame_batch(x.size(2), batch, [&](std::int64_t start, std::int64_t count) {
      parts.push_back(pass(x.narrow(2, start, count), cache));
    });
    return parts.size() == 1 ? parts.front() : at::cat(parts, 2);
  }

  [[nodiscard]] std::int64_t latent_tile_height() const {
    return tiling_->sample_height / spatial_downscale();
  }
  [[nodiscard]] std::int64_t latent_tile_width() const {
    return tiling_->sample_width / spatial_downscale();
  }
  [[nodiscard]] vae_detail::TileGrid grid(bool encoding) const {
    const std::int64_t sh = tiling_->sample_height, sw = tiling_->sample_width;
    const std::int64_t lh = latent_tile_height(), lw = latent_tile_width();
    vae_detail::TileGrid g;
    g.dim = 3;
    g.in_h = encoding ? sh : lh;
    g.in_w = encoding ? sw : lw;
    g.out_h = encoding ? lh : sh;
    g.out_w = encoding ? lw : sw;
    g.overlap_h = tiling_->overlap_height;
    g.overlap_w = tiling_->overlap_width;
    return g;
  }

  Config c_;
  bool slicing_ = false;
  std::optional<CogVideoXTiling> tiling_;
  CogVideoXFrameBatches frames_;
};

template <nn::ElementwiseActivation Act = nn::activation::SiLU>
using AutoencoderKLCogVideoX = torch::nn::ModuleHolder<AutoencoderKLCogVideoXImpl<Act>>;

}  // namespace difftrain::models
