#pragma once
// Rectified-flow training as SD3's trainer does it, and the flow-matching Euler sampler (diffusers'
// FlowMatchEulerDiscreteScheduler): x_σ = (1 − σ)·x₀ + σ·ε, the model predicts ε − x₀, and the
// shift σ' = s·σ / (1 + (s − 1)·σ) moves sampling towards noisier σ. Dynamic shifting (Flux, SD3.5:
// the shift depends on the image's sequence length through μ, exponential e^μ/(e^μ + 1/σ − 1) or
// linear μ/(μ + 1/σ − 1)) and shift_terminal (LTX-Video: the last σ stretched to a given value)
// as diffusers has them.

#include <ATen/ATen.h>
#include <ATen/core/Generator.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/diffusion/sampler_common.hpp"

namespace difftrain::diffusion {

class FlowMatchEuler {
 public:
  enum class TimeShift { exponential, linear };
  struct Options {
    std::int64_t num_train_timesteps = 1000;
    double shift = 1.0;
    bool use_dynamic_shifting = false;  ///< then set_timesteps needs μ (calculate_shift)
    TimeShift time_shift_type = TimeShift::exponential;
    std::optional<double> shift_terminal = std::nullopt;
  };
  static constexpr std::string_view name = "flow_match_euler";

  FlowMatchEuler() : FlowMatchEuler(Options()) {}
  explicit FlowMatchEuler(const Options& o) : o_(o) {
    if (o.num_train_timesteps <= 0)
      throw ConfigError("must be > 0", "flow matching option num_train_timesteps");
    if (!(o.shift > 0)) throw ConfigError("must be > 0", "flow matching option shift");
    if (o.shift_terminal && !(*o.shift_terminal >= 0 && *o.shift_terminal < 1))
      throw ConfigError("must be in [0, 1)", "flow matching option shift_terminal");
    const auto n = static_cast<double>(o.num_train_timesteps);
    // float32 throughout, as diffusers builds these tables (unshifted with dynamic shifting).
    for (std::int64_t i = o.num_train_timesteps; i >= 1; --i) {
      const auto sigma = static_cast<float>(static_cast<float>(i) / static_cast<float>(n));
      train_sigmas_.push_back(o.use_dynamic_shifting ? sigma : shifted(sigma));
    }
    sigma_max_ = train_sigmas_.front();
    sigma_min_ = train_sigmas_.back();
  }

  [[nodiscard]] const Options& options() const noexcept { return o_; }

  /// Training: σ for each timestep index (0 = the noisiest), as SD3's script looks them up.
  [[nodiscard]] at::Tensor sigmas_for(const at::Tensor& indices) const {
    if (indices.is_floating_point())
      throw ConfigError("indices must be integers", "FlowMatchEuler::sigmas_for");
    if (indices.numel() > 0 && (indices.min().item<std::int64_t>() < 0 ||
                                indices.max().item<std::int64_t>() >= o_.num_train_timesteps))
      throw ConfigError("an index is outside [0, " + std::to_string(o_.num_train_timesteps) + ")",
                        "FlowMatchEuler::sigmas_for");
    return at::tensor(train_sigmas_, at::kFloat)
        .index_select(0, indices.flatten().to(at::kLong).cpu())
        .reshape(indices.sizes());
  }
  /// Training timesteps (σ · N) for the same indices.
  [[nodiscard]] at::Tensor timesteps_for(const at::Tensor& indices) const {
    return sigmas_for(indices) * static_cast<float>(o_.num_train_timesteps);
  }
  /// (1 − σ)·x₀ + σ·ε, σ broadcast over a batch.
  [[nodiscard]] static at::Tensor noisy_input(const at::Tensor& x0, const at::Tensor& noise,
                                              const at::Tensor& sigmas) {
    if (x0.sizes() != noise.sizes())
      throw ShapeError(
          "x0 has shape " + c10::str(x0.sizes()) + ", noise " + c10::str(noise.sizes()),
          "flow matching noisy_input");
    const at::Tensor s = broadcast(sigmas, x0);
    return (1.0 - s) * x0 + s * noise;
  }
  /// The regression target ε − x₀.
  [[nodiscard]] static at::Tensor target(const at::Tensor& x0, const at::Tensor& noise) {
    return noise - x0;
  }

  /// Flux's μ for an image of `image_seq_len` tokens: linear between (base_seq_len, base_shift)
  /// and (max_seq_len, max_shift).
  [[nodiscard]] static double calculate_shift(double image_seq_len, double base_seq_len = 256,
                                              double max_seq_len = 4096, double base_shift = 0.5,
                                              double max_shift = 1.15) {
    const double m = (max_shift - base_shift) / (max_seq_len - base_seq_len);
    const double b = base_shift - m * base_seq_len;
    return image_seq_len * m + b;
  }
  /// μ for the next set_timesteps calls (dynamic shifting).
  void set_mu(double mu) {
    if (!std::isfinite(mu)) throw ConfigError("must be finite", "flow matching mu");
    mu_ = mu;
  }

  /// Sampling: n σ's from σ_max to σ_min (shifted; numpy's float64 arithmetic, then float32),
  /// then 0. With dynamic shifting `mu` (or the one set_mu gave) sets the shift.
  void set_timesteps(std::int64_t n, std::optional<double> mu = std::nullopt) {
    if (n <= 0) throw ConfigError("must be > 0", "flow matching num_inference_steps");
    const auto N = static_cast<double>(o_.num_train_timesteps);
    const double t_max = static_cast<double>(sigma_max_) * N;
    const double t_min = static_cast<double>(sigma_min_) * N;
    std::vector<double> base;
    for (std::int64_t i = 0; i < n; ++i) base.push_back(numpy::linspace(t_max, t_min, n, i) / N);
    shift_and_keep<double>(base, mu);
  }

