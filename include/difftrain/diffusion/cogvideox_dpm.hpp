#pragma once
// CogVideoX's DPM sampler (diffusers' CogVideoXDPMScheduler): a stochastic second-order
// DPM-Solver++ step in log-SNR λ = log √(ᾱ/(1 − ᾱ)). With h = λ_prev − λ_t,
//   x_prev = √((1 − ᾱ_prev)/(1 − ᾱ_t))·e^(−h)·x − (e^(−2h) − 1)·√ᾱ_prev·D + √(1 − ᾱ_prev)·√(1 −
//   e^(−2h))·z
// where D is x̂₀ on the first and the last step and, in between, the extrapolation
// (1 + 1/(2r))·x̂₀ − 1/(2r)·x̂₀_last with r = h_last / h from the previous step's λ. Every step
// draws z from the generator, and a second-order step draws twice (the first draw is discarded,
// as diffusers discards it), so one seed gives diffusers' samples. Infinite λ at a zero-SNR first
// step or at the final ᾱ = 1 resolve to the limits diffusers' IEEE arithmetic gives.

#include <ATen/ATen.h>
#include <ATen/core/Generator.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "difftrain/diffusion/cogvideox_ddim.hpp"
#include "difftrain/diffusion/noise_schedule.hpp"
#include "difftrain/diffusion/sampler_common.hpp"

namespace difftrain::diffusion {

class CogVideoXDpm : public cogvideox_detail::Steps {
 public:
  static constexpr std::string_view name = "cogvideox_dpm";
  using Steps::Steps;

  /// Sets the timesteps and forgets the previous run's x̂₀.
  void set_timesteps(std::int64_t n) {
    Steps::set_timesteps(n);
    last_x0_ = at::Tensor();
  }

  /// One step from timestep t; `t_back` is the previous step's timestep (none on the first step)
  /// and `last_x0` the previous step's x̂₀. Returns (x_prev, this step's x̂₀), as diffusers does.
  [[nodiscard]] std::pair<at::Tensor, at::Tensor> step(
      const at::Tensor& model_output, const at::Tensor& last_x0, std::int64_t t,
      std::optional<std::int64_t> t_back, const at::Tensor& sample,
      std::optional<at::Generator> generator = std::nullopt) const {
    const std::int64_t prev_t = prev_timestep(t, "CogVideoXDpm::step");
    check_step_shapes(model_output, sample, "CogVideoXDpm::step");
    if (last_x0.defined()) check_step_shapes(last_x0, sample, "CogVideoXDpm::step (last x0)");
    const double a_t = schedule_->alpha_cumprod(t);
    const double a_prev = alpha_prev(prev_t);
    const at::Tensor x0 = x0_of(model_output, a_t, sample);
    auto lambda = [](double a) { return std::log(std::pow(a / (1 - a), 0.5)); };
    const double lam = lambda(a_t);
    const double h = lambda(a_prev) - lam;
    const double mult1 = std::pow((1 - a_prev) / (1 - a_t), 0.5) * std::exp(-h);
    const double mult2 = std::expm1(-2 * h) * std::pow(a_prev, 0.5);
    const double mult_noise = std::pow(1 - a_prev, 0.5) * std::pow(1 - std::exp(-2 * h), 0.5);
    at::Tensor noise = at::randn(sample.sizes(), generator, sample.options());
    if (!last_x0.defined() || prev_t < 0)
      return {mult1 * sample - mult2 * x0 + mult_noise * noise, x0};
    const std::int64_t back = t_back.value_or(-1);
    if (back < 0)
      throw ConfigError("a second-order step (a last x0 given) needs the previous timestep",
                        "CogVideoXDpm::step");
    const double a_back = schedule_->alpha_cumprod(back);
    const double r = (lam - lambda(a_back)) / h;
    const double mult3 = 1 + 1 / (2 * r);
    const double mult4 = 1 / (2 * r);
    const at::Tensor d = mult3 * x0 - mult4 * last_x0;
    noise = at::randn(sample.sizes(), generator, sample.options());
    return {mult1 * sample - mult2 * d + mult_noise * noise, x0};
  }

  /// The uniform sampling interface (see sample.hpp): keeps x̂₀ between steps.
  [[nodiscard]] at::Tensor step_at(std::size_t i, const at::Tensor& out, const at::Tensor& x,
                                   std::optional<at::Generator> generator) {
    if (i == 0) last_x0_ = at::Tensor();
    std::optional<std::int64_t> back;
    if (i > 0) back = timesteps_.at(i - 1);
    auto [prev, x0] = step(out, last_x0_, timesteps_.at(i), back, x, std::move(generator));
    last_x0_ = x0;
    return prev;
  }

 private:
  at::Tensor last_x0_;
};

}  // namespace difftrain::diffusion
