// Fine-tuning a diffusers UNet with LoRA, as diffusers' train_text_to_image_lora.py does: load a
// UNet2DConditionModel and an AutoencoderKL from diffusers folders, encode the training images to
// latents with the VAE (scaled by its scaling_factor), train LoRA branches on every attention
// projection with difftrain's Trainer (ε or v prediction from the scheduler config, optional
// min-SNR weighting, EMA of the LoRA weights), write the LoRA in the PEFT layout diffusers loads
// and the kohya layout the web UI loads, and a grid of samples decoded by the VAE.
//
// The images are Fashion-MNIST's, resized to --resolution and repeated to the VAE's channels. In
// place of a text encoder, each class gets fixed "prompt" tokens (seeded Gaussian, the width of
// the UNet's cross-attention): what a text encoder's output would be for a caption naming it.
// With a real Stable Diffusion folder the program works the same; captions would need a text
// encoder difftrain does not ship.

#include <CLI/CLI.hpp>
#include <difftrain/adapters/stable_diffusion_lora_files.hpp>
#include <difftrain/adapters/unet_adapters.hpp>
#include <difftrain/diffusion/ddim.hpp>
#include <difftrain/diffusion/sample.hpp>
#include <difftrain/diffusion/weighting.hpp>
#include <difftrain/ema/ema.hpp>
#include <difftrain/io/atomic_file.hpp>
#include <difftrain/io/image_grid.hpp>
#include <difftrain/io/png.hpp>
#include <difftrain/io/read_file.hpp>
#include <difftrain/io/safetensors.hpp>
#include <difftrain/models/models.hpp>
#include <difftrain/models/single_file/stable_diffusion_configs.hpp>
#include <difftrain/train/callbacks.hpp>
#include <difftrain/train/seeding.hpp>
#include <difftrain/train/trainer.hpp>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "../common/cli_checks.hpp"
#include "../common/run_skeleton.hpp"
#include "../common/scheduler_config.hpp"
#include "../fashion_mnist/data.hpp"

