// diffusers' UNet2DConditionModel in difftrain against diffusers itself, at a small SD-like
// configuration (3 levels of 64/128/256 channels, cross-attention to 16 tokens of 128, 32×32
// latents, batch 2):
//  - unet_step_vs_diffusers: forward + backward of a mean-square loss; the baseline is the same
//    step in Python eager (benchmarks/python_unet_step.py, same thread count) — goal ratio <= 1.0;
//  - unet_checkpointing: the same step without (baseline) and with (difftrain) gradient
//    checkpointing; the ratio is the time it costs, the peak_MiB counters the CPU memory of each
//    step (every allocation counted by a CPU allocator wrapper installed for this benchmark).
// On a GPU (skipped elsewhere), at a larger SD-like configuration (128/256/512 channels, two layers
// per block, 8 heads, 77 tokens of 768, 64×64 latents, batch 8) under bf16 autocast:
//  - unet_cuda_bf16_vs_diffusers: the step against diffusers' in Python eager on the same GPU;
//  - unet_cuda_attention_<kernel>: the step with each SDPA kernel against the Math backend;
//  - unet_cuda_checkpointing: time and peak GPU memory (the caching allocator's) without and with
//    gradient checkpointing.

#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <torch/cuda.h>

#include <difftrain/models/unet_2d_condition.hpp>
#include <difftrain/nn/attention/math.hpp>
#include <difftrain/train/precision.hpp>
#include "../tests/unit/counting_allocator.hpp"
#include "python_baseline.hpp"

#if __has_include(<c10/cuda/CUDACachingAllocator.h>)
#include <c10/cuda/CUDACachingAllocator.h>
#define DIFFTRAIN_BENCH_CUDA_MEMORY 1
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>

