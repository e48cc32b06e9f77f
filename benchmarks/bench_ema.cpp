// EMA update engines.
//  - ema_many_small: 2,000 tensors of 4K parameters; the multi-tensor engine against the
//    per-tensor loop (the loop is the baseline).
//  - ema_bandwidth: one large model's update (multi-tensor lerp reads shadow and weights and writes
//    the shadow: 12 bytes a parameter) against copying the same number of bytes with one copy_
//    (memcpy on the CPU, device-to-device on a GPU). 1 / ratio is the fraction of copy bandwidth
//    reached. Size: DIFFTRAIN_BENCH_EMA_PARAMS (default 200M parameters).
//  - ema_offload_step: a stand-in training step (matmuls) with an offloaded EMA update after it,
//    with and without overlap, against the step alone: the ratio is the added time per step.
#include <ATen/ATen.h>
#include <benchmark/benchmark.h>
#include <torch/cuda.h>
#include <torch/nn/module.h>
#include <difftrain/ema/ema.hpp>

#include <cstdlib>
#include <cstring>
#include <string>

namespace {
namespace ema = difftrain::ema;

at::Device bench_device() {
  return torch::cuda::is_available() ? at::Device(at::kCUDA) : at::Device(at::kCPU);
}

void sync() {
  if (torch::cuda::is_available()) torch::cuda::synchronize();
}

struct Many : torch::nn::Module {
  Many(int count, int size) {
    for (int i = 0; i < count; ++i)
      register_parameter("p" + std::to_string(i),
                         at::randn({size}, at::TensorOptions().device(bench_device())));
  }
};

template <class Engine>
void many_small(benchmark::State& state) {
  Many model(2000, 4096);
  ema::Ema<ema::Constant, Engine> e(model, {.decay = 0.999});
  for (auto _ : state) {
    e.update();
    e.engine().synchronize();
    sync();
  }
  state.SetItemsProcessed(state.iterations() * 2000 * 4096);
}

std::int64_t big_size() {
  const char* env = std::getenv("DIFFTRAIN_BENCH_EMA_PARAMS");
  return env != nullptr ? std::stoll(env) : 200'000'000;
}

void bandwidth_baseline(benchmark::State& state) {
  const std::int64_t n = big_size() * 3 / 2;  // copying 1.5 N floats moves 12 N bytes
  const at::Tensor src = at::rand({n}, at::TensorOptions().device(bench_device()));
  at::Tensor dst = at::empty_like(src);
  for (auto _ : state) {
    if (src.is_cuda()) {
      dst.copy_(src);
      sync();
    } else {
      std::memcpy(dst.data_ptr(), src.data_ptr(), static_cast<std::size_t>(n) * sizeof(float));
      benchmark::ClobberMemory();
    }
  }
  state.SetBytesProcessed(state.iterations() * n * 8);
}

void bandwidth_difftrain(benchmark::State& state) {
  struct One : torch::nn::Module {
    One() {
      register_parameter("w", at::rand({big_size()}, at::TensorOptions().device(bench_device())));
    }
  } model;
  ema::Ema<ema::Constant, ema::MultiTensor> e(model, {.decay = 0.999});
  for (auto _ : state) {
    e.update();
    sync();
  }
  state.SetBytesProcessed(state.iterations() * big_size() * 12);
}

struct Stand : torch::nn::Module {
  Stand() {
    for (int i = 0; i < 8; ++i)
      register_parameter("w" + std::to_string(i),
                         at::randn({512, 512}, at::TensorOptions().device(bench_device())));
  }
  void step() {
    const at::NoGradGuard g;
    at::Tensor x = at::randn({256, 512}, at::TensorOptions().device(bench_device()));
    for (auto& p : parameters()) x = at::tanh(x.matmul(p));
    for (auto& p : parameters()) p.add_(x.mean() * 1e-6);
    sync();
  }
};

void offload_baseline(benchmark::State& state) {
  Stand model;
  for (auto _ : state) model.step();
}

void offload_difftrain(benchmark::State& state, bool overlap) {
  Stand model;
  ema::Ema<ema::Constant, ema::Offloaded> e(model, {.decay = 0.999}, {.overlap = overlap});
  for (auto _ : state) {
    model.step();
    e.update();
  }
  e.engine().synchronize();
}

// The EMA rule chosen at run time (ema::RuleByName: one std::visit per update) against the same
// rule named at compile time, over a small model (100 tensors of 1,000): the ratio is the cost of
// choosing on the command line, where a rule's arithmetic is not hidden by large tensors.
template <class Rule>
void rule_update(benchmark::State& state, const typename Rule::Options& o) {
  Many model(100, 1000);
  ema::Ema<Rule, ema::MultiTensor> e(model, o);
  for (auto _ : state) e.update();
}
void rule_static(benchmark::State& state) {
  rule_update<ema::WarmupDecay>(state, {.decay = 0.9999, .use_ema_warmup = true});
}
void rule_by_name(benchmark::State& state) {
  rule_update<ema::RuleByName>(
      state, ema::RuleByName::from_json(
                 {{"rule", "warmup_decay"}, {"decay", 0.9999}, {"use_ema_warmup", true}}));
}
}  // namespace

BENCHMARK(rule_static)->Name("ema_rule_update/baseline")->UseRealTime();
BENCHMARK(rule_by_name)->Name("ema_rule_update/difftrain")->UseRealTime();
BENCHMARK(many_small<ema::PerTensor>)->Name("ema_many_small/baseline")->UseRealTime();
BENCHMARK(many_small<ema::MultiTensor>)->Name("ema_many_small/difftrain")->UseRealTime();
BENCHMARK(bandwidth_baseline)->Name("ema_bandwidth/baseline")->Iterations(5)->UseRealTime();
BENCHMARK(bandwidth_difftrain)->Name("ema_bandwidth/difftrain")->Iterations(5)->UseRealTime();
BENCHMARK(offload_baseline)->Name("ema_offload_step/baseline")->UseRealTime();
BENCHMARK(offload_baseline)->Name("ema_offload_step_overlapped/baseline")->UseRealTime();
BENCHMARK_CAPTURE(offload_difftrain, serial, false)
    ->Name("ema_offload_step/difftrain")
    ->UseRealTime();
BENCHMARK_CAPTURE(offload_difftrain, overlapped, true)
    ->Name("ema_offload_step_overlapped/difftrain")
    ->UseRealTime();
