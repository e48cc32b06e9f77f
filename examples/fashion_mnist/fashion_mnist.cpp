// Trains a small class-conditional diffusion model on Fashion-MNIST with difftrain's Trainer,
// samples it with classifier-free guidance from the EMA weights, and scores the samples with a
// classifier trained by the same program. `fashion_mnist --help` lists the flags.
//
// Writes to --out: checkpoints/ (atomic, the latest few), loss.csv, loss.png and lr.png,
// samples.png (a row per class), classifier.safetensors (cached judge), ema.safetensors (the EMA
// weights), unet/ (the EMA UNet as a diffusers model folder; transformer/ with --model dit or
// flux-mini),
// results.json (class accuracy, Fréchet distance, timings) and tensorboard/ (the run's event file:
// `tensorboard --logdir OUT/tensorboard`).
//
// Ctrl-C stops after the current step, saves a checkpoint and exits with status 130; run again
// with --resume to continue. A second Ctrl-C kills the program at once.
//
// Under torchrun (`torchrun --nproc-per-node 2 --no-python fashion_mnist ...`) every rank trains
// the same model on its share of each batch; rank 0 alone trains the classifier, writes the logs,
// checkpoints, samples and results.

#include <torch/cuda.h>
#include <CLI/CLI.hpp>
#include <difftrain/diffusion/ddim.hpp>
#include <difftrain/diffusion/dpm_solver.hpp>
#include <difftrain/diffusion/flow_matching.hpp>
#include <difftrain/diffusion/sample.hpp>
#include <difftrain/distributed/sharded_data_parallel.hpp>
#include <difftrain/ema/ema.hpp>
#include <difftrain/eval/frechet_distance.hpp>
#include <difftrain/io/image_grid.hpp>
#include <difftrain/log/event_file.hpp>
#include <difftrain/models/pretrained.hpp>
#include <difftrain/nn/module_tensors.hpp>
#include <difftrain/schedule/by_name.hpp>
#include <difftrain/train/callbacks.hpp>
#include <difftrain/train/optimizer_by_name.hpp>
#include <difftrain/train/profile.hpp>
#include <difftrain/train/progress.hpp>
#include <difftrain/train/seeding.hpp>
#include <difftrain/train/tensorboard.hpp>
#include <difftrain/train/trainer.hpp>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "../common/cli_checks.hpp"
#include "../common/run_skeleton.hpp"
#include "classifier.hpp"
#include "data.hpp"
#include "denoiser.hpp"
#include "report.hpp"

namespace fs = std::filesystem;
namespace tr = difftrain::train;
namespace df = difftrain::diffusion;
using fmnist::dt::ConfigError;

namespace {

using examples::g_interrupted;
using examples::on_sigint;
using examples::StopOnInterrupt;

struct Settings : examples::RunFlags, examples::JudgeFlags {
  Settings() {
    data_dir = fmnist::kDefaultDataDir;
    out = "runs/fashion_mnist";
  }
  // model and training
  std::string model = "unet";                                  // or "dit", "flux-mini"
  [[nodiscard]] bool flow() const { return model != "unet"; }  // a flow-matching transformer
  std::int64_t channels = 16;
  bool attention_14 = false;
  fmnist::DiTOptions dit;
  std::vector<std::string> unet_flags_given, dit_flags_given;  // to refuse the other model's
  std::int64_t steps = 700;
  std::int64_t batch_size = 64;
  double lr = 2e-3;
  double weight_decay = 0.01;
  std::int64_t warmup = 100;
  std::string lr_scheduler = "cosine";
  double ema_decay = 0.995;
  std::string ema_rule = "warmup_decay";
  std::string ema_settings = "{}";
  std::string mixed_precision = "auto";  // auto: bf16 on a CPU that computes it natively
  double clip = 1.0;
  double p_uncond = 0.1;
  std::int64_t checkpoint_every = 250;
  std::int64_t keep = 2;
  bool resume = false;
  std::string resume_from;  // diffusers' --resume_from_checkpoint: a checkpoint file or "latest"
  std::string logging_dir;  // the loss log's folder (default: --out)
  std::string prediction_type = "v_prediction";
  double snr_gamma = 5.0;
  double adam_beta1 = 0.9, adam_beta2 = 0.999, adam_epsilon = 1e-8;
  std::string adam_kernel = "fused";  // torch's fused AdamW, its multi-tensor one, or LibTorch's
  std::string optimizer = "AdamW";    // any name OptimizerByName takes (kohya's)
  std::vector<std::string> optimizer_args;  // its settings, key=value
  std::int64_t accumulation = 1;
  bool take_new_settings = false;
  std::int64_t stop_at = 0;
  bool overwrite = false;
  bool progress = false;
  std::int64_t progress_lines = -1;  // off a terminal: a line every N steps (-1: a tenth of them)
  std::int64_t sample_every = 0;     // a sample grid into TensorBoard every N steps (0: none)
  std::int64_t profile_steps = 0;    // profile this many steps after 10 warm-up ones (0: none)
  // sampling and scoring
  std::string sampler = "auto";  // dpm++ for the UNet, euler for the DiT
  std::int64_t sample_steps = 12;
  bool clip_x0 = true;
  double guidance = 3.0;
  std::int64_t samples_per_class = 50;
  std::int64_t grid_columns = 10;
  double rank_timeout = 1800;
  int sharding = 0;  // ZeRO's stage under torchrun: 0 replicates (DataParallel)
  bool allow_world_size_change = false;
};

at::Tensor sample(const Settings& s, fmnist::Denoiser& net, const df::NoiseSchedule& schedule,
                  const at::Tensor& labels, at::Device device, bool show_progress = false);

/// What the model draws now (the EMA weights, swapped in by SampleEvery): four images per class
/// from the same noise every time, so TensorBoard shows one grid changing over the run.
struct PeekSamples {
  const Settings* s;
  fmnist::Denoiser* net;
  const df::NoiseSchedule* schedule;
  at::Device device;
  template <class T>
  at::Tensor operator()(T& /*trainer*/) const {
    (*net)->eval();
    const at::Tensor labels = at::arange(fmnist::kClasses, at::kLong).repeat_interleave(4);
    at::Tensor images = sample(*s, *net, *schedule, labels, device).clamp(-1, 1);
    (*net)->train();
    return images;
  }
};

struct DenoiserConfig : tr::DefaultConfig {
  using Optimizer = tr::OptimizerByName;                        // --optimizer, --optimizer-args
  using Schedule = difftrain::schedule::ByName;                 // --lr-scheduler, diffusers' names
  using Ema = difftrain::ema::Ema<difftrain::ema::RuleByName>;  // --ema-rule, --ema-settings
  using Precision = tr::PrecisionByName;                        // --mixed_precision
  using Clipping = tr::ClipByNorm;
  using Callbacks =
      std::tuple<tr::ProgressBar, tr::CsvLossLog, tr::CheckpointEvery, tr::TensorBoard,
                 tr::SampleEvery<PeekSamples>, tr::StepProfile, StopOnInterrupt>;
  // --sharding picks the stage at run time; 0 is DataParallel itself.
  using Parallel = difftrain::distributed::ShardedDataParallel;
};
using DenoiserTrainer = tr::Trainer<fmnist::DenoiserImpl, DenoiserConfig>;

/// The EMA rule of the command line: --ema-rule with --ema-settings (a JSON object), and
/// --ema-decay as the rule's decay (beta for ema_pytorch) unless the settings give one.
nlohmann::json ema_rule_json(const Settings& s) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(s.ema_settings);
  } catch (const nlohmann::json::parse_error& e) {
    throw ConfigError(std::string("is not valid JSON: ") + e.what(), "--ema-settings");
  }
  if (!j.is_object()) throw ConfigError("must be a JSON object", "--ema-settings");
  if (j.contains("rule")) throw ConfigError("name the rule with --ema-rule", "--ema-settings");
  j["rule"] = s.ema_rule;
  const char* decay_key = s.ema_rule == "ema_pytorch" ? "beta"
                          : s.ema_rule == "karras"    ? nullptr
                                                      : "decay";
  if (decay_key != nullptr && !j.contains(decay_key)) j[decay_key] = s.ema_decay;
  return j;
}
difftrain::ema::RuleByName::Options ema_rule_options(const Settings& s) {
  return difftrain::ema::RuleByName::from_json(ema_rule_json(s), "--ema-rule/--ema-settings");
}