namespace {
namespace models = difftrain::models;

nlohmann::json bench_config() {
  return {{"sample_size", 32},
          {"in_channels", 4},
          {"out_channels", 4},
          {"block_out_channels", {64, 128, 256}},
          {"down_block_types", {"CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"}},
          {"up_block_types", {"UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"}},
          {"layers_per_block", 1},
          {"cross_attention_dim", 128},
          {"attention_head_dim", {2, 4, 8}}};
}

struct Step {
  models::UNet2DConditionModel<> unet;
  at::Tensor x, t, ctx;
  Step()
      : unet(models::UNet2DConditionConfig::from_json(bench_config(), "bench")),
        x(at::randn({2, 4, 32, 32})),
        t(at::tensor({10, 500})),
        ctx(at::randn({2, 16, 128})) {
    unet->train();
  }
  void run() {
    unet->zero_grad(true);
    unet->forward(x, t, ctx).square().mean().backward();
  }
};

void diffusers_step(benchmark::State& state) {
  static std::string why;
  static const double seconds = difftrain::bench::python_seconds_per_step(
      difftrain::bench::python_script("python_unet_step.py") + " '" + bench_config().dump() +
          "' 10 " + std::to_string(at::get_num_threads()),
      &why);
  difftrain::bench::report_baseline(state, seconds, why);
}

void difftrain_timed(benchmark::State& state) {
  Step s;
  s.run();
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    s.run();
    state.SetIterationTime(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
}

/// Counts the bytes the CPU allocator hands out: current and peak. Data and context stay the same
/// pointer (LibTorch's raw_allocate asks for that), so the sizes live in a map.
difftrain::test::CountingAllocator& counting() {
  return difftrain::test::CountingAllocator::install();
}

template <bool On>
void checkpointing(benchmark::State& state) {
  auto& alloc = counting();
  Step s;
  s.unet->set_gradient_checkpointing(On);
  s.run();
  double peak = 0;
  for (auto _ : state) {
    alloc.reset_peak();
    s.run();
    peak = static_cast<double>(alloc.peak()) / (1 << 20);
  }
  state.counters["peak_MiB"] = peak;
}
// ---- on a GPU ----------------------------------------------------------------------------------
namespace att = difftrain::nn::attention;
constexpr std::int64_t kGpuBatch = 8, kGpuTokens = 77;

nlohmann::json gpu_config() {
  nlohmann::json c = bench_config();
  c["sample_size"] = 64;
  c["block_out_channels"] = {128, 256, 512};
  c["layers_per_block"] = 2;
  c["cross_attention_dim"] = 768;
  c["attention_head_dim"] = 8;
  return c;
}

template <class Backend>
struct GpuStep {
  models::UNet2DConditionModel<Backend> unet;
  at::Tensor x, t, ctx;
  GpuStep() : unet(models::UNet2DConditionConfig::from_json(gpu_config(), "bench")) {
    const auto o = at::TensorOptions().device(at::kCUDA);
    unet->to(at::kCUDA);
    unet->train();
    x = at::randn({kGpuBatch, 4, 64, 64}, o);
    t = at::arange(kGpuBatch, o.dtype(at::kLong)) * 997 % 1000;
    ctx = at::randn({kGpuBatch, kGpuTokens, 768}, o);
  }
  void run() {
    unet->zero_grad(true);
    at::Tensor loss;
    {
      difftrain::train::AutocastGuard autocast(c10::kCUDA, at::kBFloat16);
      loss = unet->forward(x, t, ctx).to(at::kFloat).square().mean();
    }
    loss.backward();
  }
};

template <class Backend>
void gpu_step(benchmark::State& state, bool checkpointing = false) {
  if (!torch::cuda::is_available()) {
    state.SkipWithError("no CUDA device");
    return;
  }
  GpuStep<Backend> s;
  s.unet->set_gradient_checkpointing(checkpointing);
  for (int i = 0; i < 3; ++i) s.run();
  torch::cuda::synchronize();
#ifdef DIFFTRAIN_BENCH_CUDA_MEMORY
  c10::cuda::CUDACachingAllocator::resetPeakStats(0);
#endif
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    s.run();
    torch::cuda::synchronize();
    // Read only by the cases registered with UseManualTime (the pair with diffusers' time).
    state.SetIterationTime(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
#ifdef DIFFTRAIN_BENCH_CUDA_MEMORY
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(0);
  state.counters["peak_MiB"] =
      static_cast<double>(
          stats
              .allocated_bytes[static_cast<std::size_t>(c10::CachingAllocator::StatType::AGGREGATE)]
              .peak) /
      (1 << 20);
#endif
}

void gpu_math(benchmark::State& s) { gpu_step<att::Math>(s); }
void gpu_flash(benchmark::State& s) { gpu_step<att::Sdpa<att::Flash>>(s); }
void gpu_mem_efficient(benchmark::State& s) { gpu_step<att::Sdpa<att::MemEfficient>>(s); }
void gpu_cudnn(benchmark::State& s) { gpu_step<att::Sdpa<att::CuDNN>>(s); }
void gpu_auto(benchmark::State& s) { gpu_step<att::Sdpa<att::Auto>>(s); }
void gpu_auto_checkpointed(benchmark::State& s) { gpu_step<att::Sdpa<att::Auto>>(s, true); }

void diffusers_gpu_step(benchmark::State& state) {
  if (!torch::cuda::is_available()) {
    state.SkipWithError("no CUDA device");
    return;
  }
  static std::string why;
  static const double seconds = difftrain::bench::python_seconds_per_step(
      difftrain::bench::python_script("python_unet_step.py") + " '" + gpu_config().dump() +
          "' 20 1 cuda bf16 " + std::to_string(kGpuBatch) + " " + std::to_string(kGpuTokens),
      &why);
  difftrain::bench::report_baseline(state, seconds, why);
}

}  // namespace

BENCHMARK(diffusers_gpu_step)->Name("unet_cuda_bf16_vs_diffusers/baseline")->UseManualTime();
BENCHMARK(gpu_auto)->Name("unet_cuda_bf16_vs_diffusers/difftrain")->UseManualTime();
BENCHMARK(gpu_math)->Name("unet_cuda_attention_flash/baseline")->UseRealTime();
BENCHMARK(gpu_flash)->Name("unet_cuda_attention_flash/difftrain")->UseRealTime();
BENCHMARK(gpu_math)->Name("unet_cuda_attention_mem_efficient/baseline")->UseRealTime();
BENCHMARK(gpu_mem_efficient)->Name("unet_cuda_attention_mem_efficient/difftrain")->UseRealTime();
BENCHMARK(gpu_math)->Name("unet_cuda_attention_cudnn/baseline")->UseRealTime();
BENCHMARK(gpu_cudnn)->Name("unet_cuda_attention_cudnn/difftrain")->UseRealTime();
BENCHMARK(gpu_auto)->Name("unet_cuda_checkpointing/baseline")->UseRealTime();
BENCHMARK(gpu_auto_checkpointed)->Name("unet_cuda_checkpointing/difftrain")->UseRealTime();

BENCHMARK(diffusers_step)->Name("unet_step_vs_diffusers/baseline")->UseManualTime();
BENCHMARK(difftrain_timed)->Name("unet_step_vs_diffusers/difftrain")->UseManualTime();
BENCHMARK_TEMPLATE(checkpointing, false)->Name("unet_checkpointing/baseline")->UseRealTime();
BENCHMARK_TEMPLATE(checkpointing, true)->Name("unet_checkpointing/difftrain")->UseRealTime();
