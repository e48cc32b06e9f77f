// A sampler step's own cost against the torch expression it computes, on the same tensors:
// the DDIM update x_prev = √ᾱ_prev·x̂₀ + √(1−ᾱ_prev)·ε̂ written out by hand is the baseline.
// Goal: ratio <= 1.1. Also a full 50-step DDIM run on a small convolutional model: the sampler's
// share of the total time (model forward + sampler). add_noise_drawn_timesteps_vs_checked: a
// training lookup with timesteps the schedule drew (no range read-back) against checked ones.
#include <ATen/ATen.h>
#include <benchmark/benchmark.h>
#include <difftrain/diffusion/diffusion.hpp>

#include <cmath>

namespace {
namespace df = difftrain::diffusion;

const df::NoiseSchedule& schedule() {
  static const df::NoiseSchedule s(
      {.beta_start = 0.00085, .beta_end = 0.012, .beta_schedule = df::BetaSchedule::scaled_linear});
  return s;
}

void ddim_step_baseline(benchmark::State& state) {
  const at::Tensor x = at::randn({state.range(0), 4, 64, 64});
  const at::Tensor eps = at::randn_like(x);
  const double a_t = schedule().alpha_cumprod(981);
  const double a_prev = schedule().alpha_cumprod(961);
  for (auto _ : state) {
    const at::Tensor x0 = (x - std::sqrt(1 - a_t) * eps) / std::sqrt(a_t);
    at::Tensor prev = std::sqrt(a_prev) * x0 + std::sqrt(1 - a_prev) * eps;
    benchmark::DoNotOptimize(prev.data_ptr());
  }
}

void ddim_step_difftrain(benchmark::State& state) {
  const at::Tensor x = at::randn({state.range(0), 4, 64, 64});
  const at::Tensor eps = at::randn_like(x);
  df::Ddim ddim(schedule(), {.clipping = {.clip_sample = false}, .steps_offset = 1});
  ddim.set_timesteps(50);
  for (auto _ : state) {
    at::Tensor prev = ddim.step(eps, 981, x);
    benchmark::DoNotOptimize(prev.data_ptr());
  }
}

// A small convolutional "denoiser", so the sampler's share of a run is measured against real work.
at::Tensor tiny_model(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2) {
  return at::conv2d(at::silu(at::conv2d(x, w1, {}, 1, 1)), w2, {}, 1, 1);
}

void ddim_run_baseline(benchmark::State& state) {  // the model calls alone
  const at::Tensor w1 = at::randn({32, 4, 3, 3}) * 0.1;
  const at::Tensor w2 = at::randn({4, 32, 3, 3}) * 0.1;
  const at::Tensor x = at::randn({4, 4, 32, 32});
  for (auto _ : state)
    for (int i = 0; i < 50; ++i) benchmark::DoNotOptimize(tiny_model(x, w1, w2).data_ptr());
}

void ddim_run_difftrain(benchmark::State& state) {  // model + sampler
  const at::Tensor w1 = at::randn({32, 4, 3, 3}) * 0.1;
  const at::Tensor w2 = at::randn({4, 32, 3, 3}) * 0.1;
  df::Ddim ddim(schedule(), {.clipping = {.clip_sample = false}, .steps_offset = 1});
  ddim.set_timesteps(50);
  for (auto _ : state) {
    at::Tensor x = at::randn({4, 4, 32, 32});
    for (std::int64_t t : ddim.timesteps()) x = ddim.step(tiny_model(x, w1, w2), t, x);
    benchmark::DoNotOptimize(x.data_ptr());
  }
}
}  // namespace

BENCHMARK(ddim_step_baseline)->Name("ddim_step/baseline")->Arg(1)->Arg(8)->UseRealTime();
BENCHMARK(ddim_step_difftrain)->Name("ddim_step/difftrain")->Arg(1)->Arg(8)->UseRealTime();
BENCHMARK(ddim_run_baseline)->Name("ddim_50_steps_model_share/baseline")->UseRealTime();
BENCHMARK(ddim_run_difftrain)->Name("ddim_50_steps_model_share/difftrain")->UseRealTime();

namespace {
void dpm_run_baseline(benchmark::State& state) {  // the model calls alone
  const at::Tensor w1 = at::randn({32, 4, 3, 3}) * 0.1;
  const at::Tensor w2 = at::randn({4, 32, 3, 3}) * 0.1;
  const at::Tensor x = at::randn({4, 4, 32, 32});
  for (auto _ : state)
    for (int i = 0; i < 20; ++i) benchmark::DoNotOptimize(tiny_model(x, w1, w2).data_ptr());
}

void dpm_run_difftrain(benchmark::State& state) {  // model + sampler
  const at::Tensor w1 = at::randn({32, 4, 3, 3}) * 0.1;
  const at::Tensor w2 = at::randn({4, 32, 3, 3}) * 0.1;
  df::DpmSolverPP2M dpm(schedule(), {});
  for (auto _ : state) {
    dpm.set_timesteps(20);
    at::Tensor x = at::randn({4, 4, 32, 32});
    for (std::size_t i = 0; i < dpm.timesteps().size(); ++i) x = dpm.step(tiny_model(x, w1, w2), x);
    benchmark::DoNotOptimize(x.data_ptr());
  }
}
}  // namespace

BENCHMARK(dpm_run_baseline)->Name("dpm_20_steps_model_share/baseline")->UseRealTime();
BENCHMARK(dpm_run_difftrain)->Name("dpm_20_steps_model_share/difftrain")->UseRealTime();

namespace {
// The training-step lookup of ᾱ_t with add_noise on a main-job-sized batch (64 × 1 × 28 × 28):
// timesteps a caller made (range read back and checked, baseline) against timesteps the schedule
// drew itself (sample_timesteps: no read-back). On a GPU the read-back is a wait for the device;
// here on the CPU it is the check's host work.
template <bool Drawn>
void add_noise_timesteps(benchmark::State& state) {
  const at::Tensor x0 = at::randn({64, 1, 28, 28});
  const at::Tensor noise = at::randn_like(x0);
  for (auto _ : state) {
    const at::Tensor t = Drawn ? schedule().sample_timesteps(64, x0.options())
                               : at::randint(0, 1000, {64}, x0.options().dtype(at::kLong));
    at::Tensor xt = schedule().add_noise(x0, noise, t);
    benchmark::DoNotOptimize(xt.data_ptr());
  }
}
}  // namespace

BENCHMARK_TEMPLATE(add_noise_timesteps, false)
    ->Name("add_noise_drawn_timesteps_vs_checked/baseline")
    ->UseRealTime();
BENCHMARK_TEMPLATE(add_noise_timesteps, true)
    ->Name("add_noise_drawn_timesteps_vs_checked/difftrain")
    ->UseRealTime();
