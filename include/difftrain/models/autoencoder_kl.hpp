#pragma once
// diffusers' AutoencoderKL — the VAE of Stable Diffusion — built from its `config.json`, with
// diffusers' parameter names. encode() gives the diagonal Gaussian posterior over latents,
// decode() the image; the latents a UNet trains on are (sample − shift_factor) · scaling_factor.
// Like diffusers, encode and decode can work one image at a time (slicing) and in overlapping
// tiles blended linearly across their seams (tiling), which bounds memory for large images.

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/models/config_reader.hpp"
#include "difftrain/models/embeddings.hpp"
#include "difftrain/models/unet_blocks.hpp"

namespace difftrain::models {

/// The posterior of a VAE encoding: mean and log-variance (clamped to [-30, 20]) per latent.
struct DiagonalGaussianDistribution {
  at::Tensor mean, logvar, std, var;
  bool deterministic = false;

  explicit DiagonalGaussianDistribution(const at::Tensor& parameters, bool deterministic_ = false)
      : deterministic(deterministic_) {
    if (parameters.dim() < 2 || parameters.size(1) % 2 != 0)
      throw ShapeError(
          "the moments must have an even channel count, got " + c10::str(parameters.sizes()),
          "DiagonalGaussianDistribution");
    const auto halves = parameters.chunk(2, 1);
    mean = halves[0];
    logvar = halves[1].clamp(-30.0, 20.0);
    std = (0.5 * logvar).exp();
    var = logvar.exp();
    if (deterministic) std = var = at::zeros_like(mean);
  }

  /// mean + std · ε, ε ~ N(0, 1) drawn from `generator` (the global one when undefined).
  [[nodiscard]] at::Tensor sample(std::optional<at::Generator> generator = std::nullopt) const {
    return mean + std * at::randn(mean.sizes(), generator, mean.options());
  }
  [[nodiscard]] at::Tensor mode() const { return mean; }
  /// KL divergence to N(0, 1), summed over all but the batch dimension.
  [[nodiscard]] at::Tensor kl() const {
    if (deterministic) return at::zeros({1}, mean.options());
    return 0.5 * (mean.pow(2) + var - 1.0 - logvar).sum({1, 2, 3});
  }
  /// Negative log-likelihood of `x`, summed over all but the batch dimension.
  [[nodiscard]] at::Tensor nll(const at::Tensor& x) const {
    if (deterministic) return at::zeros({1}, mean.options());
    return 0.5 * (std::log(2.0 * M_PI) + logvar + (x - mean).pow(2) / var).sum({1, 2, 3});
  }
};

/// The fields of diffusers' AutoencoderKL config, with diffusers' defaults.
struct AutoencoderKLConfig {
  /// diffusers' `_class_name` for this model.
  static constexpr std::string_view class_name = "AutoencoderKL";

  std::int64_t in_channels = 3, out_channels = 3;
  std::vector<std::string> down_block_types{"DownEncoderBlock2D"};
  std::vector<std::string> up_block_types{"UpDecoderBlock2D"};
  std::vector<std::int64_t> block_out_channels{64};
  std::int64_t layers_per_block = 1;
  std::string act_fn = "silu";
  std::int64_t latent_channels = 4;
  std::int64_t norm_num_groups = 32;
  nlohmann::json sample_size = 32;  // an int or [h, w]; the tiling size in diffusers
  double scaling_factor = 0.18215;
  std::optional<double> shift_factor;
  std::optional<std::vector<double>> latents_mean, latents_std;
  bool force_upcast = true;  // diffusers' pipelines run an fp16 VAE in float32
  bool use_quant_conv = true, use_post_quant_conv = true;
  bool mid_block_add_attention = true;

  void resolve(const std::string& where) {
    check_vae_config(*this, "DownEncoderBlock2D", "UpDecoderBlock2D", where);
  }

