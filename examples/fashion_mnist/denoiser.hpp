#pragma once
// The main job's denoiser, one of two backbones (--model):
//
// unet (the default): a small class-conditional configuration of difftrain's
// models::UNet2DConditionModel (diffusers' UNet, parameter for parameter) for 28×28 images,
// block_out_channels (C, 3C/2, 2C), layers_per_block (0, 1, 1):
//
//   28×28  conv_in → DownBlock2D (no resnet: the downsampler) ────────────────skips──┐
//   14×14  DownBlock2D(3C/2) [or CrossAttnDownBlock2D] ──────────────────skips──┐      │
//    7×7   DownBlock2D(2C) → UNetMidBlock2DCrossAttn (resnet, transformer,      │      │
//          resnet) → UpBlock2D(2C), two resnets                                 │      │
//   14×14  UpBlock2D(3C/2), two resnets [or CrossAttnUpBlock2D] ◄───────────────┘      │
//   28×28  UpBlock2D(C), one resnet → GroupNorm → SiLU → conv_out ◄─────────────────────┘
//
// diffusers' up blocks upsample before their convolution, so a resnet at 28×28 costs the most on
// a CPU: this shape keeps one (on the way up) and measured the step time of the former hand-built
// UNet with better samples (docs/results.md). 8 GroupNorm groups, linear transformer projections,
// heads of `d_head` channels. The bracketed cross-attention at 14×14 (196 tokens) is optional: on
// two CPU cores it costs more than it gives in a short run.
//
// The class conditions the UNet twice: through diffusers' class embedding (num_class_embeds,
// added to the timestep embedding every resnet receives), and through `context_tokens` context
// vectors per class (a table of this wrapper, standing in for a text encoder) that the
// transformers cross-attend to as encoder_hidden_states. Residual branches (each resnet's conv2,
// each transformer's proj_out) and conv_out start at zero, so the untrained network predicts zero
// and each block starts as the identity (faster early training, as in ADM); everything else keeps
// diffusers' initialisation. It learns the noise schedule's ε, v or x₀ (--prediction-type).
//
// dit: difftrain's models::DiTTransformer2DModel (diffusers' DiT) on p×p patches of the image,
// class-conditional through adaLN-Zero, trained with flow matching (rectified flow: x_σ =
// (1 − σ)·x₀ + σ·ε, the target ε − x₀, σ drawn logit-normal as SD3's default) and sampled with
// the flow-matching Euler sampler. As in DiT's paper, every block's modulation and the output
// layers start at zero, so each block starts as the identity and the untrained model predicts
// zero.
//
// flux-mini: a small Flux-style transformer on class captions (flux_mini.hpp), trained and
// sampled with flow matching as dit.
//
// Every way label 10 is the null class: training drops labels to it with probability `p_uncond`,
// so one network gives both halves of classifier-free guidance.

#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <difftrain/diffusion/flow_matching.hpp>
#include <difftrain/diffusion/noise_schedule.hpp>
#include <difftrain/diffusion/weighting.hpp>
#include <difftrain/models/dit_transformer_2d.hpp>
#include <difftrain/models/flux_transformer_2d.hpp>
#include <difftrain/models/unet_2d_condition.hpp>
#include <difftrain/nn/activation/elementwise.hpp>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "flux_mini.hpp"

