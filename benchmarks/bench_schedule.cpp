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

// A schedule chosen at run time (schedule::ByName, one indirect call per group) against the same
// schedule named at compile time, binding both to the same 4-group optimizer: the ratio is the
// cost of choosing on the command line.
template <class S>
void lr_scheduler_step(benchmark::State& state, const typename S::Options& o) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (int g = 0; g < 4; ++g)
    groups.emplace_back(std::vector<at::Tensor>{at::zeros({1}, at::requires_grad())});
  torch::optim::AdamW opt(std::move(groups), torch::optim::AdamWOptions(1e-3));
  sch::LrScheduler<S> scheduler(opt, S(o));
  for (auto _ : state) {
    scheduler.set_step(scheduler.last_step() % 1000 + 1);
    benchmark::DoNotOptimize(opt.param_groups()[0].options().get_lr());
  }
}
void lr_scheduler_static(benchmark::State& state) {
  lr_scheduler_step<sch::Cosine>(state, {.num_warmup_steps = 100, .num_training_steps = 1001});
}
void lr_scheduler_by_name(benchmark::State& state) {
  sch::ByName::Options o;
  o.lr_scheduler = "cosine";
  o.args.num_warmup_steps = 100;
  o.args.num_training_steps = 1001;
  lr_scheduler_step<sch::ByName>(state, o);
}
}  // namespace

BENCHMARK(lr_scheduler_static)->Name("lr_scheduler_step/baseline");
BENCHMARK(lr_scheduler_by_name)->Name("lr_scheduler_step/difftrain");
BENCHMARK(schedule_step_baseline)->Name("schedule_step/baseline");
BENCHMARK(schedule_step_difftrain)->Name("schedule_step/difftrain");
BENCHMARK(schedule_step_baseline)->Name("step_string_step/baseline");
BENCHMARK(step_string_step_difftrain)->Name("step_string_step/difftrain");
