#pragma once
// DPM-Solver++ multistep (Lu et al. 2022; diffusers' DPMSolverMultistepScheduler with algorithm
// "dpmsolver++" or "sde-dpmsolver++"): a solver in log-SNR λ of order 1, 2 or 3 that reuses the
// previous steps' data predictions, with lower orders on the first steps and, as diffusers does,
// near the end (lower_order_final, euler_at_final, a final σ of 0).
//
// Timesteps by spacing (linspace, leading, trailing with steps_offset), or from Karras σ; the λ
// clip (lambda_min_clipped) shortens the schedule for cosine betas. The SDE variant draws noise
// from the sampling generator. diffusers' deprecated noise-prediction algorithms ("dpmsolver",
// "sde-dpmsolver") are not offered.

#include <ATen/ATen.h>
#include <ATen/core/Generator.h>

#include <cmath>
#include <cstdint>
#include <deque>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "difftrain/diffusion/euler.hpp"
#include "difftrain/diffusion/sampler_common.hpp"

namespace difftrain::diffusion {

class DpmSolverMultistep {
 public:
  enum class Algorithm { dpmsolver_pp, sde_dpmsolver_pp };
  /// How second-order steps combine the last two outputs. Third-order steps have one form for
  /// both (as in diffusers, where `heun` with `solver_order=3` changes only the warm-up and final
  /// second-order steps).
  enum class SolverType { midpoint, heun };
  struct Options {
    Prediction prediction_type = Prediction::epsilon;
    bool use_karras_sigmas = false;
    /// diffusers' DPM-Solver has dynamic thresholding only; clip_sample is difftrain's addition.
    Clipping clipping = {.clip_sample = false};
    std::int64_t solver_order = 2;
    Algorithm algorithm_type = Algorithm::dpmsolver_pp;
    SolverType solver_type = SolverType::midpoint;
    bool lower_order_final = true;
    bool euler_at_final = false;
    FinalSigmas final_sigmas_type = FinalSigmas::zero;
    double lambda_min_clipped = -std::numeric_limits<double>::infinity();
    TimestepSpacing timestep_spacing = TimestepSpacing::linspace;
    std::int64_t steps_offset = 0;
  };
  static constexpr std::string_view name = "dpm_solver++";

  DpmSolverMultistep(const NoiseSchedule& schedule, const Options& o)
      : schedule_(&schedule), o_(o), table_(schedule) {
    if (o.solver_order < 1 || o.solver_order > 3)
      throw ConfigError("must be 1, 2 or 3, got " + std::to_string(o.solver_order),
                        "DPM-Solver++ option solver_order");
    if (std::isnan(o.lambda_min_clipped))
      throw ConfigError("is NaN", "DPM-Solver++ option lambda_min_clipped");
  }

  void set_timesteps(std::int64_t n) {
    const std::int64_t N = schedule_->num_train_timesteps();
    if (n <= 0 || n > N)
      throw ConfigError("must be in [1, " + std::to_string(N) + "], got " + std::to_string(n),
                        "DPM-Solver++ num_inference_steps");
    std::vector<double> t = spaced(n);
    std::vector<double> sigmas;
    if (o_.use_karras_sigmas) {
      sigmas = SigmaTable::karras(table_.sigmas().back(), table_.sigmas().front(), n);
      t.clear();
      // diffusers rounds σ→t, except for cosine betas where the int64 cast truncates.
      const bool truncate = schedule_->options().beta_schedule == BetaSchedule::squaredcos_cap_v2;
      for (double s : sigmas) {
        const double v = table_.sigma_to_t(s);
        t.push_back(truncate ? std::trunc(v) : std::nearbyint(v));
      }
    } else {
      for (double ti : t) sigmas.push_back(table_.interp(ti));
    }
    sigmas_.clear();
    timesteps_.clear();
    for (double s : sigmas) sigmas_.push_back(static_cast<float>(s));
    sigmas_.push_back(o_.final_sigmas_type == FinalSigmas::zero ? 0.0F : table_.sigmas().front());
    for (double v : t) timesteps_.push_back(static_cast<std::int64_t>(v));
    model_outputs_.clear();
    lower_order_nums_ = 0;
    step_index_ = 0;
  }
  [[nodiscard]] const std::vector<std::int64_t>& timesteps() const noexcept { return timesteps_; }
  [[nodiscard]] const std::vector<float>& sigmas() const noexcept { return sigmas_; }

