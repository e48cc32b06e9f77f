#pragma once
// Euler sampling in σ space (Karras et al. 2022; diffusers' EulerDiscreteScheduler): σ_t =
// √((1 − ᾱ_t)/ᾱ_t), the model sees x / √(σ² + 1), and x moves along (x − x̂₀)/σ. Optional Karras σ
// spacing (ρ = 7), a final σ of 0 or σ_min, and the churn of Karras et al.'s Algorithm 2
// (s_churn, s_tmin, s_tmax, s_noise): noise raises σ to σ̂ = σ(1 + γ) before the step.

#include <ATen/ATen.h>
#include <ATen/core/Generator.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "difftrain/diffusion/sampler_common.hpp"

namespace difftrain::diffusion {

enum class FinalSigmas { zero, sigma_min };

/// The σ schedule of diffusers' Euler-family samplers: timesteps by spacing (float32), σ by
/// interpolation in the training table, optionally Karras-spaced, then the final σ.
struct EulerSchedule {
  std::vector<float> timesteps;
  std::vector<float> sigmas;  ///< one more than timesteps: the last is the final σ

  static EulerSchedule make(const NoiseSchedule& schedule, const SigmaTable& table, std::int64_t n,
                            TimestepSpacing spacing, std::int64_t steps_offset, bool karras,
                            FinalSigmas final_sigmas, const char* who) {
    const std::int64_t N = schedule.num_train_timesteps();
    if (n <= 0 || n > N)
      throw ConfigError("must be in [1, " + std::to_string(N) + "], got " + std::to_string(n),
                        std::string(who) + " num_inference_steps");
    std::vector<double> t;
    if (spacing == TimestepSpacing::linspace) {
      for (std::int64_t i = n - 1; i >= 0; --i)  // np.linspace(0, N-1, n, dtype=float32)
        t.push_back(static_cast<float>(numpy::linspace(0, static_cast<double>(N - 1), n, i)));
    } else {
      for (std::int64_t v : spaced_timesteps(N, n, spacing, steps_offset))
        t.push_back(static_cast<double>(v));
    }
    std::vector<double> sigmas;
    for (double ti : t) sigmas.push_back(table.interp(ti));
    if (karras) {
      sigmas = SigmaTable::karras(sigmas.front(), sigmas.back(), n);
      t.clear();
      for (double s : sigmas) t.push_back(table.sigma_to_t(s));
    }
    EulerSchedule out;
    for (double s : sigmas) out.sigmas.push_back(static_cast<float>(s));
    for (double v : t) out.timesteps.push_back(static_cast<float>(v));
    out.sigmas.push_back(final_sigmas == FinalSigmas::zero ? 0.0F : table.sigmas().front());
    return out;
  }

  /// The standard deviation of the starting noise.
  [[nodiscard]] double init_noise_sigma(TimestepSpacing spacing) const {
    const double m = *std::max_element(sigmas.begin(), sigmas.end());
    return (spacing == TimestepSpacing::linspace || spacing == TimestepSpacing::trailing)
               ? m
               : static_cast<double>(
                     std::sqrt(static_cast<float>(m) * static_cast<float>(m) + 1.0F));
  }
};

/// x / √(σ² + 1): what a σ-space model sees at σ.
inline at::Tensor sigma_space_input(const at::Tensor& sample, float sigma) {
  return sample / std::sqrt(sigma * sigma + 1.0F);
}

/// x̂₀ from a σ-space model output at σ, as diffusers' Euler-family samplers compute it.
inline at::Tensor sigma_space_x0(Prediction p, const at::Tensor& out, const at::Tensor& sample,
                                 float sigma) {
  switch (p) {
    case Prediction::epsilon:
      return sample - sigma * out;
    case Prediction::v_prediction:
      return out * (-sigma / std::sqrt(sigma * sigma + 1.0F)) + (sample / (sigma * sigma + 1.0F));
    case Prediction::sample:
      return out;
  }
  return out;
}

class Euler {
 public:
  struct Options {
    Prediction prediction_type = Prediction::epsilon;
    TimestepSpacing timestep_spacing = TimestepSpacing::linspace;
    std::int64_t steps_offset = 0;
    bool use_karras_sigmas = false;
    FinalSigmas final_sigmas_type = FinalSigmas::zero;
    double s_churn =
        0.0;  ///< churn per step is min(s_churn / steps, √2 − 1) within [s_tmin, s_tmax]
    double s_tmin = 0.0;
    double s_tmax = std::numeric_limits<double>::infinity();
    double s_noise = 1.0;
  };
  static constexpr std::string_view name = "euler";

