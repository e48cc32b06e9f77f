// The data-parallel policy at world size 1 against no policy, in the same run: a program built
// with Config::Parallel = DataParallel but started without a launcher must train as fast as one
// without the policy (goal: ratio <= 1.02). The step is train_step_small's (bench_train.cpp): a
// 3-layer MLP, AdamW, clipping, 2 micro-batches. The 2-rank figures (all-reduce hidden behind
// backward, step time against Python's DDP) need several processes: benchmarks/distributed.py.
#include <ATen/ATen.h>
#include <benchmark/benchmark.h>
#include <torch/nn/modules/linear.h>

#include <cstdlib>
#include <difftrain/distributed/data_parallel.hpp>
#include <difftrain/train/trainer.hpp>
#include <vector>

namespace {
namespace tr = difftrain::train;

struct Batch {
  at::Tensor x, y;
};

struct Mlp : torch::nn::Module {
  using Batch = ::Batch;
  Mlp() {
    a = register_module("a", torch::nn::Linear(256, 256));
    b = register_module("b", torch::nn::Linear(256, 256));
    c = register_module("c", torch::nn::Linear(256, 256));
  }
  at::Tensor loss(const Batch& batch) {
    return (c(at::silu(b(at::silu(a(batch.x))))) - batch.y).pow(2).mean();
  }
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
};

struct Plain : tr::DefaultConfig {};
struct WithPolicy : tr::DefaultConfig {
  using Parallel = difftrain::distributed::DataParallel;
};

template <class Config>
void step(benchmark::State& state) {
  // No launcher variables: a world of one.
  for (const char* k : {"RANK", "WORLD_SIZE"}) ::unsetenv(k);
  Mlp net;
  typename tr::Trainer<Mlp, Config>::Options o;
  o.accumulation_steps = 2;
  tr::Trainer<Mlp, Config> trainer(net, o);
  std::vector<Batch> data;
  for (int i = 0; i < 2; ++i) data.push_back({at::randn({64, 256}), at::randn({64, 256})});
  for (int i = 0; i < 5; ++i) (void)trainer.step(data);
  for (auto _ : state) benchmark::DoNotOptimize(trainer.step(data));
}
}  // namespace

BENCHMARK_TEMPLATE(step, Plain)->Name("data_parallel_world_1/baseline")->UseRealTime();
BENCHMARK_TEMPLATE(step, WithPolicy)->Name("data_parallel_world_1/difftrain")->UseRealTime();
