#pragma once
// Line plots with labelled axes, drawn with cairo (antialiased lines, real fonts through
// fontconfig; docs/observability.md says why cairo): a title, axis labels, tick labels on "nice"
// values (1, 2, 5 × 10^k; decades on a log axis), a grid, a legend. A figure is a grid of such
// panels. Linking: the `difftrain::plot` CMake target (cairo).
//
//   log::Axes a{.title = "loss", .x_label = "step", .y_label = "loss", .log_y = true};
//   a.series.push_back({.label = "per step", .x = steps, .y = losses});
//   io::write_png("loss.png", log::plot(a));

#include <cairo.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <numbers>
#include <optional>
#include <string>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/io/png.hpp"

namespace difftrain::log {

struct Rgb {
  double r = 0.12, g = 0.47, b = 0.71;
};
/// A categorical palette (the one most plotting tools start with), for series without a colour.
inline constexpr Rgb kPalette[] = {{0.12, 0.47, 0.71}, {1.00, 0.50, 0.05}, {0.17, 0.63, 0.17},
                                   {0.84, 0.15, 0.16}, {0.58, 0.40, 0.74}, {0.55, 0.34, 0.29},
                                   {0.89, 0.47, 0.76}, {0.50, 0.50, 0.50}};

struct Series {
  std::string label{};  ///< shown in the legend; empty: not listed
  std::vector<double> x, y;
  std::optional<Rgb> color{};  ///< default: the palette, in order
  double line_width = 1.5;
};

struct Axes {
  std::string title{}, x_label{}, y_label{};
  bool log_y = false;  ///< non-positive values are left out on a log axis
  std::vector<Series> series{};
};

struct FigureOptions {
  std::uint32_t width = 800, height = 450;  ///< the whole figure, pixels
  int columns = 1;                          ///< panels per row
  double font_size = 13;                    ///< tick labels; titles and axis labels a bit larger
  bool legend = true;
};

/// Where a panel's parts went, in pixels (what tests look at).
struct PanelLayout {
  struct Box {
    double x0 = 0, y0 = 0, x1 = 0, y1 = 0;
  };
  Box plot_area, title, x_label, y_label, x_ticks, y_ticks;
};

namespace plot_detail {

/// Tick values: multiples of 1, 2 or 5 × 10^k in [lo, hi], about `target` of them.
inline std::vector<double> nice_ticks(double lo, double hi, int target = 6) {
  std::vector<double> t;
  if (!(hi > lo)) return {lo};
  const double raw = (hi - lo) / std::max(1, target);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * mag >= raw) {
      step = m * mag;
      break;
    }
  // k·step as an integer count of 10^e, divided once: 0.03, not 0.030000000000000002.
  const double e = std::floor(std::log10(raw));
  const double units = std::round(step / mag);
  for (auto k = static_cast<long long>(std::ceil(lo / step - 1e-9));
       static_cast<double>(k) * step <= hi + step * 1e-9; ++k) {
    const double n = static_cast<double>(k) * units;
    t.push_back(e < 0 ? n / std::pow(10.0, -e) : n * std::pow(10.0, e));
  }
  return t;
}

/// Log-axis ticks (in log10 units) with the ones that get a label.
inline std::vector<std::pair<double, bool>> log_ticks(double lo, double hi) {
  std::vector<std::pair<double, bool>> t;
  const double span = hi - lo;
  for (int e = static_cast<int>(std::floor(lo)); e <= static_cast<int>(std::ceil(hi)); ++e)
    for (int m = 1; m <= 9; ++m) {
      const double v = e + std::log10(m);
      if (v < lo - 1e-12 || v > hi + 1e-12) continue;
      const bool labelled = m == 1 || (span < 2.2 && (m == 2 || m == 5)) || (span < 0.5);
      t.emplace_back(v, labelled);
    }
  return t;
}

inline std::string tick_label(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g", v);
  return buf;
}

struct CairoDeleter {
  void operator()(cairo_t* c) const { cairo_destroy(c); }
  void operator()(cairo_surface_t* s) const { cairo_surface_destroy(s); }
};

class Painter {
 public:
  explicit Painter(cairo_t* cr) : cr_(cr) {}
  void font(double size, bool bold = false) {
    cairo_select_font_face(cr_, "DejaVu Sans", CAIRO_FONT_SLANT_NORMAL,
                           bold ? CAIRO_FONT_WEIGHT_BOLD : CAIRO_FONT_WEIGHT_NORMAL);
    cairo_set_font_size(cr_, size);
  }
  [[nodiscard]] double text_width(const std::string& s) {
    cairo_text_extents_t e;
    cairo_text_extents(cr_, s.c_str(), &e);
    return e.x_advance;
  }
  [[nodiscard]] double ascent() {
    cairo_font_extents_t e;
    cairo_font_extents(cr_, &e);
    return e.ascent;
  }
  /// Text with its anchor at (x, y): ax/ay 0 left/top, 0.5 centre, 1 right/bottom. Returns its box.
  PanelLayout::Box text(const std::string& s, double x, double y, double ax, double ay,
                        bool vertical = false) {
    if (s.empty()) return {x, y, x, y};
    const double w = text_width(s), h = ascent();
    cairo_save(cr_);
    cairo_translate(cr_, x, y);
    if (vertical) cairo_rotate(cr_, -std::numbers::pi / 2);
    cairo_move_to(cr_, -ax * w, (1 - ay) * h);
    cairo_show_text(cr_, s.c_str());
    cairo_restore(cr_);
    if (vertical) return {x - ay * h, y - (1 - ax) * w, x + (1 - ay) * h, y + ax * w};
    return {x - ax * w, y - ay * h, x + (1 - ax) * w, y + (1 - ay) * h};
  }
  void color(double r, double g, double b) { cairo_set_source_rgb(cr_, r, g, b); }
  void line(double x0, double y0, double x1, double y1, double width) {
    cairo_set_line_width(cr_, width);
    cairo_move_to(cr_, x0, y0);
    cairo_line_to(cr_, x1, y1);
    cairo_stroke(cr_);
  }
  cairo_t* get() { return cr_; }

