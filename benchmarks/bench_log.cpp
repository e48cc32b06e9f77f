// What watching a run costs: a main-job training step (the Fashion-MNIST example's UNet at its
// default size, batch 64) with the TensorBoard callback off (baseline) and on (difftrain): every
// step's scalars, and a 40-image sample grid every 500 steps. A benchmark runs far fewer than
// 500 steps, so the grid's cost (encoding and writing it, timed once per run) is added at 1/500
// per step; drawing the samples is the run's own work, not logging, and is not counted. Both
// cases step both trainers in turn (see main_job_step). Goal: ratio ≤ 1.01; the counters give the
// logging's own time per step, measured inside the steps.
#include <ATen/ATen.h>
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <difftrain/io/remove_tree.hpp>
#include <difftrain/train/tensorboard.hpp>
#include <difftrain/train/trainer.hpp>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>

#include "../examples/fashion_mnist/denoiser.hpp"

namespace {

struct LoggedConfig : difftrain::train::DefaultConfig {
  using Ema = difftrain::ema::Ema<difftrain::ema::WarmupDecay>;
  using Callbacks = std::tuple<difftrain::train::TensorBoard>;
};

using LoggedTrainer = difftrain::train::Trainer<fmnist::DenoiserImpl, LoggedConfig>;

std::unique_ptr<LoggedTrainer> make_trainer(fmnist::DenoiserImpl& net,
                                            const std::filesystem::path& dir) {
  LoggedTrainer::Options o;
  o.optimizer.lr = 1e-3;
  o.ema.rule.decay = 0.999;
  return std::make_unique<LoggedTrainer>(
      net, o, LoggedConfig::Callbacks{difftrain::train::TensorBoard({.dir = dir})});
}

// The two trainers (callback off, on) step in turn on the same batch, so a shared machine's
// drift hits both alike; each case reports its own trainer's steps.
template <bool Logging>
void main_job_step(benchmark::State& state) {
  namespace tr = difftrain::train;
  at::manual_seed(0);
  const difftrain::diffusion::NoiseSchedule schedule;
  fmnist::Denoiser off_net(fmnist::UNetOptions{.channels = 16}, schedule);
  fmnist::Denoiser on_net(fmnist::UNetOptions{.channels = 16}, schedule);
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("difftrain-bench-tb-" + std::to_string(::getpid()));
  (void)difftrain::io::remove_tree(dir);
  auto off = make_trainer(*off_net, {});
  auto on = make_trainer(*on_net, dir);
  const fmnist::DenoiserImpl::Batch batch{at::rand({64, 1, 28, 28}) * 2 - 1,
                                          at::randint(0, 10, {64}, at::kLong)};
  const std::vector<fmnist::DenoiserImpl::Batch> micro{batch};
  for (int i = 0; i < 2; ++i) (void)off->step(micro), (void)on->step(micro);  // warm-up
  // The grid's cost, once: encoding 40 images to PNG and writing them.
  const at::Tensor grid = at::rand({40, 1, 28, 28}) * 2 - 1;
  auto& tb = std::get<tr::TensorBoard>(on->callbacks());
  auto t0 = std::chrono::steady_clock::now();
  tb.add_images("samples", grid, on->global_step(), {.columns = 4});
  tb.flush();
  const double image_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  double callbacks = 0, total[2] = {0, 0};
  std::int64_t steps = 0;
  auto timed = [&](LoggedTrainer& t, int which) {
    const auto start = std::chrono::steady_clock::now();
    const tr::StepInfo info = t.step(micro);
    const double step =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    total[which] += step;
    return std::pair{step, step - info.seconds};  // StepInfo::seconds ends before the callbacks
  };
  for (auto _ : state) {
    const auto [off_step, off_cb] = timed(*off, 0);
    const auto [on_step, on_cb] = timed(*on, 1);
    callbacks += on_cb;
    ++steps;
    state.SetIterationTime(Logging ? on_step + image_seconds / 500.0 : off_step);
  }
  const double n = static_cast<double>(std::max<std::int64_t>(steps, 1));
  if constexpr (Logging) {
    // The logging alone, measured inside each step: steadier than a ratio of two noisy steps.
    state.counters["callback_us_per_step"] = 1e6 * callbacks / n;
    state.counters["image_ms_per_500_steps"] = image_seconds * 1e3;
    state.counters["logging_share_of_step_pct"] =
        100 * (callbacks / n + image_seconds / 500.0) / (total[0] / n);
  }
  (void)difftrain::io::remove_tree(dir);
}

}  // namespace

BENCHMARK_TEMPLATE(main_job_step, false)
    ->Name("tensorboard_logging_overhead/baseline")
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(4.0);
BENCHMARK_TEMPLATE(main_job_step, true)
    ->Name("tensorboard_logging_overhead/difftrain")
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(4.0);