using examples::seconds_since;

at::Tensor sample(const Settings& s, fmnist::Denoiser& net, const df::NoiseSchedule& schedule,
                  const at::Tensor& labels, at::Device device, bool show_progress) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(s.seed + 1);
  const at::Tensor noise = at::randn({labels.size(0), 1, 28, 28}, gen).to(device);
  const at::Tensor cond = labels.to(device);
  const at::Tensor uncond = at::full_like(cond, net->null_label());
  // Its own progress line (on a terminal, or with --progress): sampler steps over all chunks.
  constexpr std::int64_t chunk = 250;
  const std::int64_t total = (labels.size(0) + chunk - 1) / chunk * s.sample_steps;
  tr::ProgressLine bar({.label = "sample",
                        .total = total,
                        .lines_every = std::max<std::int64_t>(1, total / 10),
                        .force = s.progress && show_progress});
  bar.start();
  const df::SampleOptions opts{.num_inference_steps = s.sample_steps,
                               .guidance_scale = s.guidance,
                               .chunk_size = chunk,
                               .on_step = [&](std::int64_t done, std::int64_t /*total*/) {
                                 if (show_progress) bar.update(done);
                               }};
  auto model = [&](const at::Tensor& x, const at::Tensor& t, const at::Tensor& c) {
    return net->forward(x, t, c);
  };
  auto finish = [&](at::Tensor x) {
    bar.finish();
    return x;
  };
  if (net->is_flow()) {
    // The rectified flow from σ = 1 (noise) to 0 in Euler steps, unshifted (28×28 is small).
    df::FlowMatchEuler euler;
    return finish(df::sample(euler, model, noise, opts, cond, uncond));
  }
  // Images live in [-1, 1]: clipping each step's x̂₀ there keeps an early, poor noise estimate
  // (divided by √ᾱ ≈ 0.006 at t = 999) from turning into salt-and-pepper pixels.
  const df::Clipping clip{.clip_sample = s.clip_x0};
  if (s.sampler == "ddim") {
    df::Ddim ddim(schedule, {.prediction_type = net->options().prediction,
                             .clipping = clip,
                             .timestep_spacing = df::TimestepSpacing::trailing});
    return finish(df::sample(ddim, model, noise, opts, cond, uncond));
  }
  df::DpmSolverPP2M dpm(schedule, {.prediction_type = net->options().prediction, .clipping = clip});
  return finish(df::sample(dpm, model, noise, opts, cond, uncond));
}

/// The flags of one backbone given with the other (each would be silently ignored), as a sentence.
void refuse_other_models_flags(const Settings& s) {
  for (const auto& [owner, given] :
       {std::pair<std::string, const std::vector<std::string>*>{"unet", &s.unet_flags_given},
        {"dit", &s.dit_flags_given}}) {
    if (owner == s.model || given->empty()) continue;
    std::string names;
    for (const auto& n : *given) names += (names.empty() ? "" : ", ") + n;
    throw ConfigError(names + (given->size() == 1 ? " applies" : " apply") + " to --model " +
                          owner + ", not to --model " + s.model +
                          (s.flow() ? " (the transformer learns a flow-matching velocity and "
                                      "samples with the flow Euler sampler)"
                                    : ""),
                      "--model");
  }
}