  /// What this config implies about a weight file: block and layer counts, and the convolutions
  /// that fix every block's width and the latent channels.
  [[nodiscard]] WeightSignature weight_signature() const {
    WeightSignature s;
    const auto n = static_cast<std::int64_t>(block_out_channels.size());
    const auto& ch = block_out_channels;
    s.shapes.push_back({"encoder.conv_in.weight", {ch[0], in_channels, 3, 3}});
    s.shapes.push_back({"encoder.conv_out.weight", {2 * latent_channels, ch.back(), 3, 3}});
    s.shapes.push_back({"decoder.conv_in.weight", {ch.back(), latent_channels, 3, 3}});
    s.shapes.push_back({"decoder.conv_out.weight", {out_channels, ch[0], 3, 3}});
    s.counts.push_back({"encoder.down_blocks.", n});
    s.counts.push_back({"decoder.up_blocks.", n});
    for (std::int64_t i = 0; i < n; ++i) {
      const auto k = static_cast<std::size_t>(i);
      const std::string down = "encoder.down_blocks." + std::to_string(i) + ".";
      s.counts.push_back({down + "resnets.", layers_per_block});
      s.counts.push_back(
          {"decoder.up_blocks." + std::to_string(i) + ".resnets.", layers_per_block + 1});
      s.shapes.push_back({down + "resnets.0.conv1.weight", {ch[k], ch[k == 0 ? 0 : k - 1], 3, 3}});
    }
    return s;
  }

  static AutoencoderKLConfig from_json(const nlohmann::json& j, const std::string& where) {
    ConfigReader r(j, where);
    AutoencoderKLConfig c;
    read_vae_fields(r, c);
    c.sample_size = r.get("sample_size", c.sample_size);
    c.mid_block_add_attention = r.get("mid_block_add_attention", c.mid_block_add_attention);
    r.finish();
    c.resolve(where);
    return c;
  }

  /// The file from_pretrained read this config from (see ConfigAsRead).
  ConfigAsRead as_read{};

  [[nodiscard]] nlohmann::json to_json() const {
    nlohmann::json j = vae_config_json(*this);
    j["sample_size"] = sample_size;
    j["mid_block_add_attention"] = mid_block_add_attention;
    return j;
  }
};

namespace vae_detail {
inline ResnetSettings resnet_settings(const AutoencoderKLConfig& c) {
  ResnetSettings s;
  s.groups = c.norm_num_groups;
  s.eps = 1e-6;
  return s;
}
template <nn::attention::AttentionBackend Backend, nn::ElementwiseActivation Act>
MidBlock<Backend, Act> mid_block(const AutoencoderKLConfig& c) {
  MidBlockOptions m;
  m.channels = c.block_out_channels.back();
  m.num_layers = 1;
  m.resnet = resnet_settings(c);
  if (c.mid_block_add_attention) m.self_attention_head_dim = m.channels;  // one head
  return MidBlock<Backend, Act>(m);
}
}  // namespace vae_detail

template <nn::attention::AttentionBackend Backend, nn::ElementwiseActivation Act>
class VaeEncoderImpl : public torch::nn::Module {
 public:
  explicit VaeEncoderImpl(const AutoencoderKLConfig& c) {
    using namespace torch::nn;
    const auto& ch = c.block_out_channels;
    conv_in = register_module("conv_in", Conv2d(Conv2dOptions(c.in_channels, ch[0], 3).padding(1)));
    down_blocks = register_module("down_blocks", ModuleList());
    std::int64_t out = ch[0];
    for (std::size_t i = 0; i < ch.size(); ++i) {
      DownBlockOptions d;
      d.in_channels = out;
      d.out_channels = out = ch[i];
      d.num_layers = c.layers_per_block;
      d.resnet = vae_detail::resnet_settings(c);
      d.add_downsample = i + 1 < ch.size();
      d.downsample_padding = 0;
      down_.push_back(DownBlock<Backend, Act>(d));
      down_blocks->push_back(down_.back());
    }
    mid_block = register_module("mid_block", vae_detail::mid_block<Backend, Act>(c));
    conv_norm_out = register_module(
        "conv_norm_out", GroupNorm(GroupNormOptions(c.norm_num_groups, ch.back()).eps(1e-6)));
    conv_out = register_module(
        "conv_out", Conv2d(Conv2dOptions(ch.back(), 2 * c.latent_channels, 3).padding(1)));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = conv_in->forward(x);
    for (auto& d : down_) h = d->forward(h, {}, {}, nullptr);
    h = mid_block->forward(h);
    return conv_out->forward(at::silu(conv_norm_out->forward(h)));  // SiLU whatever act_fn says
  }
  void set_checkpointing(bool on) {
    for (auto& d : down_) d->set_checkpointing(on);
    mid_block->set_checkpointing(on);
  }
  torch::nn::Conv2d conv_in{nullptr}, conv_out{nullptr};
  torch::nn::ModuleList down_blocks{nullptr};
  MidBlock<Backend, Act> mid_block{nullptr};
  torch::nn::GroupNorm conv_norm_out{nullptr};