namespace fmnist {

namespace dt = difftrain;
using Act = dt::nn::activation::SiLU;
using AttentionBackend = dt::nn::attention::Sdpa<dt::nn::attention::Auto>;
using Model = dt::models::UNet2DConditionModel<AttentionBackend, Act>;
using DiT = dt::models::DiTTransformer2DModel<AttentionBackend, dt::nn::activation::GELUTanh>;

struct UNetOptions {
  std::int64_t channels = 32;       ///< C: 28×28 width; 14×14 uses 3C/2, 7×7 2C
  std::int64_t context_tokens = 4;  ///< class context tokens (2C wide) the transformers read
  std::int64_t d_head = 32;         ///< attention head width (width / d_head heads, at least 1)
  bool attention_14 = false;        ///< transformers at 14×14 too, not only in the middle
  std::int64_t classes = 10;        ///< real classes; label `classes` is the null class
  double p_uncond = 0.1;            ///< chance a training label becomes the null class
  dt::diffusion::Prediction prediction = dt::diffusion::Prediction::epsilon;
  double snr_gamma = 0.0;  ///< > 0: min-SNR-γ loss weighting (diffusers' --snr_gamma)
};

/// The DiT backbone (--model dit): `depth` blocks of `width` channels in `heads` heads over
/// (28/patch)² patch tokens.
struct DiTOptions {
  std::int64_t width = 128;
  std::int64_t depth = 6;
  std::int64_t heads = 4;
  std::int64_t patch = 4;
};

/// The DiTTransformer2DModel configuration of these options (its `config.json`).
inline dt::models::DiTTransformer2DConfig dit_config(const DiTOptions& o, std::int64_t classes) {
  if (o.heads <= 0 || o.width <= 0 || o.width % o.heads != 0)
    throw dt::ConfigError("width " + std::to_string(o.width) + " must be a positive multiple of " +
                              std::to_string(o.heads) + " heads",
                          "DiT --dit-width/--dit-heads");
  if (o.patch <= 0 || 28 % o.patch != 0)
    throw dt::ConfigError("must divide 28 (1, 2, 4, 7, 14 or 28), got " + std::to_string(o.patch),
                          "DiT --dit-patch");
  dt::models::DiTTransformer2DConfig c;
  c.num_attention_heads = o.heads;
  c.attention_head_dim = o.width / o.heads;
  c.in_channels = 1;
  c.num_layers = o.depth;
  c.sample_size = 28;
  c.patch_size = o.patch;
  c.num_embeds_ada_norm = classes;  // label `classes` is the null row
  c.validate("DiT --dit-width/--dit-heads/--dit-depth");
  return c;
}

/// adaLN-Zero as DiT's paper initialises it: every block's modulation (norm1.linear) and the
/// output layers (proj_out_1, proj_out_2) start at zero.
inline void zero_modulation(torch::nn::Module& m) {
  at::NoGradGuard no_grad;
  for (auto& p : m.named_parameters()) {
    const std::string& n = p.key();
    if (n.find(".norm1.linear.") != std::string::npos || n.starts_with("proj_out_"))
      p.value().zero_();
  }
}

/// Stores every 4-D parameter channels-last: the classifier's convolutions run ~1.5× faster so
/// on the CPU (the UNet's do not: its GroupNorms are slower channels-last there).
inline void to_channels_last(torch::nn::Module& m) {
  at::NoGradGuard no_grad;
  for (auto& p : m.parameters())
    if (p.dim() == 4) p.set_data(p.contiguous(at::MemoryFormat::ChannelsLast));
}

/// The UNet2DConditionModel configuration of these options (what its `config.json` holds).
inline dt::models::UNet2DConditionConfig unet_config(const UNetOptions& o) {
  const std::int64_t c = o.channels;
  if (c <= 0 || c % 16 != 0)
    throw dt::ConfigError(
        "must be a positive multiple of 16 (widths C, 3C/2 and 2C in GroupNorms "
        "of 8 groups), got " +
            std::to_string(c),
        "UNet channels");
  if (o.d_head <= 0) throw dt::ConfigError("must be positive", "UNet d_head");
  if (o.context_tokens <= 0)
    throw dt::ConfigError("must be positive, got " + std::to_string(o.context_tokens),
                          "UNet context_tokens");
  dt::models::UNet2DConditionConfig u;
  u.sample_size = 28;
  u.in_channels = u.out_channels = 1;
  const std::string down14 = o.attention_14 ? "CrossAttnDownBlock2D" : "DownBlock2D";
  const std::string up14 = o.attention_14 ? "CrossAttnUpBlock2D" : "UpBlock2D";
  u.down_block_types = {"DownBlock2D", down14, "DownBlock2D"};
  u.up_block_types = {"UpBlock2D", up14, "UpBlock2D"};
  u.block_out_channels = {c, 3 * c / 2, 2 * c};
  u.layers_per_block = {0, 1, 1};
  u.norm_num_groups = 8;
  u.cross_attention_dim.assign(3, 2 * c);
  // diffusers' attention_head_dim is the number of heads: width / d_head, at least one.
  for (const std::int64_t width : u.block_out_channels) {
    const std::int64_t heads = std::max<std::int64_t>(1, width / o.d_head);
    if (width % heads != 0)
      throw dt::ConfigError("gives " + std::to_string(heads) +
                                " heads, which do not divide width " + std::to_string(width),
                            "UNet d_head " + std::to_string(o.d_head));
    u.attention_head_dim.push_back(heads);
  }
  u.use_linear_projection = true;
  u.time_embedding_dim = 4 * c;
  u.num_class_embeds = o.classes + 1;
  return u;
}

/// Zeroes the residual branches' last layers and conv_out (see the opening comment).
inline void zero_residual_branches(torch::nn::Module& m) {
  at::NoGradGuard no_grad;
  for (auto& p : m.named_parameters()) {
    const std::string& n = p.key();
    const std::string_view module = std::string_view(n).substr(0, n.rfind('.'));
    if (module.ends_with(".conv2") || module.ends_with(".proj_out") || module == "conv_out")
      p.value().zero_();
  }
}

class DenoiserImpl : public torch::nn::Module {
 public:
  /// The flow-matching sampler's training steps (σ = index / 1000), the DiT's timestep scale.
  static constexpr std::int64_t kFlowTimesteps = 1000;