  Euler(const NoiseSchedule& schedule, const Options& o)
      : schedule_(&schedule), o_(o), table_(schedule) {
    if (!(o.s_churn >= 0) || !std::isfinite(o.s_churn))
      throw ConfigError("must be a finite number >= 0", "Euler option s_churn");
    if (!(o.s_tmin <= o.s_tmax)) throw ConfigError("must not exceed s_tmax", "Euler option s_tmin");
    if (!std::isfinite(o.s_noise)) throw ConfigError("must be finite", "Euler option s_noise");
  }

  void set_timesteps(std::int64_t n) {
    s_ = EulerSchedule::make(*schedule_, table_, n, o_.timestep_spacing, o_.steps_offset,
                             o_.use_karras_sigmas, o_.final_sigmas_type, "Euler");
    step_index_ = 0;
  }

  [[nodiscard]] const std::vector<float>& timesteps() const noexcept { return s_.timesteps; }
  [[nodiscard]] const std::vector<float>& sigmas() const noexcept { return s_.sigmas; }
  [[nodiscard]] double init_noise_sigma() const { return s_.init_noise_sigma(o_.timestep_spacing); }
  /// x / √(σ² + 1) at the current step: what the model sees.
  [[nodiscard]] at::Tensor scale_model_input(const at::Tensor& sample) const {
    return sigma_space_input(sample, current_sigma());
  }

  /// One step; `generator` draws the churn noise (used only when s_churn > 0).
  [[nodiscard]] at::Tensor step(const at::Tensor& model_output, const at::Tensor& sample_in,
                                std::optional<at::Generator> generator = std::nullopt) {
    check_step_shapes(model_output, sample_in, "Euler::step");
    const float sigma = current_sigma();
    at::Tensor sample = sample_in.to(at::kFloat);
    // torch compares the float32 σ with the bounds cast to float32.
    const double gamma =
        (static_cast<float>(o_.s_tmin) <= sigma && sigma <= static_cast<float>(o_.s_tmax))
            ? std::min(o_.s_churn / static_cast<double>(s_.sigmas.size() - 1), std::sqrt(2.0) - 1)
            : 0.0;
    const float sigma_hat = sigma * static_cast<float>(gamma + 1);
    if (gamma > 0) {
      const at::Tensor noise = at::randn(model_output.sizes(), generator, model_output.options());
      const at::Tensor eps = noise * o_.s_noise;
      sample = sample + eps * std::sqrt(sigma_hat * sigma_hat - sigma * sigma);
    }
    // diffusers scales ε by the churned σ̂ but v by σ.
    const at::Tensor x0 =
        sigma_space_x0(o_.prediction_type, model_output, sample,
                       o_.prediction_type == Prediction::epsilon ? sigma_hat : sigma);
    const at::Tensor derivative = (sample - x0) / sigma_hat;
    const float dt = s_.sigmas[step_index_ + 1] - sigma_hat;
    ++step_index_;
    return (sample + derivative * dt).to(model_output.scalar_type());
  }

  /// The uniform sampling interface (see sample.hpp).
  [[nodiscard]] at::Tensor model_input(const at::Tensor& x) const { return scale_model_input(x); }
  [[nodiscard]] at::Tensor step_at(std::size_t i, const at::Tensor& out, const at::Tensor& x,
                                   std::optional<at::Generator> gen) {
    if (i != step_index_) throw ConfigError("steps must be taken in order", "Euler::step_at");
    return step(out, x, std::move(gen));
  }

