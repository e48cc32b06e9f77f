#pragma once
// Classifier-free guidance and a sampling loop over any model callable, in chunks of a batch size.

#include <ATen/ATen.h>
#include <ATen/core/Generator.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "difftrain/core/error.hpp"

namespace difftrain::diffusion {

/// uncond + scale·(cond − uncond), then (guidance_rescale > 0) rescaled towards the conditional
/// prediction's standard deviation (Lin et al. 2023, diffusers' rescale_noise_cfg).
inline at::Tensor classifier_free_guidance(const at::Tensor& cond, const at::Tensor& uncond,
                                           double scale, double guidance_rescale = 0.0) {
  if (cond.sizes() != uncond.sizes())
    throw ShapeError("conditional output " + c10::str(cond.sizes()) + " vs unconditional " +
                         c10::str(uncond.sizes()),
                     "classifier_free_guidance");
  at::Tensor cfg = uncond + scale * (cond - uncond);
  if (guidance_rescale > 0) {
    std::vector<std::int64_t> dims;
    for (std::int64_t d = 1; d < cond.dim(); ++d) dims.push_back(d);
    const at::Tensor std_text = cond.std(dims, /*unbiased=*/true, /*keepdim=*/true);
    const at::Tensor std_cfg = cfg.std(dims, true, true);
    const at::Tensor rescaled = cfg * (std_text / std_cfg);
    cfg = guidance_rescale * rescaled + (1 - guidance_rescale) * cfg;
  }
  return cfg;
}

/// Runs `f(begin, end)` over [0, total) in chunks of at most `chunk` and concatenates the results
/// along dim 0, so sampling a large batch never holds more than `chunk` samples' activations.
template <class F>
at::Tensor in_chunks(std::int64_t total, std::int64_t chunk, F&& f) {
  if (chunk <= 0) throw ConfigError("must be > 0", "sampling chunk size");
  std::vector<at::Tensor> parts;
  for (std::int64_t begin = 0; begin < total; begin += chunk)
    parts.push_back(f(begin, std::min(total, begin + chunk)));
  return at::cat(parts, 0);
}

}  // namespace difftrain::diffusion
