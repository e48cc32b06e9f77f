#pragma once
// What the run leaves behind besides checkpoints: the loss and learning-rate curves as pictures
// with labelled axes (difftrain/log/plot.hpp, cairo).

#include <difftrain/io/atomic_file.hpp>
#include <difftrain/io/png.hpp>
#if DIFFTRAIN_HAS_PLOT
#include <difftrain/log/plot.hpp>
#endif

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
  std::vector<double> steps, losses, lrs;
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
    if (cells.size() < 5) continue;
    try {
      const double step = std::stod(cells[0]), loss = std::stod(cells[3]), lr = std::stod(cells[4]);
      c.steps.push_back(step);
      c.losses.push_back(loss);
      c.lrs.push_back(lr);
    } catch (const std::exception&) {  // a row cut by a crash: left out
    }
  }
  return c;
}

#if DIFFTRAIN_HAS_PLOT
/// The loss per step (light) and its running mean (dark) over the steps, on a log axis. The mean
/// spans a 40th of the run (5 to 200 steps).
inline difftrain::io::RgbImage plot_loss(const LossCurve& c) {
  namespace lg = difftrain::log;
  const std::size_t window = std::clamp<std::size_t>(c.losses.size() / 40, 5, 200);
  lg::Axes a{.title = "Training loss",
             .x_label = "optimizer step",
             .y_label = "loss (log scale)",
             .log_y = true};
  a.series.push_back({.label = "per step",
                      .x = c.steps,
                      .y = c.losses,
                      .color = lg::Rgb{0.68, 0.80, 0.92},
                      .line_width = 1});
  a.series.push_back({.label = "running mean (" + std::to_string(window) + " steps)",
                      .x = c.steps,
                      .y = lg::running_mean(c.losses, window),
                      .color = lg::Rgb{0.08, 0.28, 0.63},
                      .line_width = 2});
  return lg::plot(a, {.width = 800, .height = 420});
}

/// The learning rate each step used.
inline difftrain::io::RgbImage plot_lr(const LossCurve& c) {
  namespace lg = difftrain::log;
  lg::Axes a{.title = "Learning rate", .x_label = "optimizer step", .y_label = "learning rate"};
  a.series.push_back({.label = "", .x = c.steps, .y = c.lrs});
  return lg::plot(a, {.width = 800, .height = 320});
}
#endif

}  // namespace fmnist
