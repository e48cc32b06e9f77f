// Attention backends and transformer blocks. On a GPU in bfloat16, on the CPU in float32.
//  - attention_overhead_*: difftrain's Sdpa<Auto> against at::scaled_dot_product_attention on the
//    same tensors (goal: ratio <= 1.02) at (4, 16, 4096, 128) and at a short sequence (256) on the
//    GPU; (1, 8, 1024, 64) and 256 on the CPU.
//  - attention_tflops/<backend>/<fwd|fwdbwd>/L/D: achieved TFLOP/s (counter "TFLOPs") and, on the
//    GPU, the fraction of the H100's 989 TFLOP/s dense bf16 peak ("of_peak"). Sequence lengths
//    256…16K on the GPU, 256…2K on the CPU; head dims 64 and 128. Kernels that cannot run the
//    shape are skipped with their reason.
//  - block_checkpoint: BasicTransformerBlock forward+backward with checkpointing (difftrain)
//    against without (baseline): the ratio is the time cost; on the GPU the counter "peak_MiB"
//    gives each side's peak memory.
#include <ATen/ATen.h>
#include <benchmark/benchmark.h>
#include <torch/cuda.h>
#include <difftrain/nn/attention/attention.hpp>
#include <difftrain/nn/blocks/blocks.hpp>

#if __has_include(<c10/cuda/CUDACachingAllocator.h>)
#include <c10/cuda/CUDACachingAllocator.h>
#define DIFFTRAIN_BENCH_CUDA_MEMORY 1
#endif

#include <string>
#include <vector>

namespace {
namespace att = difftrain::nn::attention;
namespace blk = difftrain::nn::blocks;

bool gpu() { return torch::cuda::is_available(); }
void sync() {
  if (gpu()) torch::cuda::synchronize();
}
at::TensorOptions opts() {
  return gpu() ? at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16)
               : at::TensorOptions().dtype(at::kFloat);
}

struct Qkv {
  at::Tensor q, k, v;
};
Qkv make_qkv(std::int64_t b, std::int64_t h, std::int64_t l, std::int64_t d, bool grad = false) {
  auto t = [&] { return at::randn({b, h, l, d}, opts()).requires_grad_(grad); };
  return {t(), t(), t()};
}

void overhead_torch(benchmark::State& state, std::int64_t b, std::int64_t h, std::int64_t l,
                    std::int64_t d) {
  const Qkv x = make_qkv(b, h, l, d);
  // Untimed first call: the first CUDA work of the process also pays for context creation and
  // kernel selection, which would otherwise be this case's only iteration.
  (void)at::scaled_dot_product_attention(x.q, x.k, x.v);
  sync();
  for (auto _ : state) {
    benchmark::DoNotOptimize(at::scaled_dot_product_attention(x.q, x.k, x.v));
    sync();
  }
}

void overhead_difftrain(benchmark::State& state, std::int64_t b, std::int64_t h, std::int64_t l,
                        std::int64_t d) {
  const Qkv x = make_qkv(b, h, l, d);
  (void)att::Sdpa<att::Auto>::forward(x.q, x.k, x.v, {});
  sync();
  for (auto _ : state) {
    benchmark::DoNotOptimize(att::Sdpa<att::Auto>::forward(x.q, x.k, x.v, {}));
    sync();
  }
}

template <class Backend>
void tflops(benchmark::State& state, bool backward) {
  const std::int64_t l = state.range(0), d = state.range(1);
  const std::int64_t b = 1, h = gpu() ? 16 : 4;
  const Qkv x = make_qkv(b, h, l, d, backward);
  if (const att::Eligibility e = Backend::eligibility(x.q, x.k, x.v, {}); !e) {
    state.SkipWithError(("cannot run: " + e.reason).c_str());
    return;
  }
  const at::Tensor grad = at::randn({b, h, l, d}, opts());
  try {
    // Untimed first call per shape: cuDNN builds an execution plan for each new shape (0.7–1.8 s
    // on an H200), which would otherwise be the only, timed, iteration of the short cases.
    {
      at::Tensor out = Backend::forward(x.q, x.k, x.v, {});
      if (backward) out.backward(grad);
      sync();
    }
    for (auto _ : state) {
      at::Tensor out = Backend::forward(x.q, x.k, x.v, {});
      if (backward) out.backward(grad);
      sync();
    }
  } catch (const c10::Error& e) {  // the math backends run out of memory at long sequences
    state.SkipWithError(e.what_without_backtrace());
    return;
  }
  const double flops = 4.0 * static_cast<double>(b * h * l * l * d) * (backward ? 3.5 : 1.0);
  state.counters["TFLOPs"] =
      benchmark::Counter(flops * 1e-12, benchmark::Counter::kIsIterationInvariantRate);
  if (gpu())
    state.counters["of_peak"] =
        benchmark::Counter(flops * 1e-12 / 989.0, benchmark::Counter::kIsIterationInvariantRate);
}

