#pragma once
// Loss weighting and timestep sampling for diffusion training (diffusers' training_utils, the
// min-SNR recipe of its training scripts, SD3's weightings and CogVideoX's loss).

#include <ATen/ATen.h>
#include <ATen/core/Generator.h>
#include <ATen/core/grad_mode.h>

#include <cmath>
#include <cstdint>
#include <numbers>
#include <optional>
#include <string>

#include "difftrain/core/error.hpp"
#include "difftrain/diffusion/loss_options.hpp"
#include "difftrain/diffusion/noise_schedule.hpp"

namespace difftrain::diffusion {

/// Min-SNR-γ loss weights (Hang et al. 2023): min(SNR, γ) / SNR for ε-prediction,
/// min(SNR, γ) / (SNR + 1) for v-prediction, min(SNR, γ) for x₀.
inline at::Tensor min_snr_weights(const at::Tensor& snr, double gamma, Prediction p) {
  if (!(gamma > 0)) throw ConfigError("must be > 0, got " + std::to_string(gamma), "min-SNR gamma");
  const at::Tensor clipped = at::minimum(snr, at::full_like(snr, gamma));
  switch (p) {
    case Prediction::epsilon:
      return clipped / snr;
    case Prediction::v_prediction:
      return clipped / (snr + 1);
    case Prediction::sample:
      return clipped;
  }
  return clipped;
}

enum class Sd3Weighting { sigma_sqrt, cosmap, none };

/// diffusers' compute_loss_weighting_for_sd3.
inline at::Tensor sd3_loss_weighting(Sd3Weighting scheme, const at::Tensor& sigmas) {
  switch (scheme) {
    case Sd3Weighting::sigma_sqrt:
      return sigmas.pow(-2.0).to(at::kFloat);
    case Sd3Weighting::cosmap:
      return 2 / (std::numbers::pi * (1 - 2 * sigmas + 2 * sigmas.pow(2)));
    case Sd3Weighting::none:
      return at::ones_like(sigmas);
  }
  return at::ones_like(sigmas);
}

enum class TimestepDensity { uniform, logit_normal, mode };

/// diffusers' compute_density_for_timestep_sampling: u ∈ (0, 1) per sample, to be mapped to
/// timestep indices as ⌊u · N⌋.
struct DensityOptions {
  double logit_mean = 0.0;
  double logit_std = 1.0;
  double mode_scale = 1.29;
};
inline at::Tensor density_for_timestep_sampling(
    TimestepDensity scheme, std::int64_t batch_size, const DensityOptions& o = {},
    std::optional<at::Generator> generator = std::nullopt, at::Device device = at::kCPU) {
  if (batch_size <= 0) throw ConfigError("must be > 0", "timestep density batch_size");
  const auto opts = at::TensorOptions().device(device).dtype(at::kFloat);
  switch (scheme) {
    case TimestepDensity::logit_normal:
      if (!(o.logit_std > 0)) throw ConfigError("must be > 0", "timestep density logit_std");
      return at::sigmoid(at::normal(o.logit_mean, o.logit_std, {batch_size}, generator, opts));
    case TimestepDensity::mode: {
      const at::Tensor u = at::rand({batch_size}, generator, opts);
      return 1 - u - o.mode_scale * (at::cos(std::numbers::pi * u / 2).pow(2) - 1 + u);
    }
    case TimestepDensity::uniform:
      return at::rand({batch_size}, generator, opts);
  }
  return at::rand({batch_size}, generator, opts);
}

/// DREAM (Zhou et al. 2024), diffusers' compute_dream_and_update_latents: one extra no-grad
/// prediction nudges the noisy input and the target by the model's own error, scaled by
/// λ = √(1−ᾱ)^detail_preservation. ε-prediction only, as in the reference.
template <class Model>
std::pair<at::Tensor, at::Tensor> dream_update(Model&& model, const NoiseSchedule& schedule,
                                               const at::Tensor& timesteps, const at::Tensor& noise,
                                               const at::Tensor& noisy, const at::Tensor& target,
                                               Prediction prediction,
                                               double detail_preservation = 1.0) {
  if (prediction != Prediction::epsilon)
    throw ConfigError(
        "DREAM is defined for epsilon prediction only, got " + std::string(to_string(prediction)),
        "dream_update prediction");
  const at::Tensor a = schedule.alphas_cumprod_at(timesteps, noisy.dim(), noisy.options());
  const at::Tensor sqrt_one_minus = (1.0 - a).pow(0.5);
  const at::Tensor lambda = sqrt_one_minus.pow(detail_preservation);
  at::Tensor pred;
  {
    const at::NoGradGuard no_grad;
    pred = model(noisy, timesteps);
  }
  if (pred.sizes() != noise.sizes())
    throw ShapeError(
        "model output has shape " + c10::str(pred.sizes()) + ", noise " + c10::str(noise.sizes()),
        "dream_update");
  const at::Tensor delta = (noise - pred).detach() * lambda;
  return {noisy + sqrt_one_minus * delta, target + delta};
}

/// CogVideoX's training loss, as its fine-tuning (diffusers' train_cogvideox_lora.py) computes it:
/// the model's output at x_t turned into x̂₀ — for v-prediction √ᾱ·x_t − √(1−ᾱ)·v, diffusers'
/// get_velocity(output, x_t, t); ε- and x₀-predictions by their own formulas — and
/// mean over each sample of (1/(1 − ᾱ_t))·(x̂₀ − x₀)², then over the batch. In float32 whatever
/// the output's dtype; ᾱ from `schedule` (with CogVideoX's snr_shift_scale when it has one).
/// `type` other than l2 takes kohya's element-wise loss in place of the square (`huber_c` per
/// sample for huber and smooth_l1).
inline at::Tensor cogvideox_loss(const NoiseSchedule& schedule, Prediction prediction,
                                 const at::Tensor& model_output, const at::Tensor& noisy,
                                 const at::Tensor& x0, const at::Tensor& timesteps,
                                 LossType type = LossType::l2, const at::Tensor& huber_c = {}) {
  if (model_output.sizes() != x0.sizes() || noisy.sizes() != x0.sizes())
    throw ShapeError("the model output " + c10::str(model_output.sizes()) + ", x_t " +
                         c10::str(noisy.sizes()) + " and x0 " + c10::str(x0.sizes()) +
                         " must have one shape",
                     "cogvideox_loss");
  const std::int64_t n = x0.size(0);
  const at::TensorOptions f32 = x0.options().dtype(at::kFloat);
  const at::Tensor a = schedule.alphas_cumprod_at(timesteps, x0.dim(), f32);
  const at::Tensor out = model_output.to(at::kFloat), x = noisy.to(at::kFloat);
  at::Tensor x0_hat;
  switch (prediction) {
    case Prediction::v_prediction:
      x0_hat = a.sqrt() * x - (1 - a).sqrt() * out;
      break;
    case Prediction::epsilon:
      x0_hat = (x - (1 - a).sqrt() * out) / a.sqrt();
      break;
    case Prediction::sample:
      x0_hat = out;
      break;
  }
  const at::Tensor w = 1.0 / (1.0 - a);
  if (type == LossType::l2)
    return (w * (x0_hat - x0.to(at::kFloat)).square()).reshape({n, -1}).mean(1).mean();
  return (w * conditional_loss(x0_hat, x0.to(at::kFloat), type, huber_c))
      .reshape({n, -1})
      .mean(1)
      .mean();
}

}  // namespace difftrain::diffusion
