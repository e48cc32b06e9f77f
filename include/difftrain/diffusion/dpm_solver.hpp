#pragma once
// DPM-Solver++ 2M (Lu et al. 2022; diffusers' DPMSolverMultistepScheduler with algorithm
// "dpmsolver++", solver order 2, midpoint): a second-order multistep solver in log-SNR λ that
// reuses the previous step's data prediction; first order on the first step and on the final one,
// which goes to σ = 0.
// Optional Karras σ spacing.

#include <ATen/ATen.h>
#include <ATen/core/Generator.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "difftrain/diffusion/sampler_common.hpp"

namespace difftrain::diffusion {

class DpmSolverPP2M {
 public:
  struct Options {
    Prediction prediction_type = Prediction::epsilon;
    bool use_karras_sigmas = false;
    Clipping clipping = {.clip_sample = false};
  };
  static constexpr std::string_view name = "dpm_solver++_2m";

  DpmSolverPP2M(const NoiseSchedule& schedule, const Options& o)
      : schedule_(&schedule), o_(o), table_(schedule) {}

  void set_timesteps(std::int64_t n) {
    const std::int64_t N = schedule_->num_train_timesteps();
    if (n <= 0 || n > N)
      throw ConfigError("must be in [1, " + std::to_string(N) + "], got " + std::to_string(n),
                        "DPM-Solver++ num_inference_steps");
    std::vector<double> t;
    for (std::int64_t i = n; i >= 1; --i)  // np.linspace(0, N - 1, n + 1).round()[::-1][:-1]
      t.push_back(std::nearbyint(static_cast<double>(i) * static_cast<double>(N - 1) /
                                 static_cast<double>(n)));
    std::vector<double> sigmas;
    if (o_.use_karras_sigmas) {
      sigmas = SigmaTable::karras(table_.sigmas().back(), table_.sigmas().front(), n);
      t.clear();
      for (double s : sigmas) t.push_back(std::nearbyint(table_.sigma_to_t(s)));
    } else {
      for (double ti : t) sigmas.push_back(table_.interp(ti));
    }
    sigmas_.clear();
    timesteps_.clear();
    for (double s : sigmas) sigmas_.push_back(static_cast<float>(s));
    sigmas_.push_back(0.0F);
    for (double v : t) timesteps_.push_back(static_cast<std::int64_t>(v));
    previous_x0_ = at::Tensor();
    lower_order_nums_ = 0;
    step_index_ = 0;
  }
  [[nodiscard]] const std::vector<std::int64_t>& timesteps() const noexcept { return timesteps_; }
  [[nodiscard]] const std::vector<float>& sigmas() const noexcept { return sigmas_; }

  [[nodiscard]] at::Tensor step(const at::Tensor& model_output, const at::Tensor& sample_in) {
    if (sigmas_.empty())
      throw ConfigError("call set_timesteps() before step()", "DPM-Solver++ step");
    if (step_index_ + 1 >= sigmas_.size())
      throw ConfigError("all steps were taken", "DPM-Solver++ step");
    check_step_shapes(model_output, sample_in, "DPM-Solver++ step");
    const std::size_t n = timesteps_.size();
    const bool final_first_order =
        step_index_ == n - 1;  // σ_last = 0: the final step is first order
    const at::Tensor x0 = data_prediction(model_output, sample_in);
    const at::Tensor sample = sample_in.to(at::kFloat);
    const Coeffs t = coeffs(sigmas_[step_index_ + 1]);
    const Coeffs s0 = coeffs(sigmas_[step_index_]);
    const float h = t.lambda - s0.lambda;
    at::Tensor prev;
    if (lower_order_nums_ < 1 || final_first_order) {
      prev = (t.sigma / s0.sigma) * sample - (t.alpha * (std::exp(-h) - 1.0F)) * x0;
    } else {
      const Coeffs s1 = coeffs(sigmas_[step_index_ - 1]);
      const float h0 = s0.lambda - s1.lambda;
      const float r0 = h0 / h;
      const at::Tensor d1 = (1.0F / r0) * (x0 - previous_x0_);
      prev = (t.sigma / s0.sigma) * sample - (t.alpha * (std::exp(-h) - 1.0F)) * x0 -
             0.5F * (t.alpha * (std::exp(-h) - 1.0F)) * d1;
    }
    previous_x0_ = x0;
    if (lower_order_nums_ < 2) ++lower_order_nums_;
    ++step_index_;
    return prev.to(model_output.scalar_type());
  }

  /// The uniform sampling interface (see sample.hpp).
  [[nodiscard]] at::Tensor model_input(const at::Tensor& x) const { return x; }
  [[nodiscard]] at::Tensor step_at(std::size_t i, const at::Tensor& out, const at::Tensor& x,
                                   std::optional<at::Generator> /*unused*/) {
    if (i != step_index_) throw ConfigError("steps must be taken in order", "DPM-Solver++ step_at");
    return step(out, x);
  }

 private:
  struct Coeffs {
    float alpha, sigma, lambda;
  };
  static Coeffs coeffs(float sigma) {
    const float alpha = 1.0F / std::pow(sigma * sigma + 1.0F, 0.5F);
    const float sigma_t = sigma * alpha;
    return {alpha, sigma_t, std::log(alpha) - std::log(sigma_t)};
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
    return clip_x0(x0, o_.clipping);
  }

  const NoiseSchedule* schedule_;
  Options o_;
  SigmaTable table_;
  std::vector<float> sigmas_;
  std::vector<std::int64_t> timesteps_;
  at::Tensor previous_x0_;
  std::int64_t lower_order_nums_ = 0;
  std::size_t step_index_ = 0;
};

}  // namespace difftrain::diffusion