  /// Sampling from the unshifted σ's given (set_timesteps(sigmas=...); FluxPipeline passes
  /// linspace(1, 1/n, n)), taken as float32 as diffusers does, shifted as set_timesteps shifts,
  /// then 0.
  void set_sigmas(const std::vector<double>& given, std::optional<double> mu = std::nullopt) {
    if (given.empty()) throw ConfigError("needs at least one σ", "flow matching set_sigmas");
    std::vector<double> base;
    for (const double s : given) {
      if (!(s > 0 && s <= 1))
        throw ConfigError("σ's must be in (0, 1], got " + std::to_string(s),
                          "flow matching set_sigmas");
      base.push_back(static_cast<float>(s));
    }
    shift_and_keep<float>(base, mu);
  }
  [[nodiscard]] const std::vector<float>& timesteps() const noexcept { return timesteps_; }
  [[nodiscard]] const std::vector<float>& sigmas() const noexcept { return sigmas_; }

 private:
  /// The shift in T: double as numpy computes set_timesteps' own σ's, float as it computes given
  /// float32 σ's (NEP 50: Python scalars take the array's dtype).
  template <class T>
  void shift_and_keep(const std::vector<double>& base, std::optional<double> mu) {
    const auto n = static_cast<std::int64_t>(base.size());
    if (mu) set_mu(*mu);
    if (o_.use_dynamic_shifting && !mu_)
      throw ConfigError("dynamic shifting needs mu: pass it to set_timesteps or call set_mu",
                        "flow matching set_timesteps");
    const T one = 1, shift = static_cast<T>(o_.shift);
    const T e_mu = mu_ ? static_cast<T>(std::exp(*mu_)) : one, m = mu_ ? static_cast<T>(*mu_) : one;
    std::vector<T> sigmas;
    for (const double b : base) {
      const T s = static_cast<T>(b);
      if (!o_.use_dynamic_shifting) {
        sigmas.push_back(shift * s / (one + (shift - one) * s));
      } else if (o_.time_shift_type == TimeShift::exponential) {
        sigmas.push_back(e_mu / (e_mu + (one / s - one)));
      } else {
        sigmas.push_back(m / (m + (one / s - one)));
      }
    }
    if (o_.shift_terminal) {  // 1 − (1 − σ)·(1 − terminal)/(1 − σ_last)
      const T scale = (one - sigmas.back()) / (one - static_cast<T>(*o_.shift_terminal));
      if (!(scale > 0))  // one step: σ_last = 1 (diffusers computes 0/0)
        throw ConfigError("shift_terminal needs a last σ below 1 (two steps or more), got " +
                              std::to_string(n) + " step(s)",
                          "flow matching set_timesteps");
      for (T& s : sigmas) s = one - ((one - s) / scale);
    }
    sigmas_.clear();
    timesteps_.clear();
    for (const T s : sigmas) {
      sigmas_.push_back(static_cast<float>(s));
      timesteps_.push_back(sigmas_.back() * static_cast<float>(o_.num_train_timesteps));
    }
    sigmas_.push_back(0.0F);
    step_index_ = 0;
  }

 public:
  /// One Euler step along the predicted velocity; steps are taken in order.
  [[nodiscard]] at::Tensor step(const at::Tensor& model_output, const at::Tensor& sample) {
    if (sigmas_.empty())
      throw ConfigError("call set_timesteps() before step()", "FlowMatchEuler::step");
    if (step_index_ + 1 >= sigmas_.size())
      throw ConfigError("all steps were taken", "FlowMatchEuler::step");
    if (model_output.sizes() != sample.sizes())
      throw ShapeError("model output has shape " + c10::str(model_output.sizes()) +
                           " but the sample has " + c10::str(sample.sizes()),
                       "FlowMatchEuler::step");
    const float dt = sigmas_[step_index_ + 1] - sigmas_[step_index_];
    ++step_index_;
    return (sample.to(at::kFloat) + dt * model_output).to(model_output.scalar_type());
  }

  /// The uniform sampling interface (see sample.hpp).
  [[nodiscard]] at::Tensor model_input(const at::Tensor& x) const { return x; }
  [[nodiscard]] at::Tensor step_at(std::size_t i, const at::Tensor& out, const at::Tensor& x,
                                   std::optional<at::Generator> /*unused*/) {
    if (i != step_index_)
      throw ConfigError("steps must be taken in order", "FlowMatchEuler::step_at");
    return step(out, x);
  }

 private:
  [[nodiscard]] float shifted(float s) const {
    const auto shift = static_cast<float>(o_.shift);
    return shift * s / (1 + (shift - 1) * s);
  }
  static at::Tensor broadcast(const at::Tensor& s, const at::Tensor& like) {
    std::vector<std::int64_t> shape{s.numel()};
    for (std::int64_t i = 1; i < like.dim(); ++i) shape.push_back(1);
    return s.to(like.device(), like.scalar_type()).reshape(shape);
  }

  Options o_;
  std::vector<float> train_sigmas_;
  float sigma_max_ = 1;
  float sigma_min_ = 0;
  std::vector<float> sigmas_;
  std::vector<float> timesteps_;
  std::optional<double> mu_;
  std::size_t step_index_ = 0;
};

}  // namespace difftrain::diffusion
