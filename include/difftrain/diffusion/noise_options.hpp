#pragma once
// The noise options of today's LoRA trainers, as kohya's sd-scripts defines them
// (custom_train_functions.py, train_util.get_noise_noisy_latents_and_timesteps) and diffusers'
// train_text_to_image.py:
//   noise_offset (+ adaptive_noise_scale)   a shift per sample and channel added to the noise
//   multires_noise_iterations / _discount   pyramid noise: upsampled coarser noise added, then
//                                           the sum scaled back to unit standard deviation
//   ip_noise_gamma (+ random strength)      input perturbation: the noisy input is made from
//                                           noise + γ·ε' while the target keeps the noise;
//                                           diffusers' --input_perturbation is the same with a
//                                           fixed γ
// Each takes its random draws from a NoiseDraws (the test replays the reference's draws; a run
// draws from LibTorch's generator).

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "difftrain/core/error.hpp"

namespace difftrain::diffusion {

/// Where the options draw: standard-normal tensors of a shape, and uniform numbers in [0, 1)
/// (Python's random.random(), which kohya's pyramid noise uses for its scale factors).
struct NoiseDraws {
  std::function<at::Tensor(at::IntArrayRef, const at::TensorOptions&)> randn;
  std::function<double()> uniform;

  /// Both from LibTorch's generator (whose state a checkpoint keeps, so a resumed run draws what
  /// the uninterrupted one drew).
  static NoiseDraws torch() {
    return {[](at::IntArrayRef shape, const at::TensorOptions& o) { return at::randn(shape, o); },
            [] { return at::rand({1}, at::kDouble).item<double>(); }};
  }
};

/// kohya's apply_noise_offset: noise + offset · ε (ε of shape (B, C, 1, 1)); with
/// `adaptive_noise_scale` the offset per sample and channel is offset + scale · |mean of the
/// latents over H, W|, clamped at 0.
inline at::Tensor apply_noise_offset(const at::Tensor& latents, const at::Tensor& noise,
                                     double noise_offset,
                                     std::optional<double> adaptive_noise_scale,
                                     const NoiseDraws& draws) {
  if (latents.dim() < 3)
    throw ShapeError("latents " + c10::str(latents.sizes()) + " are not (B, C, H, W)",
                     "apply_noise_offset");
  at::Tensor offset = at::scalar_tensor(noise_offset, noise.options());
  if (adaptive_noise_scale) {
    std::vector<std::int64_t> spatial;
    for (std::int64_t d = 2; d < latents.dim(); ++d) spatial.push_back(d);
    const at::Tensor mean = latents.mean(spatial, /*keepdim=*/true).abs();
    offset = at::clamp_min(noise_offset + *adaptive_noise_scale * mean, 0.0);
  }
  std::vector<std::int64_t> shape{latents.size(0), latents.size(1)};
  for (std::int64_t d = 2; d < latents.dim(); ++d) shape.push_back(1);
  return noise + offset * draws.randn(shape, latents.options());
}

/// kohya's pyramid_noise_like: for i in 0..iterations−1, r = 2 + 2·u (u uniform), a noise of
/// (⌊H / rⁱ⌋, ⌊W / rⁱ⌋) (at least 1) upsampled bilinearly to (H, W) and added with weight
/// discountⁱ (stopping after a 1-wide level), then the sum divided by its standard deviation.
inline at::Tensor pyramid_noise_like(at::Tensor noise, std::int64_t iterations, double discount,
                                     const NoiseDraws& draws) {
  if (noise.dim() != 4)
    throw ShapeError("noise " + c10::str(noise.sizes()) + " is not (B, C, H, W)",
                     "pyramid_noise_like");
  if (iterations < 0 || iterations > 64)
    throw ConfigError("must be from 0 to 64, got " + std::to_string(iterations),
                      "--multires_noise_iterations");
  if (!std::isfinite(discount) || discount < 0)
    throw ConfigError("must be a finite number >= 0", "--multires_noise_discount");
  const std::int64_t b = noise.size(0), c = noise.size(1), w = noise.size(2), h = noise.size(3);
  noise = noise.clone();
  for (std::int64_t i = 0; i < iterations; ++i) {
    const double r = draws.uniform() * 2 + 2;
    const double ri = std::pow(r, static_cast<double>(i));
    // Python's int() of a positive float truncates.
    const auto wn =
        std::max<std::int64_t>(1, static_cast<std::int64_t>(static_cast<double>(w) / ri));
    const auto hn =
        std::max<std::int64_t>(1, static_cast<std::int64_t>(static_cast<double>(h) / ri));
    const at::Tensor level = draws.randn({b, c, wn, hn}, noise.options());
    noise = noise + at::upsample_bilinear2d(level, {w, h}, /*align_corners=*/false) *
                        std::pow(discount, static_cast<double>(i));
    if (wn == 1 || hn == 1) break;
  }
  return noise / noise.std();
}

/// The input perturbation strength of a step: kohya's ip_noise_gamma, times torch.rand(1) (one
/// draw of LibTorch's generator, as the reference draws it) with --ip_noise_gamma_random_strength.
inline double ip_noise_strength(double gamma, bool random_strength, const at::TensorOptions& o) {
  if (!std::isfinite(gamma) || gamma < 0)
    throw ConfigError("must be a finite number >= 0", "--ip_noise_gamma");
  if (!random_strength) return gamma;
  return at::rand({1}, o).item<double>() * gamma;
}

/// The noise the noisy input is made from under input perturbation: noise + strength · ε'.
inline at::Tensor perturbed_noise(const at::Tensor& noise, double strength,
                                  const NoiseDraws& draws) {
  if (strength == 0) return noise;
  return noise + strength * draws.randn(noise.sizes(), noise.options());
}

}  // namespace difftrain::diffusion
