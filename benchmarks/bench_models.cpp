// diffusers' UNet2DConditionModel in difftrain against diffusers itself, at a small SD-like
// configuration (3 levels of 64/128/256 channels, cross-attention to 16 tokens of 128, 32×32
// latents, batch 2):
//  - unet_step_vs_diffusers: forward + backward of a mean-square loss; the baseline is the same
//    step in Python eager (benchmarks/python_unet_step.py, same thread count) — goal ratio <= 1.0;
//  - unet_checkpointing: the same step without (baseline) and with (difftrain) gradient
//    checkpointing; the ratio is the time it costs, the peak_MiB counters the CPU memory of each
//    step (every allocation counted by a CPU allocator wrapper installed for this benchmark).

#include <benchmark/benchmark.h>
#include <c10/core/CPUAllocator.h>
#include <torch/torch.h>

#include <difftrain/models/unet_2d_condition.hpp>
#include "python_baseline.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>

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
  static const double seconds = difftrain::bench::python_seconds_per_step(
      std::string(DIFFTRAIN_PYTHON) + " " + DIFFTRAIN_BENCH_DIR + "/python_unet_step.py '" +
      bench_config().dump() + "' 10 " + std::to_string(at::get_num_threads()));
  if (seconds <= 0) {
    state.SkipWithError("the diffusers reference step did not run (python with diffusers?)");
    return;
  }
  for (auto _ : state) state.SetIterationTime(seconds);
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
class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* inner)
      : inner_(inner), inner_delete_(inner->raw_deleter()) {
    instance_ = this;
  }
  c10::DataPtr allocate(size_t n) override {
    void* d = inner_->raw_allocate(n);
    {
      std::lock_guard<std::mutex> lock(m_);
      sizes_[d] = n;
      current_ += n;
      peak_ = std::max(peak_, current_);
    }
    return {d, d, &CountingAllocator::release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &CountingAllocator::release; }
  void copy_data(void* dst, const void* src, std::size_t n) const override {
    std::memcpy(dst, src, n);
  }
  void reset_peak() {
    std::lock_guard<std::mutex> lock(m_);
    peak_ = current_;
  }
  std::size_t peak() {
    std::lock_guard<std::mutex> lock(m_);
    return peak_;
  }

 private:
  static void release(void* d) {
    if (d == nullptr) return;
    CountingAllocator* self = instance_;
    {
      std::lock_guard<std::mutex> lock(self->m_);
      if (auto it = self->sizes_.find(d); it != self->sizes_.end()) {
        self->current_ -= it->second;
        self->sizes_.erase(it);
      }
    }
    self->inner_delete_(d);
  }
  static inline CountingAllocator* instance_ = nullptr;
  c10::Allocator* inner_;
  c10::DeleterFnPtr inner_delete_;
  std::mutex m_;
  std::unordered_map<void*, std::size_t> sizes_;
  std::size_t current_ = 0, peak_ = 0;
};

CountingAllocator& counting() {
  static CountingAllocator* a = [] {
    auto* c = new CountingAllocator(c10::GetCPUAllocator());
    c10::SetCPUAllocator(c, /*priority=*/100);
    return c;
  }();
  return *a;
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
}  // namespace

BENCHMARK(diffusers_step)->Name("unet_step_vs_diffusers/baseline")->UseManualTime();
BENCHMARK(difftrain_timed)->Name("unet_step_vs_diffusers/difftrain")->UseManualTime();
BENCHMARK_TEMPLATE(checkpointing, false)->Name("unet_checkpointing/baseline")->UseRealTime();
BENCHMARK_TEMPLATE(checkpointing, true)->Name("unet_checkpointing/difftrain")->UseRealTime();
