#pragma once
// Rectified-flow training as SD3's trainer does it, and the flow-matching Euler sampler (diffusers'
// FlowMatchEulerDiscreteScheduler): x_σ = (1 − σ)·x₀ + σ·ε, the model predicts ε − x₀, and the
// shift σ' = s·σ / (1 + (s − 1)·σ) moves sampling towards noisier σ.

#include <ATen/ATen.h>
#include <ATen/core/Generator.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "difftrain/core/error.hpp"

namespace difftrain::diffusion {

class FlowMatchEuler {
 public:
  struct Options {
    std::int64_t num_train_timesteps = 1000;
    double shift = 1.0;
  };
  static constexpr std::string_view name = "flow_match_euler";

  FlowMatchEuler() : FlowMatchEuler(Options()) {}
  explicit FlowMatchEuler(const Options& o) : o_(o) {
    if (o.num_train_timesteps <= 0)
      throw ConfigError("must be > 0", "flow matching option num_train_timesteps");
    if (!(o.shift > 0)) throw ConfigError("must be > 0", "flow matching option shift");
    const auto n = static_cast<double>(o.num_train_timesteps);
    // float32 throughout, as diffusers builds these tables.
    for (std::int64_t i = o.num_train_timesteps; i >= 1; --i) {
      const float sigma = shifted(static_cast<float>(static_cast<double>(i) / n));
      train_sigmas_.push_back(sigma);
    }
    sigma_max_ = train_sigmas_.front();
    sigma_min_ = train_sigmas_.back();
  }

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

  /// Sampling: n σ's from σ_max to σ_min (shifted), then 0.
  void set_timesteps(std::int64_t n) {
    if (n <= 0) throw ConfigError("must be > 0", "flow matching num_inference_steps");
    const auto N = static_cast<float>(o_.num_train_timesteps);
    const double t_max = static_cast<double>(sigma_max_ * N);
    const double t_min = static_cast<double>(sigma_min_ * N);
    sigmas_.clear();
    timesteps_.clear();
    for (std::int64_t i = 0; i < n; ++i) {
      const double t =
          n == 1 ? t_max
                 : t_max + (t_min - t_max) * static_cast<double>(i) / static_cast<double>(n - 1);
      const float sigma = shifted(static_cast<float>(static_cast<float>(t) / N));
      sigmas_.push_back(sigma);
      timesteps_.push_back(sigma * N);
    }
    sigmas_.push_back(0.0F);
    step_index_ = 0;
  }
  [[nodiscard]] const std::vector<float>& timesteps() const noexcept { return timesteps_; }
  [[nodiscard]] const std::vector<float>& sigmas() const noexcept { return sigmas_; }

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
  std::size_t step_index_ = 0;
};

}  // namespace difftrain::diffusion
