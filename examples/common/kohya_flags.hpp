#pragma once
// The caption, noise and loss options of kohya's sd-scripts, as the SD programs take them (under
// kohya's names): the flags, their checks, the captions of a step and the noise and loss of a
// denoising step. The formulas are the library's (data/caption_options.hpp,
// diffusion/noise_options.hpp, diffusion/loss_options.hpp).

#include <CLI/CLI.hpp>
#include <difftrain/core/error.hpp>
#include <difftrain/data/caption_options.hpp>
#include <difftrain/diffusion/loss_options.hpp>
#include <difftrain/diffusion/noise_options.hpp>
#include <difftrain/diffusion/noise_schedule.hpp>
#include <difftrain/diffusion/weighting.hpp>

#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace examples {
namespace df = difftrain::diffusion;

struct KohyaFlags {
  difftrain::data::CaptionOptions captions;
  double noise_offset = 0.0, adaptive_noise_scale = 0.0;
  std::int64_t multires_noise_iterations = 0;
  double multires_noise_discount = 0.3;
  double ip_noise_gamma = 0.0;
  bool ip_noise_gamma_random_strength = false;
  double input_perturbation = 0.0;  // diffusers' train_text_to_image.py
  std::string loss_type = "l2", huber_schedule = "snr";
  double huber_c = 0.1, huber_scale = 1.0;
  bool debiased_estimation_loss = false, scale_v_pred_loss_like_noise_pred = false;
  double v_pred_like_loss = 0.0;

  /// Whether the loss is anything but the mean squared error (with min-SNR where asked).
  [[nodiscard]] bool changes_loss() const {
    return loss_type != "l2" || debiased_estimation_loss || scale_v_pred_loss_like_noise_pred ||
           v_pred_like_loss != 0;
  }

  void check() const {
    captions.check();
    auto at_least_0 = [](double v, const char* flag) {
      if (!std::isfinite(v) || v < 0)
        throw difftrain::ConfigError("must be a finite number >= 0, got " + std::to_string(v),
                                     flag);
    };
    at_least_0(noise_offset, "--noise_offset");
    at_least_0(multires_noise_discount, "--multires_noise_discount");
    at_least_0(ip_noise_gamma, "--ip_noise_gamma");
    at_least_0(input_perturbation, "--input_perturbation");
    if (!std::isfinite(adaptive_noise_scale))
      throw difftrain::ConfigError("must be a finite number", "--adaptive_noise_scale");
    if (!std::isfinite(v_pred_like_loss))
      throw difftrain::ConfigError("must be a finite number", "--v_pred_like_loss");
    if (multires_noise_iterations < 0 || multires_noise_iterations > 64)
      throw difftrain::ConfigError("must be from 0 to 64", "--multires_noise_iterations");
    const bool exponential = huber_schedule == "exponential";
    if (!std::isfinite(huber_c) || huber_c < 0 || huber_c > 1 || (exponential && huber_c <= 0))
      throw difftrain::ConfigError(
          std::string("must lie in ") + (exponential ? "(0, 1]" : "[0, 1]"), "--huber_c");
    if (!std::isfinite(huber_scale) || huber_scale <= 0)
      throw difftrain::ConfigError("must be a positive number", "--huber_scale");
    (void)df::loss_type_from(loss_type, "--loss_type");
    (void)df::huber_schedule_from(huber_schedule, "--huber_schedule");
    if (ip_noise_gamma > 0 && input_perturbation > 0)
      throw difftrain::ConfigError(
          "and --input_perturbation are the same perturbation (kohya's and diffusers' names); "
          "give one",
          "--ip_noise_gamma");
    if (ip_noise_gamma_random_strength && ip_noise_gamma <= 0)
      throw difftrain::ConfigError("needs --ip_noise_gamma", "--ip_noise_gamma_random_strength");
    if (adaptive_noise_scale != 0 && noise_offset <= 0)
      throw difftrain::ConfigError("needs --noise_offset (kohya scales the offset by it)",
                                   "--adaptive_noise_scale");
  }

