#pragma once
// A small class-conditional UNet for 28×28 images, built from difftrain blocks:
//
//   28×28  conv_in → ResBlock(C) ───────────────────────────────────skip──┐
//   14×14  down → ResBlock(2C) [+ SpatialTransformer] ────────skip──┐      │
//    7×7   down → ResBlock, SpatialTransformer, ResBlock (middle)   │      │
//   14×14  up → ResBlock(cat) [+ SpatialTransformer] ◄──────────────┘      │
//   28×28  up → ResBlock(cat) → conv_out ◄─────────────────────────────────┘
//
// The bracketed transformers at 14×14 (196 tokens) are optional: on two CPU cores they cost
// ~40 % of the step time, more than they give in a ten-minute run; on a GPU they are cheap.
//
// The class conditions the network twice: its embedding is added to the timestep embedding that
// every ResBlock receives, and its context tokens are what the SpatialTransformers cross-attend
// to. Label 10 is the null class: training drops labels to it with probability `p_uncond`, so one
// network gives both halves of classifier-free guidance.
//
// With `pooled_context` the label embedding is replaced by a projection of the context tokens, so
// every condition enters through the token table: what textual inversion needs (a new token's
// vectors then steer the whole network), used by the adapters example.
//
// Residual branches and the output convolution start at zero, so the untrained network predicts
// zero noise and each block starts as the identity (faster early training, as in ADM).

#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <difftrain/diffusion/noise_schedule.hpp>
#include <difftrain/diffusion/weighting.hpp>
#include <difftrain/nn/activation/elementwise.hpp>
#include <difftrain/nn/blocks/spatial_transformer.hpp>
#include <difftrain/nn/layers/adaptable.hpp>

#include <cmath>
#include <cstdint>
#include <string>

namespace fmnist {

namespace dt = difftrain;
using Act = dt::nn::activation::SiLU;
using AttentionBackend = dt::nn::attention::Sdpa<dt::nn::attention::Auto>;

struct UNetOptions {
  std::int64_t channels = 32;       ///< C: 28×28 width; 14×14 and 7×7 use 2C
  std::int64_t context_tokens = 4;  ///< class context tokens the transformers attend to
  std::int64_t d_head = 32;         ///< attention head width (2C / d_head heads)
  bool attention_14 = false;        ///< transformers at 14×14 too, not only in the middle
  std::int64_t classes = 10;        ///< real classes; label `classes` is the null class
  double p_uncond = 0.1;            ///< chance a training label becomes the null class
  dt::diffusion::Prediction prediction = dt::diffusion::Prediction::epsilon;
  bool pooled_context =
      false;               ///< ResBlocks see a projection of the context, not a label embedding
  double snr_gamma = 0.0;  ///< > 0: min-SNR-γ loss weighting (diffusers' --snr_gamma)
};

/// Stores every 4-D parameter channels-last: the classifier's convolutions run ~1.5× faster so
/// on the CPU (the UNet's do not: its GroupNorms are slower channels-last there).
inline void to_channels_last(torch::nn::Module& m) {
  at::NoGradGuard no_grad;
  for (auto& p : m.parameters())
    if (p.dim() == 4) p.set_data(p.contiguous(at::MemoryFormat::ChannelsLast));
}

inline void zero_(torch::nn::Module& m) {
  at::NoGradGuard no_grad;
  for (auto& p : m.parameters()) p.zero_();
}

/// GroupNorm → SiLU → conv, + the embedding's shift, → GroupNorm → SiLU → conv (zeroed), + skip.
class ResBlockImpl : public torch::nn::Module {
 public:
  ResBlockImpl(std::int64_t in, std::int64_t out, std::int64_t emb) {
    using namespace torch::nn;
    norm1 = register_module("norm1", GroupNorm(GroupNormOptions(8, in)));
    conv1 = register_module("conv1", Conv2d(Conv2dOptions(in, out, 3).padding(1)));
    // Adaptable (exactly a Linear until a LoRA branch is attached): how the condition enters.
    emb_proj = register_module("emb_proj", dt::nn::AdaptableLinear(emb, out));
    norm2 = register_module("norm2", GroupNorm(GroupNormOptions(8, out)));
    conv2 = register_module("conv2", Conv2d(Conv2dOptions(out, out, 3).padding(1)));
    zero_(*conv2);
    if (in != out) skip = register_module("skip", Conv2d(Conv2dOptions(in, out, 1)));
  }
  at::Tensor forward(const at::Tensor& x, const at::Tensor& emb) {
    at::Tensor h = conv1(Act::forward(norm1(x), {}));
    h = h + emb_proj->forward(Act::forward(emb, {})).unsqueeze(-1).unsqueeze(-1);
    h = conv2(Act::forward(norm2(h), {}));
    return h + (skip ? skip(x) : x);
  }
  torch::nn::GroupNorm norm1{nullptr}, norm2{nullptr};
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr}, skip{nullptr};
  dt::nn::AdaptableLinear emb_proj{nullptr};
};
TORCH_MODULE(ResBlock);

