// One rank of the 2-rank data-parallel benchmark (benchmarks/distributed.py starts it under
// torchrun, next to PyTorch's DDP on the same model). On an MLP of `--layers` x `--width`
// (float32), rank 0 prints as JSON the median seconds of:
//   local     forward + backward, no communication
//   after     forward + backward, then one all-reduce of every gradient (nothing overlaps)
//   buckets   forward + backward with DataParallel's reducer (bucketed all-reduce from hooks)
//   step      a whole Trainer<Net, DataParallel> step (AdamW, clipping at 1.0)
//   zero1     the same step with ShardedDataParallel, stage 1 (optimizer state sharded)
//   zero2     ... stage 2 (gradients sharded too)
//   zero3     ... stage 3 (parameters sharded too: each layer a unit, prefetched)
// and hidden = (after - buckets) / (after - local): the share of the all-reduce time that
// the buckets hide behind backward (0 when nothing overlaps, 1 when all of it does).
#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <difftrain/distributed/data_parallel.hpp>
#include <difftrain/distributed/sharded_data_parallel.hpp>
#include <difftrain/nn/unit_scope.hpp>
#include <difftrain/train/trainer.hpp>
#include <nlohmann/json.hpp>
#include <vector>

namespace {
namespace tr = difftrain::train;
namespace dist = difftrain::distributed;

struct Batch {
  at::Tensor x, y;
};

struct Mlp : torch::nn::Module {
  using Batch = ::Batch;
  Mlp(std::int64_t layers, std::int64_t width) {
    for (std::int64_t i = 0; i < layers; ++i)
      fc.push_back(register_module("fc" + std::to_string(i), torch::nn::Linear(width, width)));
  }
  at::Tensor loss(const Batch& b) {
    at::Tensor h = b.x;
    // Each layer a unit (stage 3 gathers it; a no-op otherwise), as FSDP wraps each layer.
    for (auto& l : fc) h = difftrain::nn::in_unit(*l, [&] { return at::tanh(l->forward(h)); });
    return (h - b.y).pow(2).mean();
  }
  std::vector<torch::nn::Linear> fc;
};

struct Config : tr::DefaultConfig {
  using Parallel = dist::DataParallel;
};
struct ShardedConfig : tr::DefaultConfig {
  using Parallel = dist::ShardedDataParallel;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <class F>
double timed(const dist::World& world, int iterations, F&& f) {
  std::vector<double> t;
  for (int i = 0; i < iterations + 2; ++i) {
    world.barrier();
    const auto start = std::chrono::steady_clock::now();
    f();
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (i >= 2) t.push_back(s);  // two warm-up rounds (the reducer rebuilds its buckets)
  }
  return median(t);
}
}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"one rank of the data-parallel benchmark"};
  std::int64_t layers = 12, width = 1024, batch = 64;
  int iterations = 10;
  app.add_option("--layers", layers);
  app.add_option("--width", width);
  app.add_option("--batch", batch);
  app.add_option("--iterations", iterations);
  CLI11_PARSE(app, argc, argv);
  const auto world = dist::World::from_environment();
  at::manual_seed(0);
  const Batch data{at::randn({batch, width}), at::randn({batch, width})};

  Mlp net(layers, width);
  std::vector<at::Tensor> params = net.parameters();
  dist::DataParallel dp(net, params, {.world = world});
  auto zero = [&] {
    for (auto& p : params) p.mutable_grad() = at::Tensor();
  };
  const double local = timed(*world, iterations, [&] {
    zero();
    net.loss(data).backward();
  });
  const double after = timed(*world, iterations, [&] {
    zero();
    net.loss(data).backward();
    std::vector<at::Tensor> grads;
    for (auto& p : params) grads.push_back(p.grad().reshape({-1}));
    at::Tensor flat = at::cat(grads);
    world->all_reduce_sum(flat);
    flat.div_(static_cast<double>(world->size()));
    std::int64_t at_ = 0;
    for (auto& p : params) {
      p.grad().copy_(flat.narrow(0, at_, p.numel()).view(p.sizes()));
      at_ += p.numel();
    }
  });
  const double buckets = timed(*world, iterations, [&] {
    zero();
    dp.before_forward(true);
    at::Tensor l = net.loss(data);
    dp.before_backward(l);
    l.backward();
  });

  Mlp net2(layers, width);
  tr::Trainer<Mlp, Config>::Options o;
  o.optimizer.lr = 1e-4;
  o.groups.decay_groups = false;
  o.clipping.max_norm = 1.0;
  o.parallel.world = world;
  tr::Trainer<Mlp, Config> trainer(net2, o);
  const double step = timed(*world, iterations, [&] { (void)trainer.step({data}); });
  auto sharded_step = [&](int stage) {
    Mlp net3(layers, width);
    tr::Trainer<Mlp, ShardedConfig>::Options so;
    so.optimizer.lr = 1e-4;
    so.groups.decay_groups = false;
    so.clipping.max_norm = 1.0;
    so.parallel.world = world;
    so.parallel.stage = stage;
    tr::Trainer<Mlp, ShardedConfig> sharded(net3, so);
    return timed(*world, iterations, [&] { (void)sharded.step({data}); });
  };
  const double zero1 = sharded_step(1);
  const double zero2 = sharded_step(2);
  const double zero3 = sharded_step(3);

  if (world->is_main()) {
    const nlohmann::json out = {
        {"world_size", world->size()},
        {"layers", layers},
        {"width", width},
        {"batch", batch},
        {"local", local},
        {"after", after},
        {"buckets", buckets},
        {"step", step},
        {"zero1", zero1},
        {"zero2", zero2},
        {"zero3", zero3},
        {"hidden", after > local ? (after - buckets) / (after - local) : 0.0}};
    std::printf("%s\n", out.dump().c_str());
  }
  return 0;
}
