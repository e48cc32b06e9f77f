// The trainer's per-step cost against a hand-written LibTorch loop doing the same work in the same
// run: AdamW with a decay and a no-decay group, a cosine schedule with warm-up, clip_grad_norm_,
// 2 micro-batches of accumulation, EMA (diffusers' warm-up decay) — goal: ratio <= 1.03.
//  - train_step_small: a 3-layer MLP (width 256), where per-step overhead shows most;
//  - train_step_block: a BasicTransformerBlock (dim 256, 256 tokens), where compute dominates.
//  - train_vs_python_eager: train_step_small's step against the same step written in Python and run
//    eagerly (torch, diffusers' scheduler and EMAModel); 1 / ratio is the steps/s speed-up (goal on
//    the GPU: >= 1.5).
// On a GPU everything runs there (the step synchronises once, on the loss value, in both loops).
#include <ATen/ATen.h>
#include <benchmark/benchmark.h>
#include <torch/cuda.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>
#include <chrono>
#include <cstdio>
#include <difftrain/nn/blocks/transformer_block.hpp>
#include <difftrain/train/trainer.hpp>
#include <string>

#include "python_baseline.hpp"

namespace {
namespace tr = difftrain::train;
namespace ds = difftrain::schedule;

at::Device device() {
  return torch::cuda::is_available() ? at::Device(at::kCUDA) : at::Device(at::kCPU);
}

struct Batch {
  at::Tensor x, y;
};

struct MlpImpl : torch::nn::Module {
  using Batch = ::Batch;
  MlpImpl() {
    a = register_module("a", torch::nn::Linear(256, 256));
    b = register_module("b", torch::nn::Linear(256, 256));
    c = register_module("c", torch::nn::Linear(256, 256));
    to(device());
  }
  at::Tensor loss(const Batch& batch) {
    return torch::mse_loss(c(torch::silu(b(torch::silu(a(batch.x))))), batch.y);
  }
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
};

struct BlockNet : torch::nn::Module {
  using Batch = ::Batch;
  BlockNet() {
    difftrain::nn::blocks::TransformerBlockOptions o;
    o.dim = 256;
    o.n_heads = 4;
    o.d_head = 64;
    block = register_module("block", difftrain::nn::blocks::BasicTransformerBlock<>(o));
    to(device());
  }
  at::Tensor loss(const Batch& batch) { return torch::mse_loss(block->forward(batch.x), batch.y); }
  difftrain::nn::blocks::BasicTransformerBlock<> block{nullptr};
};

struct Cfg : tr::DefaultConfig {
  using Schedule = ds::Cosine;
  using Ema = difftrain::ema::Ema<difftrain::ema::WarmupDecay>;
};

template <class Net>
std::vector<Batch> batches(bool tokens) {
  std::vector<Batch> out;
  for (int i = 0; i < 2; ++i) {
    const auto shape =
        tokens ? std::vector<std::int64_t>{8, 256, 256} : std::vector<std::int64_t>{64, 256};
    out.push_back({at::randn(shape, at::TensorOptions().device(device())),
                   at::randn(shape, at::TensorOptions().device(device()))});
  }
  return out;
}

template <class Net>
void hand_written(benchmark::State& state) {
  const bool tokens = state.range(0) != 0;
  Net net;
  std::vector<at::Tensor> decay, no_decay;
  for (auto& p : net.parameters()) (p.dim() >= 2 ? decay : no_decay).push_back(p);
  torch::optim::AdamWOptions defaults(1e-4);
  defaults.weight_decay(1e-2);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(defaults));
  auto nd = std::make_unique<torch::optim::AdamWOptions>(defaults);
  nd->weight_decay(0.0);
  groups.emplace_back(no_decay, std::move(nd));
  torch::optim::AdamW opt(std::move(groups), defaults);
  const ds::Cosine sched({100, 100000, 0.5});
  std::vector<at::Tensor> params = net.parameters(), shadow;
  for (auto& p : params) shadow.push_back(p.detach().clone());
  const auto data = batches<Net>(tokens);
  std::int64_t step = 0;
  const double base = 1e-4;
  for (auto _ : state) {
    opt.zero_grad(true);
    double loss = 0;
    for (const auto& b : data) {
      at::Tensor l = net.loss(b);
      loss += l.detach().template item<double>();
      (l * 0.5).backward();
    }
    benchmark::DoNotOptimize(torch::nn::utils::clip_grad_norm_(params, 1.0));
    opt.step();
    ++step;
    for (auto& g : opt.param_groups()) g.options().set_lr(sched.lr(step, base));
    const double decay_now =
        std::min(0.9999, (1.0 + static_cast<double>(step)) / (10.0 + static_cast<double>(step)));
    at::NoGradGuard ng;
    for (std::size_t i = 0; i < params.size(); ++i) shadow[i].lerp_(params[i], 1.0 - decay_now);
    benchmark::DoNotOptimize(loss);
  }
}

template <class Net>
void with_trainer(benchmark::State& state) {
  const bool tokens = state.range(0) != 0;
  Net net;
  typename tr::Trainer<Net, Cfg>::Options o;
  o.optimizer.lr = 1e-4;
  o.schedule = {100, 100000, 0.5};
  o.clipping.max_norm = 1.0;
  o.accumulation_steps = 2;
  tr::Trainer<Net, Cfg> trainer(net, o);
  const auto data = batches<Net>(tokens);
  for (auto _ : state) benchmark::DoNotOptimize(trainer.step(data));
}
// train_step_small's trainer, timed per step like the Python loop (wall clock, synchronised).
void trainer_timed(benchmark::State& state) {
  MlpImpl net;
  tr::Trainer<MlpImpl, Cfg>::Options o;
  o.optimizer.lr = 1e-4;
  o.schedule = {100, 100000, 0.5};
  o.clipping.max_norm = 1.0;
  o.accumulation_steps = 2;
  tr::Trainer<MlpImpl, Cfg> trainer(net, o);
  const auto data = batches<MlpImpl>(false);
  for (int i = 0; i < 20; ++i) (void)trainer.step(data);
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    benchmark::DoNotOptimize(trainer.step(data));
    if (torch::cuda::is_available()) torch::cuda::synchronize();
    state.SetIterationTime(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
}

// The same step as train_step_small in Python, eagerly (benchmarks/python_eager_train.py, run once
// by this benchmark); its seconds per step are this case's baseline time.
void python_eager(benchmark::State& state) {
  static std::string why;
  static const double seconds = difftrain::bench::python_seconds_per_step(
      difftrain::bench::python_script("python_eager_train.py") + " 200", &why);
  if (seconds <= 0) {
    difftrain::bench::skip_without_baseline(state, why);
    return;
  }
  for (auto _ : state) state.SetIterationTime(seconds);
}
}  // namespace

BENCHMARK(python_eager)->Name("train_vs_python_eager/baseline")->Arg(0)->UseManualTime();
BENCHMARK(trainer_timed)->Name("train_vs_python_eager/difftrain")->Arg(0)->UseManualTime();
BENCHMARK_TEMPLATE(hand_written, MlpImpl)->Name("train_step_small/baseline")->Arg(0)->UseRealTime();
BENCHMARK_TEMPLATE(with_trainer, MlpImpl)
    ->Name("train_step_small/difftrain")
    ->Arg(0)
    ->UseRealTime();
BENCHMARK_TEMPLATE(hand_written, BlockNet)
    ->Name("train_step_block/baseline")
    ->Arg(1)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(with_trainer, BlockNet)
    ->Name("train_step_block/difftrain")
    ->Arg(1)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
