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

/// What CogVideoX's DDIM and DPM samplers are configured with (their schedulers' fields).
struct CogVideoXSamplerOptions {
  Prediction prediction_type = Prediction::epsilon;  // CogVideoX's configs: v_prediction
  bool set_alpha_to_one = true;
  std::int64_t steps_offset = 0;
  TimestepSpacing timestep_spacing = TimestepSpacing::leading;  // CogVideoX's: trailing
};

namespace cogvideox_detail {
/// The timesteps and ᾱ lookups both CogVideoX samplers share.
class Steps {
 public:
  using Options = CogVideoXSamplerOptions;
  Steps(const NoiseSchedule& schedule, const Options& o) : schedule_(&schedule), o_(o) {}

  void set_timesteps(std::int64_t n) {
    timesteps_ =
        spaced_timesteps(schedule_->num_train_timesteps(), n, o_.timestep_spacing, o_.steps_offset);
    num_inference_steps_ = n;
  }
  [[nodiscard]] const std::vector<std::int64_t>& timesteps() const noexcept { return timesteps_; }
  [[nodiscard]] at::Tensor model_input(const at::Tensor& x) const { return x; }

 protected:
  /// The timestep a step from t lands on (negative past the last).
  [[nodiscard]] std::int64_t prev_timestep(std::int64_t t, const char* who) const {
    if (num_inference_steps_ == 0) throw ConfigError("call set_timesteps() before step()", who);
    return t - schedule_->num_train_timesteps() / num_inference_steps_;
  }
  /// ᾱ at prev_t, or the final ᾱ (1 with set_alpha_to_one, else ᾱ₀) past the last step.
  [[nodiscard]] double alpha_prev(std::int64_t prev_t) const {
    if (prev_t >= 0) return schedule_->alpha_cumprod(prev_t);
    return o_.set_alpha_to_one ? 1.0 : schedule_->alpha_cumprod(0);
  }
  [[nodiscard]] at::Tensor x0_of(const at::Tensor& model_output, double a_t,
                                 const at::Tensor& sample) const {
    return predicted_x0<double>(o_.prediction_type, model_output, sample, a_t);
  }

  const NoiseSchedule* schedule_;
  Options o_;
  std::vector<std::int64_t> timesteps_;
  std::int64_t num_inference_steps_ = 0;
};
}  // namespace cogvideox_detail

class CogVideoXDdim : public cogvideox_detail::Steps {
 public:
  static constexpr std::string_view name = "cogvideox_ddim";
  using Steps::Steps;

  /// x̂₀ of a model output at timestep t, as the step computes it.
  [[nodiscard]] at::Tensor predicted_original(const at::Tensor& model_output, std::int64_t t,
                                              const at::Tensor& sample) const {
    return x0_of(model_output, schedule_->alpha_cumprod(t), sample);
  }

  [[nodiscard]] at::Tensor step(const at::Tensor& model_output, std::int64_t t,
                                const at::Tensor& sample) const {
    const std::int64_t prev_t = prev_timestep(t, "CogVideoXDdim::step");
    check_step_shapes(model_output, sample, "CogVideoXDdim::step");
    const double a_t = schedule_->alpha_cumprod(t);
    const double a_prev = alpha_prev(prev_t);
    const at::Tensor x0 = x0_of(model_output, a_t, sample);
    const double a = std::pow((1 - a_prev) / (1 - a_t), 0.5);
    const double b = std::pow(a_prev, 0.5) - std::pow(a_t, 0.5) * a;
    return a * sample + b * x0;
  }

  /// The uniform sampling interface (see sample.hpp).
  [[nodiscard]] at::Tensor step_at(std::size_t i, const at::Tensor& out, const at::Tensor& x,
                                   std::optional<at::Generator> /*deterministic*/) {
    return step(out, timesteps_.at(i), x);
  }
};

/// CogVideoX pipelines' use_dynamic_cfg: the guidance scale at timestep t of a run of
/// num_inference_steps steps, 1 + s·(1 − cos(π·((N − t) / N)^5)) / 2. The pipelines put the
/// timestep itself (not the step's index) in the formula; so does this, so samples match theirs.
inline double cogvideox_dynamic_guidance(double guidance_scale, std::int64_t num_inference_steps,
                                         std::int64_t t) {
  const double n = static_cast<double>(num_inference_steps);
  const double pi = 3.14159265358979323846;
  return 1 + guidance_scale *
                 ((1 - std::cos(pi * std::pow((n - static_cast<double>(t)) / n, 5.0))) / 2);
}

}  // namespace difftrain::diffusion
