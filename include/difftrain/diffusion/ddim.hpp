#pragma once
// DDIM (diffusers' DDIMScheduler): deterministic at eta = 0, DDPM-like at eta = 1.

#include <ATen/ATen.h>
#include <ATen/core/Generator.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "difftrain/diffusion/sampler_common.hpp"

namespace difftrain::diffusion {

class Ddim {
 public:
  struct Options {
    Prediction prediction_type = Prediction::epsilon;
    Clipping clipping = {};
    bool set_alpha_to_one = true;
    std::int64_t steps_offset = 0;
    TimestepSpacing timestep_spacing = TimestepSpacing::leading;
    double eta = 0.0;
    bool use_clipped_model_output = false;
  };
  static constexpr std::string_view name = "ddim";

  Ddim(const NoiseSchedule& schedule, const Options& o) : schedule_(&schedule), o_(o) {
    if (o.eta < 0) throw ConfigError("must be >= 0", "ddim option eta");
  }

  void set_timesteps(std::int64_t n) {
    timesteps_ =
        spaced_timesteps(schedule_->num_train_timesteps(), n, o_.timestep_spacing, o_.steps_offset);
    num_inference_steps_ = n;
  }
  [[nodiscard]] const std::vector<std::int64_t>& timesteps() const noexcept { return timesteps_; }

  [[nodiscard]] at::Tensor step(const at::Tensor& model_output, std::int64_t t,
                                const at::Tensor& sample,
                                std::optional<at::Generator> generator = std::nullopt,
                                const std::optional<at::Tensor>& noise = std::nullopt) const {
    if (num_inference_steps_ == 0)
      throw ConfigError("call set_timesteps() before step()", "Ddim::step");
    check_step_shapes(model_output, sample, "Ddim::step");
    if (schedule_->options().precision == Precision::float32)
      return step_in<float>(model_output, t, sample, std::move(generator), noise);
    return step_in<double>(model_output, t, sample, std::move(generator), noise);
  }

  /// The uniform sampling interface (see sample.hpp).
  [[nodiscard]] at::Tensor model_input(const at::Tensor& x) const { return x; }
  [[nodiscard]] at::Tensor step_at(std::size_t i, const at::Tensor& out, const at::Tensor& x,
                                   std::optional<at::Generator> gen) {
    return step(out, timesteps_.at(i), x, std::move(gen));
  }

 private:
  /// The step with its scalars in T (float for a float32 schedule, as diffusers computes them).
  template <class T>
  [[nodiscard]] at::Tensor step_in(const at::Tensor& model_output, std::int64_t t,
                                   const at::Tensor& sample, std::optional<at::Generator> generator,
                                   const std::optional<at::Tensor>& noise) const {
    const std::int64_t prev_t = t - schedule_->num_train_timesteps() / num_inference_steps_;
    const auto a_t = static_cast<T>(schedule_->alpha_cumprod(t));
    const auto final_alpha =
        o_.set_alpha_to_one ? T(1) : static_cast<T>(schedule_->alpha_cumprod(0));
    const T a_prev = prev_t >= 0 ? static_cast<T>(schedule_->alpha_cumprod(prev_t)) : final_alpha;
    const T beta_t = T(1) - a_t;
    auto [x0, eps] = split_prediction<T>(o_.prediction_type, model_output, sample, a_t);
    x0 = clip_x0(x0, o_.clipping);
    const T variance = ((T(1) - a_prev) / beta_t) * (T(1) - a_t / a_prev);
    const T std_dev = static_cast<T>(o_.eta) * std::sqrt(variance);
    if (o_.use_clipped_model_output)
      eps = (sample - static_cast<double>(std::sqrt(a_t)) * x0) /
            static_cast<double>(std::sqrt(beta_t));
    // √ᾱ_prev·x̂₀ + √(1 − ᾱ_prev − σ²)·ε̂, fused: x̂₀ is a temporary of ours, scaled in place.
    at::Tensor prev =
        (x0.is_same(model_output) ? x0.clone() : x0)
            .mul_(static_cast<double>(std::sqrt(a_prev)))
            .add_(eps, static_cast<double>(std::sqrt(T(1) - a_prev - std_dev * std_dev)));
    if (o_.eta > 0) {
      const at::Tensor z =
          noise ? *noise : at::randn(model_output.sizes(), generator, model_output.options());
      if (z.sizes() != sample.sizes())
        throw ShapeError("noise has shape " + c10::str(z.sizes()), "Ddim::step noise");
      prev = prev + static_cast<double>(std_dev) * z;
    }
    return prev;
  }

  const NoiseSchedule* schedule_;
  Options o_;
  std::vector<std::int64_t> timesteps_;
  std::int64_t num_inference_steps_ = 0;
};

}  // namespace difftrain::diffusion
