#pragma once
// One sampling loop for every sampler: classifier-free guidance over any model callable, a large
// batch in chunks, random numbers from one generator. Call it inside an `ema::EmaScope` to sample
// with the EMA weights.
//
//   auto images = diffusion::sample(ddim, model, noise, {.num_inference_steps = 50, .guidance_scale
//   = 4.0},
//                                   labels, null_labels);
//
// `model(x, t, cond)` returns the prediction for a batch x at timestep t (a 1-d tensor, one value
// per sample) and conditioning `cond` (a tensor whose first dimension is the batch). An
// unconditional model, `model(x, t)`, is sampled without a `cond` argument.

#include <ATen/ATen.h>
#include <ATen/core/Generator.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <functional>
#include <optional>

#include "difftrain/core/error.hpp"
#include "difftrain/diffusion/guidance.hpp"

namespace difftrain::diffusion {

template <class S>
concept UniformSampler = requires(S& s, const S& cs, std::size_t i, const at::Tensor& x,
                                  std::optional<at::Generator> g) {
  s.set_timesteps(std::int64_t{});
  cs.timesteps();
  { cs.model_input(x) } -> std::convertible_to<at::Tensor>;
  { s.step_at(i, x, x, g) } -> std::convertible_to<at::Tensor>;
};

struct SampleOptions {
  std::int64_t num_inference_steps = 50;
  double guidance_scale = 1.0;  ///< 1: no guidance (one model call per step)
  double guidance_rescale = 0.0;
  std::int64_t chunk_size = 64;  ///< samples per model call batch
  /// The guidance scale at step `i` (timestep `t`) in place of guidance_scale, which still says
  /// whether to guide (CogVideoX's use_dynamic_cfg: cogvideox_dynamic_guidance).
  std::function<double(std::size_t i, std::int64_t t)> guidance_at{};
  /// Called after every sampler step with the steps done and to do over all chunks (a progress
  /// line, train::ProgressLine).
  std::function<void(std::int64_t done, std::int64_t total)> on_step{};
};

/// Samples from `noise` (already scaled by the sampler's initial σ where it has one). With guidance
/// scale ≠ 1, `uncond` (same shape as `cond`) is the null conditioning.
template <UniformSampler S, class Model>
at::Tensor sample(S& sampler, Model&& model, const at::Tensor& noise, const SampleOptions& o,
                  const at::Tensor& cond, const std::optional<at::Tensor>& uncond = std::nullopt,
                  std::optional<at::Generator> generator = std::nullopt) {
  const bool guided = o.guidance_scale != 1.0;
  if (guided && !cond.defined())
    throw ConfigError("guidance (scale " + std::to_string(o.guidance_scale) +
                          ") needs a conditioning; an unconditional model samples with scale 1",
                      "diffusion::sample cond");
  if (guided && !uncond)
    throw ConfigError("guidance needs the unconditional (null) conditioning",
                      "diffusion::sample uncond");
  if (cond.defined() && cond.dim() > 0 && cond.size(0) != noise.size(0))
    throw ShapeError("conditioning has batch " + std::to_string(cond.size(0)) + ", noise " +
                         std::to_string(noise.size(0)),
                     "diffusion::sample cond");
  if (guided && uncond->sizes() != cond.sizes())
    throw ShapeError(
        "uncond has shape " + c10::str(uncond->sizes()) + ", cond " + c10::str(cond.sizes()),
        "diffusion::sample uncond");
  const at::NoGradGuard no_grad;
  sampler.set_timesteps(o.num_inference_steps);
  const auto timesteps = sampler.timesteps();
  const std::int64_t chunks = (noise.size(0) + std::max<std::int64_t>(o.chunk_size, 1) - 1) /
                              std::max<std::int64_t>(o.chunk_size, 1);
  const auto steps_total = chunks * static_cast<std::int64_t>(timesteps.size());
  std::int64_t steps_done = 0;
  return in_chunks(noise.size(0), o.chunk_size, [&](std::int64_t begin, std::int64_t end) {
    S chunk_sampler = sampler;  // multistep samplers keep per-run history
    chunk_sampler.set_timesteps(o.num_inference_steps);
    at::Tensor x = noise.slice(0, begin, end);
    const at::Tensor c = cond.defined() ? cond.slice(0, begin, end) : at::Tensor();
    for (std::size_t i = 0; i < timesteps.size(); ++i) {
      const at::Tensor in = chunk_sampler.model_input(x);
      const at::Tensor t = at::full({end - begin}, static_cast<double>(timesteps[i]),
                                    at::TensorOptions().device(x.device()).dtype(at::kFloat));
      at::Tensor out;
      if (guided) {
        const at::Tensor both =
            model(at::cat({in, in}), at::cat({t, t}), at::cat({c, uncond->slice(0, begin, end)}));
        const auto halves = both.chunk(2, 0);
        const double scale = o.guidance_at ? o.guidance_at(i, timesteps[i]) : o.guidance_scale;
        out = classifier_free_guidance(halves[0], halves[1], scale, o.guidance_rescale);
      } else {
        out = model(in, t, c);
      }
      x = chunk_sampler.step_at(i, out, x, generator);
      if (o.on_step) o.on_step(++steps_done, steps_total);
    }
    return x;
  });
}

/// Samples an unconditional model, `model(x, t)`, from `noise` (guidance needs a conditioning: the
/// scale must be 1).
template <UniformSampler S, class Model>
requires std::invocable<Model&, const at::Tensor&, const at::Tensor&> at::Tensor sample(
    S& sampler, Model&& model, const at::Tensor& noise, const SampleOptions& o,
    std::optional<at::Generator> generator = std::nullopt) {
  auto conditioned = [&](const at::Tensor& x, const at::Tensor& t, const at::Tensor& /*none*/) {
    return model(x, t);
  };
  return sample(sampler, conditioned, noise, o, at::Tensor(), std::nullopt, std::move(generator));
}

}  // namespace difftrain::diffusion
