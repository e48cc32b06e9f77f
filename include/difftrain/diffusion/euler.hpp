#pragma once
// Euler sampling in σ space (Karras et al. 2022; diffusers' EulerDiscreteScheduler without churn):
// σ_t = √((1 − ᾱ_t)/ᾱ_t), the model sees x / √(σ² + 1), and x moves along (x − x̂₀)/σ. Optional
// Karras σ spacing (ρ = 7).

#include <ATen/ATen.h>
#include <ATen/core/Generator.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "difftrain/diffusion/sampler_common.hpp"

namespace difftrain::diffusion {

class Euler {
 public:
  struct Options {
    Prediction prediction_type = Prediction::epsilon;
    TimestepSpacing timestep_spacing = TimestepSpacing::linspace;
    std::int64_t steps_offset = 0;
    bool use_karras_sigmas = false;
  };
  static constexpr std::string_view name = "euler";

  Euler(const NoiseSchedule& schedule, const Options& o)
      : schedule_(&schedule), o_(o), table_(schedule) {}

  void set_timesteps(std::int64_t n) {
    const std::int64_t N = schedule_->num_train_timesteps();
    if (n <= 0 || n > N)
      throw ConfigError("must be in [1, " + std::to_string(N) + "], got " + std::to_string(n),
                        "Euler num_inference_steps");
    std::vector<double> t;
    if (o_.timestep_spacing == TimestepSpacing::linspace) {
      for (std::int64_t i = n - 1; i >= 0; --i)  // np.linspace(0, N-1, n, dtype=float32)
        t.push_back(static_cast<double>(
            static_cast<float>(n == 1 ? 0.0
                                      : static_cast<double>(i) * static_cast<double>(N - 1) /
                                            static_cast<double>(n - 1))));
    } else {
      for (std::int64_t v : spaced_timesteps(N, n, o_.timestep_spacing, o_.steps_offset))
        t.push_back(static_cast<double>(v));
    }
    std::vector<double> sigmas;
    for (double ti : t) sigmas.push_back(table_.interp(ti));
    if (o_.use_karras_sigmas) {
      sigmas = SigmaTable::karras(sigmas.front(), sigmas.back(), n);
      t.clear();
      for (double s : sigmas) t.push_back(table_.sigma_to_t(s));
    }
    sigmas_.clear();
    timesteps_.clear();
    for (double s : sigmas) sigmas_.push_back(static_cast<float>(s));
    for (double v : t) timesteps_.push_back(static_cast<float>(v));
    sigmas_.push_back(0.0F);
    step_index_ = 0;
  }

  [[nodiscard]] const std::vector<float>& timesteps() const noexcept { return timesteps_; }
  [[nodiscard]] const std::vector<float>& sigmas() const noexcept { return sigmas_; }
  /// The standard deviation of the starting noise.
  [[nodiscard]] double init_noise_sigma() const {
    const double m = *std::max_element(sigmas_.begin(), sigmas_.end());
    return (o_.timestep_spacing == TimestepSpacing::linspace ||
            o_.timestep_spacing == TimestepSpacing::trailing)
               ? m
               : std::sqrt(m * m + 1);
  }
  /// x / √(σ² + 1) at the current step: what the model sees.
  [[nodiscard]] at::Tensor scale_model_input(const at::Tensor& sample) const {
    const float s = current_sigma();
    return sample / std::pow(s * s + 1.0F, 0.5F);
  }

  [[nodiscard]] at::Tensor step(const at::Tensor& model_output, const at::Tensor& sample_in) {
    check_step_shapes(model_output, sample_in, "Euler::step");
    const float sigma = current_sigma();
    const at::Tensor sample = sample_in.to(at::kFloat);
    at::Tensor x0;
    switch (o_.prediction_type) {
      case Prediction::sample:
        x0 = model_output;
        break;
      case Prediction::epsilon:
        x0 = sample - sigma * model_output;
        break;
      case Prediction::v_prediction:
        x0 = model_output * (-sigma / std::pow(sigma * sigma + 1.0F, 0.5F)) +
             (sample / (sigma * sigma + 1.0F));
        break;
    }
    const at::Tensor derivative = (sample - x0) / sigma;
    const float dt = sigmas_[step_index_ + 1] - sigma;
    ++step_index_;
    return (sample + derivative * dt).to(model_output.scalar_type());
  }

  /// The uniform sampling interface (see sample.hpp).
  [[nodiscard]] at::Tensor model_input(const at::Tensor& x) const { return scale_model_input(x); }
  [[nodiscard]] at::Tensor step_at(std::size_t i, const at::Tensor& out, const at::Tensor& x,
                                   std::optional<at::Generator> /*unused*/) {
    if (i != step_index_) throw ConfigError("steps must be taken in order", "Euler::step_at");
    return step(out, x);
  }

 private:
  [[nodiscard]] float current_sigma() const {
    if (sigmas_.empty()) throw ConfigError("call set_timesteps() before sampling", "Euler");
    if (step_index_ + 1 >= sigmas_.size()) throw ConfigError("all steps were taken", "Euler::step");
    return sigmas_[step_index_];
  }
  const NoiseSchedule* schedule_;
  Options o_;
  SigmaTable table_;
  std::vector<float> sigmas_;
  std::vector<float> timesteps_;
  std::size_t step_index_ = 0;
};

}  // namespace difftrain::diffusion