namespace {
namespace dt = difftrain;
namespace df = difftrain::diffusion;
namespace ad = difftrain::adapters;
namespace models = difftrain::models;
namespace tr = difftrain::train;
namespace fs = std::filesystem;
using dt::ConfigError;

struct Settings {
  std::string unet_dir, vae_dir, scheduler_config, data_dir = "/usr/share/datasets/fashion-mnist";
  std::string single_file_config;  // a folder holding unet/ and vae/ configs for a single file
  bool use_ema_weights = false;    // a single file's EMA weights (model_ema.*) in place of its own
  std::string out = "build/finetune_unet";
  std::string prediction_type;  // empty: the scheduler config's
  std::int64_t classes = 3, images = 64, resolution = 32, steps = 200, batch = 8, rank = 4;
  std::int64_t prompt_tokens = 4, samples_per_class = 4, sample_steps = 20, seed = 0;
  double lr = 1e-3, alpha = 4.0, snr_gamma = 0.0, ema_decay = 0.999;
};

using Unet = models::UNet2DConditionModel<>;

/// The trainee: the UNet with its LoRA branches, the denoising loss on VAE latents.
struct LatentDenoiserImpl : torch::nn::Module {
  struct Batch {
    at::Tensor latents, labels;
    [[nodiscard]] std::int64_t size() const { return latents.size(0); }
    [[nodiscard]] Batch slice(std::int64_t start, std::int64_t length) const {
      return {latents.narrow(0, start, length), labels.narrow(0, start, length)};
    }
  };
  LatentDenoiserImpl(Unet u, const df::NoiseSchedule& s, at::Tensor prompt_table, df::Prediction p,
                     double gamma)
      : unet(register_module("unet", u)), schedule(s), prediction(p), snr_gamma(gamma) {
    prompts = register_buffer("prompts", std::move(prompt_table));
  }
  at::Tensor loss(const Batch& b) {
    const std::int64_t n = b.latents.size(0);
    const at::Tensor t = at::randint(schedule.num_train_timesteps(), {n}, at::kLong);
    const at::Tensor noise = at::randn_like(b.latents);
    const at::Tensor pred = unet->forward(schedule.add_noise(b.latents, noise, t), t,
                                          prompts.index_select(0, b.labels));
    const at::Tensor target = schedule.target(prediction, b.latents, noise, t);
    if (snr_gamma <= 0) return at::mse_loss(pred, target);
    // diffusers' min-SNR: per-sample MSE weighted by min(SNR, γ)/SNR (ε) or /(SNR + 1) (v).
    const at::Tensor per_sample = (pred - target).square().mean({1, 2, 3});
    const at::Tensor w = df::min_snr_weights(schedule.snr(t).to(at::kFloat), snr_gamma, prediction);
    return (per_sample * w).mean();
  }
  Unet unet{nullptr};
  df::NoiseSchedule schedule;
  df::Prediction prediction;
  double snr_gamma;
  at::Tensor prompts;
};
TORCH_MODULE(LatentDenoiser);

/// Keeps every step's loss, for the report.
struct LossRecord {
  std::vector<double>* losses;
  template <class T>
  void on_step_end(T& /*trainer*/, const tr::StepInfo& s) {
    losses->push_back(s.loss);
  }
};

struct LoraConfig : tr::DefaultConfig {
  using Ema = dt::ema::Ema<dt::ema::WarmupDecay>;
  using Callbacks = std::tuple<tr::ProgressBar, LossRecord>;
};

/// The mean of up to `n` values from the front (or the back).
double mean_of(const std::vector<double>& v, std::size_t n, bool back) {
  n = std::min(n, v.size());
  double sum = 0;
  for (std::size_t i = 0; i < n; ++i) sum += back ? v[v.size() - 1 - i] : v[i];
  return n == 0 ? 0.0 : sum / static_cast<double>(n);
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

int run(const Settings& s) {
  const auto t0 = std::chrono::steady_clock::now();
  const bool single_file = fs::is_regular_file(s.unet_dir);
  if (s.unet_dir.empty() || (s.vae_dir.empty() && !single_file))
    throw ConfigError(
        "name the diffusers UNet and VAE folders (--unet DIR --vae DIR), or a single file "
        "(--unet model.safetensors, its VAE from the same file)",
        "flags");
  if (!single_file && !s.single_file_config.empty())
    throw ConfigError("goes with a single file (--unet model.safetensors)",
                      "--single_file_config " + s.single_file_config);
  if (!single_file && s.use_ema_weights)
    throw ConfigError("goes with a single file (--unet model.safetensors)", "--use_ema_weights");
  const fs::path out(s.out);
  const examples::OutputFolder output_folder(out);
  const examples::SchedulerConfig sc =
      examples::read_scheduler_config(s.scheduler_config, s.prediction_type);
  const df::Prediction prediction = sc.prediction;
  const df::NoiseSchedule schedule(sc.schedule);

  tr::set_seed(s.seed);
  models::AutoencoderKL<> vae{nullptr};
  Unet unet{nullptr};
  if (single_file) {
    // The web UI's layout: the UNet (and, without --vae, the VAE) from one file, their configs
    // from --single_file_config's unet/ and vae/ folders or told from the file's keys.
    const models::SingleFile file = models::read_single_file(s.unet_dir, s.use_ema_weights);
    const auto config = [&](const char* part, auto told) {
      if (s.single_file_config.empty()) return told;
      const fs::path folder = fs::path(s.single_file_config) / part;
      return nlohmann::json(models::read_model_config(folder));
    };
    const std::string where = s.unet_dir + " (configs " +
                              (s.single_file_config.empty() ? std::string("told from its keys")
                                                            : "from " + s.single_file_config) +
                              ")";
    unet = models::unet_from_single_file<Unet>(
        file, models::UNet2DConditionConfig::from_json(
                  config("unet", models::unet_config_from_single_file(file)), where));
    vae = s.vae_dir.empty()
              ? models::vae_from_single_file(
                    file, models::AutoencoderKLConfig::from_json(
                              config("vae", models::vae_config_from_single_file(file)), where))
              : models::from_pretrained<models::AutoencoderKL<>>(s.vae_dir);
  } else {
    vae = models::from_pretrained<models::AutoencoderKL<>>(s.vae_dir);
    unet = models::from_pretrained<Unet>(s.unet_dir);
  }
  const auto& uc = unet->config();
  if (uc.in_channels != vae->config().latent_channels)
    throw ConfigError("the UNet takes " + std::to_string(uc.in_channels) +
                          " channels but the VAE's latents have " +
                          std::to_string(vae->config().latent_channels),
                      s.unet_dir);
  if (s.resolution % vae->downscale() != 0)
    throw ConfigError(
        "must be a multiple of the VAE's downscale " + std::to_string(vae->downscale()),
        "--resolution");
  if (uc.class_embed_type || uc.num_class_embeds)
    throw ConfigError(
        "this example conditions through cross-attention only; the UNet is "
        "class-conditional",
        s.unet_dir);

  // Images of the first `classes` classes → latents, once (the VAE stays frozen).
  const fmnist::Dataset data = fmnist::load(s.data_dir, 0);
  std::vector<at::Tensor> picked_images, picked_labels;
  for (std::int64_t c = 0; c < s.classes; ++c) {
    const at::Tensor idx = data.train.labels.eq(c).nonzero().flatten().narrow(0, 0, s.images);
    picked_images.push_back(data.train.images.index_select(0, idx));
    picked_labels.push_back(at::full({s.images}, c, at::kLong));
  }
  const std::int64_t channels = vae->config().in_channels;
  at::Tensor images =
      at::upsample_bilinear2d(at::cat(picked_images), {s.resolution, s.resolution}, false)
          .repeat({1, channels, 1, 1});
  const at::Tensor labels = at::cat(picked_labels);
  at::Tensor latents;
  {
    at::NoGradGuard no_grad;
    vae->eval();
    auto gen = at::make_generator<at::CPUGeneratorImpl>(s.seed + 1);
    std::vector<at::Tensor> chunks;
    for (const auto& chunk : images.split(32)) chunks.push_back(vae->encode_latents(chunk, gen));
    latents = at::cat(chunks);
  }
  std::fprintf(stderr, "latents: %lld × %s (scaling factor %g)\n",
               static_cast<long long>(latents.size(0)), c10::str(latents.sizes().slice(1)).c_str(),
               vae->config().scaling_factor);

  // Fixed prompt tokens per class, as a frozen text encoder's output would be.
  auto prompt_gen = at::make_generator<at::CPUGeneratorImpl>(s.seed + 2);
  const at::Tensor prompts =
      at::randn({s.classes, s.prompt_tokens, uc.cross_attention_dim.front()}, prompt_gen);

  const auto adapted =
      ad::inject_lora(*unet, ad::unet_lora_targets(), {.rank = s.rank, .alpha = s.alpha});
  LatentDenoiser trainee(unet, schedule, prompts, prediction, s.snr_gamma);
  trainee->train();
  tr::Trainer<LatentDenoiserImpl, LoraConfig>::Options o;
  o.optimizer.lr = s.lr;
  o.optimizer.weight_decay = 0.0;
  o.ema.rule.decay = s.ema_decay;
  std::vector<double> losses;
  tr::Trainer<LatentDenoiserImpl, LoraConfig> trainer(
      *trainee, o, {tr::ProgressBar({.total_steps = s.steps, .every = 25}), LossRecord{&losses}});
  auto batch_gen = at::make_generator<at::CPUGeneratorImpl>(s.seed + 3);
  const auto t_train = std::chrono::steady_clock::now();
  trainer.fit(
      [&](std::int64_t, std::int64_t) {
        const at::Tensor idx = at::randint(latents.size(0), {s.batch}, batch_gen, at::kLong);
        return LatentDenoiserImpl::Batch{latents.index_select(0, idx), labels.index_select(0, idx)};
      },
      s.steps);
  // Single steps are noisy (random timesteps): compare the means of the first and last tenth.
  const std::size_t tenth = std::max<std::size_t>(1, losses.size() / 10);
  const double first_loss = mean_of(losses, tenth, false), last_loss = mean_of(losses, tenth, true);
  const double train_seconds = seconds_since(t_train);

  // The LoRA (EMA weights) in both layouts.
  nlohmann::json files;
  {
    dt::ema::EmaScope scope(trainer.ema());
    const ad::StableDiffusionLoraFiles names;
    (void)ad::save_stable_diffusion_lora_files(out, {.unet = unet.get()},
                                               {{"lora_rank", std::to_string(s.rank)},
                                                {"lora_alpha", std::to_string(s.alpha)},
                                                {"base_model", s.unet_dir}},
                                               names);
    files["peft"] = names.peft.string();
    files["kohya"] = names.kohya.string();

    // Samples: DDIM from the EMA weights, one row per class, decoded by the VAE.
    unet->eval();
    at::NoGradGuard no_grad;
    df::Ddim ddim(schedule, {.prediction_type = prediction,
                             .timestep_spacing = df::TimestepSpacing::trailing});
    const std::int64_t n = s.classes * s.samples_per_class;
    const at::Tensor rows = at::arange(s.classes, at::kLong).repeat_interleave(s.samples_per_class);
    const std::int64_t h = s.resolution / vae->downscale();
    auto noise_gen = at::make_generator<at::CPUGeneratorImpl>(s.seed + 4);
    const at::Tensor noise = at::randn({n, uc.in_channels, h, h}, noise_gen);
    const at::Tensor z = df::sample(
        ddim,
        [&](const at::Tensor& x, const at::Tensor& t) {
          return unet->forward(x, t, prompts.index_select(0, rows.narrow(0, 0, x.size(0))));
        },
        noise, {.num_inference_steps = s.sample_steps, .chunk_size = n});
    const at::Tensor decoded = vae->decode_latents(z).clamp(-1, 1).mean(1, true);
    dt::io::write_png(out / "samples.png",
                      dt::io::image_grid(decoded, {.columns = s.samples_per_class, .padding = 2}),
                      {{"Description", "one row per class, decoded by the VAE"}});
    files["samples"] = "samples.png";
  }
  nlohmann::json results;
  results["files"] = files;
  results["lora_layers"] = adapted.size();
  results["latents"] = latents.size(0);
  results["steps"] = s.steps;
  results["first_loss"] = first_loss;
  results["last_loss"] = last_loss;
  results["prediction_type"] = std::string(df::to_string(prediction));
  results["scaling_factor"] = vae->config().scaling_factor;
  results["train_seconds"] = train_seconds;
  results["total_seconds"] = seconds_since(t0);
  const std::string text = results.dump(2) + "\n";
  dt::io::write_file_atomic(out / "results.json", std::span<const char>(text.data(), text.size()));
  std::printf("LoRA on %zu layers, %lld steps (loss %.4f → %.4f); wrote %s/{%s,%s,samples.png}\n",
              adapted.size(), static_cast<long long>(s.steps), first_loss, last_loss, s.out.c_str(),
              files["peft"].get<std::string>().c_str(), files["kohya"].get<std::string>().c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  CLI::App app{"Fine-tune a diffusers UNet with LoRA on VAE latents of Fashion-MNIST images."};
  app.get_formatter()->column_width(40);
  app.add_option("--unet", s.unet_dir,
                 "diffusers UNet2DConditionModel folder, or a Stable Diffusion single file "
                 "(.safetensors, .ckpt in the web UI's layout)")
      ->required();
  app.add_option("--vae", s.vae_dir,
                 "diffusers AutoencoderKL folder (with a single file: its own VAE when not given)");
  app.add_option("--single_file_config", s.single_file_config,
                 "with a single file: a folder holding unet/ and vae/ config.json (a pipeline "
                 "folder); without it the configs are told from the file's keys");
  app.add_flag("--use_ema_weights", s.use_ema_weights,
               "with a single file that holds EMA weights (model_ema.*): start from them instead "
               "of the trained ones (the web UI's model_ema)");
  app.add_option("--scheduler-config,--scheduler_config", s.scheduler_config,
                 "diffusers scheduler_config.json (default: Stable Diffusion's schedule)");
  app.add_option("--prediction-type,--prediction_type", s.prediction_type,
                 "epsilon, v_prediction or sample (default: the scheduler config's)");
  app.add_option("--data-dir", s.data_dir, "Fashion-MNIST IDX folder")->capture_default_str();
  app.add_option("--out,--output_dir", s.out, "output folder")->capture_default_str();
  app.add_option("--classes", s.classes, "classes to learn (the first N)")
      ->check(examples::count_in(1, 10))
      ->capture_default_str();
  app.add_option("--images", s.images, "training images per class")
      ->check(examples::count_in(1, 6000))
      ->capture_default_str();
  app.add_option("--resolution", s.resolution, "image size given to the VAE")
      ->check(examples::count_in(8, 1024))
      ->capture_default_str();
  app.add_option("--steps,--max_train_steps", s.steps, "training steps")
      ->check(examples::count_in(1, 100'000'000))
      ->capture_default_str();
  app.add_option("--batch,--train_batch_size", s.batch, "latents per step")
      ->check(examples::count_in(1, 100'000))
      ->capture_default_str();
  app.add_option("--lr,--learning_rate", s.lr, "AdamW learning rate")
      ->check(examples::number_in(0, 1e4, true))
      ->capture_default_str();
  app.add_option("--rank", s.rank, "LoRA rank")
      ->check(examples::count_in(1, 4096))
      ->capture_default_str();
  app.add_option("--alpha", s.alpha, "LoRA alpha")
      ->check(examples::number_in(0, 1e6, true))
      ->capture_default_str();
  app.add_option("--snr-gamma,--snr_gamma", s.snr_gamma, "min-SNR γ (0: plain MSE)")
      ->check(examples::number_in(0, 1e6))
      ->capture_default_str();
  app.add_option("--ema-decay", s.ema_decay, "EMA decay of the LoRA weights")
      ->check(examples::number_in(0, 1))
      ->capture_default_str();
  app.add_option("--prompt-tokens", s.prompt_tokens, "tokens of each class's prompt")
      ->check(examples::count_in(1, 1024))
      ->capture_default_str();
  app.add_option("--samples-per-class", s.samples_per_class, "samples in each row of the grid")
      ->check(examples::count_in(1, 64))
      ->capture_default_str();
  app.add_option("--sample-steps", s.sample_steps, "DDIM steps")
      ->check(examples::count_in(1, 1000))
      ->capture_default_str();
  app.add_option("--seed", s.seed, "seeds everything")->capture_default_str();
  if (const auto rc = examples::parse_command_line(app, argc, argv)) return *rc;
  return examples::run_reporting_errors([&] { return run(s); });
}
