#pragma once
// The image transforms of the training scripts with torchvision's meaning, on uint8 (C, H, W)
// tensors (or (N, C, H, W)): resize (the shorter side to a size, or to (h, w); bilinear or bicubic
// with antialiasing, or nearest), center and random crop, horizontal flip, and the float
// conversion to [-1, 1] (ToTensor then Normalize([0.5], [0.5])). The deterministic ones run the
// same ATen kernels as torchvision.transforms.v2.functional with the same dtypes, so they are
// equal to it to the bit; diffusers' scripts resize PIL images instead, and docs/data.md states
// how far torchvision's resize (and so this one) is from PIL's.

#include <ATen/ATen.h>
#include <ATen/Version.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "difftrain/core/error.hpp"

namespace difftrain::data {

enum class Interpolation { nearest, bilinear, bicubic };

/// torchvision's output size: `size` of one value sets the shorter side (the longer one scaled
/// and truncated, then capped at max_size), of two values is (height, width).
inline std::array<std::int64_t, 2> resized_size(std::int64_t height, std::int64_t width,
                                                const std::vector<std::int64_t>& size,
                                                std::optional<std::int64_t> max_size = {}) {
  const std::string where = "resize";
  if (size.empty() || size.size() > 2)
    throw ConfigError("size must hold one value (the shorter side) or two (height, width)", where);
  for (const auto s : size)
    if (s < 1) throw ConfigError("size " + std::to_string(s) + " must be at least 1", where);
  if (size.size() == 2) {
    if (max_size) throw ConfigError("max_size applies only to a one-value size", where);
    return {size[0], size[1]};
  }
  const bool portrait = width <= height;
  const std::int64_t shorter = portrait ? width : height, longer = portrait ? height : width;
  std::int64_t new_short = size[0];
  auto new_long = static_cast<std::int64_t>(
      static_cast<double>(new_short) * static_cast<double>(longer) / static_cast<double>(shorter));
  if (max_size) {
    if (*max_size <= new_short)
      throw ConfigError("max_size " + std::to_string(*max_size) +
                            " must be greater than the shorter side's size " +
                            std::to_string(new_short),
                        where);
    if (new_long > *max_size) {
      new_short =
          static_cast<std::int64_t>(static_cast<double>(*max_size) *
                                    static_cast<double>(new_short) / static_cast<double>(new_long));
      new_long = *max_size;
    }
  }
  return portrait ? std::array<std::int64_t, 2>{new_long, new_short}
                  : std::array<std::int64_t, 2>{new_short, new_long};
}

namespace transform_detail {

inline void check_image(const at::Tensor& img, const char* what) {
  if (img.dim() != 3 && img.dim() != 4)
    throw ShapeError(std::string("expects (C, H, W) or (N, C, H, W), got ") + c10::str(img.sizes()),
                     what);
}

/// Whether torchvision resizes uint8 with bilinear natively on this CPU (it does with AVX2 and
/// AVX-512 kernels, else through float32 and rounding).
inline bool native_uint8_bilinear() {
  const std::string cap = at::get_cpu_capability();
  return cap == "AVX2" || cap == "AVX512";
}

}  // namespace transform_detail

/// torchvision.transforms.v2.functional.resize of a uint8 or float image.
inline at::Tensor resize(const at::Tensor& img, const std::vector<std::int64_t>& size,
                         Interpolation mode = Interpolation::bilinear, bool antialias = true,
                         std::optional<std::int64_t> max_size = {}) {
  transform_detail::check_image(img, "resize");
  const auto h = img.size(-2), w = img.size(-1), c = img.size(-3);
  const auto [nh, nw] = resized_size(h, w, size, max_size);
  if (nh == h && nw == w) return img;
  if (img.numel() == 0) throw ShapeError("cannot resize an empty image", "resize");
  const auto dtype = img.scalar_type();
  bool native = dtype == at::kFloat || dtype == at::kDouble;
  if (dtype == at::kByte)
    native = mode == Interpolation::nearest ||
             (img.is_cpu() &&
              (mode == Interpolation::bicubic || transform_detail::native_uint8_bilinear()));
  at::Tensor x = img.reshape({-1, c, h, w});
  if (!native) x = x.to(at::kFloat);
  const std::vector<std::int64_t> out{nh, nw};
  switch (mode) {
    case Interpolation::nearest:
      x = at::upsample_nearest2d(x, out);
      break;
    case Interpolation::bilinear:
      x = antialias ? at::_upsample_bilinear2d_aa(x, out, false)
                    : at::upsample_bilinear2d(x, out, false);
      break;
    case Interpolation::bicubic:
      x = antialias ? at::_upsample_bicubic2d_aa(x, out, false)
                    : at::upsample_bicubic2d(x, out, false);
      break;
  }
  if (!native) {
    if (mode == Interpolation::bicubic && dtype == at::kByte) x = x.clamp(0, 255);
    if (!at::isFloatingType(dtype)) x = x.round();
    x = x.to(dtype);
  }
  std::vector<std::int64_t> shape(img.sizes().begin(), img.sizes().end() - 2);
  shape.push_back(nh);
  shape.push_back(nw);
  return x.reshape(shape);
}

/// Where a crop starts: SDXL's crop_coords_top_left.
struct CropCorner {
  std::int64_t top = 0, left = 0;
};

/// torchvision's center_crop: the anchor round((H - h) / 2) (Python's round, half to even), the
/// image zero-padded first where the crop is larger.
inline at::Tensor center_crop(const at::Tensor& img, std::int64_t height, std::int64_t width,
                              CropCorner* corner = nullptr) {
  transform_detail::check_image(img, "center_crop");
  if (height < 1 || width < 1)
    throw ConfigError(
        "a crop of " + std::to_string(height) + "x" + std::to_string(width) + " is empty",
        "center_crop");
  at::Tensor x = img;
  auto ih = x.size(-2), iw = x.size(-1);
  if (height > ih || width > iw) {
    const std::int64_t left = width > iw ? (width - iw) / 2 : 0;
    const std::int64_t top = height > ih ? (height - ih) / 2 : 0;
    const std::int64_t right = width > iw ? (width - iw + 1) / 2 : 0;
    const std::int64_t bottom = height > ih ? (height - ih + 1) / 2 : 0;
    x = at::constant_pad_nd(x, {left, right, top, bottom}, 0);
    ih = x.size(-2);
    iw = x.size(-1);
  }
  const auto top =
      static_cast<std::int64_t>(std::nearbyint(static_cast<double>(ih - height) / 2.0));
  const auto left =
      static_cast<std::int64_t>(std::nearbyint(static_cast<double>(iw - width) / 2.0));
  if (corner != nullptr) *corner = {top, left};
  return x.slice(-2, top, top + height).slice(-1, left, left + width);
}

/// torchvision's RandomCrop (no padding): the corner drawn as RandomCrop.get_params draws it,
/// torch.randint(0, H - h + 1) then torch.randint(0, W - w + 1), from `generator`.
inline at::Tensor random_crop(const at::Tensor& img, std::int64_t height, std::int64_t width,
                              at::Generator generator, CropCorner* corner = nullptr) {
  transform_detail::check_image(img, "random_crop");
  const auto ih = img.size(-2), iw = img.size(-1);
  if (height < 1 || width < 1 || height > ih || width > iw)
    throw ShapeError("a crop of " + std::to_string(height) + "x" + std::to_string(width) +
                         " does not fit the image's " + std::to_string(ih) + "x" +
                         std::to_string(iw),
                     "random_crop");
  CropCorner c;
  if (!(ih == height && iw == width)) {
    c.top = at::randint(0, ih - height + 1, {1}, generator, at::kLong).item<std::int64_t>();
    c.left = at::randint(0, iw - width + 1, {1}, generator, at::kLong).item<std::int64_t>();
  }
  if (corner != nullptr) *corner = c;
  return img.slice(-2, c.top, c.top + height).slice(-1, c.left, c.left + width);
}

inline at::Tensor horizontal_flip(const at::Tensor& img) {
  transform_detail::check_image(img, "horizontal_flip");
  return img.flip({-1});
}

/// transforms.ToTensor() then Normalize([0.5], [0.5]): uint8 to float32 in [-1, 1], as the
/// training scripts feed the VAE.
inline at::Tensor to_unit_range(const at::Tensor& img) {
  transform_detail::check_image(img, "to_unit_range");
  if (img.scalar_type() != at::kByte)
    throw ShapeError(
        std::string("expects uint8 pixels, got ") + std::string(c10::toString(img.scalar_type())),
        "to_unit_range");
  return img.to(at::kFloat).div_(255).sub_(0.5).div_(0.5);
}

}  // namespace difftrain::data
