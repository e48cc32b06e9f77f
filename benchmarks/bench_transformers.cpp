// diffusers' diffusion transformers in difftrain against diffusers itself, each at a small config
// of 4 blocks of 4 heads × 32 with patch 2 on 32×32×4 latents (256 tokens), batch 4:
//  - dit_step_vs_diffusers: DiT (learned sigma, 1,000 classes); pixart_step_vs_diffusers: PixArt
//    (16 caption tokens of 64, projected); sd3_step_vs_diffusers: SD3's MMDiT (16 text tokens of
//    64, pooled text of 32, qk RMS norm, a dual-attention block): forward + backward of a
//    mean-square loss; cogvideox_step_vs_diffusers: CogVideoX-5B's kind (3-D rotary embeddings) on
//    3 latent frames of 16×16×4 (192 video tokens) with 16 text tokens of 64; the baseline is the
//    same step in Python eager
//    (benchmarks/python_transformer_step.py, same thread count) — goal ratio <= 1.0;
//  - cogvideox_vae_step_vs_diffusers: CogVideoX's 3-D VAE at 3 levels of 32/64/64 channels, one
//    resnet per level, reconstructing a 9-frame 32×32 video (batch 4) through the posterior's
//    mode, forward + backward, against diffusers' AutoencoderKLCogVideoX the same way;
//  - dit_attention_share: the same step, and the step with the attention kernel replaced by
//    q + k + v (same shapes, gradients still reach every projection); the counter
//    attention_share = 1 − the second time / the first is the kernel's part of the step.
// On a GPU (skipped elsewhere), DiT-B/2's shape (12 blocks of 12 × 64, 256 tokens, batch 32) under
// bf16 autocast:
//  - dit_cuda_bf16_vs_diffusers: the step against diffusers' in Python eager on the same GPU.

#include <benchmark/benchmark.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <difftrain/models/autoencoder_kl_cogvideox.hpp>
#include <difftrain/models/cogvideox_transformer_3d.hpp>
#include <difftrain/models/dit_transformer_2d.hpp>
#include <difftrain/models/pixart_transformer_2d.hpp>
#include <difftrain/models/sd3_transformer_2d.hpp>
#include <difftrain/train/precision.hpp>

#include <chrono>
#include <map>
#include <string>
#include <utility>

#include "python_baseline.hpp"