  /// One step. The SDE variant's noise comes from `generator` unless `noise` is given.
  [[nodiscard]] at::Tensor step(const at::Tensor& model_output, const at::Tensor& sample_in,
                                std::optional<at::Generator> generator = std::nullopt,
                                const std::optional<at::Tensor>& noise = std::nullopt) {
    if (sigmas_.empty())
      throw ConfigError("call set_timesteps() before step()", "DPM-Solver++ step");
    if (step_index_ + 1 >= sigmas_.size())
      throw ConfigError("all steps were taken", "DPM-Solver++ step");
    check_step_shapes(model_output, sample_in, "DPM-Solver++ step");
    const std::size_t n = timesteps_.size();
    const bool short_run = o_.lower_order_final && n < 15;
    const bool lower_order_final =
        step_index_ == n - 1 &&
        (o_.euler_at_final || short_run || o_.final_sigmas_type == FinalSigmas::zero);
    const bool lower_order_second = step_index_ + 2 == n && short_run;

    const at::Tensor x0 = data_prediction(model_output, sample_in);
    model_outputs_.push_back(x0);
    while (model_outputs_.size() > static_cast<std::size_t>(o_.solver_order))
      model_outputs_.pop_front();
    const at::Tensor sample = sample_in.to(at::kFloat);
    at::Tensor z;
    if (o_.algorithm_type == Algorithm::sde_dpmsolver_pp) {
      z = noise ? noise->to(model_output.device(), at::kFloat)
                : at::randn(model_output.sizes(), generator,
                            model_output.options().dtype(at::kFloat));
      if (z.sizes() != sample.sizes())
        throw ShapeError("noise has shape " + c10::str(z.sizes()), "DPM-Solver++ step noise");
    }
    at::Tensor prev;
    if (o_.solver_order == 1 || lower_order_nums_ < 1 || lower_order_final) {
      prev = first_order(sample, z);
    } else if (o_.solver_order == 2 || lower_order_nums_ < 2 || lower_order_second) {
      prev = second_order(sample, z);
    } else {
      prev = third_order(sample, z);
    }
    if (lower_order_nums_ < o_.solver_order) ++lower_order_nums_;
    ++step_index_;
    return prev.to(model_output.scalar_type());
  }

  /// The uniform sampling interface (see sample.hpp).
  [[nodiscard]] at::Tensor model_input(const at::Tensor& x) const { return x; }
  [[nodiscard]] at::Tensor step_at(std::size_t i, const at::Tensor& out, const at::Tensor& x,
                                   std::optional<at::Generator> gen) {
    if (i != step_index_) throw ConfigError("steps must be taken in order", "DPM-Solver++ step_at");
    return step(out, x, std::move(gen));
  }

 private:
  struct Coeffs {
    float alpha, sigma, lambda;
  };
  static Coeffs coeffs(float sigma) {
    const float alpha = 1.0F / std::sqrt(sigma * sigma + 1.0F);
    const float sigma_t = sigma * alpha;
    return {alpha, sigma_t, std::log(alpha) - std::log(sigma_t)};
  }

