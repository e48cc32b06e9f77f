#pragma once
// Shared pieces of the DDPM-family samplers: timestep spacing, x₀/ε from a model output, clipping
// and dynamic thresholding, all as diffusers computes them.

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/diffusion/noise_schedule.hpp"

namespace difftrain::diffusion {

enum class TimestepSpacing { leading, trailing, linspace };

/// diffusers' set_timesteps spacing: descending training timesteps for `n` inference steps.
inline std::vector<std::int64_t> spaced_timesteps(std::int64_t train_steps, std::int64_t n,
                                                  TimestepSpacing spacing,
                                                  std::int64_t steps_offset = 0) {
  if (n <= 0)
    throw ConfigError("must be > 0, got " + std::to_string(n), "sampler num_inference_steps");
  if (n > train_steps)
    throw ConfigError(std::to_string(n) + " inference steps exceed the " +
                          std::to_string(train_steps) +
                          " training timesteps the model was trained with",
                      "sampler num_inference_steps");
  std::vector<std::int64_t> t;
  switch (spacing) {
    case TimestepSpacing::linspace:
      for (std::int64_t i = n - 1; i >= 0; --i) {
        const double v = n == 1 ? 0.0
                                : static_cast<double>(i) * static_cast<double>(train_steps - 1) /
                                      static_cast<double>(n - 1);
        t.push_back(static_cast<std::int64_t>(std::nearbyint(v)));
      }
      break;
    case TimestepSpacing::leading: {
      const std::int64_t ratio = train_steps / n;
      for (std::int64_t i = n - 1; i >= 0; --i) t.push_back(i * ratio + steps_offset);
      break;
    }
    case TimestepSpacing::trailing: {
      const double ratio = static_cast<double>(train_steps) / static_cast<double>(n);
      for (double v = static_cast<double>(train_steps); v > 0; v -= ratio)
        t.push_back(static_cast<std::int64_t>(std::nearbyint(v)) - 1);
      break;
    }
  }
  for (std::int64_t v : t)
    if (v < 0 || v >= train_steps)
      throw ConfigError("spacing produced timestep " + std::to_string(v) + " outside [0, " +
                            std::to_string(train_steps) + ")",
                        "sampler steps_offset");
  return t;
}

/// How a predicted x₀ is kept in range.
struct Clipping {
  bool clip_sample = true;
  double clip_sample_range = 1.0;
  bool thresholding = false;  ///< dynamic thresholding (Imagen); overrides clip_sample
  double dynamic_thresholding_ratio = 0.995;
  double sample_max_value = 1.0;
};

inline at::Tensor threshold_sample(const at::Tensor& sample, const Clipping& c) {
  const auto dtype = sample.scalar_type();
  at::Tensor s = (dtype == at::kFloat || dtype == at::kDouble) ? sample : sample.to(at::kFloat);
  const std::int64_t b = s.size(0);
  at::Tensor flat = s.reshape({b, -1});
  at::Tensor q = at::quantile(flat.abs(), c.dynamic_thresholding_ratio, 1)
                     .clamp(1.0, c.sample_max_value)
                     .unsqueeze(1);
  flat = at::clamp(flat, -q, q) / q;
  return flat.reshape(sample.sizes()).to(dtype);
}

inline at::Tensor clip_x0(const at::Tensor& x0, const Clipping& c) {
  if (c.thresholding) return threshold_sample(x0, c);
  if (c.clip_sample) return x0.clamp(-c.clip_sample_range, c.clip_sample_range);
  return x0;
}

/// (x₀, ε) from a model output of the given prediction type at ᾱ = alpha_prod.
inline std::pair<at::Tensor, at::Tensor> split_prediction(Prediction p, const at::Tensor& out,
                                                          const at::Tensor& x, double alpha_prod) {
  const double beta_prod = 1 - alpha_prod;
  switch (p) {
    case Prediction::epsilon:
      return {(x - std::pow(beta_prod, 0.5) * out) / std::pow(alpha_prod, 0.5), out};
    case Prediction::sample:
      return {out, (x - std::pow(alpha_prod, 0.5) * out) / std::pow(beta_prod, 0.5)};
    case Prediction::v_prediction:
      return {std::pow(alpha_prod, 0.5) * x - std::pow(beta_prod, 0.5) * out,
              std::pow(alpha_prod, 0.5) * out + std::pow(beta_prod, 0.5) * x};
  }
  return {out, out};
}

inline void check_step_shapes(const at::Tensor& out, const at::Tensor& x, const char* who) {
  if (out.sizes() != x.sizes())
    throw ShapeError("model output has shape " + c10::str(out.sizes()) + " but the sample has " +
                         c10::str(x.sizes()),
                     who);
}

/// σ_t = √((1 − ᾱ_t)/ᾱ_t) of every training timestep (float32, as diffusers computes it), with
/// the lookups the σ-space samplers share.
class SigmaTable {
 public:
  explicit SigmaTable(const NoiseSchedule& schedule) {
    const auto& ac = schedule.alphas_cumprod();
    for (std::size_t i = 0; i < ac.size(); ++i) {
      const auto a = static_cast<float>(ac(i));
      sigmas_.push_back(std::pow((1.0F - a) / a, 0.5F));
      log_sigmas_.push_back(std::log(static_cast<double>(sigmas_.back())));
    }
  }
  [[nodiscard]] const std::vector<float>& sigmas() const noexcept { return sigmas_; }

  /// np.interp(t, arange(N), σ).
  [[nodiscard]] double interp(double t) const {
    if (t <= 0) return sigmas_.front();
    const auto lo = static_cast<std::size_t>(std::floor(t));
    if (lo + 1 >= sigmas_.size()) return sigmas_.back();
    const double w = t - static_cast<double>(lo);
    return static_cast<double>(sigmas_[lo]) +
           w * (static_cast<double>(sigmas_[lo + 1]) - sigmas_[lo]);
  }

  /// diffusers' _sigma_to_t: the fractional timestep of σ, interpolating in log σ.
  [[nodiscard]] double sigma_to_t(double sigma) const {
    const double log_sigma = std::log(std::max(sigma, 1e-10));
    std::size_t low = 0;
    for (std::size_t i = 0; i < log_sigmas_.size(); ++i)
      if (log_sigma - log_sigmas_[i] >= 0) low = i;
    low = std::min(low, log_sigmas_.size() - 2);
    const double lo = log_sigmas_[low];
    const double hi = log_sigmas_[low + 1];
    const double w = std::clamp((lo - log_sigma) / (lo - hi), 0.0, 1.0);
    return (1 - w) * static_cast<double>(low) + w * static_cast<double>(low + 1);
  }

  /// Karras et al.'s σ spacing (ρ = 7) between σ_max and σ_min, n values.
  [[nodiscard]] static std::vector<double> karras(double sigma_max, double sigma_min,
                                                  std::int64_t n) {
    const double rho = 7.0;
    std::vector<double> out;
    for (std::int64_t i = 0; i < n; ++i) {
      const double ramp = n == 1 ? 0.0 : static_cast<double>(i) / static_cast<double>(n - 1);
      out.push_back(std::pow(std::pow(sigma_max, 1 / rho) + ramp * (std::pow(sigma_min, 1 / rho) -
                                                                    std::pow(sigma_max, 1 / rho)),
                             rho));
    }
    return out;
  }

 private:
  std::vector<float> sigmas_;
  std::vector<double> log_sigmas_;
};

}  // namespace difftrain::diffusion
