#pragma once
// The discrete noise schedule of DDPM-family models: betas, alphas and their cumulative product,
// tabulated once (xtensor, float64 by default) and handed to LibTorch as tensors where a batch
// needs them. `Precision::float32` reproduces diffusers' own tables (it builds them in float32),
// for bit-level parity with models trained there.

#include <ATen/ATen.h>

#include <array>
#include <mutex>
#include <optional>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <string>
#include <string_view>
#include <vector>
#include <xtensor/xtensor.hpp>

#include "difftrain/core/error.hpp"

namespace difftrain::diffusion {

enum class BetaSchedule { linear, scaled_linear, squaredcos_cap_v2, sigmoid };
enum class Prediction { epsilon, v_prediction, sample };
enum class Precision { float64, float32 };

/// diffusers' `prediction_type` name ("epsilon", "v_prediction", "sample"); another is a
/// ConfigError at `where`.
inline Prediction prediction_from(std::string_view name, const std::string& where) {
  if (name == "epsilon") return Prediction::epsilon;
  if (name == "v_prediction") return Prediction::v_prediction;
  if (name == "sample") return Prediction::sample;
  throw ConfigError(
      "prediction_type \"" + std::string(name) + "\" is not epsilon, v_prediction or sample",
      where);
}

/// diffusers' `beta_schedule` name; another is a ConfigError at `where`.
inline BetaSchedule beta_schedule_from(std::string_view name, const std::string& where) {
  if (name == "linear") return BetaSchedule::linear;
  if (name == "scaled_linear") return BetaSchedule::scaled_linear;
  if (name == "squaredcos_cap_v2") return BetaSchedule::squaredcos_cap_v2;
  if (name == "sigmoid") return BetaSchedule::sigmoid;
  throw ConfigError("beta_schedule \"" + std::string(name) +
                        "\" is not linear, scaled_linear, squaredcos_cap_v2 or sigmoid",
                    where);
}

inline std::string_view to_string(Prediction p) {
  switch (p) {
    case Prediction::epsilon:
      return "epsilon";
    case Prediction::v_prediction:
      return "v_prediction";
    case Prediction::sample:
      return "sample";
  }
  return "?";
}

class NoiseSchedule {
 public:
  struct Options {
    std::int64_t num_train_timesteps = 1000;
    double beta_start = 0.0001;
    double beta_end = 0.02;
    BetaSchedule beta_schedule = BetaSchedule::linear;
    bool rescale_betas_zero_snr = false;
    /// CogVideoX's schedulers (CogVideoXDDIMScheduler, CogVideoXDPMScheduler): ᾱ is shifted to
    /// ᾱ / (s + (1 − s)·ᾱ), lowering every SNR by the factor s, and with rescale_betas_zero_snr
    /// the zero-terminal-SNR rescale is applied to that shifted ᾱ. Unset: no shift (s = 1 is the
    /// same table). CogVideoX-2B's scheduler has 3.0, the 5B models' 1.0.
    std::optional<double> snr_shift_scale{};
    Precision precision = Precision::float64;
  };

  NoiseSchedule() : NoiseSchedule(Options()) {}
  explicit NoiseSchedule(const Options& o) : o_(o) {
    if (o.num_train_timesteps <= 0)
      throw ConfigError("must be > 0, got " + std::to_string(o.num_train_timesteps),
                        "noise schedule option num_train_timesteps");
    if (!(o.beta_start > 0 && o.beta_end > o.beta_start && o.beta_end < 1))
      throw ConfigError("need 0 < beta_start < beta_end < 1",
                        "noise schedule options beta_start/beta_end");
    const auto n = static_cast<std::size_t>(o.num_train_timesteps);
    betas_ = xt::zeros<double>({n});
    alphas_ = xt::zeros<double>({n});
    alphas_cumprod_ = xt::zeros<double>({n});
    if (o.snr_shift_scale) {
      build_shifted();
    } else if (o.precision == Precision::float32) {
      build_as_diffusers();
    } else {
      for (std::size_t i = 0; i < n; ++i) betas_(i) = beta(i, n);
      if (o.rescale_betas_zero_snr) rescale_in<double>();
      double prod = 1.0;
      for (std::size_t i = 0; i < n; ++i) {
        alphas_(i) = 1.0 - betas_(i);
        prod *= alphas_(i);
        alphas_cumprod_(i) = prod;
      }
    }
    // The table as a CPU tensor once, in the precision the lookups use, rather than per call.
    alphas_cumprod_tensor_ =
        at::tensor(std::vector<double>(alphas_cumprod_.begin(), alphas_cumprod_.end()), at::kDouble)
            .to(o_.precision == Precision::float32 ? at::kFloat : at::kDouble);
  }