void block_step(benchmark::State& state, bool checkpointed) {
  blk::TransformerBlockOptions o;
  o.dim = gpu() ? 1024 : 256;
  o.n_heads = gpu() ? 16 : 4;
  o.d_head = 64;
  o.context_dim = 768;
  o.checkpoint = checkpointed;
  blk::BasicTransformerBlock<> m(o);
  m->to(opts().device(), opts().dtype().toScalarType());
  m->train();
  const std::int64_t tokens = gpu() ? 4096 : 1024;
  const at::Tensor x = at::randn({gpu() ? 4 : 2, tokens, o.dim}, opts()).requires_grad_();
  const at::Tensor ctx = at::randn({x.size(0), 77, 768}, opts());
  m->forward(x, ctx)
      .sum()
      .backward();  // untimed: kernel selection and the allocator's first growth
  sync();
#ifdef DIFFTRAIN_BENCH_CUDA_MEMORY
  if (gpu()) {
    c10::cuda::CUDACachingAllocator::resetPeakStats(0);
  }
#endif
  for (auto _ : state) {
    m->forward(x, ctx).sum().backward();
    sync();
  }
#ifdef DIFFTRAIN_BENCH_CUDA_MEMORY
  if (gpu()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(0);
    state.counters["peak_MiB"] =
        static_cast<double>(stats
                                .allocated_bytes[static_cast<std::size_t>(
                                    c10::CachingAllocator::StatType::AGGREGATE)]
                                .peak) /
        (1 << 20);
  }
#endif
}

void register_all() {
  const bool g = gpu();
  const std::int64_t b = g ? 4 : 1, h = g ? 16 : 8, long_l = g ? 4096 : 1024, d = g ? 128 : 64;
  benchmark::RegisterBenchmark("attention_overhead_long/baseline", overhead_torch, b, h, long_l, d)
      ->UseRealTime();
  benchmark::RegisterBenchmark("attention_overhead_long/difftrain", overhead_difftrain, b, h,
                               long_l, d)
      ->UseRealTime();
  benchmark::RegisterBenchmark("attention_overhead_short/baseline", overhead_torch, b, h, 256, d)
      ->UseRealTime();
  benchmark::RegisterBenchmark("attention_overhead_short/difftrain", overhead_difftrain, b, h, 256,
                               d)
      ->UseRealTime();

  const std::int64_t max_l = g ? 16384 : 2048;
  auto sweep = [&](benchmark::internal::Benchmark* bm) {
    for (std::int64_t l = 256; l <= max_l; l *= 2)
      for (std::int64_t hd : {64, 128}) bm->Args({l, hd});
    bm->UseRealTime()->Unit(benchmark::kMillisecond);
  };
  auto both = [&](const std::string& name, auto fn) {
    sweep(benchmark::RegisterBenchmark(("attention_tflops/" + name + "/fwd").c_str(), fn, false));
    sweep(benchmark::RegisterBenchmark(("attention_tflops/" + name + "/fwdbwd").c_str(), fn, true));
  };
  both("math", tflops<att::Math>);
  both("chunked_math", tflops<att::Chunked<att::Math, 1024>>);
  both("sdpa_auto", tflops<att::Sdpa<att::Auto>>);
  both("sdpa_flash", tflops<att::Sdpa<att::Flash>>);
  if (g) {
    both("sdpa_mem_efficient", tflops<att::Sdpa<att::MemEfficient>>);
    both("sdpa_cudnn", tflops<att::Sdpa<att::CuDNN>>);
  }

  benchmark::RegisterBenchmark("block_checkpoint/baseline", block_step, false)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("block_checkpoint/difftrain", block_step, true)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
}

const bool registered = (register_all(), true);
}  // namespace
