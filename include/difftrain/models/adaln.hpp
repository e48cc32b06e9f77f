#pragma once
// What diffusers' adaLN transformers (DiT, PixArt, SD3 and the Flux-like ones after them) share:
// the modulation x·(1 + scale) + shift, the sinusoidal timestep embedder every one of them puts in
// front of its conditioning (256 channels, sin and cos flipped, then TimestepEmbedding), the
// layer norm without affine parameters the modulation follows, and PixArtAlphaTextProjection.

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <cstdint>

#include "difftrain/models/embeddings.hpp"

namespace difftrain::models {

/// x·(1 + scale) + shift. Modulations of shape (B, D) are broadcast over the tokens of x
/// (B, N, D); those already (B, 1, D) are used as they are.
inline at::Tensor modulate(const at::Tensor& x, const at::Tensor& shift, const at::Tensor& scale) {
  if (scale.dim() + 1 == x.dim()) return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1);
  return x * (1 + scale) + shift;
}

/// The width of the sinusoidal projection the adaLN transformers embed timesteps from.
inline constexpr std::int64_t kAdaLnTimestepChannels = 256;

/// diffusers' Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift): the sinusoidal
/// projection of timesteps (B,) → (B, 256), in float32.
inline at::Tensor project_timesteps(const at::Tensor& timesteps, double downscale_freq_shift) {
  return timestep_embedding(timesteps, kAdaLnTimestepChannels, /*flip_sin_to_cos=*/true,
                            downscale_freq_shift);
}

/// diffusers' TimestepEmbedding(256, width): linear_1 → SiLU → linear_2 over project_timesteps.
inline TimestepEmbedding<> adaln_timestep_embedder(std::int64_t width) {
  TimestepEmbeddingOptions o;
  o.in_channels = kAdaLnTimestepChannels;
  o.time_embed_dim = width;
  return TimestepEmbedding<>(o);
}

/// The LayerNorm an adaLN modulation follows: no affine parameters, eps 1e-6.
inline torch::nn::LayerNorm adaln_layer_norm(std::int64_t dim) {
  return torch::nn::LayerNorm(
      torch::nn::LayerNormOptions({dim}).elementwise_affine(false).eps(1e-6));
}

/// diffusers' PixArtAlphaTextProjection: linear_1 → GELU-tanh (PixArt's captions) or SiLU (SD3's
/// pooled text) → linear_2.
class PixArtTextProjectionImpl : public torch::nn::Module {
 public:
  PixArtTextProjectionImpl(std::int64_t in_features, std::int64_t hidden_size, bool silu = false)
      : silu_(silu) {
    linear_1 = register_module("linear_1", torch::nn::Linear(in_features, hidden_size));
    linear_2 = register_module("linear_2", torch::nn::Linear(hidden_size, hidden_size));
  }
  at::Tensor forward(const at::Tensor& caption) {
    const at::Tensor h = linear_1->forward(caption);
    return linear_2->forward(silu_ ? at::silu(h) : at::gelu(h, "tanh"));
  }
  torch::nn::Linear linear_1{nullptr}, linear_2{nullptr};

 private:
  bool silu_;
};
TORCH_MODULE(PixArtTextProjection);

}  // namespace difftrain::models