 private:
  [[nodiscard]] float current_sigma() const {
    if (s_.sigmas.empty()) throw ConfigError("call set_timesteps() before sampling", "Euler");
    if (step_index_ + 1 >= s_.sigmas.size())
      throw ConfigError("all steps were taken", "Euler::step");
    return s_.sigmas[step_index_];
  }
  const NoiseSchedule* schedule_;
  Options o_;
  SigmaTable table_;
  EulerSchedule s_;
  std::size_t step_index_ = 0;
};

/// Euler ancestral (diffusers' EulerAncestralDiscreteScheduler): each step goes down to σ_down and
/// adds fresh noise of σ_up, with σ_up² + σ_down² = σ_next².
class EulerAncestral {
 public:
  struct Options {
    Prediction prediction_type = Prediction::epsilon;
    TimestepSpacing timestep_spacing = TimestepSpacing::linspace;
    std::int64_t steps_offset = 0;
  };
  static constexpr std::string_view name = "euler_ancestral";

  EulerAncestral(const NoiseSchedule& schedule, const Options& o)
      : schedule_(&schedule), o_(o), table_(schedule) {
    if (o.prediction_type == Prediction::sample)
      throw ConfigError("diffusers' Euler ancestral has no 'sample' prediction",
                        "EulerAncestral option prediction_type");
  }

  void set_timesteps(std::int64_t n) {
    s_ = EulerSchedule::make(*schedule_, table_, n, o_.timestep_spacing, o_.steps_offset, false,
                             FinalSigmas::zero, "EulerAncestral");
    step_index_ = 0;
  }
  [[nodiscard]] const std::vector<float>& timesteps() const noexcept { return s_.timesteps; }
  [[nodiscard]] const std::vector<float>& sigmas() const noexcept { return s_.sigmas; }
  [[nodiscard]] double init_noise_sigma() const { return s_.init_noise_sigma(o_.timestep_spacing); }
  [[nodiscard]] at::Tensor scale_model_input(const at::Tensor& sample) const {
    return sigma_space_input(sample, current_sigma());
  }

  /// One step; the ancestral noise comes from `generator` unless `noise` is given.
  [[nodiscard]] at::Tensor step(const at::Tensor& model_output, const at::Tensor& sample_in,
                                std::optional<at::Generator> generator = std::nullopt,
                                const std::optional<at::Tensor>& noise = std::nullopt) {
    check_step_shapes(model_output, sample_in, "EulerAncestral::step");
    const float sigma = current_sigma();
    const at::Tensor sample = sample_in.to(at::kFloat);
    const at::Tensor x0 = sigma_space_x0(o_.prediction_type, model_output, sample, sigma);
    const float from = sigma;
    const float to = s_.sigmas[step_index_ + 1];
    const float up = std::sqrt(to * to * (from * from - to * to) / (from * from));
    const float down = std::sqrt(to * to - up * up);
    const at::Tensor derivative = (sample - x0) / sigma;
    at::Tensor prev = sample + derivative * (down - sigma);
    const at::Tensor z =
        noise ? *noise : at::randn(model_output.sizes(), generator, model_output.options());
    if (z.sizes() != sample.sizes())
      throw ShapeError("noise has shape " + c10::str(z.sizes()), "EulerAncestral::step noise");
    prev = prev + z * up;
    ++step_index_;
    return prev.to(model_output.scalar_type());
  }

  [[nodiscard]] at::Tensor model_input(const at::Tensor& x) const { return scale_model_input(x); }
  [[nodiscard]] at::Tensor step_at(std::size_t i, const at::Tensor& out, const at::Tensor& x,
                                   std::optional<at::Generator> gen) {
    if (i != step_index_)
      throw ConfigError("steps must be taken in order", "EulerAncestral::step_at");
    return step(out, x, std::move(gen));
  }

 private:
  [[nodiscard]] float current_sigma() const {
    if (s_.sigmas.empty())
      throw ConfigError("call set_timesteps() before sampling", "EulerAncestral");
    if (step_index_ + 1 >= s_.sigmas.size())
      throw ConfigError("all steps were taken", "EulerAncestral::step");
    return s_.sigmas[step_index_];
  }
  const NoiseSchedule* schedule_;
  Options o_;
  SigmaTable table_;
  EulerSchedule s_;
  std::size_t step_index_ = 0;
};

}  // namespace difftrain::diffusion
