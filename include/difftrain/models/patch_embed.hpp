#pragma once
// diffusers' PatchEmbed: a p×p convolution with stride p turns a latent (B, C, H, W) into
// (H/p)·(W/p) tokens, plus the fixed 2-D sine-cosine position table of
// get_2d_sincos_pos_embed (MAE's, with diffusers' base_size and interpolation_scale). The table
// is not a parameter and diffusers does not save it (a non-persistent buffer): it is computed
// here for the input's grid and kept for the next call of the same size and device. With
// `pos_embed_max_size` (SD3) the table of the largest grid is a saved buffer, `pos_embed`, and
// each input takes its centre crop, as diffusers' cropped_pos_embed.

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "difftrain/core/error.hpp"

namespace difftrain::models {

/// get_1d_sincos_pos_embed_from_grid(embed_dim, positions): (N, embed_dim), the sines of
/// positions · 10000^(−i / (embed_dim/2)) then their cosines, taken in float64 as diffusers does
/// and returned in `dtype` (float32, as diffusers' 2-D tables are; CogVideoX's 3-D table keeps
/// float64).
inline at::Tensor sincos_1d_pos_embed(std::int64_t embed_dim, const at::Tensor& positions,
                                      at::ScalarType dtype = at::kFloat) {
  if (embed_dim <= 0 || embed_dim % 2 != 0)
    throw ConfigError("the embedding width " + std::to_string(embed_dim) +
                          " must be a positive even number (a sine and a cosine half)",
                      "sincos_1d_pos_embed");
  const std::int64_t half = embed_dim / 2;
  at::Tensor omega = at::arange(half, positions.options().dtype(at::kDouble)) / (embed_dim / 2.0);
  omega = 1.0 / at::pow(10000.0, omega);
  const at::Tensor out = at::outer(positions.reshape(-1).to(at::kDouble), omega);
  return at::cat({out.sin(), out.cos()}, 1).to(dtype);
}

/// The 2-D table for float32 positions of the rows and columns of a (rows × cols) grid:
/// (rows·cols, embed_dim), row-major over the grid. As in diffusers, the first half of each vector
/// encodes the column and the second half the row (its meshgrid is "xy").
inline at::Tensor sincos_2d_pos_embed_from_positions(std::int64_t embed_dim,
                                                     const at::Tensor& row_positions,
                                                     const at::Tensor& col_positions,
                                                     at::ScalarType dtype = at::kFloat) {
  if (embed_dim <= 0 || embed_dim % 4 != 0)
    throw ConfigError("the embedding width " + std::to_string(embed_dim) +
                          " must be a positive multiple of 4 (a sine and a cosine half for each "
                          "of the two axes)",
                      "sincos_2d_pos_embed");
  const std::int64_t h = row_positions.numel(), w = col_positions.numel();
  if (h <= 0 || w <= 0)
    throw ShapeError("an empty grid " + std::to_string(h) + "x" + std::to_string(w),
                     "sincos_2d_pos_embed");
  const at::Tensor rows = row_positions.view({h, 1}).expand({h, w}).reshape(-1);
  const at::Tensor cols = col_positions.view({1, w}).expand({h, w}).reshape(-1);
  return at::cat({sincos_1d_pos_embed(embed_dim / 2, cols, dtype),
                  sincos_1d_pos_embed(embed_dim / 2, rows, dtype)},
                 1);
}

/// get_2d_sincos_pos_embed(embed_dim, (grid_h, grid_w), base_size, interpolation_scale):
/// (grid_h·grid_w, embed_dim) float32; positions are arange(n) / (n / base_size) /
/// interpolation_scale in float32.
inline at::Tensor sincos_2d_pos_embed(std::int64_t embed_dim, std::int64_t grid_h,
                                      std::int64_t grid_w, double base_size,
                                      double interpolation_scale = 1.0,
                                      at::Device device = at::kCPU) {
  if (grid_h <= 0 || grid_w <= 0)
    throw ShapeError("an empty grid " + std::to_string(grid_h) + "x" + std::to_string(grid_w),
                     "sincos_2d_pos_embed");
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  auto positions = [&](std::int64_t n) {
    return at::arange(n, f32) / (static_cast<double>(n) / base_size) / interpolation_scale;
  };
  return sincos_2d_pos_embed_from_positions(embed_dim, positions(grid_h), positions(grid_w));
}

/// The patch grid (h, w) of latents (B, in_channels, H, W), whose H and W must be multiples of
/// `patch`; anything else is a ShapeError at `where`. Every patched transformer checks its input
/// with it.
inline std::pair<std::int64_t, std::int64_t> patch_grid(const at::Tensor& latents,
                                                        std::int64_t in_channels,
                                                        std::int64_t patch,
                                                        const std::string& where) {
  if (latents.dim() != 4 || latents.size(1) != in_channels)
    throw ShapeError("expects latents (B, " + std::to_string(in_channels) + ", H, W), got " +
                         c10::str(latents.sizes()),
                     where);
  if (latents.size(2) % patch != 0 || latents.size(3) % patch != 0)
    throw ShapeError("the latent size " + std::to_string(latents.size(2)) + "x" +
                         std::to_string(latents.size(3)) + " is not a multiple of patch_size " +
                         std::to_string(patch),
                     where);
  return {latents.size(2) / patch, latents.size(3) / patch};
}

/// A batch's timesteps on `device`: one value for all `batch` samples, or (B,).
inline at::Tensor batch_timesteps(const at::Tensor& timestep, std::int64_t batch, at::Device device,
                                  const std::string& where) {
  at::Tensor t = timestep.to(device);
  if (t.numel() == 1) t = t.reshape({}).expand({batch});
  if (t.dim() != 1 || t.size(0) != batch)
    throw ShapeError("timestep must be one value or (B,) = (" + std::to_string(batch) + ",), got " +
                         c10::str(timestep.sizes()),
                     where);
  return t;
}

/// Patch tokens (B, h·w, p·p·C) back to an image (B, C, h·p, w·p): "n h w p q c -> n c (h p) (w
/// q)".
inline at::Tensor unpatchify(const at::Tensor& tokens, std::int64_t h, std::int64_t w,
                             std::int64_t patch, std::int64_t channels) {
  const std::int64_t b = tokens.size(0);
  return tokens.reshape({b, h, w, patch, patch, channels})
      .permute({0, 5, 1, 3, 2, 4})
      .reshape({b, channels, h * patch, w * patch});
}

struct PatchEmbedOptions {
  std::int64_t height = 224, width = 224;  // the configured sample size, in latent pixels
  std::int64_t patch_size = 16;
  std::int64_t in_channels = 3;
  std::int64_t embed_dim = 768;
  bool layer_norm = false;
  bool bias = true;
  double interpolation_scale = 1.0;
  std::optional<std::int64_t> pos_embed_max_size;  // in patches; then the table is cropped
};

class PatchEmbedImpl : public torch::nn::Module {
 public:
  explicit PatchEmbedImpl(const PatchEmbedOptions& o) : o_(o) {
    if (o.patch_size <= 0 || o.in_channels <= 0 || o.embed_dim <= 0)
      throw ConfigError("patch_size, in_channels and embed_dim must be positive", "PatchEmbed");
    if (o.height < o.patch_size || o.width < o.patch_size)
      throw ConfigError("the sample size " + std::to_string(o.height) + "x" +
                            std::to_string(o.width) + " is smaller than one patch of " +
                            std::to_string(o.patch_size),
                        "PatchEmbed");
    // Checked now, not at the first call: a width the table cannot have is a config mistake.
    if (o.embed_dim % 4 != 0)
      throw ConfigError("the inner width " + std::to_string(o.embed_dim) +
                            " (heads × head width) must be a multiple of 4 for the 2-D sine-cosine "
                            "position table",
                        "PatchEmbed");
    proj = register_module(
        "proj", torch::nn::Conv2d(torch::nn::Conv2dOptions(o.in_channels, o.embed_dim, o.patch_size)
                                      .stride(o.patch_size)
                                      .bias(o.bias)));
    if (o.layer_norm)
      norm = register_module(
          "norm",
          torch::nn::LayerNorm(
              torch::nn::LayerNormOptions({o.embed_dim}).elementwise_affine(false).eps(1e-6)));
    if (o.pos_embed_max_size) {
      const std::int64_t m = *o.pos_embed_max_size;
      if (m <= 0) throw ConfigError("pos_embed_max_size must be positive", "PatchEmbed");
      max_table_ = register_buffer(
          "pos_embed",
          sincos_2d_pos_embed(o.embed_dim, m, m, static_cast<double>(o.height / o.patch_size),
                              o.interpolation_scale)
              .unsqueeze(0));
    }
  }