  [[nodiscard]] const Options& options() const noexcept { return o_; }
  [[nodiscard]] std::int64_t num_train_timesteps() const noexcept { return o_.num_train_timesteps; }
  [[nodiscard]] const xt::xtensor<double, 1>& betas() const noexcept { return betas_; }
  [[nodiscard]] const xt::xtensor<double, 1>& alphas() const noexcept { return alphas_; }
  [[nodiscard]] const xt::xtensor<double, 1>& alphas_cumprod() const noexcept {
    return alphas_cumprod_;
  }

  /// ᾱ at timestep t (checked).
  [[nodiscard]] double alpha_cumprod(std::int64_t t) const {
    check_timestep(t);
    return alphas_cumprod_(static_cast<std::size_t>(t));
  }

  /// ᾱ for a tensor of timesteps, shaped to broadcast against a (B, ...) tensor of `rank` dims.
  [[nodiscard]] at::Tensor alphas_cumprod_at(const at::Tensor& timesteps, std::int64_t rank,
                                             const at::TensorOptions& opts) const {
    check_timesteps(timesteps);
    const at::Tensor table = alphas_cumprod_tensor_.to(opts.device());
    at::Tensor a =
        table.index_select(0, timesteps.flatten().to(opts.device(), at::kLong)).to(opts.dtype());
    std::vector<std::int64_t> shape{a.size(0)};
    for (std::int64_t i = 1; i < rank; ++i) shape.push_back(1);
    return a.reshape(shape);
  }

  /// diffusers' add_noise: √ᾱ·x₀ + √(1−ᾱ)·ε.
  [[nodiscard]] at::Tensor add_noise(const at::Tensor& x0, const at::Tensor& noise,
                                     const at::Tensor& timesteps) const {
    check_same_shape(x0, noise, "add_noise");
    const at::Tensor a = alphas_cumprod_at(timesteps, x0.dim(), x0.options());
    return a.pow(0.5) * x0 + (1 - a).pow(0.5) * noise;
  }

  /// diffusers' get_velocity: √ᾱ·ε − √(1−ᾱ)·x₀.
  [[nodiscard]] at::Tensor get_velocity(const at::Tensor& x0, const at::Tensor& noise,
                                        const at::Tensor& timesteps) const {
    check_same_shape(x0, noise, "get_velocity");
    const at::Tensor a = alphas_cumprod_at(timesteps, x0.dim(), x0.options());
    return a.pow(0.5) * noise - (1 - a).pow(0.5) * x0;
  }

  /// The training target for a prediction type.
  [[nodiscard]] at::Tensor target(Prediction p, const at::Tensor& x0, const at::Tensor& noise,
                                  const at::Tensor& timesteps) const {
    switch (p) {
      case Prediction::epsilon:
        return noise;
      case Prediction::v_prediction:
        return get_velocity(x0, noise, timesteps);
      case Prediction::sample:
        return x0;
    }
    return noise;
  }