 private:
  std::vector<DownBlock<Backend, Act>> down_;
};

template <nn::attention::AttentionBackend Backend, nn::ElementwiseActivation Act>
class VaeDecoderImpl : public torch::nn::Module {
 public:
  explicit VaeDecoderImpl(const AutoencoderKLConfig& c) {
    using namespace torch::nn;
    const auto& ch = c.block_out_channels;
    conv_in = register_module("conv_in",
                              Conv2d(Conv2dOptions(c.latent_channels, ch.back(), 3).padding(1)));
    up_blocks = register_module("up_blocks", ModuleList());
    mid_block = register_module("mid_block", vae_detail::mid_block<Backend, Act>(c));
    std::int64_t out = ch.back();
    for (std::size_t i = 0; i < ch.size(); ++i) {
      UpBlockOptions u;
      u.prev_output_channels = out;
      u.out_channels = out = ch[ch.size() - 1 - i];
      u.num_layers = c.layers_per_block + 1;
      u.resnet = vae_detail::resnet_settings(c);
      u.add_upsample = i + 1 < ch.size();
      u.skips = false;
      up_.push_back(UpBlock<Backend, Act>(u));
      up_blocks->push_back(up_.back());
    }
    conv_norm_out = register_module(
        "conv_norm_out", GroupNorm(GroupNormOptions(c.norm_num_groups, ch[0]).eps(1e-6)));
    conv_out =
        register_module("conv_out", Conv2d(Conv2dOptions(ch[0], c.out_channels, 3).padding(1)));
  }
  at::Tensor forward(const at::Tensor& z) {
    at::Tensor h = mid_block->forward(conv_in->forward(z));
    for (auto& u : up_) h = u->forward(h, {}, {}, nullptr);
    return conv_out->forward(at::silu(conv_norm_out->forward(h)));
  }
  void set_checkpointing(bool on) {
    for (auto& u : up_) u->set_checkpointing(on);
    mid_block->set_checkpointing(on);
  }
  torch::nn::Conv2d conv_in{nullptr}, conv_out{nullptr};
  torch::nn::ModuleList up_blocks{nullptr};
  MidBlock<Backend, Act> mid_block{nullptr};
  torch::nn::GroupNorm conv_norm_out{nullptr};