  /// (B, C, H, W) → (B, (H/p)·(W/p), embed_dim); H and W must be multiples of the patch size.
  at::Tensor forward(const at::Tensor& latent) {
    const auto [h, w] = patch_grid(latent, o_.in_channels, o_.patch_size, "PatchEmbed");
    at::Tensor x = proj->forward(latent).flatten(2).transpose(1, 2);
    if (norm) x = norm->forward(x);
    return (x + pos_embed(h, w, x.device())).to(x.scalar_type());
  }

  /// The (1, h·w, embed_dim) float32 table for a grid of h×w patches.
  at::Tensor pos_embed(std::int64_t h, std::int64_t w, at::Device device) {
    if (o_.pos_embed_max_size) {
      const std::int64_t m = *o_.pos_embed_max_size;
      if (h > m || w > m)
        throw ShapeError("a grid of " + std::to_string(h) + "x" + std::to_string(w) +
                             " patches exceeds pos_embed_max_size " + std::to_string(m),
                         "PatchEmbed");
      const std::int64_t top = (m - h) / 2, left = (m - w) / 2;
      return max_table_.view({1, m, m, -1})
          .narrow(1, top, h)
          .narrow(2, left, w)
          .reshape({1, h * w, -1});
    }
    if (!table_.defined() || table_h_ != h || table_w_ != w || table_.device() != device) {
      table_ =
          sincos_2d_pos_embed(o_.embed_dim, h, w, static_cast<double>(o_.height / o_.patch_size),
                              o_.interpolation_scale, device)
              .unsqueeze(0);
      table_h_ = h;
      table_w_ = w;
    }
    return table_;
  }

  [[nodiscard]] const PatchEmbedOptions& options() const { return o_; }

  torch::nn::Conv2d proj{nullptr};
  torch::nn::LayerNorm norm{nullptr};

 private:
  PatchEmbedOptions o_;
  at::Tensor max_table_;  // the saved table of pos_embed_max_size (SD3), or undefined
  at::Tensor table_;
  std::int64_t table_h_ = 0, table_w_ = 0;
};
TORCH_MODULE(PatchEmbed);

}  // namespace difftrain::models