namespace {
namespace models = difftrain::models;
namespace att = difftrain::nn::attention;

constexpr std::int64_t kBatch = 4, kGpuBatch = 32, kTokens = 16;

nlohmann::json pixart_config() {
  return {{"num_attention_heads", 4}, {"attention_head_dim", 32},
          {"in_channels", 4},         {"out_channels", 8},
          {"num_layers", 4},          {"sample_size", 32},
          {"patch_size", 2},          {"cross_attention_dim", 128},
          {"caption_channels", 64}};
}
nlohmann::json sd3_config() {
  return {{"sample_size", 32},
          {"patch_size", 2},
          {"in_channels", 4},
          {"num_layers", 4},
          {"attention_head_dim", 32},
          {"num_attention_heads", 4},
          {"joint_attention_dim", 64},
          {"caption_projection_dim", 128},
          {"pooled_projection_dim", 32},
          {"out_channels", 4},
          {"pos_embed_max_size", 32},
          {"qk_norm", "rms_norm"},
          {"dual_attention_layers", {0}}};
}

nlohmann::json cogvideox_config() {
  return {{"num_attention_heads", 4}, {"attention_head_dim", 32},
          {"in_channels", 4},         {"out_channels", 4},
          {"time_embed_dim", 64},     {"text_embed_dim", 64},
          {"num_layers", 4},          {"sample_width", 16},
          {"sample_height", 16},      {"sample_frames", 9},
          {"patch_size", 2},          {"use_rotary_positional_embeddings", true}};
}

/// The Python baseline's seconds per step for `kind` (dit, pixart, sd3) at `config`, measured
/// once per run (the benchmark library may call a case more than once).
void python_baseline(benchmark::State& state, const std::string& kind,
                     const nlohmann::json& config) {
  static std::map<std::string, std::pair<double, std::string>> measured;
  auto it = measured.find(kind);
  if (it == measured.end()) {
    std::string why;
    const double seconds = difftrain::bench::python_seconds_per_step(
        difftrain::bench::python_script("python_transformer_step.py") + " " + kind + " '" +
            config.dump() + "' 10 " + std::to_string(at::get_num_threads()) + " " +
            std::to_string(kBatch),
        &why);
    it = measured.emplace(kind, std::make_pair(seconds, why)).first;
  }
  difftrain::bench::report_baseline(state, it->second.first, it->second.second);
}

/// A timed forward + backward of `model` called by `call`.
template <class Model, class Call>
void timed_steps(benchmark::State& state, Model& model, Call&& call) {
  model->eval();
  auto run = [&] {
    model->zero_grad(true);
    call().square().mean().backward();
  };
  run();
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    run();
    state.SetIterationTime(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
}

void pixart_diffusers(benchmark::State& state) {
  python_baseline(state, "pixart", pixart_config());
}
void pixart_difftrain(benchmark::State& state) {
  models::PixArtTransformer2DModel<> model(
      models::PixArtTransformer2DConfig::from_json(pixart_config(), "bench"));
  const at::Tensor x = at::randn({kBatch, 4, 32, 32}), text = at::randn({kBatch, kTokens, 64});
  const at::Tensor t = at::arange(kBatch, at::kLong) * 997 % 1000;
  timed_steps(state, model, [&] { return model->forward(x, t, text); });
}
void sd3_diffusers(benchmark::State& state) { python_baseline(state, "sd3", sd3_config()); }
void sd3_difftrain(benchmark::State& state) {
  models::SD3Transformer2DModel<> model(
      models::SD3Transformer2DConfig::from_json(sd3_config(), "bench"));
  const at::Tensor x = at::randn({kBatch, 4, 32, 32}), text = at::randn({kBatch, kTokens, 64}),
                   pooled = at::randn({kBatch, 32});
  const at::Tensor t = (at::arange(kBatch, at::kLong) * 997 % 1000).to(at::kFloat);
  timed_steps(state, model, [&] { return model->forward(x, text, pooled, t); });
}

void cogvideox_diffusers(benchmark::State& state) {
  python_baseline(state, "cogvideox", cogvideox_config());
}
void cogvideox_difftrain(benchmark::State& state) {
  models::CogVideoXTransformer3DModel<> model(
      models::CogVideoXTransformer3DConfig::from_json(cogvideox_config(), "bench"));
  const at::Tensor x = at::randn({kBatch, 3, 4, 16, 16}), text = at::randn({kBatch, kTokens, 64});
  const at::Tensor t = at::arange(kBatch, at::kLong) * 997 % 1000;
  timed_steps(state, model, [&] { return model->forward(x, text, t); });
}

nlohmann::json cogvideox_vae_config() {
  const std::vector<std::string> down(3, "CogVideoXDownBlock3D"), up(3, "CogVideoXUpBlock3D");
  return {{"block_out_channels", {32, 64, 64}},
          {"down_block_types", down},
          {"up_block_types", up},
          {"layers_per_block", 1},
          {"latent_channels", 4},
          {"norm_num_groups", 32},
          {"temporal_compression_ratio", 4}};
}
void cogvideox_vae_diffusers(benchmark::State& state) {
  python_baseline(state, "cogvideox_vae", cogvideox_vae_config());
}
void cogvideox_vae_difftrain(benchmark::State& state) {
  models::AutoencoderKLCogVideoX<> model(
      models::AutoencoderKLCogVideoXConfig::from_json(cogvideox_vae_config(), "bench"));
  const at::Tensor x = at::randn({kBatch, 3, 9, 32, 32});
  timed_steps(state, model, [&] { return model->forward(x); });
}

nlohmann::json bench_config() {
  return {{"num_attention_heads", 4}, {"attention_head_dim", 32},
          {"in_channels", 4},         {"out_channels", 8},
          {"num_layers", 4},          {"sample_size", 32},
          {"patch_size", 2},          {"num_embeds_ada_norm", 1000}};
}
nlohmann::json gpu_config() {
  nlohmann::json c = bench_config();
  c["num_attention_heads"] = 12;
  c["attention_head_dim"] = 64;
  c["num_layers"] = 12;
  return c;
}

/// Not attention: q + k + v, so the step keeps its shapes and every projection its gradient, at
/// the cost of two additions.
struct NoAttention {
  static constexpr std::string_view name = "no_attention";
  static att::Eligibility eligibility(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const att::AttentionArgs&) {
    return att::Eligibility::yes();
  }
  static at::Tensor forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const att::AttentionArgs&) {
    return q + k + v;
  }
};

template <class Backend>
struct Step {
  models::DiTTransformer2DModel<Backend> dit;
  at::Tensor x, t, labels;
  bool autocast;
  Step(const nlohmann::json& config, std::int64_t batch, at::Device device)
      : dit(models::DiTTransformer2DConfig::from_json(config, "bench")),
        autocast(device.is_cuda()) {
    const auto o = at::TensorOptions().device(device);
    dit->to(device);
    dit->eval();  // no random label dropout, as the Python side
    const std::int64_t size = config["sample_size"];
    x = at::randn({batch, 4, size, size}, o);
    t = at::arange(batch, o.dtype(at::kLong)) * 997 % 1000;
    labels = at::arange(batch, o.dtype(at::kLong)) % 1000;
  }
  void run() {
    dit->zero_grad(true);
    at::Tensor loss;
    if (autocast) {
      difftrain::train::AutocastGuard guard(c10::kCUDA, at::kBFloat16);
      loss = dit->forward(x, t, labels).to(at::kFloat).square().mean();
    } else {
      loss = dit->forward(x, t, labels).square().mean();
    }
    loss.backward();
  }
  double timed() {
    const auto start = std::chrono::steady_clock::now();
    run();
    if (autocast) torch::cuda::synchronize();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
};

void diffusers_step(benchmark::State& state) {
  static std::string why;
  static const double seconds = difftrain::bench::python_seconds_per_step(
      difftrain::bench::python_script("python_transformer_step.py") + " dit '" +
          bench_config().dump() + "' 10 " + std::to_string(at::get_num_threads()) + " " +
          std::to_string(kBatch),
      &why);
  difftrain::bench::report_baseline(state, seconds, why);
}

void difftrain_step(benchmark::State& state) {
  Step<att::Sdpa<att::Auto>> s(bench_config(), kBatch, at::kCPU);
  s.run();
  for (auto _ : state) state.SetIterationTime(s.timed());
}

void attention_share(benchmark::State& state) {
  Step<att::Sdpa<att::Auto>> with(bench_config(), kBatch, at::kCPU);
  Step<NoAttention> without(bench_config(), kBatch, at::kCPU);
  with.run();
  without.run();
  double t_with = 0, t_without = 0;
  for (auto _ : state) {
    t_with += with.timed();  // alternated, so a busy moment lands on both
    t_without += without.timed();
  }
  state.counters["step_ms"] = 1e3 * t_with / static_cast<double>(state.iterations());
  state.counters["no_attention_ms"] = 1e3 * t_without / static_cast<double>(state.iterations());
  state.counters["attention_share"] = 1.0 - t_without / t_with;
}

void diffusers_gpu_step(benchmark::State& state) {
  if (!torch::cuda::is_available()) {
    state.SkipWithError("no CUDA device");
    return;
  }
  static std::string why;
  static const double seconds = difftrain::bench::python_seconds_per_step(
      difftrain::bench::python_script("python_transformer_step.py") + " dit '" +
          gpu_config().dump() + "' 20 " + std::to_string(at::get_num_threads()) + " " +
          std::to_string(kGpuBatch) + " cuda bf16",
      &why);
  difftrain::bench::report_baseline(state, seconds, why);
}

void gpu_step(benchmark::State& state) {
  if (!torch::cuda::is_available()) {
    state.SkipWithError("no CUDA device");
    return;
  }
  Step<att::Sdpa<att::Auto>> s(gpu_config(), kGpuBatch, at::kCUDA);
  for (int i = 0; i < 3; ++i) s.run();
  torch::cuda::synchronize();
  for (auto _ : state) state.SetIterationTime(s.timed());
}

}  // namespace

BENCHMARK(diffusers_step)->Name("dit_step_vs_diffusers/baseline")->UseManualTime();
BENCHMARK(difftrain_step)->Name("dit_step_vs_diffusers/difftrain")->UseManualTime();
BENCHMARK(pixart_diffusers)->Name("pixart_step_vs_diffusers/baseline")->UseManualTime();
BENCHMARK(pixart_difftrain)->Name("pixart_step_vs_diffusers/difftrain")->UseManualTime();
BENCHMARK(sd3_diffusers)->Name("sd3_step_vs_diffusers/baseline")->UseManualTime();
BENCHMARK(sd3_difftrain)->Name("sd3_step_vs_diffusers/difftrain")->UseManualTime();
BENCHMARK(cogvideox_diffusers)->Name("cogvideox_step_vs_diffusers/baseline")->UseManualTime();
BENCHMARK(cogvideox_difftrain)->Name("cogvideox_step_vs_diffusers/difftrain")->UseManualTime();
BENCHMARK(cogvideox_vae_diffusers)
    ->Name("cogvideox_vae_step_vs_diffusers/baseline")
    ->UseManualTime();
BENCHMARK(cogvideox_vae_difftrain)
    ->Name("cogvideox_vae_step_vs_diffusers/difftrain")
    ->UseManualTime();
BENCHMARK(attention_share)->Name("dit_attention_share")->Iterations(10)->UseRealTime();
BENCHMARK(diffusers_gpu_step)->Name("dit_cuda_bf16_vs_diffusers/baseline")->UseManualTime();
BENCHMARK(gpu_step)->Name("dit_cuda_bf16_vs_diffusers/difftrain")->UseManualTime();