  /// diffusers' compute_snr: (√ᾱ / √(1−ᾱ))², float32.
  [[nodiscard]] at::Tensor snr(const at::Tensor& timesteps) const {
    check_timesteps(timesteps);
    const at::Tensor& table = alphas_cumprod_tensor_;
    const at::Tensor idx = timesteps.to(at::kCPU, at::kLong);
    const at::Tensor alpha =
        table.pow(0.5).index_select(0, idx.flatten()).to(at::kFloat).reshape(timesteps.sizes());
    const at::Tensor sigma = (1.0 - table)
                                 .pow(0.5)
                                 .index_select(0, idx.flatten())
                                 .to(at::kFloat)
                                 .reshape(timesteps.sizes());
    return (alpha / sigma).pow(2).to(timesteps.device());
  }

  void check_timestep(std::int64_t t) const {
    if (t < 0 || t >= o_.num_train_timesteps)
      throw ConfigError("timestep " + std::to_string(t) + " is outside [0, " +
                            std::to_string(o_.num_train_timesteps) + ")",
                        "noise schedule");
  }
  /// Timesteps must be integers in [0, num_train_timesteps). Reading a GPU tensor's range back
  /// waits for the device, so timesteps this schedule drew itself (sample_timesteps) and that
  /// have not been written since are known to be in range and not read back.
  void check_timesteps(const at::Tensor& t) const {
    if (t.is_floating_point() || t.is_complex())
      throw ConfigError(
          "timesteps must be integers, got " + std::string(c10::toString(t.scalar_type())),
          "noise schedule");
    if (t.numel() == 0 || drawn_.holds(t)) return;
    // One read-back for both ends.
    const auto [lo_t, hi_t] = at::aminmax(t);
    const at::Tensor ends = at::stack({lo_t, hi_t}).to(at::kCPU, at::kLong);
    check_timestep(ends[0].item<std::int64_t>());
    check_timestep(ends[1].item<std::int64_t>());
  }

  /// `batch` timesteps drawn uniformly from [0, num_train_timesteps), as diffusers' training
  /// scripts draw them, on `options`' device (int64). The lookups that take them skip the range
  /// check, which on a GPU would wait for the device once per call.
  [[nodiscard]] at::Tensor sample_timesteps(std::int64_t batch, const at::TensorOptions& options,
                                            std::optional<at::Generator> generator = {}) const {
    at::Tensor t = at::randint(0, o_.num_train_timesteps, {batch}, std::move(generator),
                               options.dtype(at::kLong));
    drawn_.remember(t);
    return t;
  }

 private:
  static void check_same_shape(const at::Tensor& a, const at::Tensor& b, const char* what) {
    if (a.sizes() != b.sizes())
      throw ShapeError(
          "sample has shape " + c10::str(a.sizes()) + " but noise has " + c10::str(b.sizes()),
          std::string("noise schedule ") + what);
  }

  [[nodiscard]] double beta(std::size_t i, std::size_t n) const {
    const auto N = static_cast<double>(n);
    const auto x = static_cast<double>(i);
    const auto lerp = [&](double a, double b) { return n == 1 ? a : a + (b - a) * x / (N - 1); };
    switch (o_.beta_schedule) {
      case BetaSchedule::linear:
        return lerp(o_.beta_start, o_.beta_end);
      case BetaSchedule::scaled_linear: {
        const double r = lerp(std::sqrt(o_.beta_start), std::sqrt(o_.beta_end));
        return r * r;
      }
      case BetaSchedule::squaredcos_cap_v2: {
        const auto alpha_bar = [](double t) {
          return std::pow(std::cos((t + 0.008) / 1.008 * std::numbers::pi / 2), 2);
        };
        return std::min(1 - alpha_bar((x + 1) / N) / alpha_bar(x / N), 0.999);
      }
      case BetaSchedule::sigmoid: {
        const double s = 1.0 / (1.0 + std::exp(-lerp(-6.0, 6.0)));
        return s * (o_.beta_end - o_.beta_start) + o_.beta_start;
      }
    }
    return 0;
  }