  [[nodiscard]] nlohmann::json settings() const {
    const auto& c = captions;
    return {{"noise_offset", noise_offset},
            {"adaptive_noise_scale", adaptive_noise_scale},
            {"multires_noise_iterations", multires_noise_iterations},
            {"multires_noise_discount", multires_noise_discount},
            {"ip_noise_gamma", ip_noise_gamma},
            {"input_perturbation", input_perturbation},
            {"loss_type", loss_type},
            {"huber_schedule", huber_schedule},
            {"huber_c", huber_c},
            {"debiased_estimation_loss", debiased_estimation_loss},
            {"v_pred_like_loss", v_pred_like_loss},
            {"scale_v_pred_loss_like_noise_pred", scale_v_pred_loss_like_noise_pred},
            {"shuffle_caption", c.shuffle_caption},
            {"keep_tokens", c.keep_tokens},
            {"caption_dropout_rate", c.caption_dropout_rate},
            {"caption_tag_dropout_rate", c.caption_tag_dropout_rate}};
  }
};

/// The flags, in two groups of `app`.
inline void add_kohya_flags(CLI::App& app, KohyaFlags& f) {
  auto* c = app.add_option_group("captions (kohya's options, applied each time an image is used)");
  auto& o = f.captions;
  c->add_flag("--shuffle_caption", o.shuffle_caption, "shuffle the comma-separated tags");
  c->add_option("--keep_tokens", o.keep_tokens, "the first N tags stay in front, unshuffled")
      ->capture_default_str();
  c->add_option("--keep_tokens_separator", o.keep_tokens_separator,
                "tags before it (and after a second one) stay in place");
  c->add_option("--caption_separator", o.caption_separator)->capture_default_str();
  c->add_option("--secondary_separator", o.secondary_separator,
                "a separator that does not split tags, made the caption separator at the end");
  c->add_flag("--enable_wildcard", o.enable_wildcard,
              "{a|b|c} choices and one line of a multi-line caption");
  c->add_option("--caption_prefix", o.caption_prefix);
  c->add_option("--caption_suffix", o.caption_suffix);
  c->add_option("--caption_dropout_rate", o.caption_dropout_rate,
                "the whole caption left empty with this probability")
      ->capture_default_str();
  c->add_option("--caption_dropout_every_n_epochs", o.caption_dropout_every_n_epochs,
                "every caption left empty in every N-th epoch")
      ->capture_default_str();
  c->add_option("--caption_tag_dropout_rate", o.caption_tag_dropout_rate,
                "each shuffled tag dropped with this probability")
      ->capture_default_str();
  c->add_option("--token_warmup_min", o.token_warmup_min)->capture_default_str();
  c->add_option("--token_warmup_step", o.token_warmup_step,
                "the tags grow from --token_warmup_min to all over these steps (< 1: a fraction "
                "of the run)")
      ->capture_default_str();
  auto* n = app.add_option_group("noise and loss (kohya's options)");
  n->add_option("--noise_offset", f.noise_offset, "a shift per sample and channel")
      ->capture_default_str();
  n->add_option("--adaptive_noise_scale", f.adaptive_noise_scale,
                "adds this times |mean of the latents| to --noise_offset")
      ->capture_default_str();
  n->add_option("--multires_noise_iterations", f.multires_noise_iterations,
                "pyramid noise levels (0: off)")
      ->capture_default_str();
  n->add_option("--multires_noise_discount", f.multires_noise_discount)->capture_default_str();
  n->add_option("--ip_noise_gamma", f.ip_noise_gamma,
                "input perturbation: the noisy input from noise + γ·ε'")
      ->capture_default_str();
  n->add_flag("--ip_noise_gamma_random_strength", f.ip_noise_gamma_random_strength,
              "γ times a uniform draw each step");
  n->add_option("--input_perturbation", f.input_perturbation,
                "diffusers' name for a fixed --ip_noise_gamma")
      ->capture_default_str();
  n->add_option("--loss_type", f.loss_type, "l2, l1, huber or smooth_l1")->capture_default_str();
  n->add_option("--huber_schedule", f.huber_schedule, "constant, exponential or snr")
      ->capture_default_str();
  n->add_option("--huber_c", f.huber_c)->capture_default_str();
  n->add_option("--huber_scale", f.huber_scale)->capture_default_str();
  n->add_flag("--debiased_estimation_loss", f.debiased_estimation_loss,
              "weight each sample by 1/√SNR (v-prediction: 1/(SNR + 1))");
  n->add_option("--v_pred_like_loss", f.v_pred_like_loss,
                "add the loss scaled as v-prediction's, times this")
      ->capture_default_str();
  n->add_flag("--scale_v_pred_loss_like_noise_pred", f.scale_v_pred_loss_like_noise_pred,
              "weight a v-prediction loss by SNR/(SNR + 1)");
}

/// The noise of a denoising step and the noise its noisy input is made from (input
/// perturbation), with kohya's offset, pyramid and perturbation.
struct StepNoise {
  at::Tensor noise, input_noise;
};