  /// diffusers' DPM-Solver spacing over the first `last` training timesteps (λ-clipped).
  [[nodiscard]] std::vector<double> spaced(std::int64_t n) const {
    const std::int64_t N = schedule_->num_train_timesteps();
    const std::int64_t last = N - clipped_count();
    std::vector<double> t;
    switch (o_.timestep_spacing) {
      case TimestepSpacing::linspace:  // np.linspace(0, last - 1, n + 1).round()[::-1][:-1]
        for (std::int64_t i = n; i >= 1; --i)
          t.push_back(numpy::round(numpy::linspace(0, static_cast<double>(last - 1), n + 1, i)));
        break;
      case TimestepSpacing::leading: {  // (arange(n + 1) * (last // (n + 1)))[::-1][:-1] + offset
        const std::int64_t ratio = last / (n + 1);
        for (std::int64_t i = n; i >= 1; --i)
          t.push_back(static_cast<double>(i * ratio + o_.steps_offset));
        break;
      }
      case TimestepSpacing::trailing:  // np.arange(last, 0, -N/n).round() - 1
        for (double v : numpy::arange(static_cast<double>(last), 0,
                                      -(static_cast<double>(N) / static_cast<double>(n))))
          t.push_back(numpy::round(v) - 1);
        // As in sampler_common.hpp: numpy's arange can give one value too many (a timestep −1).
        if (t.size() > static_cast<std::size_t>(n)) t.resize(static_cast<std::size_t>(n));
        break;
    }
    for (double v : t)
      if (v < 0 || v >= static_cast<double>(N))
        throw ConfigError("spacing produced timestep " + std::to_string(v) + " outside [0, " +
                              std::to_string(N) + ")",
                          "DPM-Solver++ options timestep_spacing/steps_offset");
    if (t.empty())
      throw ConfigError("lambda_min_clipped leaves no timestep", "DPM-Solver++ options");
    return t;
  }

  /// How many of the last training timesteps have λ below lambda_min_clipped
  /// (torch.searchsorted over the flipped λ table).
  [[nodiscard]] std::int64_t clipped_count() const {
    if (std::isinf(o_.lambda_min_clipped) && o_.lambda_min_clipped < 0) return 0;
    // λ_t = log √ᾱ − log √(1 − ᾱ) with diffusers' torch calls, then searchsorted on the flipped
    // table: the number of trailing timesteps with λ below the clip.
    const at::Tensor a = at::tensor(table_.alphas_cumprod(), at::kFloat);
    const at::Tensor lambda = (at::log(at::sqrt(a)) - at::log(at::sqrt(1 - a))).contiguous();
    const float* l = lambda.data_ptr<float>();
    std::int64_t count = 0;
    for (std::int64_t i = lambda.numel() - 1; i >= 0; --i) {
      if (!(static_cast<double>(l[i]) < o_.lambda_min_clipped)) break;
      ++count;
    }
    return count;
  }

  [[nodiscard]] at::Tensor data_prediction(const at::Tensor& out, const at::Tensor& sample) const {
    const Coeffs c = coeffs(sigmas_[step_index_]);
    at::Tensor x0;
    switch (o_.prediction_type) {
      case Prediction::epsilon:
        x0 = (sample - c.sigma * out) / c.alpha;
        break;
      case Prediction::sample:
        x0 = out;
        break;
      case Prediction::v_prediction:
        x0 = c.alpha * sample - c.sigma * out;
        break;
    }
    if (o_.clipping.thresholding) return threshold_sample(x0, o_.clipping);
    if (o_.clipping.clip_sample)
      return x0.clamp(-o_.clipping.clip_sample_range, o_.clipping.clip_sample_range);
    return x0;
  }

  [[nodiscard]] bool sde() const { return o_.algorithm_type == Algorithm::sde_dpmsolver_pp; }

  [[nodiscard]] at::Tensor first_order(const at::Tensor& sample, const at::Tensor& z) const {
    const Coeffs t = coeffs(sigmas_[step_index_ + 1]);
    const Coeffs s = coeffs(sigmas_[step_index_]);
    const float h = t.lambda - s.lambda;
    const at::Tensor& m = model_outputs_.back();
    if (!sde()) return (t.sigma / s.sigma) * sample - (t.alpha * (std::exp(-h) - 1.0F)) * m;
    return (t.sigma / s.sigma * std::exp(-h)) * sample + (t.alpha * (1 - std::exp(-2.0F * h))) * m +
           t.sigma * std::sqrt(1.0F - std::exp(-2 * h)) * z;
  }

