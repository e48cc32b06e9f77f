// Flux.1 LoRA training on one device: what kohya's memory options cost and save.
//  - flux_block_swap/N: a LoRA step (forward + backward, checkpointed blocks) of a mid-size Flux
//    (6 double and 12 single blocks of 4 heads × 64, 256 image and 64 text tokens, batch 1) with
//    N blocks swapped (N / 2 double, 2·(N − N / 2) single) against the same model without
//    swapping, paired rounds in one run: the ratio is the time swapping costs; the counters give
//    the frozen weights' bytes resident on the device at their peak against the unswapped model's
//    (on this CPU the "device" is host memory too: the copies and frees are real, the saving is
//    what a GPU would keep free).
//  - flux_fp8_base: the same step with the frozen linear weights stored in float8 (a per-tensor
//    scale, dequantised per layer) against float32 storage; counters: weight bytes against bf16's.
//  - flux_dev_lora_memory: Flux.1-dev's full width (24 heads × 128), one double and one single
//    block with fp8 weights and rank-16 LoRA, measured at two token counts (CPU allocator, float32
//    compute); from those per-block figures and Flux.1-dev's parameter table, the peak device
//    memory of a LoRA step at 1024² (4,096 image + 512 text tokens, batch 1, bf16 compute,
//    checkpointed blocks, cached text), for 0 and 35 swapped blocks; the goal is 16 GiB.

#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <difftrain/adapters/flux_lora_files.hpp>
#include <difftrain/adapters/lora_inject.hpp>
#include <difftrain/models/flux_transformer_2d.hpp>
#include <difftrain/nn/block_swap.hpp>

#include <chrono>
#include <cstdio>
#include <memory>
#include <numeric>

#include "../tests/unit/counting_allocator.hpp"
#include "paired.hpp"

