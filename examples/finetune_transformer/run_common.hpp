#pragma once
// What every model family of finetune_transformer shares: the flags, the trainer configuration, the
// ranks of a torchrun launch, the trained transformer's files and results.json. A family is one
// more header beside sd3.hpp and cogvideox.hpp, with its run_<family>(Settings, Ranks) and its
// pipeline class in run() (finetune_transformer.cpp).

#include <ATen/CPUGeneratorImpl.h>
#include <CLI/CLI.hpp>
#include <difftrain/adapters/lora_inject.hpp>
#include <difftrain/data/data.hpp>
#include <difftrain/diffusion/cogvideox_dpm.hpp>
#include <difftrain/diffusion/flow_matching.hpp>
#include <difftrain/diffusion/sample.hpp>
#include <difftrain/diffusion/weighting.hpp>
#include <difftrain/io/atomic_file.hpp>
#include <difftrain/io/json_file.hpp>
#include <difftrain/io/read_file.hpp>
#include <difftrain/io/safetensors.hpp>
#include <difftrain/models/models.hpp>
#include <difftrain/schedule/by_name.hpp>
#include <difftrain/text/clip_tokenizer.hpp>
#include <difftrain/text/encode_prompt.hpp>
#include <difftrain/text/t5_tokenizer.hpp>
#include <difftrain/train/callbacks.hpp>
#include <difftrain/train/seeding.hpp>
#include <difftrain/train/tensorboard.hpp>
#include <difftrain/train/trainer.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "../common/cli_checks.hpp"
#include "../common/kohya_flags.hpp"
#include "../common/run_skeleton.hpp"
#include "../common/scheduler_config.hpp"
#include "../common/sd_pipeline.hpp"
#include "../common/sd_run.hpp"
#include "../common/sd_torchrun.hpp"
#include "../common/training_folder.hpp"

