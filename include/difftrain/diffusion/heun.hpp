#pragma once
// Heun's second-order sampler (Karras et al. 2022, Algorithm 1; diffusers' HeunDiscreteScheduler):
// each of the n steps but the last takes an Euler step to σ_next, evaluates the model there, and
// redoes the step with the mean of the two slopes. The timesteps list has 2n − 1 entries, one per
// model evaluation; the σ schedule is Euler's (spacing, Karras σ).

#include <ATen/ATen.h>
#include <ATen/core/Generator.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "difftrain/diffusion/euler.hpp"
#include "difftrain/diffusion/sampler_common.hpp"

namespace difftrain::diffusion {

class Heun {
 public:
  struct Options {
    Prediction prediction_type = Prediction::epsilon;
    TimestepSpacing timestep_spacing = TimestepSpacing::linspace;
    std::int64_t steps_offset = 0;
    bool use_karras_sigmas = false;
    bool clip_sample = false;
    double clip_sample_range = 1.0;
  };
  static constexpr std::string_view name = "heun";

  Heun(const NoiseSchedule& schedule, const Options& o)
      : schedule_(&schedule), o_(o), table_(schedule) {
    if (!(o.clip_sample_range > 0))
      throw ConfigError("must be > 0", "Heun option clip_sample_range");
  }

  /// `n` steps: 2n − 1 model evaluations.
  void set_timesteps(std::int64_t n) {
    const EulerSchedule base =
        EulerSchedule::make(*schedule_, table_, n, o_.timestep_spacing, o_.steps_offset,
                            o_.use_karras_sigmas, FinalSigmas::zero, "Heun");
    sigmas_ = {base.sigmas.front()};
    for (std::size_t i = 1; i + 1 < base.sigmas.size(); ++i)
      sigmas_.insert(sigmas_.end(), 2, base.sigmas[i]);
    sigmas_.push_back(base.sigmas.back());
    timesteps_ = {base.timesteps.front()};
    for (std::size_t i = 1; i < base.timesteps.size(); ++i)
      timesteps_.insert(timesteps_.end(), 2, base.timesteps[i]);
    init_noise_sigma_ = base.init_noise_sigma(o_.timestep_spacing);
    step_index_ = 0;
    first_order_ = true;
  }
  [[nodiscard]] const std::vector<float>& timesteps() const noexcept { return timesteps_; }
  [[nodiscard]] const std::vector<float>& sigmas() const noexcept { return sigmas_; }
  [[nodiscard]] double init_noise_sigma() const { return init_noise_sigma_; }
  [[nodiscard]] at::Tensor scale_model_input(const at::Tensor& sample) const {
    return sigma_space_input(sample, sigma_at(step_index_));
  }

  [[nodiscard]] at::Tensor step(const at::Tensor& model_output, const at::Tensor& sample_in) {
    check_step_shapes(model_output, sample_in, "Heun::step");
    if (step_index_ >= timesteps_.size()) throw ConfigError("all steps were taken", "Heun::step");
    const float sigma = sigma_at(first_order_ ? step_index_ : step_index_ - 1);
    const float sigma_next = sigma_at(first_order_ ? step_index_ + 1 : step_index_);
    const float sigma_input = first_order_ ? sigma : sigma_next;
    at::Tensor x0 = sigma_space_x0(o_.prediction_type, model_output, sample_in, sigma_input);
    if (o_.clip_sample) x0 = x0.clamp(-o_.clip_sample_range, o_.clip_sample_range);
    at::Tensor prev;
    if (first_order_) {
      const at::Tensor derivative = (sample_in - x0) / sigma;
      dt_ = sigma_next - sigma;
      previous_derivative_ = derivative;
      sample_ = sample_in;
      prev = sample_in + derivative * dt_;
      // The last step has no second evaluation.
      first_order_ = step_index_ + 1 == timesteps_.size();
    } else {
      const at::Tensor derivative = ((sample_in - x0) / sigma_next + previous_derivative_) / 2;
      prev = sample_ + derivative * dt_;
      previous_derivative_ = at::Tensor();
      sample_ = at::Tensor();
      first_order_ = true;
    }
    ++step_index_;
    return prev;
  }

  /// The uniform sampling interface (see sample.hpp).
  [[nodiscard]] at::Tensor model_input(const at::Tensor& x) const { return scale_model_input(x); }
  [[nodiscard]] at::Tensor step_at(std::size_t i, const at::Tensor& out, const at::Tensor& x,
                                   std::optional<at::Generator> /*unused*/) {
    if (i != step_index_) throw ConfigError("steps must be taken in order", "Heun::step_at");
    return step(out, x);
  }

 private:
  [[nodiscard]] float sigma_at(std::size_t i) const {
    if (sigmas_.empty()) throw ConfigError("call set_timesteps() before sampling", "Heun");
    if (i >= sigmas_.size()) throw ConfigError("all steps were taken", "Heun::step");
    return sigmas_[i];
  }
  const NoiseSchedule* schedule_;
  Options o_;
  SigmaTable table_;
  std::vector<float> sigmas_;
  std::vector<float> timesteps_;
  double init_noise_sigma_ = 1.0;
  at::Tensor previous_derivative_;
  at::Tensor sample_;
  float dt_ = 0;
  std::size_t step_index_ = 0;
  bool first_order_ = true;
};

}  // namespace difftrain::diffusion
