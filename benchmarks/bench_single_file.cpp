// Reading a Stable Diffusion single file (the web UI's layout) into diffusers-named models, against
// two baselines measured in the same run, on an SD-like model of about 160M parameters (UNet at
// 128/256/512 channels, VAE at 64/128/256/256, a 6-layer CLIP ViT-L-wide text encoder):
//  - single_file_load_vs_folder: the same three models read from a diffusers folder (plain
//    safetensors files under their own names; goal: the single file within 1.5x of it);
//  - single_file_load_vs_diffusers: diffusers' StableDiffusionPipeline.from_single_file on the same
//    file with the same configs (its tokenizer and scheduler handed in loaded; goal <= 1.0);
//  - single_file_load_construction_share: building the three models from their configs as the
//    loaders do (without drawing random initial values, as diffusers' init_empty_weights) against
//    the whole single-file load: the share of the load that is not reading;
//  - single_file_construction_undrawn: that construction against LibTorch's usual one, which
//    draws every initial value (what loading cost before the loaders skipped it).
// One intra-op thread on both sides. Each difftrain iteration maps the file, renames, splits
// OpenCLIP-style fused tensors where there are any, builds the three models and copies the weights
// in.
#include <ATen/ATen.h>
#include <benchmark/benchmark.h>
#include <difftrain/io/remove_tree.hpp>
#include <difftrain/models/models.hpp>
#include <difftrain/models/single_file/stable_diffusion.hpp>
#include <difftrain/nn/init/without_random_init.hpp>

#include <filesystem>
#include <string>

#include "python_baseline.hpp"

namespace {
namespace fs = std::filesystem;
namespace models = difftrain::models;

struct Files {
  fs::path root, single;
  models::UNet2DConditionConfig unet;
  models::AutoencoderKLConfig vae;
  models::CLIPTextConfig clip;
};

const Files& files() {
  static const Files f = [] {
    Files out;
    out.root = fs::temp_directory_path() / "difftrain-bench-single-file";
    difftrain::io::remove_tree(out.root);
    fs::create_directories(out.root);
    at::manual_seed(0);
    out.unet =
        models::UNet2DConditionConfig::from_json({{"block_out_channels", {128, 256, 512, 512}},
                                                  {"cross_attention_dim", 768},
                                                  {"attention_head_dim", 8},
                                                  {"layers_per_block", 2}},
                                                 "bench unet");
    out.vae = models::AutoencoderKLConfig::from_json(
        {{"block_out_channels", {64, 128, 256, 256}},
         {"down_block_types", std::vector<std::string>(4, "DownEncoderBlock2D")},
         {"up_block_types", std::vector<std::string>(4, "UpDecoderBlock2D")},
         {"layers_per_block", 2},
         {"latent_channels", 4}},
        "bench vae");
    out.clip = models::CLIPTextConfig::from_json({{"hidden_size", 768},
                                                  {"intermediate_size", 3072},
                                                  {"num_hidden_layers", 6},
                                                  {"num_attention_heads", 12},
                                                  {"hidden_act", "quick_gelu"},
                                                  {"projection_dim", 768}},
                                                 "bench clip");
    models::UNet2DConditionModel<> unet(out.unet);
    models::AutoencoderKL<> vae(out.vae);
    models::CLIPTextModel<> clip(out.clip);
    models::save_pretrained(unet, out.root / "unet");
    models::save_pretrained(vae, out.root / "vae");
    models::save_pretrained(clip, out.root / "text_encoder");
    out.single = out.root / "model.safetensors";
    models::save_stable_diffusion_single_file(out.single, unet, vae, clip);
    return out;
  }();
  return f;
}

void from_folder(benchmark::State& state) {
  const Files& f = files();
  at::set_num_threads(1);
  for (auto _ : state) {
    auto unet = models::from_pretrained<models::UNet2DConditionModel<>>(f.root / "unet");
    auto vae = models::from_pretrained<models::AutoencoderKL<>>(f.root / "vae");
    auto clip = models::from_pretrained<models::CLIPTextModel<>>(f.root / "text_encoder");
    benchmark::DoNotOptimize(unet.get());
  }
}

void from_single_file(benchmark::State& state) {
  const Files& f = files();
  at::set_num_threads(1);
  for (auto _ : state) {
    const auto file = models::read_single_file(f.single);
    auto unet = models::unet_from_single_file(file, f.unet);
    auto vae = models::vae_from_single_file(file, f.vae);
    auto clip = models::clip_from_single_file(file, f.clip);
    benchmark::DoNotOptimize(unet.get());
  }
}

double diffusers_seconds(std::string& why) {
  static std::string reason;
  static const double seconds = difftrain::bench::python_seconds_per_step(
      difftrain::bench::python_script("python_single_file.py") + " " + files().single.string() +
          " " + files().root.string(),
      &reason);
  why = reason;
  return seconds;
}

void diffusers_from_single_file(benchmark::State& state) {
  std::string why;
  const double seconds = diffusers_seconds(why);
  difftrain::bench::report_baseline(state, seconds, why);
}

void from_single_file_timed(benchmark::State& state) {
  const Files& f = files();
  at::set_num_threads(1);
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    const auto file = models::read_single_file(f.single);
    auto unet = models::unet_from_single_file(file, f.unet);
    auto vae = models::vae_from_single_file(file, f.vae);
    auto clip = models::clip_from_single_file(file, f.clip);
    benchmark::DoNotOptimize(unet.get());
    state.SetIterationTime(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
}

// The models built from their configs alone, as the loaders build them (without drawing random
// initial values: every parameter is loaded right after), the part of the load that is not
// reading: against the whole single-file load, the ratio is that part's share.
void construction_only(benchmark::State& state) {
  const Files& f = files();
  at::set_num_threads(1);
  for (auto _ : state) {
    const difftrain::nn::init::WithoutRandomInit undrawn;
    models::UNet2DConditionModel<> unet(f.unet);
    models::AutoencoderKL<> vae(f.vae);
    models::CLIPTextModel<> clip(f.clip);
    benchmark::DoNotOptimize(unet.get());
  }
}

// The same models built as a user's `Model m(config)` builds them (LibTorch's and the libraries'
// random initialisation): the baseline that construction without drawing is measured against.
void construction_drawn(benchmark::State& state) {
  const Files& f = files();
  at::set_num_threads(1);
  for (auto _ : state) {
    models::UNet2DConditionModel<> unet(f.unet);
    models::AutoencoderKL<> vae(f.vae);
    models::CLIPTextModel<> clip(f.clip);
    benchmark::DoNotOptimize(unet.get());
  }
}

}  // namespace

BENCHMARK(from_single_file)
    ->Name("single_file_load_construction_share/baseline")
    ->Iterations(3)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(construction_only)
    ->Name("single_file_load_construction_share/difftrain")
    ->Iterations(3)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(construction_drawn)
    ->Name("single_file_construction_undrawn/baseline")
    ->Iterations(3)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(construction_only)
    ->Name("single_file_construction_undrawn/difftrain")
    ->Iterations(3)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(from_folder)
    ->Name("single_file_load_vs_folder/baseline")
    ->Iterations(3)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(from_single_file)
    ->Name("single_file_load_vs_folder/difftrain")
    ->Iterations(3)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(diffusers_from_single_file)
    ->Name("single_file_load_vs_diffusers/baseline")
    ->Iterations(3)
    ->Unit(benchmark::kMillisecond)
    ->UseManualTime();
BENCHMARK(from_single_file_timed)
    ->Name("single_file_load_vs_diffusers/difftrain")
    ->Iterations(3)
    ->Unit(benchmark::kMillisecond)
    ->UseManualTime();