  /// The float32 tables with the torch calls diffusers' schedulers make (torch.linspace, the
  /// zero-SNR rescale of Lin et al., cumprod): torch's vectorised float32 kernels are not always
  /// correctly rounded (sqrt, for one), so only the same calls give the same tables, bit for bit.
  void build_as_diffusers() {
    const std::int64_t n = o_.num_train_timesteps;
    at::Tensor betas;
    switch (o_.beta_schedule) {
      case BetaSchedule::linear:
        betas = at::linspace(o_.beta_start, o_.beta_end, n, at::kFloat);
        break;
      case BetaSchedule::scaled_linear:  // Python's beta ** 0.5 is libm's pow
        betas =
            at::linspace(std::pow(o_.beta_start, 0.5), std::pow(o_.beta_end, 0.5), n, at::kFloat)
                .pow(2);
        break;
      case BetaSchedule::squaredcos_cap_v2: {  // computed in Python floats, stored as float32
        std::vector<double> b;
        for (std::size_t i = 0; i < static_cast<std::size_t>(n); ++i)
          b.push_back(beta(i, static_cast<std::size_t>(n)));
        betas = at::tensor(b, at::kDouble).to(at::kFloat);
        break;
      }
      case BetaSchedule::sigmoid:
        betas = at::sigmoid(at::linspace(-6, 6, n, at::kFloat)) * (o_.beta_end - o_.beta_start) +
                o_.beta_start;
        break;
    }
    if (o_.rescale_betas_zero_snr) {
      at::Tensor sqrt_bar = (1.0 - betas).cumprod(0).sqrt();
      const at::Tensor first = sqrt_bar[0].clone();
      const at::Tensor last = sqrt_bar[-1].clone();
      sqrt_bar -= last;
      sqrt_bar *= first / (first - last);
      const at::Tensor bar = sqrt_bar.pow(2);
      betas = 1 - at::cat({bar.slice(0, 0, 1), bar.slice(0, 1) / bar.slice(0, 0, -1)});
    }
    const at::Tensor alphas = 1.0 - betas;
    const at::Tensor cumprod = alphas.cumprod(0);
    const auto store = [](xt::xtensor<double, 1>& out, const at::Tensor& t) {
      const at::Tensor d = t.to(at::kDouble).contiguous();
      std::copy(d.data_ptr<double>(), d.data_ptr<double>() + d.numel(), out.begin());
    };
    store(betas_, betas);
    store(alphas_, alphas);
    store(alphas_cumprod_, cumprod);
  }

  /// CogVideoX's tables with its schedulers' torch calls: betas (scaled_linear in float64 even in
  /// diffusers' precision, linear and squaredcos_cap_v2 in float32 there), ᾱ = cumprod(1 − β),
  /// the SNR shift, then the zero-SNR rescale on ᾱ itself. β and α are stored as the per-step
  /// values of the final ᾱ (αᵢ = ᾱᵢ/ᾱᵢ₋₁), which is what the DDPM-family formulas read.
  void build_shifted() {
    const double s = *o_.snr_shift_scale;
    if (!(s > 0 && std::isfinite(s)))
      throw ConfigError("must be a positive number, got " + std::to_string(s),
                        "noise schedule option snr_shift_scale");
    if (o_.beta_schedule == BetaSchedule::sigmoid)
      throw ConfigError("CogVideoX's schedulers have linear, scaled_linear and squaredcos_cap_v2",
                        "noise schedule option beta_schedule with snr_shift_scale");
    const std::int64_t n = o_.num_train_timesteps;
    const bool as_diffusers = o_.precision == Precision::float32;
    at::Tensor betas;
    switch (o_.beta_schedule) {
      case BetaSchedule::linear:
        betas =
            at::linspace(o_.beta_start, o_.beta_end, n, as_diffusers ? at::kFloat : at::kDouble);
        break;
      case BetaSchedule::scaled_linear:
        betas =
            at::linspace(std::pow(o_.beta_start, 0.5), std::pow(o_.beta_end, 0.5), n, at::kDouble)
                .pow(2);
        break;
      default: {
        std::vector<double> b;
        for (std::size_t i = 0; i < static_cast<std::size_t>(n); ++i)
          b.push_back(beta(i, static_cast<std::size_t>(n)));
        betas = at::tensor(b, at::kDouble).to(as_diffusers ? at::kFloat : at::kDouble);
        break;
      }
    }
    at::Tensor bar = (1.0 - betas).cumprod(0);
    bar = bar / (s + (1 - s) * bar);
    if (o_.rescale_betas_zero_snr) {
      at::Tensor sqrt_bar = bar.sqrt();
      const at::Tensor first = sqrt_bar[0].clone();
      const at::Tensor last = sqrt_bar[-1].clone();
      sqrt_bar -= last;
      sqrt_bar *= first / (first - last);
      bar = sqrt_bar.pow(2);
    }
    const at::Tensor d = bar.to(at::kDouble).contiguous();
    std::copy(d.data_ptr<double>(), d.data_ptr<double>() + d.numel(), alphas_cumprod_.begin());
    for (std::size_t i = 0; i < alphas_cumprod_.size(); ++i) {
      alphas_(i) = i == 0 ? alphas_cumprod_(0) : alphas_cumprod_(i) / alphas_cumprod_(i - 1);
      betas_(i) = 1.0 - alphas_(i);
    }
  }