inline StepNoise step_noise(const at::Tensor& latents, const KohyaFlags& f) {
  const df::NoiseDraws draws = df::NoiseDraws::torch();
  at::Tensor noise = at::randn_like(latents);
  if (f.noise_offset > 0)
    noise = df::apply_noise_offset(
        latents, noise, f.noise_offset,
        f.adaptive_noise_scale != 0 ? std::optional<double>(f.adaptive_noise_scale) : std::nullopt,
        draws);
  if (f.multires_noise_iterations > 0)
    noise = df::pyramid_noise_like(noise, f.multires_noise_iterations, f.multires_noise_discount,
                                   draws);
  const double strength =
      f.ip_noise_gamma > 0
          ? df::ip_noise_strength(f.ip_noise_gamma, f.ip_noise_gamma_random_strength,
                                  latents.options().dtype(at::kFloat))
          : f.input_perturbation;
  return {noise, df::perturbed_noise(noise, strength, draws)};
}

/// kohya's loss of a denoising step per sample: the loss type (with its Huber threshold)
/// element-wise, the mean per sample, then min-SNR (γ > 0), the v-prediction scalings and
/// debiased estimation, in kohya's order; `masks` (B, H, W) in [0, 1], when given, weight the
/// element-wise loss first (kohya's apply_masked_loss). step_loss takes the mean over the batch.
inline at::Tensor step_loss_per_sample(const at::Tensor& pred, const at::Tensor& target,
                                       const at::Tensor& timesteps,
                                       const df::NoiseSchedule& schedule, df::Prediction prediction,
                                       double snr_gamma, const KohyaFlags& f,
                                       const at::Tensor& masks = {}) {
  const df::LossType type = df::loss_type_from(f.loss_type, "--loss_type");
  at::Tensor c;
  if (type == df::LossType::huber || type == df::LossType::smooth_l1)
    c = df::huber_threshold(df::huber_schedule_from(f.huber_schedule, "--huber_schedule"),
                            f.huber_c, f.huber_scale, timesteps, schedule)
            .to(pred.device());
  at::Tensor elementwise =
      df::conditional_loss(pred.to(at::kFloat), target.to(at::kFloat), type, c);
  if (masks.defined()) elementwise = df::masked_loss(elementwise, masks.to(elementwise.device()));
  at::Tensor loss = elementwise.mean({1, 2, 3});
  const bool weighted = snr_gamma > 0 || f.scale_v_pred_loss_like_noise_pred ||
                        f.v_pred_like_loss != 0 || f.debiased_estimation_loss;
  if (!weighted) return loss;
  const bool v = prediction == df::Prediction::v_prediction;
  const at::Tensor snr = schedule.snr(timesteps.cpu()).to(at::kFloat).to(loss.device());
  if (snr_gamma > 0) loss = loss * df::min_snr_weights(snr, snr_gamma, prediction);
  if (f.scale_v_pred_loss_like_noise_pred) loss = df::v_prediction_scaled_like_noise(loss, snr);
  if (f.v_pred_like_loss != 0) loss = df::v_prediction_like_loss(loss, snr, f.v_pred_like_loss);
  if (f.debiased_estimation_loss) loss = df::debiased_estimation(loss, snr, v);
  return loss;
}

inline at::Tensor step_loss(const at::Tensor& pred, const at::Tensor& target,
                            const at::Tensor& timesteps, const df::NoiseSchedule& schedule,
                            df::Prediction prediction, double snr_gamma, const KohyaFlags& f) {
  return step_loss_per_sample(pred, target, timesteps, schedule, prediction, snr_gamma, f).mean();
}

/// The captions of a micro-batch as kohya processes them: `place` (the micro-batch's place in
/// the run) seeds the draws, so a resumed run draws what the uninterrupted one drew.
inline std::vector<std::string> processed_captions(std::vector<std::string> captions,
                                                   const KohyaFlags& f, std::uint64_t seed,
                                                   std::int64_t place, std::int64_t epoch,
                                                   std::int64_t step,
                                                   std::int64_t max_train_steps) {
  if (!f.captions.any()) return captions;
  const auto draws = difftrain::data::CaptionDraws::seeded(seed * 0x9E3779B97F4A7C15ULL +
                                                           static_cast<std::uint64_t>(place));
  for (auto& c : captions)
    c = difftrain::data::process_caption(std::move(c), f.captions, epoch, step, max_train_steps,
                                         draws);
  return captions;
}

}  // namespace examples