  /// One training example set: images in [-1, 1] and their labels.
  struct Batch {
    at::Tensor images;  ///< (B, 1, 28, 28)
    at::Tensor labels;  ///< (B,) int64
    [[nodiscard]] std::int64_t size() const { return labels.size(0); }
    [[nodiscard]] Batch slice(std::int64_t start, std::int64_t length) const {
      return {images.narrow(0, start, length), labels.narrow(0, start, length)};
    }
  };

  /// A UNet with `o`, or a DiT with `dit_options`, or the Flux-style transformer (`flux_mini`),
  /// the transformers with `o`'s classes and p_uncond.
  DenoiserImpl(const UNetOptions& o, const dt::diffusion::NoiseSchedule& schedule,
               std::optional<DiTOptions> dit_options = std::nullopt, bool flux_mini = false)
      : o_(o), schedule_(&schedule) {
    if (flux_mini) {
      flux = register_module("flux", FluxMini(o.classes));
      return;
    }
    if (dit_options) {
      dit = register_module("dit", DiT(dit_config(*dit_options, o.classes), "fmnist::DiT"));
      // This wrapper drops labels itself (p_uncond), as for the UNet.
      dit->set_class_dropout_prob(0.0);
      zero_modulation(*dit);
      return;
    }
    unet = register_module("unet", Model(unet_config(o), "fmnist::UNet"));
    context_emb = register_module(
        "context_emb", torch::nn::Embedding(o.classes + 1, o.context_tokens * 2 * o.channels));
    zero_residual_branches(*unet);
  }

  [[nodiscard]] const UNetOptions& options() const { return o_; }
  [[nodiscard]] std::int64_t null_label() const { return o_.classes; }
  [[nodiscard]] bool is_dit() const { return !dit.is_empty(); }
  [[nodiscard]] bool is_flux() const { return !flux.is_empty(); }
  /// A transformer trained with flow matching (DiT or flux-mini).
  [[nodiscard]] bool is_flow() const { return is_dit() || is_flux(); }

  /// The prediction for noisy images x at timesteps t (B,) and labels: the UNet's ε, v or x₀ (per
  /// options) at schedule timesteps, the DiT's velocity ε − x₀ at flow timesteps σ · 1000.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& t, const at::Tensor& labels) {
    const at::Tensor lab = labels.to(x.device(), at::kLong);
    if (is_flux()) return flux->forward(x, t.to(x.device()), lab);
    if (is_dit()) {
      if (x.dim() != 4 || x.size(1) != 1 || x.size(2) != 28 || x.size(3) != 28)
        throw dt::ShapeError("expects (B, 1, 28, 28) images, got " + c10::str(x.sizes()), "DiT");
      return dit->forward(x, t.to(x.device()), lab);
    }
    return predict(x, t, context(lab), lab);
  }