int run(const Settings& s) {
  const auto t_start = std::chrono::steady_clock::now();
  (void)ema_rule_options(s);  // a wrong EMA setting is named before any work
  {                           // and so is a wrong optimizer name or setting
    tr::ParamGroup one;
    one.params = {at::zeros({1}).requires_grad_()};
    (void)tr::OptimizerByName::make({one}, {.type = s.optimizer, .args = s.optimizer_args});
  }
  (void)examples::device_from(s.device);  // a name and a device this machine has
  refuse_other_models_flags(s);
  if (s.model == "dit") (void)fmnist::dit_config(s.dit, fmnist::kClasses);  // named before work
  if (s.flow() ? s.sampler != "euler" : s.sampler != "dpm++" && s.sampler != "ddim")
    throw ConfigError(std::string("must be ") +
                          (s.flow() ? "euler (the flow-matching sampler) for --model " + s.model
                                    : "dpm++ or ddim for --model unet") +
                          ", got '" + s.sampler + "'",
                      "--sampler");
  // The ranks of a torchrun launch (a world of one without it). Every rank checks the same flags
  // and so fails the same way before this point.
  const auto world = difftrain::distributed::World::from_environment(
      {.timeout = std::chrono::milliseconds(static_cast<std::int64_t>(s.rank_timeout * 1000))});
  if (s.batch_size % world->size() != 0)
    throw ConfigError("is " + std::to_string(s.batch_size) + ", not a multiple of the " +
                          std::to_string(world->size()) + " ranks sharing each batch",
                      "--batch-size");
  const bool main_rank = world->is_main();
  examples::apply_threads(s);
  // With CUDA, each rank of a node uses its own GPU.
  const at::Device device =
      s.device == "cuda" && world->distributed()
          ? at::Device(at::kCUDA, static_cast<at::DeviceIndex>(world->local_rank()))
          : at::Device(s.device);
  // bf16 autocast where the CPU computes bf16 natively (measured faster there at the same
  // quality, docs/results.md); elsewhere, and on CUDA, float32 unless asked.
  const std::string mixed_precision = s.mixed_precision != "auto" ? s.mixed_precision
                                      : device.is_cpu() && tr::cpu_has_native_bf16() ? "bf16"
                                                                                     : "no";
  if (s.out.empty()) throw ConfigError("is empty; name the output folder", "--out");
  const fs::path out(s.out);
  const fs::path ckpt_dir = out / "checkpoints";
  const bool have_checkpoints = !tr::CheckpointEvery::list(ckpt_dir).empty();
  if (have_checkpoints && !s.resume && !s.overwrite)
    throw ConfigError(
        "holds checkpoints of an earlier run; pass --resume to continue it or "
        "--overwrite to start again (its checkpoints are then replaced)",
        ckpt_dir.string());
  difftrain::io::ensure_writable_folder(out);
  difftrain::io::ensure_writable_folder(ckpt_dir);
  if (!s.logging_dir.empty()) difftrain::io::ensure_writable_folder(s.logging_dir);
  tr::set_seed(s.seed);

  auto t = std::chrono::steady_clock::now();
  const fmnist::Dataset data = fmnist::load(s.data_dir, s.limit);
  std::fprintf(stderr, "data: %lld training and %lld test images from %s (%.1f s)\n",
               static_cast<long long>(data.train.size()), static_cast<long long>(data.test.size()),
               s.data_dir.c_str(), seconds_since(t));

  // The judge first: a run whose scores would mean nothing stops before it trains anything.
  // Rank 0 scores; the other ranks wait for it in the trainer's first collective.
  t = std::chrono::steady_clock::now();
  const fs::path classifier_path = s.classifier_file(s.out);
  std::optional<fmnist::TrainedClassifier> judge;
  if (main_rank)
    judge = fmnist::judge_for(
        data, {.epochs = s.classifier_epochs, .seed = s.seed, .progress = s.progress},
        classifier_path, device, s.min_classifier_accuracy);

  // The diffusion model and its trainer. Seeded again here so its weights and noise do not depend
  // on whether the classifier was trained (drawing numbers) or loaded from the cache.
  tr::set_seed(s.seed);
  const df::NoiseSchedule schedule;
  fmnist::Denoiser net(
      fmnist::UNetOptions{.channels = s.channels,
                          .attention_14 = s.attention_14,
                          .p_uncond = s.p_uncond,
                          .prediction = df::prediction_from(s.prediction_type, "--prediction-type"),
                          .snr_gamma = s.snr_gamma},
      schedule, s.model == "dit" ? std::optional<fmnist::DiTOptions>(s.dit) : std::nullopt,
      s.model == "flux-mini");
  net->to(device);
  DenoiserTrainer::Options o;
  o.optimizer.lr = s.lr;
  o.optimizer.weight_decay = s.weight_decay;
  o.optimizer.beta1 = s.adam_beta1;
  o.optimizer.beta2 = s.adam_beta2;
  o.optimizer.eps = s.adam_epsilon;
  o.optimizer.kernel = s.adam_kernel == "fused"     ? tr::AdamKernel::fused
                       : s.adam_kernel == "foreach" ? tr::AdamKernel::foreach
                                                    : tr::AdamKernel::per_parameter;
  o.optimizer.type = s.optimizer;
  o.optimizer.args = s.optimizer_args;
  o.accumulation_steps = s.accumulation;
  o.schedule.lr_scheduler = s.lr_scheduler;
  o.schedule.args.num_warmup_steps = std::min(s.warmup, s.steps);
  o.schedule.args.num_training_steps = s.steps;
  o.ema.rule = ema_rule_options(s);
  o.precision.mixed_precision = mixed_precision;
  o.clipping.max_norm = s.clip;
  o.parallel.world = world;
  o.parallel.stage = s.sharding;
  // Stage 3 frees each UNet or DiT block's parameters on the ranks that do not own them during
  // forward and backward; between steps every rank holds them whole, since the sample grids and
  // the EMA's files are made on rank 0 alone.
  o.parallel.reshard_after_step = false;
  o.allow_world_size_change = s.allow_world_size_change;
  // A checkpoint written with another LR, schedule (--steps, --warmup), weight decay, clipping or
  // EMA decay is refused by name, unless the run is told to train on with this command line's.
  if (s.take_new_settings)
    o.take_on_resume = {
        .lr = true, .schedule = true, .optimizer = true, .ema = true, .clipping = true};
  auto remove = [](const fs::path& path) {
    std::error_code ec;
    fs::remove(path, ec);
    if (ec) throw difftrain::IoError("cannot remove: " + ec.message(), path.string());
  };
  const fs::path loss_csv = (s.logging_dir.empty() ? out : fs::path(s.logging_dir)) / "loss.csv";
  if (main_rank && s.overwrite && !s.resume) tr::CheckpointEvery::remove_all(ckpt_dir);
  if (main_rank && !s.resume) remove(loss_csv);
  // TensorBoard: a fresh run starts a fresh folder (a folder named with --tensorboard only with
  // --overwrite: it may hold other runs); a resumed one adds a file whose restart marker replaces
  // the steps logged after its checkpoint.
  const fs::path tb_dir = s.tensorboard_folder();
  if (main_rank && !s.resume && (s.tensorboard.empty() || s.overwrite))
    difftrain::log::remove_event_files(tb_dir);
  // The settings results.json repeats, under its names; TensorBoard's table shows them with the
  // model's and optimizer's own.
  const nlohmann::json shared_settings = {
      {"model", s.model},
      {"sampler", s.sampler},
      {"sampling_steps", s.sample_steps},
      {"clip_x0", !s.flow() && s.clip_x0},
      {"guidance_scale", s.guidance},
      {"batch_size", s.batch_size},
      {"lr_scheduler", s.lr_scheduler},
      {"lr", s.lr},
      {"ema", ema_rule_json(s)},
      {"mixed_precision", mixed_precision},
      {"prediction_type", s.flow() ? "flow_matching" : s.prediction_type},
      {"snr_gamma", s.flow() ? 0.0 : s.snr_gamma},
      {"gradient_accumulation_steps", s.accumulation},
      {"device", s.device},
      {"seed", s.seed}};
  nlohmann::json run_settings = {
      {"steps", s.steps},
      {"channels", s.channels},
      {"attention_14", s.attention_14},
      {"warmup", s.warmup},
      {"weight_decay", s.weight_decay},
      {"adam_kernel", s.adam_kernel},
      {"optimizer", tr::OptimizerByName::chosen_name({.type = s.optimizer})},
      {"optimizer_args", s.optimizer_args},
      {"max_grad_norm", s.clip},
      {"p_uncond", s.p_uncond},
      {"ranks", world->size()}};
  if (s.model == "dit")
    run_settings.update({{"dit_width", s.dit.width},
                         {"dit_depth", s.dit.depth},
                         {"dit_heads", s.dit.heads},
                         {"dit_patch", s.dit.patch}});
  run_settings.update(shared_settings);
  const std::int64_t n = data.train.size();
  const std::int64_t per_epoch = std::max<std::int64_t>(1, n / (s.batch_size * s.accumulation));

  std::int64_t resumed_from = 0;
  std::unique_ptr<DenoiserTrainer> trainer;
  auto make_trainer = [&] {
    return std::make_unique<DenoiserTrainer>(
        *net, o,
        DenoiserConfig::Callbacks{
            tr::ProgressBar({.total_steps = s.steps,
                             .every = 10,
                             .lines_every = s.progress_lines >= 0
                                                ? s.progress_lines
                                                : std::max<std::int64_t>(1, s.steps / 10),
                             .force = s.progress}),
            tr::CsvLossLog({.path = loss_csv, .steps_per_epoch = per_epoch}),
            tr::CheckpointEvery({.dir = ckpt_dir,
                                 .every = s.checkpoint_every,
                                 .keep_last = static_cast<std::size_t>(s.keep)}),
            tr::TensorBoard({.dir = tb_dir, .config = run_settings}),
            tr::SampleEvery<PeekSamples>(
                s.sample_every > 0 ? s.sample_every : std::numeric_limits<std::int64_t>::max(),
                PeekSamples{&s, &net, &schedule, device}, "samples", {.columns = 4}),
            tr::StepProfile(
                {.after_step = s.profile_steps > 0 ? 10 : std::numeric_limits<std::int64_t>::max(),
                 .steps = std::max<std::int64_t>(1, s.profile_steps),
                 .trace = out / "profile.json"}),
            StopOnInterrupt{s.stop_at}});
  };
  if (s.resume) {
    // The newest checkpoint that loads; a torn, corrupted or unreadable one is skipped with a
    // note. Loading cuts the loss log back to the checkpoint's step (CsvLossLog::on_resume).
    trainer = make_trainer();
    std::vector<std::string> skipped;
    std::optional<fs::path> from;
    if (!s.resume_from.empty() && s.resume_from != "latest") {
      trainer->load_checkpoint(s.resume_from);  // a file named on purpose: no fallback
      from = fs::path(s.resume_from);
    } else {
      from = tr::resume_latest(*trainer, ckpt_dir, &skipped);
    }
    for (const auto& why : skipped) std::fprintf(stderr, "resume: skipped %s\n", why.c_str());
    if (!from) throw ConfigError("holds no readable checkpoint to resume from", ckpt_dir.string());
    resumed_from = trainer->global_step();
    std::fprintf(stderr, "resume: continuing from %s (step %lld)\n", from->string().c_str(),
                 static_cast<long long>(resumed_from));
  } else {
    trainer = make_trainer();
  }

  // Batches are a function of the step alone, so a resumed run sees exactly the batches the
  // uninterrupted one would have. Every rank draws the same batch and takes its share of it.
  const at::Tensor images = data.train.images.to(device);
  const at::Tensor labels = data.train.labels.to(device);
  fmnist::EpochBatches batches(n, s.batch_size, s.seed, device);
  const std::int64_t share = std::min(s.batch_size, n) / world->size();
  if (share < 1)
    throw ConfigError("leaves no image of each batch to some of the " +
                          std::to_string(world->size()) + " ranks (" + std::to_string(n) +
                          " images)",
                      "--limit");
  // With accumulation, each micro-batch of a step is the next batch of the epoch order.
  auto source = [&](std::int64_t step, std::int64_t micro) {
    const at::Tensor idx =
        batches.indices(step * s.accumulation + micro).narrow(0, world->rank() * share, share);
    return fmnist::DenoiserImpl::Batch{images.index_select(0, idx), labels.index_select(0, idx)};
  };
  // Each rank its own noise and label dropout (a resumed run restores each rank's generator).
  if (world->rank() > 0 && !s.resume) tr::set_seed(s.seed + 7919 * world->rank());

  std::signal(SIGINT, on_sigint);
  t = std::chrono::steady_clock::now();
  if (main_rank)
    std::fprintf(
        stderr, "train: %lld steps of %lld images, %s with %lld parameters, on %s%s\n",
        static_cast<long long>(s.steps), static_cast<long long>(s.batch_size),
        s.model == "dit"         ? "DiT"
        : s.model == "flux-mini" ? "Flux-mini"
                                 : "UNet",
        static_cast<long long>([&] {
          std::int64_t c = 0;
          for (const auto& p : net->parameters()) c += p.numel();
          return c;
        }()),
        s.device.c_str(),
        world->distributed() ? (", " + std::to_string(world->size()) + " ranks").c_str() : "");
  trainer->fit(source, s.steps);
  const double train_seconds = seconds_since(t);
  const std::int64_t trained_steps = trainer->global_step() - resumed_from;
  std::signal(SIGINT, SIG_DFL);
  auto& checkpoints = std::get<tr::CheckpointEvery>(trainer->callbacks());
  if (trained_steps > 0 && trainer->global_step() % s.checkpoint_every != 0)
    checkpoints.save(*trainer);  // the last step, unless the callback just saved it
  // Every rank: the EMA's weights in the model for what rank 0 samples and writes (under
  // --sharding each rank keeps the EMA of what it steps, and the shadows travel here).
  std::optional<DenoiserTrainer::EmaWeights> ema_weights;
  if (!g_interrupted.load() && trainer->global_step() >= s.steps)
    ema_weights.emplace(trainer->ema_weights());
  if (!main_rank) return g_interrupted.load() ? 130 : 0;  // rank 0 samples, scores and reports
  if (g_interrupted.load() || trainer->global_step() < s.steps) {
    std::fprintf(stderr,
                 "%s at step %lld; checkpoint saved in %s; run again with --resume to continue\n",
                 g_interrupted.load() ? "interrupted" : "paused",
                 static_cast<long long>(trainer->global_step()), ckpt_dir.string().c_str());
    return g_interrupted.load() ? 130 : 0;
  }
  const double steps_per_second = trained_steps > 0 ? trained_steps / train_seconds : 0.0;
  if (trained_steps == 0)
    std::fprintf(stderr, "train: already at step %lld; sampling only\n",
                 static_cast<long long>(trainer->global_step()));
  else
    std::fprintf(stderr, "train: %lld steps in %.1f s (%.2f steps/s)\n",
                 static_cast<long long>(trained_steps), train_seconds, steps_per_second);
  if (const auto& profile = std::get<tr::StepProfile>(trainer->callbacks()); profile.done())
    std::fprintf(stderr, "profile (trace: %s):\n%s\n%s", (out / "profile.json").string().c_str(),
                 profile.phase_table().c_str(), profile.table(25).c_str());
  const fmnist::LossCurve curve = fmnist::read_loss_log(loss_csv);
#if DIFFTRAIN_HAS_PLOT
  const difftrain::io::RgbImage loss_plot = fmnist::plot_loss(curve);
  difftrain::io::write_png(out / "loss.png", loss_plot,
                           {{"Description", "difftrain Fashion-MNIST loss per step (log scale)"}});
  difftrain::io::write_png(out / "lr.png", fmnist::plot_lr(curve),
                           {{"Description", "difftrain Fashion-MNIST learning rate per step"}});
#else
  std::fprintf(stderr, "plots: built without cairo; loss.png and lr.png not drawn\n");
#endif

  // Sample from the EMA weights.
  t = std::chrono::steady_clock::now();
  const at::Tensor sample_labels =
      at::arange(fmnist::kClasses, at::kLong).repeat_interleave(s.samples_per_class);
  at::Tensor samples;
  {
    net->eval();
    difftrain::io::save_safetensors(out / "ema.safetensors",
                                    difftrain::nn::module_tensors(*net, /*buffers=*/false),
                                    {{"step", std::to_string(trainer->global_step())}});
    // The backbone alone as a diffusers model folder (UNet2DConditionModel.from_pretrained or
    // DiTTransformer2DModel.from_pretrained reads it); the UNet's class tokens are
    // ema.safetensors' context_emb.weight.
    if (net->is_dit())
      difftrain::models::save_pretrained(net->dit, out / "transformer");
    else if (net->is_flux())
      difftrain::models::save_pretrained(net->flux->transformer, out / "transformer");
    else
      difftrain::models::save_pretrained(net->unet, out / "unet");
    samples = sample(s, net, schedule, sample_labels, device, true).clamp(-1, 1);
  }
  const double sample_seconds = seconds_since(t);
  std::fprintf(stderr, "sample: %lld images, %s, %lld steps, guidance %.2f (%.1f s)\n",
               static_cast<long long>(samples.size(0)), s.sampler.c_str(),
               static_cast<long long>(s.sample_steps), s.guidance, sample_seconds);

  // The grid: a row per class, the first `grid_columns` samples of each.
  const std::int64_t cols = std::min(s.grid_columns, s.samples_per_class);
  const at::Tensor grid_pick = samples.view({fmnist::kClasses, s.samples_per_class, 1, 28, 28})
                                   .narrow(1, 0, cols)
                                   .flatten(0, 1);
  difftrain::io::write_png(out / "samples.png",
                           difftrain::io::image_grid(grid_pick, {.columns = cols, .padding = 2}),
                           {{"Description", "difftrain Fashion-MNIST samples, a row per class"}});

  // Score: class accuracy of the samples and the Fréchet distance to the real test images in the
  // classifier's feature space; the real-vs-real distance at the same sample count is the floor.
  auto& cls = judge->net;
  cls->eval();
  // Its progress in batches of 500: the samples' labels and features, the test set's and the
  // real images' features.
  constexpr std::int64_t score_batch = 500;
  auto batches_of = [](std::int64_t count) { return (count + score_batch - 1) / score_batch; };
  const std::int64_t score_total = 2 * batches_of(samples.size(0)) + batches_of(data.test.size()) +
                                   batches_of(std::min(n, samples.size(0)));
  tr::ProgressLine score_bar({.label = "score",
                              .total = score_total,
                              .lines_every = std::max<std::int64_t>(1, score_total / 4),
                              .force = s.progress});
  score_bar.start();
  std::int64_t scored = 0;
  auto batched = [&](const at::Tensor& x, auto&& fn) {
    return fmnist::batched(x, score_batch, [&](const at::Tensor& b) {
      at::Tensor r = fn(b);
      score_bar.update(++scored);
      return r;
    });
  };
  const at::Tensor pred =
      batched(samples, [&](const at::Tensor& x) { return cls->forward(x).argmax(1); }).cpu();
  const at::Tensor correct = pred.eq(sample_labels);
  const double accuracy = correct.to(at::kDouble).mean().item<double>();
  const at::Tensor per_class =
      correct.to(at::kDouble).view({fmnist::kClasses, s.samples_per_class}).mean(1);
  auto features = [&](const at::Tensor& x) {
    return batched(x.to(device), [&](const at::Tensor& b) { return cls->features(b); });
  };
  const at::Tensor test_features = features(data.test.images);
  const double fd = difftrain::eval::frechet_distance(features(samples), test_features);
  at::Generator pick_gen = at::make_generator<at::CPUGeneratorImpl>(s.seed + 2);
  const at::Tensor real_pick = at::randperm(n, pick_gen, at::TensorOptions().dtype(at::kLong))
                                   .narrow(0, 0, std::min(n, samples.size(0)));
  const double fd_floor = difftrain::eval::frechet_distance(
      features(data.train.images.index_select(0, real_pick)), test_features);
  score_bar.finish();

  nlohmann::json per_class_json;
  for (std::int64_t c = 0; c < fmnist::kClasses; ++c)
    per_class_json[fmnist::kClassNames[static_cast<std::size_t>(c)]] = per_class[c].item<double>();
  nlohmann::json results = {{"class_accuracy", accuracy},
                            {"per_class_accuracy", per_class_json},
                            {"frechet_distance", fd},
                            {"frechet_distance_real_at_same_count", fd_floor},
                            {"classifier_test_accuracy", judge->test_accuracy},
                            {"samples", samples.size(0)},
                            {"steps", trainer->global_step()},
                            {"train_seconds", train_seconds},
                            {"steps_per_second", steps_per_second},
                            {"sample_seconds", sample_seconds},
                            {"total_seconds", seconds_since(t_start)},
                            {"threads", at::get_num_threads()},
                            {"resumed_from", resumed_from}};
  results.update(shared_settings);
  // The results beside the training curves in TensorBoard.
  auto& tb = std::get<tr::TensorBoard>(trainer->callbacks());
  const std::int64_t last = trainer->global_step();
  tb.add_scalar("eval/class_accuracy", accuracy, last);
  tb.add_scalar("eval/frechet_distance", fd, last);
  tb.add_scalar("eval/frechet_distance_real_floor", fd_floor, last);
  tb.add_images("samples/final", grid_pick, last, {.columns = cols, .padding = 2});
#if DIFFTRAIN_HAS_PLOT
  tb.add_image("plots/loss", loss_plot, last);
#endif
  tb.close();
  const std::string text = results.dump(2) + "\n";
  difftrain::io::write_file_atomic(out / "results.json",
                                   std::span<const char>(text.data(), text.size()));
  std::printf("class accuracy of the samples: %.1f %%\n", 100 * accuracy);
  for (std::int64_t c = 0; c < fmnist::kClasses; ++c)
    std::printf("  %-12s %5.1f %%\n", fmnist::kClassNames[static_cast<std::size_t>(c)],
                100 * per_class[c].item<double>());
  std::printf("Fréchet distance to the test set: %.3f (real images at the same count: %.3f)\n", fd,
              fd_floor);
  std::printf(
      "wrote %s/{samples.png,loss.png,lr.png,loss.csv,results.json,tensorboard} in %.0f s\n",
      s.out.c_str(), seconds_since(t_start));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  CLI::App app{
      "Train a class-conditional diffusion model on Fashion-MNIST with difftrain, sample it with "
      "classifier-free guidance from the EMA weights, and score the samples with a classifier."};
  app.get_formatter()->column_width(34);
  auto* g = app.add_option_group("data and run");
  examples::add_run_flags(g, s, "directory with the IDX files (train-*, t10k-*; .gz or not)",
                          "folder of the TensorBoard event file (default: OUT/tensorboard)");
  g->add_flag("--resume", s.resume, "continue from the latest checkpoint in OUT/checkpoints");
  g->add_option("--resume_from_checkpoint", s.resume_from,
                "continue from this checkpoint file, or \"latest\" (as --resume)");
  g->add_option("--logging_dir", s.logging_dir, "folder of loss.csv (default: --out)");
  g->add_option("--stop-at-step", s.stop_at,
                "pause at this step: save a checkpoint and exit (continue with --resume)")
      ->check(examples::count_in(0, 100'000'000));
  g->add_flag("--overwrite", s.overwrite, "start again even if OUT holds checkpoints");
  g->add_flag("--take-new-settings", s.take_new_settings,
              "with --resume: train on with this command line's LR, schedule, weight decay, "
              "clipping and EMA decay when the checkpoint was written with others (else they are "
              "refused)");
  g->add_flag("--progress", s.progress, "draw the progress bar even when stderr is not a terminal");
  g->add_option("--progress-lines", s.progress_lines,
                "when stderr is not a terminal: a progress line every N steps (0: none; default: "
                "a tenth of the steps)")
      ->check(examples::count_in(0, 100'000'000));
  g->add_option("--profile-steps", s.profile_steps,
                "profile this many steps after 10 warm-up steps: print where the step's time goes "
                "and write OUT/profile.json (a Chrome trace); 0: none")
      ->check(examples::count_in(0, 100'000))
      ->capture_default_str();
  g->add_option("--sample-every", s.sample_every,
                "draw a sample grid into TensorBoard every N steps (0: only the final one)")
      ->check(examples::count_in(0, 100'000'000))
      ->capture_default_str();
  g->add_option("--sharding", s.sharding,
                "under torchrun, ZeRO's stage: 0 keeps everything on every rank (DataParallel), 1 "
                "shards the optimizer state over the ranks, 2 also the gradients, 3 also the "
                "parameters during forward and backward (each model block a unit)")
      ->check(CLI::IsMember({0, 1, 2, 3}))
      ->capture_default_str();
  g->add_flag("--allow-world-size-change", s.allow_world_size_change,
              "with --resume: continue a checkpoint written by another number of ranks (the "
              "global batch stays --batch-size; each rank's share changes)");
  g->add_option("--rank-timeout", s.rank_timeout,
                "seconds a rank of a torchrun launch waits for the others before it stops")
      ->check(examples::number_in(0, 1e7, true))
      ->capture_default_str();
  auto* m = app.add_option_group("training");
  m->add_option("--steps,--max_train_steps", s.steps, "optimizer steps")
      ->check(examples::count_in(1, 100'000'000))
      ->capture_default_str();
  m->add_option("--batch-size,--train_batch_size", s.batch_size, "images per step")
      ->check(examples::count_in(1, 1'000'000))
      ->capture_default_str();
  m->add_option("--model", s.model,
                "the denoiser: unet (diffusers' UNet2DConditionModel, noise-schedule training) or "
                "dit (diffusers' DiTTransformer2DModel, flow matching) or flux-mini (a small "
                "FluxTransformer2DModel on class captions, flow matching)")
      ->check(CLI::IsMember({"unet", "dit", "flux-mini"}))
      ->capture_default_str();
  std::vector<CLI::Option*> unet_only, dit_only;
  unet_only.push_back(m->add_option("--channels", s.channels, "UNet width C (multiple of 16)")
                          ->check(examples::count_in(16, 4096))
                          ->capture_default_str());
  unet_only.push_back(
      m->add_flag("--attention-14", s.attention_14, "transformers at 14×14 too (slower on a CPU)"));
  dit_only.push_back(m->add_option("--dit-width", s.dit.width, "DiT width (heads × head width)")
                         ->check(examples::count_in(4, 4096))
                         ->capture_default_str());
  dit_only.push_back(m->add_option("--dit-depth", s.dit.depth, "DiT blocks")
                         ->check(examples::count_in(1, 256))
                         ->capture_default_str());
  dit_only.push_back(m->add_option("--dit-heads", s.dit.heads, "DiT attention heads")
                         ->check(examples::count_in(1, 256))
                         ->capture_default_str());
  dit_only.push_back(
      m->add_option("--dit-patch", s.dit.patch, "DiT patch side (divides 28: (28/p)² tokens)")
          ->check(examples::count_in(1, 28))
          ->capture_default_str());
  m->add_option("--lr,--learning_rate", s.lr, "peak AdamW learning rate")
      ->check(examples::number_in(0, 1e4, true))
      ->capture_default_str();
  m->add_option("--weight-decay,--adam_weight_decay", s.weight_decay,
                "AdamW decay (not on biases, norms, embeddings)")
      ->check(examples::number_in(0, 1e4))
      ->capture_default_str();
  m->add_option("--lr-scheduler,--lr_scheduler", s.lr_scheduler,
                "LR schedule after the warm-up (diffusers' names)")
      ->check(CLI::IsMember({"linear", "cosine", "cosine_with_restarts", "polynomial", "constant",
                             "constant_with_warmup"}))
      ->capture_default_str();
  m->add_option("--warmup,--lr_warmup_steps", s.warmup, "linear warm-up steps before the schedule")
      ->check(examples::count_in(0, 100'000'000))
      ->capture_default_str();
  m->add_option("--ema-decay", s.ema_decay, "EMA decay cap (beta for ema_pytorch)")
      ->check(examples::number_in(0, 1))
      ->capture_default_str();
  m->add_option("--ema-rule", s.ema_rule, "EMA decay rule")
      ->check(CLI::IsMember({"constant", "warmup_decay", "lit_ema", "ema_pytorch", "karras"}))
      ->capture_default_str();
  m->add_option("--ema-settings", s.ema_settings,
                "the rule's other options as JSON, e.g. '{\"use_ema_warmup\": true}'")
      ->capture_default_str();
  unet_only.push_back(m->add_option("--prediction-type,--prediction_type", s.prediction_type,
                                    "what the UNet predicts: epsilon, v_prediction or sample")
                          ->check(CLI::IsMember({"epsilon", "v_prediction", "sample"}))
                          ->capture_default_str());
  unet_only.push_back(m->add_option("--snr-gamma,--snr_gamma", s.snr_gamma,
                                    "the UNet's min-SNR-γ loss weighting (0: off)")
                          ->check(examples::number_in(0, 1e6))
                          ->capture_default_str());
  m->add_option("--adam_beta1", s.adam_beta1, "AdamW β₁")
      ->check(examples::number_in(0, 1))
      ->capture_default_str();
  m->add_option("--adam_beta2", s.adam_beta2, "AdamW β₂")
      ->check(examples::number_in(0, 1))
      ->capture_default_str();
  m->add_option("--adam_epsilon", s.adam_epsilon, "AdamW ε")
      ->check(examples::number_in(0, 1, true))
      ->capture_default_str();
  m->add_option("--adam-kernel", s.adam_kernel,
                "AdamW's step: torch's fused kernel, its multi-tensor kernels, or LibTorch's "
                "per-parameter loop (same results to rounding)")
      ->check(CLI::IsMember({"fused", "foreach", "per_parameter"}))
      ->capture_default_str();
  m->add_option("--optimizer,--optimizer_type", s.optimizer,
                "AdamW, Adam, AdamW8bit, SGD, SGDNesterov, Lion, Prodigy, Adafactor, CAME or "
                "AdamWScheduleFree (kohya's names; --lr, --weight-decay and the AdamW flags apply "
                "where it has them)")
      ->capture_default_str();
  m->add_option("--optimizer-args,--optimizer_args", s.optimizer_args,
                "its settings as key=value (kohya's: d_coef=2 relative_step=False ...)")
      ->expected(1, -1);
  m->add_option("--gradient-accumulation-steps,--gradient_accumulation_steps", s.accumulation,
                "micro-batches of --batch-size per optimizer step")
      ->check(examples::count_in(1, 1'000'000))
      ->capture_default_str();
  m->add_option("--mixed-precision,--mixed_precision", s.mixed_precision,
                "no (float32), bf16 or fp16 (autocast; fp16 with loss scaling); auto: bf16 on a "
                "CPU with native bf16 (AVX512-BF16, AMX), else no")
      ->check(CLI::IsMember({"auto", "no", "fp32", "bf16", "fp16"}))
      ->capture_default_str();
  m->add_option("--clip,--max_grad_norm", s.clip, "gradient norm clipping")
      ->check(examples::number_in(0, 1e9, true))
      ->capture_default_str();
  m->add_option("--p-uncond", s.p_uncond, "chance a label is dropped to the null class")
      ->check(examples::number_in(0, 1))
      ->capture_default_str();
  m->add_option("--checkpoint-every,--checkpointing_steps", s.checkpoint_every,
                "steps between checkpoints")
      ->check(examples::count_in(1, 100'000'000))
      ->capture_default_str();
  m->add_option("--keep,--checkpoints_total_limit", s.keep, "checkpoints kept")
      ->check(examples::count_in(1, 1'000'000))
      ->capture_default_str();
  auto* e = app.add_option_group("sampling and scoring");
  e->add_option("--sampler", s.sampler,
                "auto, dpm++ (DPM-Solver++ 2M) or ddim for the UNet, euler (flow matching) for "
                "the DiT; auto: dpm++ or euler")
      ->capture_default_str();
  e->add_option("--sample-steps", s.sample_steps, "sampler steps")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  unet_only.push_back(
      e->add_flag("--clip-x0,!--no-clip-x0", s.clip_x0,
                  "clip each sampler step's predicted clean image to [-1, 1] (UNet; default on)"));
  e->add_option("--guidance", s.guidance, "classifier-free guidance scale (1: none)")
      ->check(examples::number_in(0, 1e4))
      ->capture_default_str();
  e->add_option("--samples-per-class", s.samples_per_class, "samples scored per class")
      ->check(CLI::Range(2, 100000))
      ->capture_default_str();
  e->add_option("--grid-columns", s.grid_columns, "samples per class in samples.png")
      ->check(examples::count_in(1, 10'000))
      ->capture_default_str();
  examples::add_judge_flags(e, s);
  // A config file (TOML or INI: `lr = 1e-3`, any of an option's long names) read first; flags
  // on the command line win over it.
  app.set_config("--config", "", "read options from this TOML/INI file (flags given here win)");
  app.allow_config_extras(CLI::config_extras_mode::error);  // a misspelt key is an error
  if (const auto rc = examples::parse_command_line(app, argc, argv)) return *rc;
  if (!s.resume_from.empty()) s.resume = true;  // "latest" or a file: either way a resume
  for (auto* o : unet_only)
    if (o->count() > 0) s.unet_flags_given.push_back(o->get_name());
  for (auto* o : dit_only)
    if (o->count() > 0) s.dit_flags_given.push_back(o->get_name());
  if (s.sampler == "auto") s.sampler = s.flow() ? "euler" : "dpm++";
  return examples::run_reporting_errors([&] { return run(s); });
}
