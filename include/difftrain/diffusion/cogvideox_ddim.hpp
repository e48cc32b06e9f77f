#pragma once
// CogVideoX's DDIM (diffusers' CogVideoXDDIMScheduler): deterministic DDIM on a schedule with
// CogVideoX's SNR shift (NoiseSchedule::Options::snr_shift_scale), written as CogVideoX writes it,
//   x_prev = a·x + b·x̂₀,  a = √((1 − ᾱ_prev)/(1 − ᾱ_t)),  b = √ᾱ_prev − √ᾱ_t·a,
// which stays finite at a zero-terminal-SNR first step (ᾱ_t = 0 with v-prediction, CogVideoX's
// setting). Like diffusers', it never clips x̂₀ (its clip_sample is read and ignored there) and
// has no η.

#include <ATen/ATen.h>
#include <ATen/core/Generator.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "difftrain/diffusion/noise_schedule.hpp"
#include "difftrain/diffusion/sampler_common.hpp"

namespace difftrain::diffusion {

class CogVideoXDdim {
 public:
  struct Options {
    Prediction prediction_type = Prediction::epsilon;  // CogVideoX's configs: v_prediction
    bool set_alpha_to_one = true;
    std::int64_t steps_offset = 0;
    TimestepSpacing timestep_spacing = TimestepSpacing::leading;  // CogVideoX's: trailing
  };
  static constexpr std::string_view name = "cogvideox_ddim";

  CogVideoXDdim(const NoiseSchedule& schedule, const Options& o) : schedule_(&schedule), o_(o) {}

  void set_timesteps(std::int64_t n) {
    timesteps_ =
        spaced_timesteps(schedule_->num_train_timesteps(), n, o_.timestep_spacing, o_.steps_offset);
    num_inference_steps_ = n;
  }
  [[nodiscard]] const std::vector<std::int64_t>& timesteps() const noexcept { return timesteps_; }

  /// x̂₀ of a model output at timestep t, as the step computes it.
  [[nodiscard]] at::Tensor predicted_original(const at::Tensor& model_output, std::int64_t t,
                                              const at::Tensor& sample) const {
    const double a_t = schedule_->alpha_cumprod(t);
    const double beta_t = 1 - a_t;
    switch (o_.prediction_type) {
      case Prediction::epsilon:
        return (sample - std::pow(beta_t, 0.5) * model_output) / std::pow(a_t, 0.5);
      case Prediction::sample:
        return model_output;
      case Prediction::v_prediction:
        return std::pow(a_t, 0.5) * sample - std::pow(beta_t, 0.5) * model_output;
    }
    return model_output;
  }

  [[nodiscard]] at::Tensor step(const at::Tensor& model_output, std::int64_t t,
                                const at::Tensor& sample) const {
    if (num_inference_steps_ == 0)
      throw ConfigError("call set_timesteps() before step()", "CogVideoXDdim::step");
    check_step_shapes(model_output, sample, "CogVideoXDdim::step");
    const std::int64_t prev_t = t - schedule_->num_train_timesteps() / num_inference_steps_;
    const double a_t = schedule_->alpha_cumprod(t);
    const double a_prev = prev_t >= 0 ? schedule_->alpha_cumprod(prev_t) : final_alpha();
    const at::Tensor x0 = predicted_original(model_output, t, sample);
    const double a = std::pow((1 - a_prev) / (1 - a_t), 0.5);
    const double b = std::pow(a_prev, 0.5) - std::pow(a_t, 0.5) * a;
    return a * sample + b * x0;
  }

  /// The uniform sampling interface (see sample.hpp).
  [[nodiscard]] at::Tensor model_input(const at::Tensor& x) const { return x; }
  [[nodiscard]] at::Tensor step_at(std::size_t i, const at::Tensor& out, const at::Tensor& x,
                                   std::optional<at::Generator> /*deterministic*/) {
    return step(out, timesteps_.at(i), x);
  }

 private:
  [[nodiscard]] double final_alpha() const {
    return o_.set_alpha_to_one ? 1.0 : schedule_->alpha_cumprod(0);
  }

  const NoiseSchedule* schedule_;
  Options o_;
  std::vector<std::int64_t> timesteps_;
  std::int64_t num_inference_steps_ = 0;
};

}  // namespace difftrain::diffusion
