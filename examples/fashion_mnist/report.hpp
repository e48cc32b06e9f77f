#pragma once
// What the run leaves behind besides checkpoints: the loss curve as a picture (drawn here, so the
// program needs no plotting library).

#include <difftrain/io/atomic_file.hpp>
#include <difftrain/io/png.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace fmnist {

struct LossCurve {
  std::vector<double> steps, losses;
};

/// Reads the step and loss columns of the trainer's CSV loss log.
inline LossCurve read_loss_log(const std::filesystem::path& path) {
  LossCurve c;
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);  // header: step,epoch,epoch_step,loss,learn_rate
  while (std::getline(in, line)) {
    std::stringstream row(line);
    std::string cell;
    std::vector<std::string> cells;
    while (std::getline(row, cell, ',')) cells.push_back(cell);
    if (cells.size() < 4) continue;
    try {
      c.steps.push_back(std::stod(cells[0]));
      c.losses.push_back(std::stod(cells[3]));
    } catch (const std::exception&) {
      c.steps.resize(c.losses.size());
    }
  }
  return c;
}

/// The loss per step (light) and its running mean (dark) on a log scale, with a grid line per
/// power of ten and per tenth of the steps.
inline difftrain::io::RgbImage plot_loss(const LossCurve& c, std::uint32_t w = 720,
                                         std::uint32_t h = 360) {
  difftrain::io::RgbImage img(w, h, 255);
  const std::int64_t left = 20, right = w - 20, top = 20, bottom = h - 20;
  auto put = [&](std::int64_t x, std::int64_t y, std::uint8_t r, std::uint8_t g, std::uint8_t b) {
    if (x < 0 || y < 0 || x >= w || y >= h) return;
    std::uint8_t* p = img.at(static_cast<std::uint32_t>(x), static_cast<std::uint32_t>(y));
    p[0] = r, p[1] = g, p[2] = b;
  };
  for (std::int64_t x = left; x <= right; ++x)
    put(x, top, 120, 120, 120), put(x, bottom, 120, 120, 120);
  for (std::int64_t y = top; y <= bottom; ++y)
    put(left, y, 120, 120, 120), put(right, y, 120, 120, 120);
  std::vector<double> s, l;
  for (std::size_t i = 0; i < c.losses.size(); ++i)
    if (std::isfinite(c.losses[i]) && c.losses[i] > 0)
      s.push_back(c.steps[i]), l.push_back(c.losses[i]);
  if (l.size() < 2) return img;
  std::vector<double> smooth(l.size());
  const double k = 2.0 / (1.0 + std::max<double>(5.0, static_cast<double>(l.size()) / 40.0));
  smooth[0] = l[0];
  for (std::size_t i = 1; i < l.size(); ++i) smooth[i] = smooth[i - 1] + k * (l[i] - smooth[i - 1]);
  const double lo = std::log10(*std::min_element(l.begin(), l.end()));
  const double hi = std::log10(*std::max_element(l.begin(), l.end()));
  const double span = std::max(hi - lo, 1e-6), x0 = s.front(), xs = std::max(s.back() - x0, 1.0);
  auto px = [&](double step) { return left + std::lround((step - x0) / xs * (right - left)); };
  auto py = [&](double loss) {
    return bottom - std::lround((std::log10(loss) - lo) / span * (bottom - top));
  };
  for (int e = static_cast<int>(std::floor(lo)); e <= static_cast<int>(std::ceil(hi)); ++e)
    for (int m = 1; m <= 9; ++m) {
      const double v = m * std::pow(10.0, e);
      if (std::log10(v) < lo || std::log10(v) > hi) continue;
      const std::uint8_t shade = m == 1 ? 190 : 230;
      for (std::int64_t x = left + 1; x < right; ++x) put(x, py(v), shade, shade, shade);
    }
  for (int q = 1; q < 10; ++q)
    for (std::int64_t y = top + 1; y < bottom; ++y)
      put(left + q * (right - left) / 10, y, 230, 230, 230);
  auto line = [&](const std::vector<double>& v, std::uint8_t r, std::uint8_t g, std::uint8_t b) {
    for (std::size_t i = 1; i < v.size(); ++i) {
      const std::int64_t xa = px(s[i - 1]), ya = py(v[i - 1]), xb = px(s[i]), yb = py(v[i]);
      const std::int64_t n = std::max<std::int64_t>({1, std::abs(xb - xa), std::abs(yb - ya)});
      for (std::int64_t t = 0; t <= n; ++t)
        put(xa + (xb - xa) * t / n, ya + (yb - ya) * t / n, r, g, b);
    }
  };
  line(l, 170, 200, 235);
  line(smooth, 20, 70, 160);
  return img;
}

}  // namespace fmnist