/// The sinusoidal timestep embedding of DDPM / diffusers (cos half first, as flip_sin_to_cos).
inline at::Tensor timestep_embedding(const at::Tensor& t, std::int64_t dim) {
  const std::int64_t half = dim / 2;
  const at::Tensor freqs =
      at::exp(at::arange(half, t.options().dtype(at::kFloat)) * (-std::log(10000.0) / half));
  const at::Tensor args = t.to(at::kFloat).unsqueeze(1) * freqs.unsqueeze(0);
  return at::cat({at::cos(args), at::sin(args)}, 1);
}

class UNetImpl : public torch::nn::Module {
 public:
  /// One training example set: images in [-1, 1] and their labels.
  struct Batch {
    at::Tensor images;  ///< (B, 1, 28, 28)
    at::Tensor labels;  ///< (B,) int64
    [[nodiscard]] std::int64_t size() const { return labels.size(0); }
    [[nodiscard]] Batch slice(std::int64_t start, std::int64_t length) const {
      return {images.narrow(0, start, length), labels.narrow(0, start, length)};
    }
  };

  UNetImpl(const UNetOptions& o, const dt::diffusion::NoiseSchedule& schedule)
      : o_(o), schedule_(&schedule) {
    using namespace torch::nn;
    const std::int64_t c = o.channels, c2 = 2 * o.channels, emb = 4 * o.channels;
    if (c <= 0 || c2 % 32 != 0)
      throw dt::ConfigError(
          "must be a positive multiple of 16 (the transformers' GroupNorm has "
          "32 groups of 2C channels), got " +
              std::to_string(c),
          "UNet channels");
    if (o.d_head <= 0 || c2 % o.d_head != 0)
      throw dt::ConfigError("must divide 2C = " + std::to_string(c2), "UNet d_head");
    time_in = register_module("time_in", Linear(c, emb));
    time_out = register_module("time_out", Linear(emb, emb));
    if (o.pooled_context)
      pool_proj = register_module("pool_proj", Linear(o.context_tokens * c2, emb));
    else
      label_emb = register_module("label_emb", Embedding(o.classes + 1, emb));
    context_emb = register_module("context_emb", Embedding(o.classes + 1, o.context_tokens * c2));
    conv_in = register_module("conv_in", Conv2d(Conv2dOptions(1, c, 3).padding(1)));
    res_28 = register_module("res_28", ResBlock(c, c, emb));
    down_28 = register_module("down_28", Conv2d(Conv2dOptions(c, c, 3).stride(2).padding(1)));
    res_14 = register_module("res_14", ResBlock(c, c2, emb));
    if (o.attention_14) attn_14 = register_module("attn_14", transformer(c2));
    down_14 = register_module("down_14", Conv2d(Conv2dOptions(c2, c2, 3).stride(2).padding(1)));
    mid_res1 = register_module("mid_res1", ResBlock(c2, c2, emb));
    mid_attn = register_module("mid_attn", transformer(c2));
    mid_res2 = register_module("mid_res2", ResBlock(c2, c2, emb));
    up_7 = register_module("up_7", Conv2d(Conv2dOptions(c2, c2, 3).padding(1)));  // then up
    up_res_14 = register_module("up_res_14", ResBlock(2 * c2, c2, emb));
    if (o.attention_14) up_attn_14 = register_module("up_attn_14", transformer(c2));
    up_14 =
        register_module("up_14", Conv2d(Conv2dOptions(c2, c, 3).padding(1)));  // at 14×14, then up
    up_res_28 = register_module("up_res_28", ResBlock(2 * c, c, emb));
    norm_out = register_module("norm_out", GroupNorm(GroupNormOptions(8, c)));
    conv_out = register_module("conv_out", Conv2d(Conv2dOptions(c, 1, 3).padding(1)));
    zero_(*conv_out);
  }