 private:
  std::vector<UpBlock<Backend, Act>> up_;
};

/// diffusers' enable_tiling: images larger than `sample_tile` (latents larger than `latent_tile`)
/// are encoded (decoded) in tiles overlapping by `overlap` of a tile, each blended linearly into
/// the tile above and the tile to its left. Not equal to untiled results (each tile sees only its
/// part of the image), but equal to diffusers' tiled ones.
struct VaeTiling {
  std::int64_t sample_tile = 0;  // 0: the config's sample_size (its first entry), as diffusers
  std::int64_t latent_tile = 0;  // 0: sample_tile / 2^(levels − 1), as diffusers
  double overlap = 0.25;         // diffusers' tile_overlap_factor
};

namespace vae_detail {
/// Blends the last entries of `a` along `dim` (rows or columns) into the first ones of `b`, in
/// place: b[k] = a[−e + k]·(1 − k/e) + b[k]·k/e for k < e, the weights computed in double as
/// diffusers' Python floats are.
inline void blend(const at::Tensor& a, at::Tensor& b, std::int64_t dim, std::int64_t extent) {
  const std::int64_t e = std::min({a.size(dim), b.size(dim), extent});
  if (e <= 0) return;
  at::Tensor w = at::arange(e, a.options().dtype(at::kDouble)) / static_cast<double>(e);
  // Shaped (e, 1, …, 1) so the weights broadcast over the dimensions after `dim`.
  std::vector<std::int64_t> shape(static_cast<std::size_t>(b.dim() - dim), 1);
  shape[0] = e;
  const at::Tensor keep = (1.0 - w).to(b.scalar_type()).view(shape);
  const at::Tensor take = w.to(b.scalar_type()).view(shape);
  const at::Tensor head = b.narrow(dim, 0, e);
  head.copy_(a.narrow(dim, a.size(dim) - e, e) * keep + head * take);
}

/// `run` on the whole batch, or on one image at a time with `slicing` (diffusers' enable_slicing).
template <class Run>
at::Tensor per_image(bool slicing, const at::Tensor& x, Run&& run) {
  if (!slicing || x.size(0) <= 1) return run(x);
  std::vector<at::Tensor> parts;
  for (const auto& one : x.split(1)) parts.push_back(run(one));
  return at::cat(parts);
}

/// The tiles of diffusers' tiled encode/decode over dimensions (`dim`, `dim` + 1): inputs of
/// in_h × in_w stepping by in·(1 − overlap), outputs of out_h × out_w blended over out·overlap
/// and cropped to out − that, per axis.
struct TileGrid {
  std::int64_t dim = 2;
  std::int64_t in_h = 0, in_w = 0, out_h = 0, out_w = 0;
  double overlap_h = 0.25, overlap_w = 0.25;
};

template <class Run>
at::Tensor tiled(const at::Tensor& x, const TileGrid& g, Run&& run) {
  auto step = [](std::int64_t tile, double overlap) {
    return static_cast<std::int64_t>(static_cast<double>(tile) * (1.0 - overlap));
  };
  auto extent = [](std::int64_t tile, double overlap) {
    return static_cast<std::int64_t>(static_cast<double>(tile) * overlap);
  };
  const std::int64_t dh = g.dim, dw = g.dim + 1;
  const std::int64_t step_h = step(g.in_h, g.overlap_h), step_w = step(g.in_w, g.overlap_w);
  const std::int64_t extent_h = extent(g.out_h, g.overlap_h);
  const std::int64_t extent_w = extent(g.out_w, g.overlap_w);
  std::vector<std::vector<at::Tensor>> rows;
  for (std::int64_t i = 0; i < x.size(dh); i += step_h) {
    auto& row = rows.emplace_back();
    for (std::int64_t j = 0; j < x.size(dw); j += step_w)
      row.push_back(run(x.slice(dh, i, i + g.in_h).slice(dw, j, j + g.in_w)));
  }
  std::vector<at::Tensor> out_rows;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    std::vector<at::Tensor> out_row;
    for (std::size_t j = 0; j < rows[i].size(); ++j) {
      at::Tensor& tile = rows[i][j];
      if (i > 0) blend(rows[i - 1][j], tile, dh, extent_h);
      if (j > 0) blend(rows[i][j - 1], tile, dw, extent_w);
      out_row.push_back(tile.slice(dh, 0, g.out_h - extent_h).slice(dw, 0, g.out_w - extent_w));
    }
    out_rows.push_back(at::cat(out_row, dw));
  }
  return at::cat(out_rows, dh);
}

/// Square tiles over (H, W) of an image batch, one overlap for both axes (AutoencoderKL).
template <class Run>
at::Tensor tiled(const at::Tensor& x, std::int64_t tile_in, std::int64_t tile_out, double overlap,
                 Run&& run) {
  return tiled(x, TileGrid{2, tile_in, tile_in, tile_out, tile_out, overlap, overlap},
               std::forward<Run>(run));
}
}  // namespace vae_detail

