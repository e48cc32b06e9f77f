#pragma once
// DDPM ancestral sampling (diffusers' DDPMScheduler): fixed variances, or a variance the model
// predicts in the second half of its channels (learned, learned_range: improved DDPM).

#include <ATen/ATen.h>
#include <ATen/core/Generator.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "difftrain/diffusion/sampler_common.hpp"

namespace difftrain::diffusion {

class Ddpm {
 public:
  /// diffusers' variances. (Its fixed_large_log takes the square root of a log, which is NaN; it is
  /// left out.) `learned`: the model's extra channels are the variance; `learned_range`: they
  /// interpolate, in [-1, 1], between the log of fixed_small and of fixed_large.
  enum class Variance { fixed_small, fixed_small_log, fixed_large, learned, learned_range };
  struct Options {
    Prediction prediction_type = Prediction::epsilon;
    Variance variance_type = Variance::fixed_small;
    Clipping clipping = {};
    TimestepSpacing timestep_spacing = TimestepSpacing::leading;
    std::int64_t steps_offset = 0;
  };
  static constexpr std::string_view name = "ddpm";

  Ddpm(const NoiseSchedule& schedule, const Options& o) : schedule_(&schedule), o_(o) {
    timesteps_.resize(static_cast<std::size_t>(schedule.num_train_timesteps()));
    for (std::size_t i = 0; i < timesteps_.size(); ++i)
      timesteps_[i] = static_cast<std::int64_t>(timesteps_.size() - 1 - i);
  }

  void set_timesteps(std::int64_t n) {
    timesteps_ =
        spaced_timesteps(schedule_->num_train_timesteps(), n, o_.timestep_spacing, o_.steps_offset);
  }
  [[nodiscard]] const std::vector<std::int64_t>& timesteps() const noexcept { return timesteps_; }

  /// x_{t_prev} from x_t and the model output at t. `noise` (same shape) is the variance noise;
  /// when absent it is drawn from `generator` (or the default one).
  [[nodiscard]] at::Tensor step(const at::Tensor& model_output, std::int64_t t,
                                const at::Tensor& sample,
                                std::optional<at::Generator> generator = std::nullopt,
                                const std::optional<at::Tensor>& noise = std::nullopt) const {
    const bool learned =
        o_.variance_type == Variance::learned || o_.variance_type == Variance::learned_range;
    at::Tensor out = model_output;
    at::Tensor predicted_variance;
    if (learned) {
      if (model_output.dim() < 2 || sample.dim() < 2 || model_output.size(1) != 2 * sample.size(1))
        throw ShapeError(
            "a learned variance needs twice the sample's channels (" +
                std::string(sample.dim() < 2 ? "?" : std::to_string(2 * sample.size(1))) +
                "), the model output has shape " + c10::str(model_output.sizes()),
            "Ddpm::step");
      const auto halves = model_output.split(sample.size(1), 1);
      out = halves[0];
      predicted_variance = halves[1];
    }
    check_step_shapes(out, sample, "Ddpm::step");
    if (schedule_->options().precision == Precision::float32)
      return step_in<float>(out, predicted_variance, t, sample, std::move(generator), noise);
    return step_in<double>(out, predicted_variance, t, sample, std::move(generator), noise);
  }

  /// The uniform sampling interface (see sample.hpp).
  [[nodiscard]] at::Tensor model_input(const at::Tensor& x) const { return x; }
  [[nodiscard]] at::Tensor step_at(std::size_t i, const at::Tensor& out, const at::Tensor& x,
                                   std::optional<at::Generator> gen) {
    return step(out, timesteps_.at(i), x, std::move(gen));
  }

  [[nodiscard]] std::int64_t previous(std::int64_t t) const {
    for (std::size_t i = 0; i < timesteps_.size(); ++i)
      if (timesteps_[i] == t) return i + 1 < timesteps_.size() ? timesteps_[i + 1] : -1;
    throw ConfigError("timestep " + std::to_string(t) + " is not one of this sampler's timesteps",
                      "Ddpm::step");
  }

 private:
  /// The step with its scalars in T (float for a float32 schedule, as diffusers computes them).
  template <class T>
  [[nodiscard]] at::Tensor step_in(const at::Tensor& out, const at::Tensor& predicted_variance,
                                   std::int64_t t, const at::Tensor& sample,
                                   std::optional<at::Generator> generator,
                                   const std::optional<at::Tensor>& noise) const {
    const std::int64_t prev_t = previous(t);
    const auto a_t = static_cast<T>(schedule_->alpha_cumprod(t));
    const auto a_prev = prev_t >= 0 ? static_cast<T>(schedule_->alpha_cumprod(prev_t)) : T(1);
    const T beta_t = T(1) - a_t;
    const T beta_prev = T(1) - a_prev;
    const T cur_alpha = a_t / a_prev;
    const T cur_beta = T(1) - cur_alpha;
    at::Tensor x0 =
        clip_x0(split_prediction<T>(o_.prediction_type, out, sample, a_t).first, o_.clipping);
    const T c_x0 = (std::sqrt(a_prev) * cur_beta) / beta_t;
    const T c_xt = std::sqrt(cur_alpha) * beta_prev / beta_t;
    at::Tensor prev = static_cast<double>(c_x0) * x0 + static_cast<double>(c_xt) * sample;
    if (t <= 0) return prev;
    const at::Tensor z = noise ? *noise : at::randn(out.sizes(), generator, out.options());
    if (z.sizes() != sample.sizes())
      throw ShapeError("noise has shape " + c10::str(z.sizes()), "Ddpm::step noise");
    const T variance = std::max((T(1) - a_prev) / (T(1) - a_t) * cur_beta, static_cast<T>(1e-20));
    double scale = 0;
    switch (o_.variance_type) {
      case Variance::fixed_small:
        scale = static_cast<double>(std::sqrt(variance));
        break;
      case Variance::fixed_small_log:
        scale = static_cast<double>(std::exp(T(0.5) * std::log(variance)));
        break;
      case Variance::fixed_large:
        scale = static_cast<double>(std::sqrt(cur_beta));
        break;
      case Variance::learned:
        return prev + predicted_variance.pow(0.5) * z;
      case Variance::learned_range: {
        const at::Tensor frac = (predicted_variance + 1) / 2;
        const at::Tensor log_variance = frac * static_cast<double>(std::log(cur_beta)) +
                                        (1 - frac) * static_cast<double>(std::log(variance));
        return prev + at::exp(0.5 * log_variance) * z;
      }
    }
    return prev + scale * z;
  }

  const NoiseSchedule* schedule_;
  Options o_;
  std::vector<std::int64_t> timesteps_;
};

}  // namespace difftrain::diffusion
