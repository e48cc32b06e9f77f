// What a schedule costs per step next to the optimizer step it drives: the bound scheduler sets
// every group's LR from a pure function of the step; AdamW updates a small model (~100k params).
// The printed ratio is the schedule's share of one AdamW step.
#include <benchmark/benchmark.h>
#include <torch/optim/adamw.h>
#include <difftrain/schedule/schedule.hpp>

#include <vector>

namespace {
namespace sch = difftrain::schedule;

std::vector<at::Tensor> small_model() {
  std::vector<at::Tensor> params;
  for (int i = 0; i < 10; ++i) {
    params.push_back(at::randn({100, 100}, at::requires_grad()));
    params.back().mutable_grad() = at::randn({100, 100});
  }
  return params;
}

void schedule_step_baseline(benchmark::State& state) {
  torch::optim::AdamW opt(small_model(), torch::optim::AdamWOptions(1e-3));
  for (auto _ : state) opt.step();
}

void schedule_step_difftrain(benchmark::State& state) {
  torch::optim::AdamW opt(small_model(), torch::optim::AdamWOptions(1e-3));
  using S = sch::WithWarmup<sch::LinearWarmup, sch::timm::Cosine>;
  sch::LrScheduler<S> scheduler(
      opt, S({.warmup = {.warmup_period = 100},
              .schedule = {.t_initial = 1000, .cycle_decay = 0.5, .cycle_limit = 1'000'000}}));
  for (auto _ : state) scheduler.step();
}

void step_string_step_difftrain(benchmark::State& state) {
  torch::optim::AdamW opt(small_model(), torch::optim::AdamWOptions(1e-3));
  sch::LrScheduler<sch::StepString> scheduler(
      opt, sch::StepString({.text = "0.005:100, 1e-3:1000, 5e-4:10000, 1e-4:100000, 1e-5"}));
  for (auto _ : state) scheduler.step();
}
}  // namespace

BENCHMARK(schedule_step_baseline)->Name("schedule_step/baseline");
BENCHMARK(schedule_step_difftrain)->Name("schedule_step/difftrain");
BENCHMARK(schedule_step_baseline)->Name("step_string_step/baseline");
BENCHMARK(step_string_step_difftrain)->Name("step_string_step/difftrain");