namespace {
namespace dt = difftrain;
namespace df = difftrain::diffusion;
namespace ad = difftrain::adapters;
namespace data = difftrain::data;
namespace models = difftrain::models;
namespace text = difftrain::text;
namespace tr = difftrain::train;
namespace fs = std::filesystem;
using dt::ConfigError;
using namespace examples::sd;  // the run's flags, folders, checkpoints and results

using Transformer = models::SD3Transformer2DModel<>;
using Clip = models::CLIPTextModel<>;
using T5 = models::T5EncoderModel<>;

struct Settings : SdRunFlags, ImageFolderFlags, LoraFlags, TorchrunFlags, SingleFileSaveFlags {
  std::string weighting_scheme = "logit_normal";
  double logit_mean = 0.0, logit_std = 1.0, mode_scale = 1.29;
  bool precondition_outputs = true;
  std::int64_t max_sequence_length = 77;
  std::string t5_tokenizer;     // an SD3 single file's T5 tokenizer without a config folder
  std::string sat_vae;          // CogVideoX: SAT's 3d-vae.pt in place of the folder's VAE
  double sat_lora_alpha = 1.0;  // CogVideoX: the alpha SAT's LoRA was trained with
  // CogVideoX folders (diffusers' train_cogvideox_lora.py flags).
  std::string video_column = "video";
  std::int64_t height = 480, width = 720, max_num_frames = 49;
  std::int64_t skip_frames_start = 0, skip_frames_end = 0;
  std::string frame_sampling = "diffusers";  // or sat (the SAT SFTDataset's window and crop)
  double video_fps = 8;                      // the rate SAT's sampling trains at
  // CogVideoX image-to-video (diffusers' train_cogvideox_image_to_video_lora.py) and sampling.
  std::vector<std::string> validation_images;  // one per --validation_prompt (or one for all)
  double noised_image_dropout = 0.05;          // the chance a step trains without its first frame
  double ofs = 2.0;                            // CogVideoX 1.5 I2V's ofs embedding input
  bool use_dynamic_cfg = false;                // CogVideoX pipelines' cosine guidance schedule
  std::vector<std::string> video_resolution_buckets;  // finetrainers' FxHxW buckets
  bool cache_latents = false;  // CogVideoX: posteriors and T5 states kept on disk
  std::string cache_dir;       // default OUTPUT_DIR/cache
  examples::KohyaFlags kohya;  // kohya's caption, input-perturbation and loss-type options
  // Flux (diffusers' train_dreambooth_lora_flux.py and kohya's flux_train_network.py flags).
  std::string lora_layers;           // comma-separated modules in place of the family's targets
  std::string lora_format = "peft";  // or kohya (Flux: lora_unet_double_blocks_...)
  std::int64_t blocks_to_swap = 0;
  bool fp8_base = false;
  std::set<std::string> given;  // the flags on the command line (families differ in defaults)
  [[nodiscard]] bool was_given(const std::string& flag) const { return given.contains(flag); }
  Settings() {
    out = "runs/finetune_transformer";
    learning_rate = 1e-4;
    guidance_scale = 5.0;
  }
};

/// The trainer both families run: AdamW, the precision, LR schedule and sharding stage the flags
/// name, and the program's callbacks.
struct TrainerConfig : tr::DefaultConfig {
  using Optimizer = tr::OptimizerByName;
  using Precision = tr::PrecisionByName;  // --mixed_precision
  using Schedule = dt::schedule::ByName;  // --lr_scheduler, diffusers' names
  using Clipping = tr::ClipByNorm;
  // --sharding picks the stage at run time; 0 is DataParallel itself (one process without
  // torchrun).
  using Parallel = dt::distributed::ShardedDataParallel;
  using Callbacks = std::tuple<tr::ProgressBar, tr::CheckpointEvery, tr::TensorBoard,
                               StopOnInterrupt, LossRecord>;
};

// ---- what both kinds of run write --------------------------------------------------------------

/// Writes the trained transformer in a layout of the family's own (a full fine-tune as one file;
/// a Flux LoRA in kohya's names) in place of the default, and names it in `files`.
using WriteSingleFile = std::function<void(nlohmann::json& files)>;

/// The trained transformer: with `write_single_file` (--save_format single_file or a base read
/// from one file; a Flux LoRA in kohya's layout), that; with --use_lora,
/// pytorch_lora_weights.safetensors (PEFT keys under transformer. with diffusers' adapter
/// metadata); otherwise the pipeline folder at `base` with
/// the trained transformer/.
template <class Transformer>
void save_trained_transformer(Transformer& transformer, const fs::path& base, const Settings& s,
                              nlohmann::json& files, const WriteSingleFile& write_single_file) {
  const fs::path out(s.out);
  if (write_single_file) {
    write_single_file(files);
    return;
  }
  if (s.use_lora) {
    nlohmann::json adapter;
    ad::add_peft_adapter_metadata(adapter, *transformer, "transformer");
    dt::io::save_safetensors(
        out / "pytorch_lora_weights.safetensors",
        ad::lora_state_dict(*transformer, {ad::LoraLayout::peft, "transformer."}),
        ad::lora_file_metadata(adapter, {{"base_model", s.model}}));
    files["peft"] = "pytorch_lora_weights.safetensors";
  } else {
    copy_pipeline_except_unet(base, out, "transformer");
    // In the variant the base was read in, so the folder loads with the same --variant.
    models::SaveOptions so;
    if (!s.variant.empty()) so.variant = s.variant;
    // diffusers' fp16 and bf16 variants hold weights of that dtype.
    if (s.variant == "fp16") so.dtype = at::kHalf;
    if (s.variant == "bf16") so.dtype = at::kBFloat16;
    models::save_pretrained(transformer, out / "transformer", so);
    files["pipeline"] = ".";
  }
}

/// results.json (the run's settings, what it wrote, its steps, losses and times) and the closing
/// line; the exit status: 0, or 130 for a stopped run, as a shell reports a run ended by Ctrl-C.
int write_run_results(const Settings& s, const nlohmann::json& run_settings,
                      const nlohmann::json& files, const FitResult& fit, std::int64_t resumed_from,
                      std::int64_t global_step, std::size_t lora_layers,
                      const std::vector<double>& losses, std::chrono::steady_clock::time_point t0) {
  const std::size_t tenth = std::max<std::size_t>(1, losses.size() / 10);
  nlohmann::json results = run_settings;
  results["files"] = files;
  results["finished"] = fit.finished;
  results["resumed_from_step"] = resumed_from;
  results["global_step"] = global_step;
  results["lora_layers"] = lora_layers;
  results["optimizer"] = chosen_optimizer(s);
  results["first_loss"] = mean_of(losses, tenth, false);
  results["last_loss"] = mean_of(losses, tenth, true);
  results["train_seconds"] = fit.seconds;
  results["total_seconds"] = examples::seconds_since(t0);
  write_results(fs::path(s.out), results);
  std::printf("%s: %lld steps (loss %.4f → %.4f); %s\n",
              s.use_lora ? ("LoRA on " + std::to_string(lora_layers) + " layers").c_str()
                         : "full fine-tuning",
              static_cast<long long>(global_step), results["first_loss"].get<double>(),
              results["last_loss"].get<double>(),
              written_files(fs::path(s.out), files, fit.finished).c_str());
  return fit.finished ? 0 : 130;
}

// ---- the run ------------------------------------------------------------------------------------

void check_flags(const Settings& s) {
  check_loraplus_flags(s);
  s.kohya.check();
  // kohya's SD3 and Flux training perturb the input (ip_noise_gamma) but offset no noise and
  // weight no loss by SNR (their flow has none); CogVideoX's loss has its own weights.
  const auto& k = s.kohya;
  for (const auto& [set, flag] : std::initializer_list<std::pair<bool, const char*>>{
           {k.noise_offset > 0, "--noise_offset"},
           {k.multires_noise_iterations > 0, "--multires_noise_iterations"},
           {k.debiased_estimation_loss, "--debiased_estimation_loss"},
           {k.v_pred_like_loss != 0, "--v_pred_like_loss"},
           {k.scale_v_pred_loss_like_noise_pred, "--scale_v_pred_loss_like_noise_pred"}})
    if (set)
      throw ConfigError(
          "is for the SD programs' noise schedules; SD3's flow (as kohya's sd3_train) and "
          "CogVideoX's loss take --ip_noise_gamma, --loss_type and the caption options here",
          flag);
  if (s.use_dora && !s.dora_wd_on_output)
    throw ConfigError(
        "asks for DoRA per input column, which PEFT's and diffusers' files cannot hold; this "
        "program writes PEFT's layout",
        "--dora_wd_on_output false");
  if (s.loraplus_text_encoder_lr_ratio > 0)
    throw ConfigError("has no branches to speed up here: the text encoders stay frozen",
                      "--loraplus_text_encoder_lr_ratio");
  const std::set<std::string> schemes{"sigma_sqrt", "logit_normal", "mode", "cosmap", "none"};
  if (!schemes.contains(s.weighting_scheme))
    throw ConfigError("is '" + s.weighting_scheme +
                          "'; diffusers' schemes are sigma_sqrt, logit_normal, mode, cosmap, none",
                      "--weighting_scheme");
  if (s.resolution % 8 != 0) throw ConfigError("must be a multiple of 8", "--resolution");
  check_single_file_save_flags(s, s.use_lora);
}

/// The loss of SD3's and Flux's flow matching: w(σ) of --weighting_scheme times the element-wise
/// loss of --loss_type (kohya's sd3_train and flux_train: Huber's threshold from t = σ·N), mean
/// per sample, then over the batch.
inline at::Tensor weighted_flow_loss(const at::Tensor& pred, const at::Tensor& target,
                                     const at::Tensor& sigmas, const at::Tensor& timesteps,
                                     std::int64_t steps, df::Sd3Weighting weighting,
                                     const Settings& s) {
  const std::int64_t n = pred.size(0);
  const at::Tensor w = df::sd3_loss_weighting(weighting, sigmas.to(at::kFloat));
  const df::LossType type = df::loss_type_from(s.kohya.loss_type, "--loss_type");
  if (type == df::LossType::l2)
    return (w * (pred - target).square()).reshape({n, -1}).mean(1).mean();
  at::Tensor c;
  if (type == df::LossType::huber || type == df::LossType::smooth_l1)
    c = df::huber_threshold(df::huber_schedule_from(s.kohya.huber_schedule, "--huber_schedule"),
                            s.kohya.huber_c, s.kohya.huber_scale, timesteps, steps)
            .to(pred.device());
  return (w * df::conditional_loss(pred, target, type, c)).reshape({n, -1}).mean(1).mean();
}

/// Huber's snr schedule needs ᾱ, which flow matching has none of (kohya's sd3_train and
/// flux_train refuse it too).
inline void check_flow_loss_flags(const Settings& s) {
  if ((s.kohya.loss_type == "huber" || s.kohya.loss_type == "smooth_l1") &&
      s.kohya.huber_schedule == "snr")
    throw ConfigError(
        "is snr (the default), which needs a noise schedule with ᾱ; flow matching has none (as in "
        "kohya's sd3_train and flux_train): give --huber_schedule constant or exponential",
        "--huber_schedule");
}

/// The ranks of a torchrun launch (a world of one without it) and this rank's device.
struct Ranks {
  std::shared_ptr<dt::distributed::World> world;
  at::Device device;
  [[nodiscard]] bool main() const { return world->is_main(); }
  /// The steps of an epoch of `batches` shared by the ranks; a ConfigError when some rank would
  /// have none.
  [[nodiscard]] std::int64_t batches_each(std::size_t batches, const std::string& what) const {
    const auto n = static_cast<std::int64_t>(batches);
    if (n < world->size())
      throw ConfigError("make " + std::to_string(n) + " batches an epoch, fewer than the " +
                            std::to_string(world->size()) + " ranks",
                        what);
    return (n + world->size() - 1) / world->size();
  }
  /// Batch `place` of this rank: batch place · ranks + rank of the run's order.
  [[nodiscard]] std::int64_t place(std::int64_t local) const {
    return local * world->size() + world->rank();
  }
  /// Each rank its own noise (a resumed run restores each rank's generator).
  void seed(std::int64_t seed, std::int64_t resumed_from) const {
    if (world->rank() > 0 && resumed_from == 0) tr::set_seed(seed + 7919 * world->rank());
  }
};

/// The run's settings every family records (results.json, TensorBoard's run config); a family
/// adds its own.
inline nlohmann::json common_run_settings(const Settings& s, const Ranks& ranks) {
  return {{"pretrained_model_name_or_path", s.model},
          {"train_data_dir", s.data_dir},
          {"train_batch_size", s.train_batch_size},
          {"gradient_accumulation_steps", s.gradient_accumulation_steps},
          {"max_train_steps", s.max_train_steps},
          {"learning_rate", s.learning_rate},
          {"lr_scheduler", s.lr_scheduler},
          {"use_lora", s.use_lora},
          {"rank", s.rank},
          {"kohya", s.kohya.settings()},
          {"mixed_precision", s.mixed_precision},
          {"gradient_checkpointing", s.gradient_checkpointing},
          {"ranks", ranks.world->size()},
          {"sharding", s.sharding},
          {"seed", s.seed}};
}

/// The loop every family shares: the trainer (AdamW, the schedule, clipping and sharding from
/// the flags, the program's callbacks), resumed when asked with each rank its own noise, stepped
/// until done or stopped; then rank 0 writes the trained transformer, the validation
/// (`write_validation(out)` writes validation.png) and results.json. Returns the exit status.
template <class Trainee, class Stream, class Transformer, class WriteValidation>
int train_and_write(Trainee& trainee, const Settings& s, const Ranks& ranks,
                    const nlohmann::json& run_settings, Stream& stream, Transformer& transformer,
                    const fs::path& base, std::size_t lora_layers,
                    WriteValidation&& write_validation, std::chrono::steady_clock::time_point t0,
                    const WriteSingleFile& write_single_file = {}) {
  using Trainer = tr::Trainer<Trainee, TrainerConfig>;
  const bool main_rank = ranks.main();
  typename Trainer::Options o;
  set_optimizer_and_schedule(o, s, s.learning_rate);
  if (s.use_lora)  // LoRA+: the transformer's B matrices
    if (auto r = loraplus_rule("transformer", s.loraplus_ratio(false), s.learning_rate))
      o.groups.rules.push_back(*r);
  o.clipping.max_norm = s.max_grad_norm;
  set_parallel(o, s, ranks.world);
  const RunFolders folders = prepare_run_folders(s, main_rank);
  std::vector<double> losses;
  Trainer trainer(trainee, o,
                  TrainerConfig::Callbacks{
                      progress_bar(s), checkpoint_every(s, folders),
                      tr::TensorBoard({.dir = folders.tensorboard, .config = run_settings}),
                      StopOnInterrupt{s.stop_at}, LossRecord{&losses}});
  const std::int64_t resumed_from = resume_if_asked(trainer, s, folders);
  ranks.seed(s.seed, resumed_from);
  const FitResult fit = fit_until_done_or_stopped(
      trainer, s, [&](std::int64_t place) { return stream.at_place(ranks.place(place)); });
  // Every rank: under --sharded_mixed_precision the parameters hold the float32 masters from
  // here on, for what rank 0 writes (nothing otherwise: they are whole between steps).
  const auto whole = trainer.whole_parameters();
  if (!main_rank) return fit.finished ? 0 : 130;  // rank 0 writes what the run leaves

  const fs::path out(s.out);
  nlohmann::json files;
  if (fit.finished) {
    save_trained_transformer(transformer, base, s, files, write_single_file);
    if (!s.validation_prompts.empty()) {
      write_validation(out);
      files["validation"] = "validation.png";
    }
  }
  return write_run_results(s, run_settings, files, fit, resumed_from, trainer.global_step(),
                           lora_layers, losses, t0);
}

}  // namespace
