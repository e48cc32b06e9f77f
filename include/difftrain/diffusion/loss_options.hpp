#pragma once
// The loss options of today's LoRA trainers, as kohya's sd-scripts defines them
// (library/train_util.py, custom_train_functions.py): the loss type (l2, l1, huber, smooth_l1)
// with its Huber threshold schedule, the SNR-based weights that are not min-SNR
// (debiased estimation, v-prediction-like loss, v-prediction scaled like noise prediction) and
// the masked loss (an alpha channel or mask image, resized to the latents by area).
//
//   const at::Tensor c = df::huber_threshold(df::HuberSchedule::snr, 0.1, 1.0, t, schedule);
//   at::Tensor loss = df::conditional_loss(pred, target, df::LossType::huber, c);  // (B, C, H, W)
//   loss = df::masked_loss(loss, alpha_masks);   // (B, H, W) masks in [0, 1]
//   loss = loss.mean({1, 2, 3});                 // per sample, then the weights:
//   loss = df::debiased_estimation(loss, schedule.snr(t));

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "difftrain/core/error.hpp"
#include "difftrain/diffusion/noise_schedule.hpp"

namespace difftrain::diffusion {

/// kohya's --loss_type.
enum class LossType { l2, l1, huber, smooth_l1 };
/// kohya's --huber_schedule: how the threshold c follows the timestep.
enum class HuberSchedule { constant, exponential, snr };

inline LossType loss_type_from(std::string_view name, const std::string& where) {
  if (name == "l2") return LossType::l2;
  if (name == "l1") return LossType::l1;
  if (name == "huber") return LossType::huber;
  if (name == "smooth_l1") return LossType::smooth_l1;
  throw ConfigError("is '" + std::string(name) + "'; the loss types are l2, l1, huber, smooth_l1",
                    where);
}

inline HuberSchedule huber_schedule_from(std::string_view name, const std::string& where) {
  if (name == "constant") return HuberSchedule::constant;
  if (name == "exponential") return HuberSchedule::exponential;
  if (name == "snr") return HuberSchedule::snr;
  throw ConfigError(
      "is '" + std::string(name) + "'; the Huber schedules are constant, exponential, snr", where);
}

/// kohya's get_huber_threshold_if_needed: per sample of `timesteps` (integers in [0, N)),
///   constant     c · scale
///   exponential  exp(ln(c) / N · t) · scale      (scale at t = 0, c · scale at t = N)
///   snr          (1 − c) / (1 + σ_t)² + c,  σ_t = √((1 − ᾱ_t) / ᾱ_t)   (scale unused, as there)
/// `huber_c` must lie in (0, 1] for the exponential schedule (its logarithm), in [0, 1] otherwise.
namespace loss_detail {
/// `huber_c` in (0, 1] for the exponential schedule (its logarithm), in [0, 1] otherwise; a
/// positive scale.
inline void check_huber(HuberSchedule schedule, double huber_c, double huber_scale) {
  if (!std::isfinite(huber_c) || huber_c < 0 || huber_c > 1 ||
      (schedule == HuberSchedule::exponential && huber_c <= 0))
    throw ConfigError(
        "must lie in " + std::string(schedule == HuberSchedule::exponential ? "(0, 1]" : "[0, 1]") +
            ", got " + std::to_string(huber_c),
        "--huber_c");
  if (!std::isfinite(huber_scale) || huber_scale <= 0)
    throw ConfigError("must be a positive number, got " + std::to_string(huber_scale),
                      "--huber_scale");
}
}  // namespace loss_detail

/// The same for a schedule without ᾱ (flow matching): `timesteps` in [0, N] (σ·N), constant and
/// exponential only; snr is a ConfigError, as kohya's SD3 and Flux paths raise.
inline at::Tensor huber_threshold(HuberSchedule schedule, double huber_c, double huber_scale,
                                  const at::Tensor& timesteps, std::int64_t num_train_timesteps);

inline at::Tensor huber_threshold(HuberSchedule schedule, double huber_c, double huber_scale,
                                  const at::Tensor& timesteps, const NoiseSchedule& noise) {
  if (schedule != HuberSchedule::snr)
    return huber_threshold(schedule, huber_c, huber_scale, timesteps, noise.num_train_timesteps());
  loss_detail::check_huber(schedule, huber_c, huber_scale);
  const at::Tensor abar =
      noise.alphas_cumprod_at(timesteps.cpu(), 1, at::TensorOptions().dtype(at::kDouble));
  const at::Tensor sigmas = ((1.0 - abar) / abar).sqrt();
  return ((1.0 - huber_c) / (1.0 + sigmas).square() + huber_c)
      .to(at::kFloat)
      .to(timesteps.device());
}

inline at::Tensor huber_threshold(HuberSchedule schedule, double huber_c, double huber_scale,
                                  const at::Tensor& timesteps, std::int64_t num_train_timesteps) {
  loss_detail::check_huber(schedule, huber_c, huber_scale);
  switch (schedule) {
    case HuberSchedule::constant:
      return at::full({timesteps.size(0)}, huber_c * huber_scale,
                      timesteps.options().dtype(at::kFloat));
    case HuberSchedule::exponential: {
      const double alpha = -std::log(huber_c) / static_cast<double>(num_train_timesteps);
      return (at::exp(-alpha * timesteps.to(at::kDouble)) * huber_scale).to(at::kFloat);
    }
    case HuberSchedule::snr:
      throw ConfigError(
          "snr needs a noise schedule with ᾱ; flow matching has none (choose constant or "
          "exponential)",
          "--huber_schedule");
  }
  return {};
}

/// kohya's conditional_loss with reduction "none": the element-wise loss of `pred` against
/// `target`. Huber: 2c(√((p − y)² + c²) − c); smooth L1: 2(√((p − y)² + c²) − c), c per sample
/// (shape (B,), from huber_threshold) broadcast over the other dimensions.
inline at::Tensor conditional_loss(const at::Tensor& pred, const at::Tensor& target, LossType type,
                                   const at::Tensor& huber_c = {}) {
  if (pred.sizes() != target.sizes())
    throw ShapeError("prediction " + c10::str(pred.sizes()) + " and target " +
                         c10::str(target.sizes()) + " differ",
                     "conditional_loss");
  switch (type) {
    case LossType::l2:
      return (pred - target).square();
    case LossType::l1:
      return (pred - target).abs();
    case LossType::huber:
    case LossType::smooth_l1: {
      if (!huber_c.defined() || huber_c.dim() != 1 || huber_c.size(0) != pred.size(0))
        throw ShapeError("needs a threshold per sample (" + std::to_string(pred.size(0)) + ")",
                         "conditional_loss huber_c");
      std::vector<std::int64_t> shape(static_cast<std::size_t>(pred.dim()), 1);
      shape[0] = -1;
      const at::Tensor c = huber_c.to(pred.scalar_type()).view(shape);
      const at::Tensor core = at::sqrt((pred - target).square() + c.square()) - c;
      return type == LossType::huber ? 2 * c * core : 2 * core;
    }
  }
  return {};
}

/// kohya's SNR as its weights read it: all_snr[t], capped at 1000 (t = 0 would be near infinite).
inline at::Tensor capped_snr(const at::Tensor& snr) {
  return at::minimum(snr, at::full_like(snr, 1000));
}

/// kohya's apply_debiased_estimation: loss · 1/√SNR_t, or loss · 1/(SNR_t + 1) for
/// v-prediction (SNR capped at 1000).
inline at::Tensor debiased_estimation(const at::Tensor& per_sample_loss, const at::Tensor& snr,
                                      bool v_prediction = false) {
  const at::Tensor s = capped_snr(snr);
  const at::Tensor w = v_prediction ? 1.0 / (s + 1) : 1.0 / s.sqrt();
  return per_sample_loss * w.to(per_sample_loss.scalar_type());
}

/// kohya's add_v_prediction_like_loss: loss + loss / (SNR/(SNR + 1)) · v_pred_like_loss.
inline at::Tensor v_prediction_like_loss(const at::Tensor& per_sample_loss, const at::Tensor& snr,
                                         double v_pred_like_loss) {
  const at::Tensor s = capped_snr(snr);
  const at::Tensor scale = (s / (s + 1)).to(per_sample_loss.scalar_type());
  return per_sample_loss + per_sample_loss / scale * v_pred_like_loss;
}

/// kohya's scale_v_prediction_loss_like_noise_prediction: loss · SNR/(SNR + 1).
inline at::Tensor v_prediction_scaled_like_noise(const at::Tensor& per_sample_loss,
                                                 const at::Tensor& snr) {
  const at::Tensor s = capped_snr(snr);
  return per_sample_loss * (s / (s + 1)).to(per_sample_loss.scalar_type());
}

/// diffusers' prior preservation (train_dreambooth_lora.py) as per-sample weights: a batch of
/// `instances` samples followed by as many class samples, whose loss there is the instance half's
/// mean plus `prior_loss_weight` times the class half's. With these weights (2 for an instance,
/// 2·prior_loss_weight for a class sample) the mean of weight × per-sample loss is that sum, and
/// the per-sample form composes with kohya's weights and with a batch split into micro-batches.
inline at::Tensor prior_preservation_weights(std::int64_t instances, double prior_loss_weight) {
  if (instances < 1) throw ShapeError("needs at least one instance sample", "prior preservation");
  if (!std::isfinite(prior_loss_weight) || prior_loss_weight < 0)
    throw ConfigError("must be a finite number >= 0", "--prior_loss_weight");
  return at::cat({at::full({instances}, 2.0, at::kFloat),
                  at::full({instances}, 2.0 * prior_loss_weight, at::kFloat)});
}

/// kohya's apply_masked_loss: the element-wise loss (B, C, h, w) times the mask (B, H, W), values
/// in [0, 1] (an alpha channel; a mask image's red channel in [-1, 1] mapped by x/2 + 1/2 first),
/// resized to (h, w) by area (adaptive average pooling).
inline at::Tensor masked_loss(const at::Tensor& loss, const at::Tensor& masks) {
  if (loss.dim() != 4 || masks.dim() != 3 || masks.size(0) != loss.size(0))
    throw ShapeError("loss " + c10::str(loss.sizes()) + " and masks " + c10::str(masks.sizes()) +
                         " are not (B, C, h, w) and (B, H, W) of one batch",
                     "masked_loss");
  const at::Tensor m = at::adaptive_avg_pool2d(masks.to(loss.scalar_type()).unsqueeze(1),
                                               {loss.size(2), loss.size(3)});
  return loss * m;
}

}  // namespace difftrain::diffusion