 private:
  cairo_t* cr_;
};

inline void grow(PanelLayout::Box& b, const PanelLayout::Box& o) {
  if (b.x1 <= b.x0 && b.y1 <= b.y0) {
    b = o;
    return;
  }
  b = {std::min(b.x0, o.x0), std::min(b.y0, o.y0), std::max(b.x1, o.x1), std::max(b.y1, o.y1)};
}

inline PanelLayout draw_panel(Painter& p, const Axes& a, double x0, double y0, double w, double h,
                              const FigureOptions& o) {
  PanelLayout lay;
  const double fs = o.font_size, pad = fs * 0.6;
  // The data's range (finite points; positive ones on a log axis).
  double xlo = std::numeric_limits<double>::infinity(), xhi = -xlo, ylo = xlo, yhi = -xlo;
  auto ty = [&](double v) { return a.log_y ? std::log10(v) : v; };
  auto usable = [&](double x, double y) {
    return std::isfinite(x) && std::isfinite(y) && (!a.log_y || y > 0);
  };
  for (const auto& s : a.series) {
    if (s.x.size() != s.y.size())
      throw ShapeError("series '" + s.label + "' has " + std::to_string(s.x.size()) + " x and " +
                           std::to_string(s.y.size()) + " y values",
                       "plot '" + a.title + "'");
    for (std::size_t i = 0; i < s.x.size(); ++i)
      if (usable(s.x[i], s.y[i])) {
        xlo = std::min(xlo, s.x[i]), xhi = std::max(xhi, s.x[i]);
        ylo = std::min(ylo, ty(s.y[i])), yhi = std::max(yhi, ty(s.y[i]));
      }
  }
  const bool empty = !std::isfinite(xlo);
  if (empty) xlo = 0, xhi = 1, ylo = 0, yhi = 1;
  if (xhi <= xlo) xlo -= 0.5, xhi += 0.5;
  if (yhi <= ylo)
    ylo -= a.log_y ? 0.5 : std::max(std::abs(ylo) * 0.1, 0.5),
        yhi += a.log_y ? 0.5 : std::max(std::abs(yhi) * 0.1, 0.5);
  const double ym = (yhi - ylo) * 0.04;
  ylo -= ym, yhi += ym;
  if (!a.log_y && ylo < 0 && ylo + ym >= 0) ylo = 0;  // a non-negative curve starts at zero

  std::vector<std::pair<double, std::string>> yt, xt;
  std::vector<double> y_minor;
  if (a.log_y) {
    for (const auto& [v, labelled] : log_ticks(ylo, yhi))
      if (labelled)
        yt.emplace_back(v, tick_label(std::pow(10.0, v)));
      else
        y_minor.push_back(v);
  } else {
    for (double v : nice_ticks(ylo, yhi)) yt.emplace_back(v, tick_label(v));
  }
  for (double v : nice_ticks(xlo, xhi)) xt.emplace_back(v, tick_label(v));

  // Margins from the text they hold.
  p.font(fs);
  double ytw = 0;
  for (const auto& t : yt) ytw = std::max(ytw, p.text_width(t.second));
  const double tick_h = p.ascent();
  p.font(fs * 1.15, true);
  const double title_h = a.title.empty() ? 0 : p.ascent() + pad;
  p.font(fs * 1.05);
  const double label_h = p.ascent();
  const double left = x0 + pad + (a.y_label.empty() ? 0 : label_h + pad) + ytw + pad;
  const double right = x0 + w - pad * 2;
  const double top = y0 + pad + title_h + pad * 0.5;
  const double bottom = y0 + h - pad - (a.x_label.empty() ? 0 : label_h + pad) - tick_h - pad;
  lay.plot_area = {left, top, right, bottom};
  auto px = [&](double x) { return left + (x - xlo) / (xhi - xlo) * (right - left); };
  auto py = [&](double y) { return bottom - (y - ylo) / (yhi - ylo) * (bottom - top); };

  // Grid, frame, ticks.
  p.color(0.93, 0.93, 0.93);
  for (double v : y_minor) p.line(left, py(v), right, py(v), 1);
  p.color(0.85, 0.85, 0.85);
  for (const auto& t : yt) p.line(left, py(t.first), right, py(t.first), 1);
  for (const auto& t : xt) p.line(px(t.first), top, px(t.first), bottom, 1);
  p.color(0.25, 0.25, 0.25);
  cairo_set_line_width(p.get(), 1.2);
  cairo_rectangle(p.get(), left, top, right - left, bottom - top);
  cairo_stroke(p.get());
  p.font(fs);
  for (const auto& t : yt) {
    p.line(left - pad * 0.5, py(t.first), left, py(t.first), 1.2);
    grow(lay.y_ticks, p.text(t.second, left - pad * 0.8, py(t.first), 1, 0.5));
  }
  for (const auto& t : xt) {
    p.line(px(t.first), bottom, px(t.first), bottom + pad * 0.5, 1.2);
    grow(lay.x_ticks, p.text(t.second, px(t.first), bottom + pad * 0.8, 0.5, 0));
  }
  p.font(fs * 1.05);
  lay.x_label = p.text(a.x_label, (left + right) / 2, y0 + h - pad, 0.5, 1);
  lay.y_label = p.text(a.y_label, x0 + pad, (top + bottom) / 2, 0.5, 0, true);
  p.font(fs * 1.15, true);
  lay.title = p.text(a.title, (left + right) / 2, y0 + pad, 0.5, 0);
  if (empty) {
    p.font(fs);
    p.color(0.5, 0.5, 0.5);
    p.text("no data", (left + right) / 2, (top + bottom) / 2, 0.5, 0.5);
    return lay;
  }

  // The series, clipped to the plot area; a gap where a point is not usable.
  cairo_save(p.get());
  cairo_rectangle(p.get(), left, top, right - left, bottom - top);
  cairo_clip(p.get());
  cairo_set_line_join(p.get(), CAIRO_LINE_JOIN_ROUND);
  for (std::size_t k = 0; k < a.series.size(); ++k) {
    const Series& s = a.series[k];
    const Rgb c = s.color.value_or(kPalette[k % std::size(kPalette)]);
    p.color(c.r, c.g, c.b);
    cairo_set_line_width(p.get(), s.line_width);
    bool pen = false;
    std::size_t points = 0;
    for (std::size_t i = 0; i < s.x.size(); ++i) {
      if (!usable(s.x[i], s.y[i])) {
        pen = false;
        continue;
      }
      const double X = px(s.x[i]), Y = py(ty(s.y[i]));
      if (pen)
        cairo_line_to(p.get(), X, Y);
      else
        cairo_move_to(p.get(), X, Y);
      pen = true;
      ++points;
    }
    if (points == 1) {  // a single point shows as a dot
      cairo_rel_line_to(p.get(), 0.01, 0);
      cairo_set_line_cap(p.get(), CAIRO_LINE_CAP_ROUND);
      cairo_set_line_width(p.get(), s.line_width * 3);
    }
    cairo_stroke(p.get());
  }
  cairo_restore(p.get());

  // The legend, top right inside the plot area.
  std::vector<std::size_t> listed;
  for (std::size_t k = 0; k < a.series.size(); ++k)
    if (!a.series[k].label.empty()) listed.push_back(k);
  if (o.legend && !listed.empty()) {
    p.font(fs);
    double tw = 0;
    for (std::size_t k : listed) tw = std::max(tw, p.text_width(a.series[k].label));
    const double row = tick_h * 1.6, swatch = fs * 2;
    const double bw = pad * 3 + swatch + tw, bh = pad + row * static_cast<double>(listed.size());
    const double bx = right - bw - pad, by = top + pad;
    cairo_rectangle(p.get(), bx, by, bw, bh);
    cairo_set_source_rgba(p.get(), 1, 1, 1, 0.85);
    cairo_fill_preserve(p.get());
    p.color(0.7, 0.7, 0.7);
    cairo_set_line_width(p.get(), 1);
    cairo_stroke(p.get());
    for (std::size_t i = 0; i < listed.size(); ++i) {
      const Series& s = a.series[listed[i]];
      const Rgb c = s.color.value_or(kPalette[listed[i] % std::size(kPalette)]);
      const double cy = by + pad / 2 + row * (static_cast<double>(i) + 0.5);
      p.color(c.r, c.g, c.b);
      p.line(bx + pad, cy, bx + pad + swatch, cy, std::max(2.0, s.line_width));
      p.color(0.1, 0.1, 0.1);
      p.text(s.label, bx + pad * 2 + swatch, cy, 0, 0.5);
    }
  }
  return lay;
}

}  // namespace plot_detail