template <nn::attention::AttentionBackend Backend = nn::attention::Sdpa<nn::attention::Auto>,
          nn::ElementwiseActivation Act = nn::activation::SiLU>
class AutoencoderKLImpl : public torch::nn::Module {
 public:
  using Config = AutoencoderKLConfig;

  explicit AutoencoderKLImpl(Config config, const std::string& where = "AutoencoderKL")
      : c_(std::move(config)) {
    c_.resolve(where);
    check_activation<Act>("act_fn", c_.act_fn, where);
    encoder = register_module("encoder", torch::nn::ModuleHolder<VaeEncoderImpl<Backend, Act>>(c_));
    decoder = register_module("decoder", torch::nn::ModuleHolder<VaeDecoderImpl<Backend, Act>>(c_));
    const std::int64_t l = c_.latent_channels;
    if (c_.use_quant_conv)
      quant_conv = register_module("quant_conv",
                                   torch::nn::Conv2d(torch::nn::Conv2dOptions(2 * l, 2 * l, 1)));
    if (c_.use_post_quant_conv)
      post_quant_conv =
          register_module("post_quant_conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(l, l, 1)));
  }

  [[nodiscard]] const Config& config() const { return c_; }
  /// How many times smaller the latents are than the image.
  [[nodiscard]] std::int64_t downscale() const {
    return std::int64_t{1} << (c_.block_out_channels.size() - 1);
  }

  DiagonalGaussianDistribution encode(const at::Tensor& x) {
    if (x.dim() != 4 || x.size(1) != c_.in_channels)
      throw ShapeError("images must be (B, " + std::to_string(c_.in_channels) + ", H, W), got " +
                           c10::str(x.sizes()),
                       "AutoencoderKL::encode");
    return DiagonalGaussianDistribution(vae_detail::per_image(
        slicing_, x, [this](const at::Tensor& one) { return moments_of(one); }));
  }

  at::Tensor decode(const at::Tensor& z) {
    if (z.dim() != 4 || z.size(1) != c_.latent_channels)
      throw ShapeError("latents must be (B, " + std::to_string(c_.latent_channels) +
                           ", h, w), got " + c10::str(z.sizes()),
                       "AutoencoderKL::decode");
    return vae_detail::per_image(slicing_, z,
                                 [this](const at::Tensor& one) { return image_of(one); });
  }

  /// diffusers' enable_slicing: encode and decode one image of a batch at a time.
  void enable_slicing(bool on = true) { slicing_ = on; }
  [[nodiscard]] bool slicing() const { return slicing_; }

  /// diffusers' enable_tiling (see VaeTiling); the sizes default to diffusers'.
  void enable_tiling(VaeTiling tiling = {}) {
    const std::string where = "AutoencoderKL::enable_tiling";
    if (tiling.sample_tile == 0) {
      const nlohmann::json& s = c_.sample_size;
      const nlohmann::json& first = s.is_array() && !s.empty() ? s.front() : s;
      if (!first.is_number_integer())
        throw ConfigError("the config's sample_size " + s.dump() +
                              " gives no tile size; set VaeTiling::sample_tile",
                          where);
      tiling.sample_tile = first.get<std::int64_t>();
    }
    if (tiling.latent_tile == 0)
      tiling.latent_tile = static_cast<std::int64_t>(static_cast<double>(tiling.sample_tile) /
                                                     static_cast<double>(downscale()));
    if (!(tiling.overlap >= 0.0 && tiling.overlap < 1.0))
      throw ConfigError("overlap must lie in [0, 1), got " + std::to_string(tiling.overlap), where);
    for (const auto tile : {tiling.sample_tile, tiling.latent_tile})
      if (tile <= 0 ||
          static_cast<std::int64_t>(static_cast<double>(tile) * (1.0 - tiling.overlap)) <= 0)
        throw ConfigError("tiles of " + std::to_string(tiling.sample_tile) + " pixels / " +
                              std::to_string(tiling.latent_tile) + " latents with overlap " +
                              std::to_string(tiling.overlap) + " do not advance",
                          where);
    tiling_ = tiling;
  }
  void disable_tiling() { tiling_.reset(); }
  [[nodiscard]] const std::optional<VaeTiling>& tiling() const { return tiling_; }

  /// Reconstruction through the posterior's mode (or a sample of it).
  at::Tensor forward(const at::Tensor& x, bool sample_posterior = false,
                     std::optional<at::Generator> generator = std::nullopt) {
    const auto posterior = encode(x);
    return decode(sample_posterior ? posterior.sample(std::move(generator)) : posterior.mode());
  }

  /// What a latent diffusion model trains on, as diffusers' training scripts compute it:
  /// (posterior sample − shift_factor) · scaling_factor.
  at::Tensor encode_latents(const at::Tensor& images,
                            std::optional<at::Generator> generator = std::nullopt) {
    at::Tensor z = encode(images).sample(std::move(generator));
    if (c_.shift_factor) z = z - *c_.shift_factor;
    return z * c_.scaling_factor;
  }
  /// Images from latents a model produced: the inverse scaling, then decode.
  at::Tensor decode_latents(const at::Tensor& latents) {
    at::Tensor z = latents / c_.scaling_factor;
    if (c_.shift_factor) z = z + *c_.shift_factor;
    return decode(z);
  }

  void set_gradient_checkpointing(bool on) {
    encoder->set_checkpointing(on);
    decoder->set_checkpointing(on);
  }

  torch::nn::ModuleHolder<VaeEncoderImpl<Backend, Act>> encoder{nullptr};
  torch::nn::ModuleHolder<VaeDecoderImpl<Backend, Act>> decoder{nullptr};
  torch::nn::Conv2d quant_conv{nullptr}, post_quant_conv{nullptr};

 private:
  at::Tensor moments_of(const at::Tensor& x) {
    auto run = [this](const at::Tensor& tile) {
      at::Tensor m = encoder->forward(tile);
      return quant_conv ? quant_conv->forward(m) : m;
    };
    if (tiling_ && (x.size(2) > tiling_->sample_tile || x.size(3) > tiling_->sample_tile))
      return vae_detail::tiled(x, tiling_->sample_tile, tiling_->latent_tile, tiling_->overlap,
                               run);
    return run(x);
  }
  at::Tensor image_of(const at::Tensor& z) {
    auto run = [this](const at::Tensor& tile) {
      return decoder->forward(post_quant_conv ? post_quant_conv->forward(tile) : tile);
    };
    if (tiling_ && (z.size(2) > tiling_->latent_tile || z.size(3) > tiling_->latent_tile))
      return vae_detail::tiled(z, tiling_->latent_tile, tiling_->sample_tile, tiling_->overlap,
                               run);
    return run(z);
  }

  Config c_;
  bool slicing_ = false;
  std::optional<VaeTiling> tiling_;
};

template <nn::attention::AttentionBackend Backend = nn::attention::Sdpa<nn::attention::Auto>,
          nn::ElementwiseActivation Act = nn::activation::SiLU>
using AutoencoderKL = torch::nn::ModuleHolder<AutoencoderKLImpl<Backend, Act>>;

}  // namespace difftrain::models
