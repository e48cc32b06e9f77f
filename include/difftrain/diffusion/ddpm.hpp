#pragma once
// DDPM ancestral sampling (diffusers' DDPMScheduler, fixed variances).

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
  /// diffusers' fixed variances. (Its fixed_large_log takes the square root of a log, which is NaN;
  /// it is left out.)
  enum class Variance { fixed_small, fixed_small_log, fixed_large };
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
    check_step_shapes(model_output, sample, "Ddpm::step");
    const std::int64_t prev_t = previous(t);
    const double a_t = schedule_->alpha_cumprod(t);
    const double a_prev = prev_t >= 0 ? schedule_->alpha_cumprod(prev_t) : 1.0;
    const double beta_t = 1 - a_t;
    const double beta_prev = 1 - a_prev;
    const double cur_alpha = a_t / a_prev;
    const double cur_beta = 1 - cur_alpha;
    at::Tensor x0 =
        clip_x0(split_prediction(o_.prediction_type, model_output, sample, a_t).first, o_.clipping);
    const double c_x0 = std::pow(a_prev, 0.5) * cur_beta / beta_t;
    const double c_xt = std::pow(cur_alpha, 0.5) * beta_prev / beta_t;
    at::Tensor prev = c_x0 * x0 + c_xt * sample;
    if (t > 0) {
      const at::Tensor z =
          noise ? *noise : at::randn(model_output.sizes(), generator, model_output.options());
      if (z.sizes() != sample.sizes())
        throw ShapeError("noise has shape " + c10::str(z.sizes()), "Ddpm::step noise");
      double variance = std::max((1 - a_prev) / (1 - a_t) * cur_beta, 1e-20);
      switch (o_.variance_type) {
        case Variance::fixed_small:
          variance = std::pow(variance, 0.5);
          break;
        case Variance::fixed_small_log:
          variance = std::exp(0.5 * std::log(variance));
          break;
        case Variance::fixed_large:
          variance = std::pow(cur_beta, 0.5);
          break;
      }
      prev = prev + variance * z;
    }
    return prev;
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
  const NoiseSchedule* schedule_;
  Options o_;
  std::vector<std::int64_t> timesteps_;
};

}  // namespace difftrain::diffusion