/// Draws the panels in a grid, row by row; `layouts` (if given) receives where each part went.
[[nodiscard]] inline io::RgbImage draw_figure(const std::vector<Axes>& panels,
                                              const FigureOptions& o = {},
                                              std::vector<PanelLayout>* layouts = nullptr) {
  using namespace plot_detail;
  if (panels.empty()) throw ConfigError("a figure needs at least one panel", "draw_figure");
  if (o.columns < 1 || o.width < 64 || o.height < 64 || o.width > 16384 || o.height > 16384 ||
      !(o.font_size > 0))
    throw ConfigError("needs columns >= 1, a size from 64 to 16384 pixels and a font size > 0",
                      "draw_figure options");
  std::unique_ptr<cairo_surface_t, CairoDeleter> surface(cairo_image_surface_create(
      CAIRO_FORMAT_RGB24, static_cast<int>(o.width), static_cast<int>(o.height)));
  std::unique_ptr<cairo_t, CairoDeleter> cr(cairo_create(surface.get()));
  cairo_set_source_rgb(cr.get(), 1, 1, 1);
  cairo_paint(cr.get());
  Painter p(cr.get());
  const auto cols = static_cast<std::size_t>(o.columns);
  const std::size_t rows = (panels.size() + cols - 1) / cols;
  const double cw =
      static_cast<double>(o.width) / static_cast<double>(std::min(cols, panels.size()));
  const double ch = static_cast<double>(o.height) / static_cast<double>(rows);
  for (std::size_t i = 0; i < panels.size(); ++i) {
    const PanelLayout lay = draw_panel(p, panels[i], cw * static_cast<double>(i % cols),
                                       ch * static_cast<double>(i / cols), cw, ch, o);
    if (layouts != nullptr) layouts->push_back(lay);
  }
  if (cairo_status(cr.get()) != CAIRO_STATUS_SUCCESS)
    throw FormatError(
        std::string("cannot be drawn: ") + cairo_status_to_string(cairo_status(cr.get())),
        "draw_figure");
  cairo_surface_flush(surface.get());
  io::RgbImage img(o.width, o.height);
  const unsigned char* data = cairo_image_surface_get_data(surface.get());
  const int stride = cairo_image_surface_get_stride(surface.get());
  for (std::uint32_t y = 0; y < o.height; ++y) {
    const auto* row =
        reinterpret_cast<const std::uint32_t*>(data + static_cast<std::ptrdiff_t>(y) * stride);
    for (std::uint32_t x = 0; x < o.width; ++x) {
      std::uint8_t* px = img.at(x, y);
      px[0] = static_cast<std::uint8_t>((row[x] >> 16) & 0xFF);
      px[1] = static_cast<std::uint8_t>((row[x] >> 8) & 0xFF);
      px[2] = static_cast<std::uint8_t>(row[x] & 0xFF);
    }
  }
  return img;
}

/// One panel.
[[nodiscard]] inline io::RgbImage plot(const Axes& axes, const FigureOptions& o = {},
                                       PanelLayout* layout = nullptr) {
  std::vector<PanelLayout> l;
  io::RgbImage img = draw_figure({axes}, o, &l);
  if (layout != nullptr) *layout = l.front();
  return img;
}

/// The running mean of the last `window` values (fewer at the start), NaNs skipped.
[[nodiscard]] inline std::vector<double> running_mean(const std::vector<double>& v,
                                                      std::size_t window) {
  std::vector<double> out(v.size(), std::nan(""));
  double sum = 0;
  std::size_t n = 0;
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (std::isfinite(v[i])) sum += v[i], ++n;
    if (i >= window && std::isfinite(v[i - window])) sum -= v[i - window], --n;
    if (n > 0) out[i] = sum / static_cast<double>(n);
  }
  return out;
}

}  // namespace difftrain::log