namespace {
namespace models = difftrain::models;
namespace nn = difftrain::nn;
namespace ad = difftrain::adapters;
using Backend = nn::attention::Sdpa<nn::attention::Auto>;
using Flux = models::FluxTransformer2DModel<Backend>;

models::FluxTransformer2DConfig mid_config() {
  models::FluxTransformer2DConfig c;
  c.num_layers = 6;
  c.num_single_layers = 12;
  c.attention_head_dim = 64;
  c.num_attention_heads = 4;
  c.in_channels = 16;
  c.joint_attention_dim = 64;
  c.pooled_projection_dim = 32;
  c.axes_dims_rope = {8, 28, 28};
  c.guidance_embeds = true;
  return c;
}

/// A LoRA step of a Flux model: the base frozen (fp8 when asked), rank 4 on diffusers' targets,
/// checkpointed blocks.
struct FluxLoraStep {
  Flux model;
  at::Tensor x, text, pooled, t, g, img, txt;
  explicit FluxLoraStep(const models::FluxTransformer2DConfig& c, bool fp8 = false,
                        std::int64_t side = 16, std::int64_t tokens = 64, std::int64_t rank = 4)
      : model(c) {
    at::manual_seed(0);
    for (auto& p : model->parameters()) p.set_requires_grad(false);
    if (fp8) (void)nn::store_frozen_weights_fp8(*model, at::kFloat);
    ad::inject_lora(*model, ad::flux_lora_targets(), nn::LoraOptions{.rank = rank});
    model->set_gradient_checkpointing(true);
    model->train();
    x = at::randn({1, side * side, c.in_channels});
    text = at::randn({1, tokens, c.joint_attention_dim});
    pooled = at::randn({1, c.pooled_projection_dim});
    t = at::rand({1});
    g = at::full({1}, 3.5);
    img = models::flux_latent_image_ids(side, side);
    txt = at::zeros({tokens, 3});
  }
  void run() {
    model->zero_grad(true);
    model->forward(x, text, pooled, t, img, txt, c_guidance()).square().mean().backward();
  }
  [[nodiscard]] at::Tensor c_guidance() const {
    return model->config().guidance_embeds ? g : at::Tensor();
  }
  [[nodiscard]] std::int64_t frozen_bytes() const {
    std::int64_t n = 0;
    for (const auto& p : model->parameters())
      if (!p.requires_grad()) n += static_cast<std::int64_t>(p.nbytes());
    for (const auto& b : model->buffers()) n += static_cast<std::int64_t>(b.nbytes());
    return n;
  }
};

template <class Step>
auto block_of(Step& s, int steps) {
  return [&s, steps] {
    return difftrain::bench::seconds_per_step(
        steps, [&] { s.run(); }, [] {});
  };
}

void block_swap(benchmark::State& state) {
  const auto n = state.range(0);
  FluxLoraStep plain(mid_config()), swapped(mid_config());
  const std::int64_t frozen = swapped.frozen_bytes();
  const auto swap = models::flux_block_swap(swapped.model, n);
  plain.run();
  swapped.run();
  const auto r = difftrain::bench::paired(6, block_of(plain, 2), block_of(swapped, 2));
  difftrain::bench::report_paired(state, r);
  const nn::BlockSwapStats& st = swap->stats();
  const double mib = 1 << 20;
  state.counters["frozen_MiB"] = static_cast<double>(frozen) / mib;
  state.counters["device_frozen_peak_MiB"] =
      static_cast<double>(frozen - st.host_bytes + st.peak_resident_bytes) / mib;
  state.counters["swapped_blocks"] = static_cast<double>(st.blocks);
  state.counters["copies_per_step"] =
      static_cast<double>(st.copies) / static_cast<double>(1 + 6 * 2);  // steps run
}

void fp8_base(benchmark::State& state) {
  FluxLoraStep f32(mid_config()), fp8(mid_config(), true);
  f32.run();
  fp8.run();
  const auto r = difftrain::bench::paired(6, block_of(f32, 2), block_of(fp8, 2));
  difftrain::bench::report_paired(state, r);
  std::int64_t linear_f32 = 0, linear_fp8 = 0;
  auto f32_params = f32.model->named_parameters();
  for (const auto& p : fp8.model->named_parameters())
    if (p.value().scalar_type() == at::kFloat8_e4m3fn) {
      linear_fp8 += static_cast<std::int64_t>(p.value().nbytes());
      linear_f32 += static_cast<std::int64_t>(f32_params[p.key()].nbytes());
    }
  state.counters["weight_bytes_vs_bf16"] =
      static_cast<double>(linear_fp8) / (static_cast<double>(linear_f32) / 2);
}

/// Peak bytes above what was held before, over forward + backward of one block at `tokens`.
struct BlockFigures {
  double double_block = 0, single_block = 0;
};

BlockFigures measure_blocks(std::int64_t image_side, std::int64_t text_tokens) {
  auto& alloc = difftrain::test::CountingAllocator::install();
  models::FluxTransformer2DConfig c;  // Flux.1-dev's widths, one block of each kind
  c.num_layers = 1;
  c.num_single_layers = 1;
  c.guidance_embeds = true;
  FluxLoraStep s(c, true, image_side, text_tokens, 16);
  const std::int64_t d = c.inner_dim(), tokens = image_side * image_side + text_tokens;
  const at::Tensor temb = at::randn({1, d});
  const auto [cos, sin] = models::flux_rotary(at::cat({s.txt, s.img}), c.axes_dims_rope);
  BlockFigures f;
  {
    auto& block = *s.model->transformer_blocks->ptr<models::FluxTransformerBlockImpl<Backend>>(0);
    const at::Tensor xi = at::randn({1, image_side * image_side, d}).requires_grad_();
    const at::Tensor ti = at::randn({1, text_tokens, d}).requires_grad_();
    alloc.reset_peak();
    const std::size_t before = alloc.peak();
    auto [to, xo] = block.forward(xi, ti, temb, cos, sin);
    (to.sum() + xo.sum()).backward();
    f.double_block = static_cast<double>(alloc.peak() - before);
  }
  {
    auto& block =
        *s.model->single_transformer_blocks->ptr<models::FluxSingleTransformerBlockImpl<Backend>>(
            0);
    const at::Tensor j = at::randn({1, tokens, d}).requires_grad_();
    alloc.reset_peak();
    const std::size_t before = alloc.peak();
    block.forward(j, temb, cos, sin).sum().backward();
    f.single_block = static_cast<double>(alloc.peak() - before);
  }
  return f;
}

void dev_lora_memory(benchmark::State& state) {
  const auto start = std::chrono::steady_clock::now();
  // Two token counts: the per-token slope and the fixed part (a dequantised weight, LoRA's
  // gradients) of each block's peak; attention's memory is linear in tokens (SDPA's kernels).
  const std::int64_t text = 64;
  const BlockFigures a = measure_blocks(8, text), b = measure_blocks(16, text);
  const double ta = 8 * 8 + text, tb = 16 * 16 + text;
  auto slope = [&](double ya, double yb) { return (yb - ya) / (tb - ta); };
  auto fixed = [&](double ya, double yb) { return ya - slope(ya, yb) * ta; };
  // Flux.1-dev's parameters: block linears in fp8 (one byte), the rest in bf16.
  models::FluxTransformer2DConfig dev;
  dev.guidance_embeds = true;
  double fp8_bytes = 0, bf16_bytes = 0, lora_params = 0, double_block = 0, single_block = 0;
  for (const auto& [name, shape] : models::flux_parameter_table(dev)) {
    const double n = std::accumulate(shape.begin(), shape.end(), 1.0, std::multiplies<>());
    const bool in_block =
        name.find("transformer_blocks.") == 0 || name.find("single_transformer_blocks.") == 0;
    const bool linear_weight = shape.size() == 2 && name.ends_with(".weight") &&
                               name.find("norm_q") == std::string::npos &&
                               name.find("norm_k") == std::string::npos;
    (linear_weight ? fp8_bytes : bf16_bytes) += linear_weight ? n : 2 * n;
    if (name.rfind("transformer_blocks.0.", 0) == 0) double_block += linear_weight ? n : 2 * n;
    if (name.rfind("single_transformer_blocks.0.", 0) == 0)
      single_block += linear_weight ? n : 2 * n;
    (void)in_block;
    for (const auto& target : ad::flux_lora_targets().target_modules)
      if (linear_weight && name.ends_with(target + ".weight"))
        lora_params += 16 * (shape[0] + shape[1]);
  }
  const double gib = 1 << 30, tokens = 4096 + 512, bf16 = 0.5;  // float32 measured → bf16
  const double act_double = bf16 * (fixed(a.double_block, b.double_block) +
                                    slope(a.double_block, b.double_block) * tokens);
  const double act_single = bf16 * (fixed(a.single_block, b.single_block) +
                                    slope(a.single_block, b.single_block) * tokens);
  // Checkpointed blocks keep their inputs (the joint tokens, and temb) for the recompute.
  const double saved_inputs = 57 * tokens * 3072 * 2;
  const double lora_state = lora_params * (4 + 4 + 8);  // fp32 weights, gradients, Adam moments
  const double weights = fp8_bytes + bf16_bytes;
  auto peak = [&](std::int64_t swapped) {
    const auto split = nn::split_blocks_to_swap(swapped, 19, 38, "blocks_to_swap");
    const double host = static_cast<double>(split.double_blocks) * double_block +
                        static_cast<double>(split.single_blocks) * single_block;
    const double in_flight = swapped > 0 ? 2 * std::max(double_block, single_block) : 0;
    return weights - host + in_flight + lora_state + saved_inputs +
           std::max(act_double, act_single);
  };
  for (auto _ : state)
    state.SetIterationTime(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  state.counters["weights_GiB"] = weights / gib;
  state.counters["double_block_act_MiB"] = act_double / (1 << 20);
  state.counters["single_block_act_MiB"] = act_single / (1 << 20);
  state.counters["lora_state_MiB"] = lora_state / (1 << 20);
  state.counters["peak_GiB_swap0"] = peak(0) / gib;
  state.counters["peak_GiB_swap18"] = peak(18) / gib;
  state.counters["peak_GiB_swap35"] = peak(35) / gib;
  std::printf(
      "Flux.1-dev LoRA step at 1024², fp8 base, checkpointed blocks, bf16: weights %.2f GiB; per "
      "block activations %.0f / %.0f MiB (double / single); peak %.2f GiB without swapping, "
      "%.2f GiB with 18 blocks swapped, %.2f GiB with 35 (goal 16 GiB)\n",
      weights / gib, act_double / (1 << 20), act_single / (1 << 20), peak(0) / gib, peak(18) / gib,
      peak(35) / gib);
}

}  // namespace

BENCHMARK(block_swap)
    ->Name("flux_block_swap")
    ->Arg(2)
    ->Arg(4)
    ->Arg(6)
    ->UseManualTime()
    ->Iterations(1);
BENCHMARK(fp8_base)->Name("flux_fp8_base")->UseManualTime()->Iterations(1);
BENCHMARK(dev_lora_memory)->Name("flux_dev_lora_memory")->UseManualTime()->Iterations(1);
