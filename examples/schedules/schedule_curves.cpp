// Writes the LR curve of every schedule difftrain has (one column each, base LR 1) to a CSV file,
// and with --png draws them side by side, a labelled panel each (difftrain/log/plot.hpp).
//
//   schedule_curves [--steps N] [--out curves.csv] [--png schedules.png]
#include <CLI/CLI.hpp>
#include <difftrain/schedule/schedule.hpp>
#if DIFFTRAIN_HAS_PLOT
#include <difftrain/io/png.hpp>
#include <difftrain/log/plot.hpp>
#endif

#include <cstdint>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "../common/cli_checks.hpp"

namespace sch = difftrain::schedule;

int main(int argc, char** argv) {
  CLI::App app{"Write every difftrain LR schedule's curve to a CSV file"};
  std::int64_t steps = 1000;
  std::string out = "schedule_curves.csv";
  app.add_option("--steps", steps, "number of optimizer steps to tabulate")
      ->check(CLI::Range(1, 10'000'000));
  app.add_option("--out", out, "CSV file to write");
  std::string png;
  app.add_option("--png", png, "also draw the curves into this PNG file");
  if (const auto rc = examples::parse_command_line(app, argc, argv)) return *rc;

  const std::int64_t w = steps / 10;  // a 10 % warm-up where a schedule has one
  using W = sch::timm::WarmupStableDecay;
  const std::vector<sch::AnySchedule> curves = {
      sch::AnySchedule(sch::Constant{}),
      sch::AnySchedule(sch::ConstantWithWarmup({.num_warmup_steps = w})),
      sch::AnySchedule(sch::Linear({.num_warmup_steps = w, .num_training_steps = steps})),
      sch::AnySchedule(sch::Cosine({.num_warmup_steps = w, .num_training_steps = steps})),
      sch::AnySchedule(sch::CosineWithRestarts(
          {.num_warmup_steps = w, .num_training_steps = steps, .num_cycles = 3})),
      sch::AnySchedule(sch::Polynomial(
          {.num_warmup_steps = w, .num_training_steps = steps, .lr_end = 0.05, .power = 2.0})),
      sch::AnySchedule(
          sch::PiecewiseConstant({.step_rules = "1:" + std::to_string(steps / 4) +
                                                ",0.5:" + std::to_string(steps / 2) + ",0.25"})),
      sch::AnySchedule(sch::CosineAnnealing({.T_max = steps, .eta_min = 0.0})),
      sch::AnySchedule(sch::ConstantFactor({.factor = 0.5, .total_iters = w})),
      sch::AnySchedule(
          sch::LinearFactor({.start_factor = 0.1, .end_factor = 1.0, .total_iters = w})),
      sch::AnySchedule(sch::Exponential({.gamma = 1.0 - 3.0 / static_cast<double>(steps)})),
      sch::AnySchedule(sch::Step({.step_size = steps / 4, .gamma = 0.5})),
      sch::AnySchedule(sch::MultiStep({.milestones = {steps / 2, steps * 3 / 4}, .gamma = 0.3})),
      sch::AnySchedule(sch::OneCycle({.total_steps = steps})),
      sch::AnySchedule(sch::timm::Cosine({.t_initial = steps / 3,
                                          .lr_min = 0.02,
                                          .cycle_decay = 0.7,
                                          .cycle_limit = 3,
                                          .warmup_t = w / 2,
                                          .warmup_lr_init = 0.01})),
      sch::AnySchedule(sch::timm::Tanh({.t_initial = steps, .warmup_t = w})),
      sch::AnySchedule(sch::timm::Poly({.t_initial = steps, .power = 2.0, .warmup_t = w})),
      sch::AnySchedule(
          sch::timm::Step({.decay_t = static_cast<double>(steps) / 5, .decay_rate = 0.7})),
      sch::AnySchedule(
          sch::timm::MultiStep({.decay_t = {steps / 3, steps * 2 / 3}, .decay_rate = 0.5})),
      sch::AnySchedule(W({.t_initial = steps, .decay_t = steps / 5, .warmup_t = w})),
      sch::AnySchedule(
          sch::WarmupCosine({.warm_up_steps = w, .lr_min = 0.05, .max_decay_steps = steps})),
      sch::AnySchedule(sch::WarmupCosineCycles({.warm_up_steps = {w / 2, w / 2},
                                                .f_min = {0.1, 0.05},
                                                .f_max = {1.0, 0.6},
                                                .f_start = {0.0, 0.1},
                                                .cycle_lengths = {steps / 2, steps / 2}})),
      sch::AnySchedule(sch::WarmupLinearCycles({.warm_up_steps = {w / 2, w / 2},
                                                .f_min = {0.0, 0.0},
                                                .f_max = {1.0, 0.5},
                                                .f_start = {0.0, 0.0},
                                                .cycle_lengths = {steps / 2, steps / 2}})),
      sch::AnySchedule(sch::StepString({.text = "1.0:" + std::to_string(steps / 5) +
                                                ", 0.6:" + std::to_string(steps / 2) + ", 0.2",
                                        .max_steps = steps})),
      sch::AnySchedule(sch::WithWarmup<sch::LinearWarmup, sch::CosineAnnealing>(
          {.warmup = {.warmup_period = w}, .schedule = {.T_max = steps}})),
      sch::AnySchedule(sch::WithWarmup<sch::ExponentialWarmup, sch::Constant>(
          {.warmup = {.warmup_period = w / 3}})),
      sch::AnySchedule(
          sch::WithWarmup<sch::RAdamWarmup, sch::Constant>({.warmup = {.beta2 = 0.999}})),
  };

  std::vector<xt::xtensor<double, 1>> tables;
  for (const auto& c : curves) tables.push_back(sch::table(c, steps));
  std::ofstream csv(out);
  if (!csv) {
    std::cerr << "cannot write " << out << '\n';
    return 1;
  }
  csv << "step";
  for (const auto& c : curves) csv << ',' << c.name();
  csv << '\n';
  csv.precision(17);
  for (std::int64_t t = 0; t < steps; ++t) {
    csv << t;
    for (const auto& table : tables) csv << ',' << table(static_cast<std::size_t>(t));
    csv << '\n';
  }
  std::cout << "wrote " << curves.size() << " schedules x " << steps << " steps to " << out << '\n';
  if (!csv.good()) return 1;
  if (png.empty()) return 0;
#if DIFFTRAIN_HAS_PLOT
  std::vector<difftrain::log::Axes> panels;
  std::vector<double> x(static_cast<std::size_t>(steps));
  for (std::size_t t = 0; t < x.size(); ++t) x[t] = static_cast<double>(t);
  for (std::size_t i = 0; i < curves.size(); ++i) {
    difftrain::log::Axes a{
        .title = std::string(curves[i].name()), .x_label = "step", .y_label = "LR factor"};
    a.series.push_back(
        {.label = "", .x = x, .y = std::vector<double>(tables[i].begin(), tables[i].end())});
    panels.push_back(std::move(a));
  }
  const int columns = 4;
  const auto rows = static_cast<std::uint32_t>((panels.size() + columns - 1) / columns);
  difftrain::io::write_png(
      png, difftrain::log::draw_figure(
               panels, {.width = 1400, .height = 260 * rows, .columns = columns, .font_size = 11}));
  std::cout << "drew them into " << png << '\n';
  return 0;
#else
  std::cerr << "built without cairo: --png is not available\n";
  return 1;
#endif
}