  /// The context tokens of labels: rows of the token table, (B, context_tokens, 2C).
  [[nodiscard]] at::Tensor context(const at::Tensor& labels) {
    return context_emb(labels.to(at::kLong))
        .view({labels.size(0), o_.context_tokens, 2 * o_.channels});
  }

  /// The denoising loss: Gaussian noise, labels dropped to the null class with probability
  /// p_uncond; for the UNet uniform timesteps and the mean squared error against the prediction
  /// type's target (min-SNR weighted if asked), for the DiT flow matching.
  at::Tensor loss(const Batch& batch) {
    const at::Tensor& x0 = batch.images;
    const std::int64_t b = x0.size(0);
    const auto dev = at::TensorOptions().device(x0.device());
    const at::Tensor noise = at::randn_like(x0);
    const at::Tensor drop = at::rand({b}, dev.dtype(at::kFloat)) < o_.p_uncond;
    const at::Tensor labels =
        at::where(drop, at::full_like(batch.labels, null_label()), batch.labels);
    if (is_flow()) {
      // SD3's logit-normal density over σ, looked up as its training script does.
      const at::Tensor u = dt::diffusion::density_for_timestep_sampling(
          dt::diffusion::TimestepDensity::logit_normal, b, {}, std::nullopt, x0.device());
      const at::Tensor idx = (u * kFlowTimesteps).to(at::kLong).clamp(0, kFlowTimesteps - 1);
      const at::Tensor sigmas = flow_.sigmas_for(idx.cpu()).to(x0.device());
      const at::Tensor xt = flow_.noisy_input(x0, noise, sigmas);
      const at::Tensor pred = forward(xt, sigmas * kFlowTimesteps, labels);
      return at::mse_loss(pred.to(at::kFloat), flow_.target(x0, noise));
    }
    const at::Tensor t = schedule_->sample_timesteps(b, dev);
    const at::Tensor xt = schedule_->add_noise(x0, noise, t);
    const at::Tensor pred = forward(xt, t, labels);
    const at::Tensor target = schedule_->target(o_.prediction, x0, noise, t);
    if (o_.snr_gamma <= 0) return at::mse_loss(pred, target);
    // diffusers' train_text_to_image.py: per-sample MSE weighted by min(SNR, γ)/SNR (ε) or
    // /(SNR + 1) (v), then the mean.
    const at::Tensor weights = dt::diffusion::min_snr_weights(
        schedule_->snr(t).to(pred.device(), at::kFloat), o_.snr_gamma, o_.prediction);
    return ((pred - target).square().mean({1, 2, 3}) * weights).mean();
  }

  Model unet{nullptr};
  torch::nn::Embedding context_emb{nullptr};
  DiT dit{nullptr};
  FluxMini flux{nullptr};

 private:
  /// The UNet on x with context tokens ctx and the labels for the class embedding.
  at::Tensor predict(const at::Tensor& x, const at::Tensor& t, const at::Tensor& ctx,
                     const at::Tensor& labels) {
    if (x.dim() != 4 || x.size(1) != 1 || x.size(2) != 28 || x.size(3) != 28)
      throw dt::ShapeError("expects (B, 1, 28, 28) images, got " + c10::str(x.sizes()), "UNet");
    const std::int64_t b = x.size(0);
    if (ctx.dim() != 3 || ctx.size(0) != b || ctx.size(1) != o_.context_tokens ||
        ctx.size(2) != 2 * o_.channels)
      throw dt::ShapeError("expects context (" + std::to_string(b) + ", " +
                               std::to_string(o_.context_tokens) + ", " +
                               std::to_string(2 * o_.channels) + "), got " + c10::str(ctx.sizes()),
                           "UNet");
    dt::models::UNetConditions cond;
    cond.class_labels = labels;
    return unet->forward(x, t.to(x.device()), ctx, cond);
  }

  UNetOptions o_;
  const dt::diffusion::NoiseSchedule* schedule_;
  dt::diffusion::FlowMatchEuler flow_;
};
TORCH_MODULE(Denoiser);

}  // namespace fmnist