  [[nodiscard]] const UNetOptions& options() const { return o_; }
  [[nodiscard]] std::int64_t null_label() const { return o_.classes; }

  /// The prediction (ε, v or x₀ per options) for noisy images x at timesteps t (B,) and labels.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& t, const at::Tensor& labels) {
    const at::Tensor lab = labels.to(x.device(), at::kLong);
    const at::Tensor ctx = context(lab);
    return predict(x, t, ctx, o_.pooled_context ? at::Tensor() : label_emb(lab));
  }

  /// The prediction for context tokens (B, context_tokens, 2C) given directly (a prompt whose
  /// tokens were replaced by an embedding's vectors); needs `pooled_context`.
  at::Tensor forward_context(const at::Tensor& x, const at::Tensor& t, const at::Tensor& ctx) {
    if (!o_.pooled_context)
      throw dt::ConfigError("needs pooled_context: otherwise labels also condition the network",
                            "UNet::forward_context");
    return predict(x, t, ctx, {});
  }

  /// The context tokens of labels: rows of the token table, (B, context_tokens, 2C).
  [[nodiscard]] at::Tensor context(const at::Tensor& labels) {
    return context_emb(labels.to(at::kLong))
        .view({labels.size(0), o_.context_tokens, 2 * o_.channels});
  }

  void set_p_uncond(double p) { o_.p_uncond = p; }

  /// The denoising loss for clean images x0 under context tokens ctx (no label dropping).
  at::Tensor context_loss(const at::Tensor& x0, const at::Tensor& ctx) {
    const std::int64_t b = x0.size(0);
    const auto dev = at::TensorOptions().device(x0.device());
    const at::Tensor t = schedule_->sample_timesteps(b, dev);
    const at::Tensor noise = at::randn_like(x0);
    const at::Tensor xt = schedule_->add_noise(x0, noise, t);
    return at::mse_loss(forward_context(xt, t, ctx),
                        schedule_->target(o_.prediction, x0, noise, t));
  }

  /// The denoising loss: uniform timesteps, Gaussian noise, labels dropped to the null class with
  /// probability p_uncond, mean squared error against the prediction type's target.
  at::Tensor loss(const Batch& batch) {
    const at::Tensor& x0 = batch.images;
    const std::int64_t b = x0.size(0);
    const auto dev = at::TensorOptions().device(x0.device());
    const at::Tensor t = schedule_->sample_timesteps(b, dev);
    const at::Tensor noise = at::randn_like(x0);
    const at::Tensor xt = schedule_->add_noise(x0, noise, t);
    const at::Tensor drop = at::rand({b}, dev.dtype(at::kFloat)) < o_.p_uncond;
    const at::Tensor labels =
        at::where(drop, at::full_like(batch.labels, null_label()), batch.labels);
    const at::Tensor pred = forward(xt, t, labels);
    const at::Tensor target = schedule_->target(o_.prediction, x0, noise, t);
    if (o_.snr_gamma <= 0) return at::mse_loss(pred, target);
    // diffusers' train_text_to_image.py: per-sample MSE weighted by min(SNR, γ)/SNR (ε) or
    // /(SNR + 1) (v), then the mean.
    const at::Tensor weights = dt::diffusion::min_snr_weights(
        schedule_->snr(t).to(pred.device(), at::kFloat), o_.snr_gamma, o_.prediction);
    return ((pred - target).square().mean({1, 2, 3}) * weights).mean();
  }

  torch::nn::Linear time_in{nullptr}, time_out{nullptr}, pool_proj{nullptr};
  torch::nn::Embedding label_emb{nullptr}, context_emb{nullptr};
  torch::nn::Conv2d conv_in{nullptr}, down_28{nullptr}, down_14{nullptr}, up_7{nullptr},
      up_14{nullptr}, conv_out{nullptr};
  ResBlock res_28{nullptr}, res_14{nullptr}, mid_res1{nullptr}, mid_res2{nullptr},
      up_res_14{nullptr}, up_res_28{nullptr};
  using Transformer = dt::nn::blocks::SpatialTransformer<AttentionBackend>;
  Transformer attn_14{nullptr}, mid_attn{nullptr}, up_attn_14{nullptr};
  torch::nn::GroupNorm norm_out{nullptr};

 private:
  at::Tensor predict(const at::Tensor& x, const at::Tensor& t, const at::Tensor& ctx,
                     const at::Tensor& label_term) {
    if (x.dim() != 4 || x.size(1) != 1 || x.size(2) != 28 || x.size(3) != 28)
      throw dt::ShapeError("expects (B, 1, 28, 28) images, got " + c10::str(x.sizes()), "UNet");
    const std::int64_t b = x.size(0);
    if (ctx.dim() != 3 || ctx.size(0) != b || ctx.size(1) != o_.context_tokens ||
        ctx.size(2) != 2 * o_.channels)
      throw dt::ShapeError("expects context (" + std::to_string(b) + ", " +
                               std::to_string(o_.context_tokens) + ", " +
                               std::to_string(2 * o_.channels) + "), got " + c10::str(ctx.sizes()),
                           "UNet");
    at::Tensor emb = time_in(timestep_embedding(t.to(x.device()), o_.channels));
    emb = time_out(Act::forward(emb, {})) +
          (label_term.defined() ? label_term : pool_proj(ctx.flatten(1)));

    const at::Tensor h28 = res_28(conv_in(x), emb);
    at::Tensor h14 = res_14(down_28(h28), emb);
    if (attn_14) h14 = attn_14->forward(h14, ctx);
    at::Tensor h = mid_res1(down_14(h14), emb);
    h = mid_res2(mid_attn->forward(h, ctx), emb);
    h = at::upsample_nearest2d(up_7(h), {14, 14});
    h = up_res_14(at::cat({h, h14}, 1), emb);
    if (up_attn_14) h = up_attn_14->forward(h, ctx);
    h = at::upsample_nearest2d(up_14(h), {28, 28});
    h = up_res_28(at::cat({h, h28}, 1), emb);
    return conv_out(Act::forward(norm_out(h), {}));
  }

  [[nodiscard]] Transformer transformer(std::int64_t dim) const {
    dt::nn::blocks::SpatialTransformerOptions s;
    s.in_channels = dim;
    s.n_heads = dim / o_.d_head;
    s.d_head = o_.d_head;
    s.context_dim = {dim};
    s.use_linear = true;
    return Transformer(s);
  }

  UNetOptions o_;
  const dt::diffusion::NoiseSchedule* schedule_;
};
TORCH_MODULE(UNet);

}  // namespace fmnist
