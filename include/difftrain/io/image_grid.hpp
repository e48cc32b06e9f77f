#pragma once
// A batch of image tensors laid out as one RGB picture (torchvision's make_grid): `columns`
// images per row, `padding` pixels of `background` between them. Values map linearly from
// [low, high] to [0, 255] and are clamped, so a model's [-1, 1] output goes in unchanged.

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "difftrain/core/error.hpp"
#include "difftrain/io/png.hpp"

namespace difftrain::io {

struct GridOptions {
  std::int64_t columns = 8;
  std::uint32_t padding = 2;
  std::uint8_t background = 0;
  double low = -1.0;
  double high = 1.0;
};

/// `images` is (N, C, H, W) with C = 1 (grey) or 3 (RGB), on any device, any float dtype.
inline RgbImage image_grid(const at::Tensor& images, const GridOptions& o = {}) {
  const std::string where = "image_grid";
  if (images.dim() != 4 || (images.size(1) != 1 && images.size(1) != 3))
    throw ShapeError("expects (N, 1 or 3, H, W) images, got " + c10::str(images.sizes()), where);
  if (images.size(0) == 0) throw ShapeError("got no images", where);
  if (o.columns < 1) throw ConfigError("columns must be >= 1", where);
  if (!(o.high > o.low)) throw ConfigError("needs high > low", where);
  const std::int64_t n = images.size(0), h = images.size(2), w = images.size(3);
  const std::int64_t cols = std::min(o.columns, n), rows = (n + cols - 1) / cols;
  const std::int64_t pad = o.padding;
  const std::int64_t width = cols * w + (cols + 1) * pad, height = rows * h + (rows + 1) * pad;
  if (width > (1 << 20) || height > (1 << 20))
    throw ShapeError("would be " + std::to_string(width) + "×" + std::to_string(height) +
                         " pixels; use fewer columns or images",
                     where);
  // To 8-bit, channels last, on the CPU: one conversion for the whole batch.
  const at::Tensor bytes =
      ((images.detach().to(at::kCPU, at::kFloat) - o.low) * (255.0 / (o.high - o.low)))
          .round()
          .clamp(0, 255)
          .to(at::kByte)
          .expand({n, 3, h, w})
          .permute({0, 2, 3, 1})
          .contiguous();
  const auto* src = bytes.data_ptr<std::uint8_t>();
  RgbImage out(static_cast<std::uint32_t>(width), static_cast<std::uint32_t>(height), o.background);
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t x0 = pad + (i % cols) * (w + pad), y0 = pad + (i / cols) * (h + pad);
    for (std::int64_t y = 0; y < h; ++y)
      std::copy_n(src + ((i * h + y) * w) * 3, w * 3,
                  out.at(static_cast<std::uint32_t>(x0), static_cast<std::uint32_t>(y0 + y)));
  }
  return out;
}

}  // namespace difftrain::io
