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

namespace numpy {

/// np.linspace(start, stop, num)[i] with numpy's arithmetic: i·((stop − start)/(num − 1)) + start,
/// the last value exactly `stop`. (i·(N−1)/(n−1) is not the same number: 499.5 against numpy's
/// 499.49999999999994 rounds to another timestep.)
inline double linspace(double start, double stop, std::int64_t num, std::int64_t i) {
  if (num > 1 && i == num - 1) return stop;
  if (num <= 1) return static_cast<double>(i) * (stop - start) + start;
  const double step = (stop - start) / static_cast<double>(num - 1);
  if (step == 0)
    return static_cast<double>(i) / static_cast<double>(num - 1) * (stop - start) + start;
  return static_cast<double>(i) * step + start;
}

/// np.arange(start, stop, step) for doubles: ceil((stop − start)/step) values; the first two are
/// start and start + step, the rest start + i·δ with δ = (start + step) − start, as numpy fills it.
inline std::vector<double> arange(double start, double stop, double step) {
  const double len = std::ceil((stop - start) / step);
  std::vector<double> out;
  if (!(len > 0)) return out;
  const auto n = static_cast<std::size_t>(len);
  out.reserve(n);
  out.push_back(start);
  if (n > 1) out.push_back(start + step);
  const double delta = (n > 1 ? out[1] : start) - start;
  for (std::size_t i = 2; i < n; ++i) out.push_back(start + static_cast<double>(i) * delta);
  return out;
}

/// np.round: halves to even (the default floating-point rounding mode).
inline double round(double v) { return std::nearbyint(v); }

}  // namespace numpy

enum class TimestepSpacing { leading, trailing, linspace };

inline void check_inference_steps(std::int64_t train_steps, std::int64_t n) {
  if (n <= 0)
    throw ConfigError("must be > 0, got " + std::to_string(n), "sampler num_inference_steps");
  if (n > train_steps)
    throw ConfigError(std::to_string(n) + " inference steps exceed the " +
                          std::to_string(train_steps) +
                          " training timesteps the model was trained with",
                      "sampler num_inference_steps");
}

inline void check_spaced(const std::vector<std::int64_t>& t, std::int64_t train_steps) {
  for (std::int64_t v : t)
    if (v < 0 || v >= train_steps)
      throw ConfigError("spacing produced timestep " + std::to_string(v) + " outside [0, " +
                            std::to_string(train_steps) + ")",
                        "sampler steps_offset");
}