  /// Lin et al., "Common Diffusion Noise Schedules and Sample Steps are Flawed", Algorithm 1, in
  /// T arithmetic (the float64 tables).
  template <class T>
  void rescale_in() {
    const std::size_t n = betas_.size();
    std::vector<T> sqrt_bar(n);
    double prod = 1.0;
    for (std::size_t i = 0; i < n; ++i) {
      prod *= static_cast<double>(T(1) - static_cast<T>(betas_(i)));
      sqrt_bar[i] = std::sqrt(static_cast<T>(prod));
    }
    const T first = sqrt_bar[0];
    const T last = sqrt_bar[n - 1];
    const T scale = first / (first - last);
    for (std::size_t i = 0; i < n; ++i) sqrt_bar[i] = (sqrt_bar[i] - last) * scale;
    T previous = 1;
    for (std::size_t i = 0; i < n; ++i) {
      const T bar = sqrt_bar[i] * sqrt_bar[i];
      betas_(i) = static_cast<double>(T(1) - (i == 0 ? bar : bar / previous));
      previous = bar;
    }
  }

  Options o_;
  xt::xtensor<double, 1> betas_;
  xt::xtensor<double, 1> alphas_;
  xt::xtensor<double, 1> alphas_cumprod_;
  at::Tensor alphas_cumprod_tensor_;
  /// The last few timestep tensors sample_timesteps drew, held (so their storage is not reused)
  /// with the version each had: a tensor written since then is checked again.
  class DrawnTimesteps {
   public:
    DrawnTimesteps() = default;
    DrawnTimesteps(const DrawnTimesteps& /*unused*/) {}  // a copied schedule trusts nothing yet
    DrawnTimesteps& operator=(const DrawnTimesteps& /*unused*/) { return *this; }
    void remember(const at::Tensor& t) {
      const std::lock_guard lock(mutex_);
      slots_[next_] = {t, t._version()};
      next_ = (next_ + 1) % slots_.size();
    }
    bool holds(const at::Tensor& t) const {
      const std::lock_guard lock(mutex_);
      for (const auto& [held, version] : slots_)
        if (held.defined() && held.unsafeGetTensorImpl() == t.unsafeGetTensorImpl() &&
            held._version() == version)
          return true;
      return false;
    }

   private:
    mutable std::mutex mutex_;
    std::array<std::pair<at::Tensor, std::int64_t>, 4> slots_;
    std::size_t next_ = 0;
  };
  mutable DrawnTimesteps drawn_;
};

}  // namespace difftrain::diffusion
