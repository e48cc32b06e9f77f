// Activation policies against the direct ATen call they wrap: forward + backward on the same
// tensor, in the same run. Goal: ratio <= 1.02.
#include <ATen/ATen.h>
#include <benchmark/benchmark.h>
#include <torch/nn/modules/container/any.h>
#include <difftrain/nn/activation.hpp>

namespace {
namespace act = difftrain::nn::activation;

template <class Direct, class Policy>
void run(benchmark::State& state, Direct direct, bool use_policy) {
  const at::Tensor x = at::randn({state.range(0), 1024}).requires_grad_(true);
  for (auto _ : state) {
    const at::Tensor y = use_policy ? Policy::forward(x, {}) : direct(x);
    y.sum().backward();
    benchmark::DoNotOptimize(x.grad().data_ptr());
    x.mutable_grad().reset();
  }
  state.SetItemsProcessed(state.iterations() * x.numel());
}

// One baseline/difftrain pair of cases per activation.
#define DIFFTRAIN_ACT_BENCH(Act, Policy, direct_call)                                  \
  void Act##_baseline(benchmark::State& s) {                                           \
    run<decltype(direct_call), Policy>(s, direct_call, false);                         \
  }                                                                                    \
  void Act##_difftrain(benchmark::State& s) {                                          \
    run<decltype(direct_call), Policy>(s, direct_call, true);                          \
  }                                                                                    \
  BENCHMARK(Act##_baseline)->Name("activation_" #Act "/baseline")->Arg(64)->Arg(1024); \
  BENCHMARK(Act##_difftrain)->Name("activation_" #Act "/difftrain")->Arg(64)->Arg(1024);

const auto relu_call = [](const at::Tensor& x) { return at::relu(x); };
const auto gelu_call = [](const at::Tensor& x) { return at::gelu(x); };
const auto silu_call = [](const at::Tensor& x) { return at::silu(x); };
DIFFTRAIN_ACT_BENCH(relu, act::ReLU, relu_call)
DIFFTRAIN_ACT_BENCH(gelu, act::GELU, gelu_call)
DIFFTRAIN_ACT_BENCH(silu, act::SiLU, silu_call)

// Through a type-erased module (what a name read from a file gives) vs the direct call.
void module_relu_baseline(benchmark::State& s) {
  run<decltype(relu_call), act::ReLU>(s, relu_call, false);
}
void module_relu_difftrain(benchmark::State& state) {
  torch::nn::AnyModule m = difftrain::nn::make_activation("relu");
  const at::Tensor x = at::randn({state.range(0), 1024}).requires_grad_(true);
  for (auto _ : state) {
    const at::Tensor y = m.forward(x);
    y.sum().backward();
    benchmark::DoNotOptimize(x.grad().data_ptr());
    x.mutable_grad().reset();
  }
}
BENCHMARK(module_relu_baseline)->Name("activation_module_relu/baseline")->Arg(64)->Arg(1024);
BENCHMARK(module_relu_difftrain)->Name("activation_module_relu/difftrain")->Arg(64)->Arg(1024);
}  // namespace