  [[nodiscard]] at::Tensor second_order(const at::Tensor& sample, const at::Tensor& z) const {
    const Coeffs t = coeffs(sigmas_[step_index_ + 1]);
    const Coeffs s0 = coeffs(sigmas_[step_index_]);
    const Coeffs s1 = coeffs(sigmas_[step_index_ - 1]);
    const at::Tensor& m0 = model_outputs_[model_outputs_.size() - 1];
    const at::Tensor& m1 = model_outputs_[model_outputs_.size() - 2];
    const float h = t.lambda - s0.lambda;
    const float h0 = s0.lambda - s1.lambda;
    const float r0 = h0 / h;
    const at::Tensor& d0 = m0;
    const at::Tensor d1 = (1.0F / r0) * (m0 - m1);
    const bool midpoint = o_.solver_type == SolverType::midpoint;
    if (!sde()) {
      const at::Tensor base =
          (t.sigma / s0.sigma) * sample - (t.alpha * (std::exp(-h) - 1.0F)) * d0;
      if (midpoint) return base - 0.5F * (t.alpha * (std::exp(-h) - 1.0F)) * d1;
      return base + (t.alpha * ((std::exp(-h) - 1.0F) / h + 1.0F)) * d1;
    }
    const at::Tensor base =
        (t.sigma / s0.sigma * std::exp(-h)) * sample + (t.alpha * (1 - std::exp(-2.0F * h))) * d0;
    const at::Tensor noise_term = t.sigma * std::sqrt(1.0F - std::exp(-2 * h)) * z;
    if (midpoint) return base + 0.5F * (t.alpha * (1 - std::exp(-2.0F * h))) * d1 + noise_term;
    return base + (t.alpha * ((1.0F - std::exp(-2.0F * h)) / (-2.0F * h) + 1.0F)) * d1 + noise_term;
  }

  [[nodiscard]] at::Tensor third_order(const at::Tensor& sample, const at::Tensor& z) const {
    const Coeffs t = coeffs(sigmas_[step_index_ + 1]);
    const Coeffs s0 = coeffs(sigmas_[step_index_]);
    const Coeffs s1 = coeffs(sigmas_[step_index_ - 1]);
    const Coeffs s2 = coeffs(sigmas_[step_index_ - 2]);
    const std::size_t k = model_outputs_.size();
    const at::Tensor& m0 = model_outputs_[k - 1];
    const at::Tensor& m1 = model_outputs_[k - 2];
    const at::Tensor& m2 = model_outputs_[k - 3];
    const float h = t.lambda - s0.lambda;
    const float h0 = s0.lambda - s1.lambda;
    const float h1 = s1.lambda - s2.lambda;
    const float r0 = h0 / h;
    const float r1 = h1 / h;
    const at::Tensor& d0 = m0;
    const at::Tensor d1_0 = (1.0F / r0) * (m0 - m1);
    const at::Tensor d1_1 = (1.0F / r1) * (m1 - m2);
    const at::Tensor d1 = d1_0 + (r0 / (r0 + r1)) * (d1_0 - d1_1);
    const at::Tensor d2 = (1.0F / (r0 + r1)) * (d1_0 - d1_1);
    if (!sde())
      return (t.sigma / s0.sigma) * sample - (t.alpha * (std::exp(-h) - 1.0F)) * d0 +
             (t.alpha * ((std::exp(-h) - 1.0F) / h + 1.0F)) * d1 -
             (t.alpha * ((std::exp(-h) - 1.0F + h) / (h * h) - 0.5F)) * d2;
    return (t.sigma / s0.sigma * std::exp(-h)) * sample +
           (t.alpha * (1.0F - std::exp(-2.0F * h))) * d0 +
           (t.alpha * ((1.0F - std::exp(-2.0F * h)) / (-2.0F * h) + 1.0F)) * d1 +
           (t.alpha *
            ((1.0F - std::exp(-2.0F * h) - 2.0F * h) / ((2.0F * h) * (2.0F * h)) - 0.5F)) *
               d2 +
           t.sigma * std::sqrt(1.0F - std::exp(-2 * h)) * z;
  }

  const NoiseSchedule* schedule_;
  Options o_;
  SigmaTable table_;
  std::vector<float> sigmas_;
  std::vector<std::int64_t> timesteps_;
  std::deque<at::Tensor> model_outputs_;
  std::int64_t lower_order_nums_ = 0;
  std::size_t step_index_ = 0;
};

/// The second-order midpoint DPM-Solver++ (the common "DPM++ 2M"): DpmSolverMultistep's defaults.
using DpmSolverPP2M = DpmSolverMultistep;

}  // namespace difftrain::diffusion