/// diffusers' set_timesteps spacing (DDPM, DDIM, Euler): descending training timesteps for `n`
/// inference steps, computed with numpy's arithmetic.
///   leading   (np.arange(n) · (N // n)).round()[::-1] + steps_offset
///   trailing  np.round(np.arange(N, 0, −N/n)) − 1, its first n values
///   linspace  np.linspace(0, N − 1, n).round()[::-1]
inline std::vector<std::int64_t> spaced_timesteps(std::int64_t train_steps, std::int64_t n,
                                                  TimestepSpacing spacing,
                                                  std::int64_t steps_offset = 0) {
  check_inference_steps(train_steps, n);
  std::vector<std::int64_t> t;
  const auto N = static_cast<double>(train_steps);
  switch (spacing) {
    case TimestepSpacing::linspace:
      for (std::int64_t i = n - 1; i >= 0; --i)
        t.push_back(static_cast<std::int64_t>(numpy::round(numpy::linspace(0, N - 1, n, i))));
      break;
    case TimestepSpacing::leading: {
      const std::int64_t ratio = train_steps / n;
      for (std::int64_t i = n - 1; i >= 0; --i) t.push_back(i * ratio + steps_offset);
      break;
    }
    case TimestepSpacing::trailing:
      for (double v : numpy::arange(N, 0, -(N / static_cast<double>(n))))
        t.push_back(static_cast<std::int64_t>(numpy::round(v)) - 1);
      // For some n (975 of 1000, say) numpy's arange yields one value too many, which diffusers
      // turns into a last timestep of -1; the first n values are the schedule.
      if (t.size() > static_cast<std::size_t>(n)) t.resize(static_cast<std::size_t>(n));
      break;
  }
  check_spaced(t, train_steps);
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

/// x₀ from a model output of the given prediction type at ᾱ = alpha_prod, with the scalar
/// arithmetic in T: float for a schedule in diffusers' float32 precision (diffusers computes these
/// coefficients on float32 tensors), double otherwise.
template <class T>
at::Tensor predicted_x0(Prediction p, const at::Tensor& out, const at::Tensor& x, T alpha_prod) {
  const auto sqrt_a = static_cast<double>(std::sqrt(alpha_prod));
  const auto sqrt_b = static_cast<double>(std::sqrt(T(1) - alpha_prod));
  switch (p) {
    case Prediction::epsilon:
      return (x - sqrt_b * out) / sqrt_a;
    case Prediction::sample:
      return out;
    case Prediction::v_prediction:
      return sqrt_a * x - sqrt_b * out;
  }
  return out;
}

/// (x₀, ε) from a model output, the scalars in T as predicted_x0's.
template <class T>
std::pair<at::Tensor, at::Tensor> split_prediction(Prediction p, const at::Tensor& out,
                                                   const at::Tensor& x, T alpha_prod) {
  const auto sqrt_a = static_cast<double>(std::sqrt(alpha_prod));
  const auto sqrt_b = static_cast<double>(std::sqrt(T(1) - alpha_prod));
  at::Tensor x0 = predicted_x0<T>(p, out, x, alpha_prod);
  switch (p) {
    case Prediction::epsilon:
      return {std::move(x0), out};
    case Prediction::sample:
      return {std::move(x0), (x - sqrt_a * out) / sqrt_b};
    case Prediction::v_prediction:
      return {std::move(x0), sqrt_a * out + sqrt_b * x};
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
/// the lookups the σ-space samplers share. A schedule rescaled to zero terminal SNR has ᾱ = 0 at
/// its last timestep; like diffusers' Euler and DPM-Solver this table uses 2⁻²⁴ there (the smallest
/// positive fp16 subnormal), so the first σ is 4096 rather than infinite.
class SigmaTable {
 public:
  explicit SigmaTable(const NoiseSchedule& schedule) {
    const auto& ac = schedule.alphas_cumprod();
    for (std::size_t i = 0; i < ac.size(); ++i) {
      auto a = static_cast<float>(ac(i));
      if (i + 1 == ac.size() && schedule.options().rescale_betas_zero_snr)
        a = std::ldexp(1.0F, -24);
      alphas_cumprod_.push_back(a);
    }
    // σ with the torch calls diffusers makes: its vectorised float32 sqrt is not always correctly
    // rounded, so std::sqrt would differ from it by an ulp in about a fifth of the table.
    const at::Tensor a = at::tensor(alphas_cumprod_, at::kFloat);
    const at::Tensor sigmas = ((1 - a) / a).pow(0.5).contiguous();
    sigmas_.assign(sigmas.data_ptr<float>(), sigmas.data_ptr<float>() + sigmas.numel());
    // np.log of a float32 array is float32 (numpy's own, not always correctly rounded either;
    // this one is).
    for (float s : sigmas_)
      log_sigmas_.push_back(static_cast<float>(std::log(static_cast<double>(s))));
  }
  [[nodiscard]] const std::vector<float>& sigmas() const noexcept { return sigmas_; }
  /// ᾱ as the σ-space samplers use it (float32; the zero-SNR end replaced by 2⁻²⁴).
  [[nodiscard]] const std::vector<float>& alphas_cumprod() const noexcept {
    return alphas_cumprod_;
  }

  /// np.interp(t, arange(N), σ).
  [[nodiscard]] double interp(double t) const {
    if (t <= 0) return sigmas_.front();
    const auto lo = static_cast<std::size_t>(std::floor(t));
    if (lo + 1 >= sigmas_.size()) return sigmas_.back();
    const double w = t - static_cast<double>(lo);
    return (static_cast<double>(sigmas_[lo + 1]) - sigmas_[lo]) * w +
           static_cast<double>(sigmas_[lo]);
  }

  /// diffusers' _sigma_to_t: the fractional timestep of σ, interpolating in log σ (whose table is
  /// float32 there, so the bracket's width is a float32 difference).
  [[nodiscard]] double sigma_to_t(double sigma) const {
    const double log_sigma = std::log(std::max(sigma, 1e-10));
    std::size_t low = 0;
    for (std::size_t i = 0; i < log_sigmas_.size(); ++i)
      if (log_sigma - static_cast<double>(log_sigmas_[i]) >= 0) low = i;
    low = std::min(low, log_sigmas_.size() - 2);
    const float lo = log_sigmas_[low];
    const float hi = log_sigmas_[low + 1];
    const double w =
        std::clamp((static_cast<double>(lo) - log_sigma) / static_cast<double>(lo - hi), 0.0, 1.0);
    return (1 - w) * static_cast<double>(low) + w * static_cast<double>(low + 1);
  }

  /// Karras et al.'s σ spacing (ρ = 7) between σ_max and σ_min, n values.
  [[nodiscard]] static std::vector<double> karras(double sigma_max, double sigma_min,
                                                  std::int64_t n) {
    const double rho = 7.0;
    std::vector<double> out;
    for (std::int64_t i = 0; i < n; ++i) {
      const double ramp = numpy::linspace(0, 1, n, i);
      out.push_back(std::pow(std::pow(sigma_max, 1 / rho) + ramp * (std::pow(sigma_min, 1 / rho) -
                                                                    std::pow(sigma_max, 1 / rho)),
                             rho));
    }
    return out;
  }

 private:
  std::vector<float> alphas_cumprod_;
  std::vector<float> sigmas_;
  std::vector<float> log_sigmas_;
};

}  // namespace difftrain::diffusion
