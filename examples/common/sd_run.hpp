#pragma once
// The run around a Stable Diffusion training program: diffusers' shared flags (pipeline, batch,
// steps, optimizer, schedule, checkpoints, validation), the output folder's guard against
// overwriting an earlier run, resuming, Ctrl-C, validation images and results.json. A program
// adds what is its own (the trainee, its data, its outputs).

#include <CLI/CLI.hpp>
#include <difftrain/io/atomic_file.hpp>
#include <difftrain/io/image_grid.hpp>
#include <difftrain/io/png.hpp>
#include <difftrain/io/remove_tree.hpp>
#include <difftrain/schedule/registry.hpp>
#include <difftrain/train/callbacks.hpp>
#include <difftrain/train/optimizer_by_name.hpp>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "cli_checks.hpp"
#include "run_skeleton.hpp"
#include "sd_pipeline.hpp"

namespace examples::sd {

/// What every SD training program takes, under diffusers' names.
struct SdRunFlags : RunFlags {
  std::string model;  // --pretrained_model_name_or_path
  std::int64_t train_batch_size = 16, gradient_accumulation_steps = 1;
  std::int64_t max_train_steps = 0;  // 0: from --num_train_epochs (diffusers: it overrides them)
  std::int64_t num_train_epochs = 100;
  std::string mixed_precision = "no";  // no, bf16, fp16 (autocast; fp16 with loss scaling)
  bool gradient_checkpointing = false;
  std::string report_to = "tensorboard";
  double learning_rate = 1e-4;
  std::string lr_scheduler = "constant";
  std::int64_t lr_warmup_steps = 0, lr_num_cycles = 1;
  double adam_beta1 = 0.9, adam_beta2 = 0.999, adam_weight_decay = 1e-2, adam_epsilon = 1e-8;
  std::string optimizer_type = "AdamW";  // kohya's --optimizer_type (train/optimizer_by_name.hpp)
  std::vector<std::string> optimizer_args;  // kohya's --optimizer_args key=value ...
  bool use_8bit_adam = false;               // diffusers' name for AdamW8bit
  std::int64_t dataloader_num_workers = 2;
  std::int64_t checkpointing_steps = 500, checkpoints_total_limit = 3;
  std::string resume_from_checkpoint;  // a checkpoint file or "latest"
  std::vector<std::string> validation_prompts;
  std::int64_t num_validation_images = 2, validation_steps = 0, num_inference_steps = 25;
  double guidance_scale = 7.5;
  std::int64_t stop_at = 0;  // stop (with a checkpoint) after this step, as Ctrl-C does; 0: never
  std::string variant;       // --variant: the pipeline's weights variant ("fp16"); empty: none
  std::string single_file_config;  // configs, tokenizer, scheduler for a single-file model
  std::string tokenizer_name;      // a single file's tokenizer without a config folder
  std::string original_config;     // a single file's original .yaml (else model.yaml beside it)
  bool use_ema_weights = false;    // a single file's EMA weights (model_ema.*) in place of its own
};

struct SdFlagGroups {
  CLI::Option_group *run, *training, *saving;
};

/// An image folder's flags (diffusers' names), shared by the programs that train on one.
struct ImageFolderFlags {
  std::string image_column = "file_name", caption_column = "text";
  std::int64_t resolution = 512;
  bool center_crop = false, random_flip = false;
  double max_grad_norm = 1.0;
  bool require_captions = false;
};

/// LoRA's flags: whether, rank and alpha.
struct LoraFlags {
  bool use_lora = false;
  std::int64_t rank = 4;
  double lora_alpha = 0.0;  // 0: the rank (diffusers' default)
  /// LoRA+ (kohya's --loraplus_*_lr_ratio): the B matrices learn this many times faster; 0: off.
  /// The specific ratios take precedence over the common one.
  double loraplus_lr_ratio = 0.0, loraplus_unet_lr_ratio = 0.0,
         loraplus_text_encoder_lr_ratio = 0.0;
  /// DoRA (diffusers' --use_dora), its norm per output row (LyCORIS' wd_on_output) or per input
  /// column (the web UI's form).
  bool use_dora = false, dora_wd_on_output = true;

  /// A branch's options from the flags: --rank, --lora_alpha (0: the rank), DoRA.
  [[nodiscard]] difftrain::nn::LoraOptions lora_options() const {
    return {.rank = rank,
            .alpha = lora_alpha > 0 ? lora_alpha : static_cast<double>(rank),
            .use_dora = use_dora,
            .dora_axis = dora_wd_on_output ? difftrain::nn::DoraAxis::output
                                           : difftrain::nn::DoraAxis::input};
  }

  /// The ratio for the trained model's B matrices (the UNet's or transformer's), or for the text
  /// encoders'; 0 when LoRA+ is off for them.
  [[nodiscard]] double loraplus_ratio(bool text_encoder) const {
    const double specific = text_encoder ? loraplus_text_encoder_lr_ratio : loraplus_unet_lr_ratio;
    return specific > 0 ? specific : loraplus_lr_ratio;
  }
};

/// LoRA+ (Hayou et al. 2024) as kohya's scripts apply it: a parameter group of the LoRA branches'
/// B matrices (`lora_B`, kohya's `lora_up`) of the modules registered as `module_pattern`, at
/// `ratio` times the learning rate; the schedules scale it with every other group.
inline std::optional<difftrain::train::ParamGroupRule> loraplus_rule(
    const std::string& module_pattern, double ratio, double lr) {
  if (ratio <= 0) return std::nullopt;
  return difftrain::train::ParamGroupRule{module_pattern + "\\..*\\.lora_B\\.", lr * ratio,
                                          std::nullopt};
}

/// How a full fine-tune is written: a diffusers folder, or one file in the family's original
/// layout in this precision.
struct SingleFileSaveFlags {
  std::string save_format = "diffusers", save_precision = "fp32";
  /// The dtype --save_precision names (none: as trained).
  [[nodiscard]] std::optional<at::ScalarType> save_dtype() const {
    if (save_precision == "fp16") return at::kHalf;
    if (save_precision == "bf16") return at::kBFloat16;
    return std::nullopt;
  }
};

/// Adds SdRunFlags' options in three groups, which the program extends with its own.
inline SdFlagGroups add_sd_run_flags(CLI::App& app, SdRunFlags& f, const std::string& data_help) {
  SdFlagGroups g{app.add_option_group("data and run"), app.add_option_group("training"),
                 app.add_option_group("checkpoints and validation")};
  g.run
      ->add_option("--pretrained_model_name_or_path", f.model,
                   "diffusers pipeline folder, or a single file (.safetensors, .ckpt)")
      ->required();
  g.run->add_option("--train_data_dir", f.data_dir, data_help)->required();
  g.run->add_option("--tokenizer_name", f.tokenizer_name,
                    "with a single-file model and no --single_file_config: CLIP's BPE merges "
                    "file (bpe_simple_vocab_16e6.txt.gz), or a tokenizer or pipeline folder; the "
                    "configs are told from the file's keys");
  g.run->add_option("--original_config", f.original_config,
                    "with a single-file model and no --single_file_config: its original .yaml "
                    "config (v2-inference-v.yaml, ...: the prediction, heads, VAE scale); "
                    "model.yaml beside model.safetensors is read without it");
  g.run->add_flag("--use_ema_weights", f.use_ema_weights,
                  "with a single file that holds EMA weights (model_ema.*, as the original "
                  "trainer saves them): start from them instead of the trained ones (the web UI's "
                  "model_ema)");
  g.run->add_option("--single_file_config", f.single_file_config,
                    "with a single-file model (.safetensors, .ckpt in the web UI's layout): a "
                    "diffusers pipeline folder of the same model for its configs, tokenizer and "
                    "scheduler (diffusers' from_single_file config=)");
  g.run->add_option("--variant", f.variant,
                    "read the weights saved with this variant (diffusers' --variant: \"fp16\" "
                    "reads *.fp16.safetensors); a full fine-tune writes its model with it too");
  g.run->add_option("--output_dir", f.out, "output folder")->capture_default_str();
  g.run->add_option("--device", f.device, "cpu, cuda or cuda:N")->capture_default_str();
  g.run->add_option("--seed", f.seed, "seeds batches, noise and samples")->capture_default_str();
  g.run->add_option("--logging_dir", f.tensorboard,
                    "TensorBoard folder (default OUTPUT_DIR/tensorboard)");
  g.run->add_flag("--no_tensorboard", f.no_tensorboard, "write no TensorBoard event files");
  g.run->add_option("--report_to", f.report_to, "tensorboard or none")->capture_default_str();
  g.run->add_option("--threads", f.threads, "intra-op CPU threads (0: the free cores)")
      ->check(count_in(0, 4096));
  g.run->add_option("--dataloader_num_workers", f.dataloader_num_workers, "decoding threads")
      ->check(count_in(0, 256))
      ->capture_default_str();
  auto* t = g.training;
  t->add_option("--train_batch_size", f.train_batch_size)
      ->check(count_in(1, 100'000))
      ->capture_default_str();
  t->add_option("--max_train_steps", f.max_train_steps,
                "optimizer steps (0: --num_train_epochs epochs)")
      ->check(count_in(0, 100'000'000))
      ->capture_default_str();
  t->add_option("--num_train_epochs", f.num_train_epochs, "epochs when --max_train_steps is 0")
      ->check(count_in(1, 1'000'000))
      ->capture_default_str();
  t->add_option("--mixed_precision", f.mixed_precision, "no, bf16 or fp16")->capture_default_str();
  t->add_flag("--gradient_checkpointing", f.gradient_checkpointing,
              "recompute activations in backward (less memory, more time)");
  t->add_option("--gradient_accumulation_steps", f.gradient_accumulation_steps)
      ->check(count_in(1, 10'000))
      ->capture_default_str();
  t->add_option("--learning_rate", f.learning_rate)
      ->check(number_in(0, 1e4, true))
      ->capture_default_str();
  t->add_option("--lr_scheduler", f.lr_scheduler, "diffusers' get_scheduler names")
      ->capture_default_str();
  t->add_option("--lr_warmup_steps", f.lr_warmup_steps)
      ->check(count_in(0, 100'000'000))
      ->capture_default_str();
  t->add_option("--lr_num_cycles", f.lr_num_cycles, "cosine_with_restarts' cycles")
      ->check(count_in(1, 1000))
      ->capture_default_str();
  t->add_option("--adam_beta1", f.adam_beta1)->check(number_in(0, 1))->capture_default_str();
  t->add_option("--adam_beta2", f.adam_beta2)->check(number_in(0, 1))->capture_default_str();
  t->add_option("--adam_weight_decay", f.adam_weight_decay)
      ->check(number_in(0, 1e3))
      ->capture_default_str();
  t->add_option("--adam_epsilon", f.adam_epsilon)
      ->check(number_in(0, 1, true))
      ->capture_default_str();
  t->add_option("--optimizer_type", f.optimizer_type,
                "AdamW, Adam, AdamW8bit, SGD, SGDNesterov, Lion, Prodigy, Adafactor, CAME or "
                "AdamWScheduleFree (kohya's names; the --adam_* flags apply where the optimizer "
                "has them)")
      ->capture_default_str();
  t->add_option("--optimizer_args", f.optimizer_args,
                "the optimizer's settings as key=value (kohya's: weight_decay=0.01 "
                "betas=0.9,0.99 d_coef=2 relative_step=False ...)")
      ->expected(1, -1);
  t->add_flag("--use_8bit_adam", f.use_8bit_adam,
              "AdamW with 8-bit moments (diffusers' flag; --optimizer_type AdamW8bit)");
  auto* c = g.saving;
  c->add_option("--checkpointing_steps", f.checkpointing_steps)
      ->check(count_in(1, 100'000'000))
      ->capture_default_str();
  c->add_option("--checkpoints_total_limit", f.checkpoints_total_limit)
      ->check(count_in(1, 100'000))
      ->capture_default_str();
  c->add_option("--resume_from_checkpoint", f.resume_from_checkpoint,
                "a checkpoint file or \"latest\"");
  c->add_option("--validation_prompt", f.validation_prompts,
                "prompt of the validation images (repeatable)");
  c->add_option("--num_validation_images", f.num_validation_images, "images per prompt")
      ->check(count_in(1, 64))
      ->capture_default_str();
  c->add_option("--validation_steps", f.validation_steps,
                "validation images to TensorBoard every N steps (0: at the end only)")
      ->check(count_in(0, 100'000'000))
      ->capture_default_str();
  c->add_option("--num_inference_steps", f.num_inference_steps)
      ->check(count_in(1, 1000))
      ->capture_default_str();
  c->add_option("--guidance_scale", f.guidance_scale)
      ->check(number_in(0, 100))
      ->capture_default_str();
  c->add_option("--stop_at", f.stop_at,
                "stop with a checkpoint after this step, as Ctrl-C does (0: never)")
      ->check(count_in(0, 100'000'000));
  return g;
}

/// Adds ImageFolderFlags' options (and --max_train_samples, `limit`) to `g`'s groups and a new
/// "images" group, which it returns for the program's own image flags.
inline CLI::Option_group* add_image_folder_flags(CLI::App& app, const SdFlagGroups& g,
                                                 ImageFolderFlags& f, std::int64_t& limit,
                                                 const std::string& resolution_help) {
  g.run->add_option("--image_column", f.image_column, "metadata file's image column")
      ->capture_default_str();
  g.run->add_option("--caption_column", f.caption_column, "metadata file's caption column")
      ->capture_default_str();
  g.run->add_option("--max_train_samples", limit, "use only the first N images (0: all)")
      ->check(count_in(0, 100'000'000));
  g.run->add_flag("--require_captions", f.require_captions,
                  "refuse images without a caption of their own (else their file name stands in)");
  g.training->add_option("--max_grad_norm", f.max_grad_norm)
      ->check(number_in(0, 1e9, true))
      ->capture_default_str();
  auto* img = app.add_option_group("images");
  img->add_option("--resolution", f.resolution, resolution_help)
      ->check(count_in(8, 8192))
      ->capture_default_str();
  img->add_flag("--center_crop", f.center_crop, "crop the center (default: a random crop)");
  img->add_flag("--random_flip", f.random_flip, "mirror half the images");
  return img;
}

/// Adds LoraFlags' options to the training group; `instead_of` names what full training trains.
/// --save_format and --save_precision; `layout` says whose single-file layout is written.
inline void add_single_file_save_flags(const SdFlagGroups& g, SingleFileSaveFlags& f,
                                       const std::string& layout) {
  g.saving
      ->add_option(
          "--save_format", f.save_format,
          "a full fine-tune as a diffusers folder, or single_file: one .safetensors in " + layout)
      ->capture_default_str();
  g.saving
      ->add_option("--save_precision", f.save_precision, "single_file's dtype: fp32, fp16 or bf16")
      ->capture_default_str();
}

/// The save flags name known values, and a single file is a full fine-tune's.
inline void check_single_file_save_flags(const SingleFileSaveFlags& f, bool use_lora) {
  if (f.save_format != "diffusers" && f.save_format != "single_file")
    throw ConfigError("is '" + f.save_format + "'; the formats are diffusers and single_file",
                      "--save_format");
  if (f.save_format == "single_file" && use_lora)
    throw ConfigError(
        "writes a full fine-tune as one file; a LoRA run writes its LoRA files (drop --use_lora "
        "or --save_format)",
        "--save_format single_file");
  if (f.save_precision != "fp32" && f.save_precision != "fp16" && f.save_precision != "bf16")
    throw ConfigError("is '" + f.save_precision + "'; the precisions are fp32, fp16 and bf16",
                      "--save_precision");
}

inline void add_lora_flags(const SdFlagGroups& g, LoraFlags& f, const std::string& instead_of) {
  g.training->add_flag("--use_lora", f.use_lora, "train LoRA branches, not the " + instead_of);
  g.training->add_option("--rank", f.rank, "LoRA rank")
      ->check(count_in(1, 4096))
      ->capture_default_str();
  g.training->add_option("--lora_alpha", f.lora_alpha, "LoRA alpha (0: the rank)")
      ->check(number_in(0, 1e6))
      ->capture_default_str();
  g.training
      ->add_option("--loraplus_lr_ratio", f.loraplus_lr_ratio,
                   "LoRA+: the B matrices at this many times the learning rate (0: off)")
      ->check(number_in(0, 1e6))
      ->capture_default_str();
  g.training
      ->add_option("--loraplus_unet_lr_ratio", f.loraplus_unet_lr_ratio,
                   "LoRA+ for the " + instead_of + "'s branches alone")
      ->check(number_in(0, 1e6));
  g.training
      ->add_option("--loraplus_text_encoder_lr_ratio", f.loraplus_text_encoder_lr_ratio,
                   "LoRA+ for the text encoders' branches alone")
      ->check(number_in(0, 1e6));
  g.training->add_flag("--use_dora", f.use_dora,
                       "DoRA: weight-decomposed LoRA branches (PEFT's use_dora)");
  g.training
      ->add_option("--dora_wd_on_output", f.dora_wd_on_output,
                   "DoRA's norm per output row (true: PEFT, diffusers, LyCORIS, ComfyUI) or per "
                   "input column (false: the web UI's form; kohya's file only)")
      ->capture_default_str();
}

/// LoRA+ and DoRA go with LoRA.
inline void check_loraplus_flags(const LoraFlags& f) {
  if (!f.use_lora && (f.loraplus_lr_ratio > 0 || f.loraplus_unet_lr_ratio > 0 ||
                      f.loraplus_text_encoder_lr_ratio > 0))
    throw ConfigError("is for LoRA branches; add --use_lora", "--loraplus_lr_ratio");
  if (!f.use_lora && f.use_dora)
    throw ConfigError("is for LoRA branches; add --use_lora", "--use_dora");
  if (!f.use_dora && !f.dora_wd_on_output)
    throw ConfigError("sets DoRA's axis; add --use_dora", "--dora_wd_on_output");
}

/// The trainer's optimizer from the flags (tr::OptimizerByName: --optimizer_type, --optimizer_args,
/// --use_8bit_adam, the --adam_* flags), `lr` the (scaled) rate.
template <class Options>
void set_optimizer_fields(Options& o, const SdRunFlags& f, double lr) {
  o.optimizer.lr = lr;
  o.optimizer.beta1 = f.adam_beta1;
  o.optimizer.beta2 = f.adam_beta2;
  o.optimizer.eps = f.adam_epsilon;
  o.optimizer.weight_decay = f.adam_weight_decay;
  o.optimizer.type = f.optimizer_type;
  o.optimizer.args = f.optimizer_args;
  if (f.use_8bit_adam) {
    if (f.optimizer_type != "AdamW")
      throw ConfigError(
          "names an optimizer; --optimizer_type " + f.optimizer_type + " names another",
          "--use_8bit_adam");
    o.optimizer.type = "AdamW8bit";
  }
}

/// The optimizer policy the flags choose, by its name (results.json's "optimizer").
inline std::string chosen_optimizer(const SdRunFlags& f) {
  struct Probe {
    tr::OptimizerByName::Options optimizer;
  } probe;
  set_optimizer_fields(probe, f, 1.0);
  return tr::OptimizerByName::chosen_name(probe.optimizer);
}

/// Refuses what these programs cannot do, naming the flag, before anything is loaded.
inline void check_sd_run_flags(SdRunFlags& f) {
  // The schedule is made with the trainer, after the models load: its name is checked here, with
  // the other flags, and named as the flag.
  try {
    (void)difftrain::schedule::get_scheduler(
        f.lr_scheduler, {.step_rules = "1:1", .num_warmup_steps = 0, .num_training_steps = 1});
  } catch (const difftrain::ConfigError& e) {
    if (e.where() == "get_scheduler name") throw ConfigError(e.message(), "--lr_scheduler");
  }
  // The optimizer, its settings and --use_8bit_adam, on a stand-in parameter: a misspelt name or
  // setting is refused now, not after the models load.
  {
    struct Probe {
      tr::OptimizerByName::Options optimizer;
    } probe;
    set_optimizer_fields(probe, f, 1e-4);
    tr::ParamGroup one;
    one.params = {at::zeros({1}).requires_grad_()};
    (void)tr::OptimizerByName::make({one}, probe.optimizer);
  }
  if (f.report_to == "none")
    f.no_tensorboard = true;
  else if (f.report_to != "tensorboard")
    throw ConfigError("is '" + f.report_to + "'; this program reports to tensorboard or none",
                      "--report_to");
  if (f.mixed_precision != "no" && f.mixed_precision != "bf16" && f.mixed_precision != "fp16")
    throw ConfigError("is '" + f.mixed_precision + "'; choose no, bf16 or fp16",
                      "--mixed_precision");
  if (!f.validation_prompts.empty())
    for (const auto& prompt : f.validation_prompts)
      if (prompt.empty()) throw ConfigError("is empty", "--validation_prompt");
}

/// diffusers' rule: --max_train_steps when given, else epochs × optimizer steps per epoch
/// (micro-batches per epoch ÷ accumulation, rounded up). Says what it chose when `say` (rank 0 of
/// a distributed run says it for all).
inline void resolve_max_train_steps(SdRunFlags& f, std::int64_t micro_batches_per_epoch,
                                    bool say = true) {
  if (micro_batches_per_epoch < 1)
    throw ConfigError(
        "leave no batch of " + std::to_string(f.train_batch_size) + " in an epoch (too few images)",
        "--train_data_dir / --train_batch_size");
  const std::int64_t per_epoch =
      (micro_batches_per_epoch + f.gradient_accumulation_steps - 1) / f.gradient_accumulation_steps;
  if (f.max_train_steps == 0) f.max_train_steps = f.num_train_epochs * per_epoch;
  if (say)
    std::fprintf(stderr, "%lld optimizer steps (%lld per epoch, %.2f epochs)\n",
                 static_cast<long long>(f.max_train_steps), static_cast<long long>(per_epoch),
                 static_cast<double>(f.max_train_steps) / static_cast<double>(per_epoch));
}

/// As argparse: a flag given twice takes its last value (a command line a script extends); the
/// repeatable --validation_prompt and the lists (--optimizer_args, --block_dims, --block_alphas)
/// keep all.
inline void last_value_wins(const std::vector<CLI::App*>& groups) {
  for (auto* group : groups)
    for (auto* opt : group->get_options())
      if (const std::string n = opt->get_name();
          n != "--validation_prompt" && n != "--optimizer_args" && n != "--block_dims" &&
          n != "--block_alphas" && n != "--conv_block_dims" && n != "--conv_block_alphas" &&
          n != "--network_args")
        opt->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
}

/// The trainer's optimizer and learning-rate schedule from the flags, `lr` the (scaled) rate.
template <class Options>
void set_optimizer_and_schedule(Options& o, const SdRunFlags& f, double lr) {
  set_optimizer_fields(o, f, lr);
  o.schedule.lr_scheduler = f.lr_scheduler;
  o.schedule.args.num_warmup_steps = std::min(f.lr_warmup_steps, f.max_train_steps);
  o.schedule.args.num_training_steps = f.max_train_steps;
  // diffusers' get_scheduler passes num_cycles to cosine_with_restarts only ("cosine" keeps half
  // a period).
  if (f.lr_scheduler == "cosine_with_restarts") o.schedule.args.num_cycles = f.lr_num_cycles;
  o.accumulation_steps = f.gradient_accumulation_steps;
  if constexpr (requires { o.precision.mixed_precision; })
    o.precision.mixed_precision = f.mixed_precision;
}

inline ValidationOptions validation_options(const SdRunFlags& f, std::int64_t resolution) {
  return {.prompts = f.validation_prompts,
          .images_per_prompt = f.num_validation_images,
          .resolution = resolution,
          .num_inference_steps = f.num_inference_steps,
          .guidance_scale = f.guidance_scale,
          .seed = f.seed};
}

struct RunFolders {
  fs::path checkpoints, tensorboard;
  bool resume = false;
};

/// The run's folders. A fresh run into a folder with checkpoints is refused (they would be
/// replaced); a fresh run starts a fresh TensorBoard folder (one named with --logging_dir is left
/// as it is: it may hold other runs), which `main` (rank 0 of a distributed run, or the one
/// process) clears while the other ranks only check.
inline RunFolders prepare_run_folders(const SdRunFlags& f, bool main = true) {
  RunFolders r{fs::path(f.out) / "checkpoints", f.tensorboard_folder(),
               !f.resume_from_checkpoint.empty()};
  if (!r.resume && !tr::CheckpointEvery::list(r.checkpoints).empty())
    throw ConfigError(
        "holds checkpoints of an earlier run; pass --resume_from_checkpoint latest to continue "
        "it, or choose another --output_dir",
        r.checkpoints.string());
  if (main && !r.resume && !r.tensorboard.empty() && f.tensorboard.empty())
    difftrain::io::remove_tree(r.tensorboard);
  return r;
}

inline tr::ProgressBar progress_bar(const SdRunFlags& f) {
  return tr::ProgressBar({.total_steps = f.max_train_steps,
                          .every = 10,
                          .lines_every = std::max<std::int64_t>(1, f.max_train_steps / 10)});
}

inline tr::CheckpointEvery checkpoint_every(const SdRunFlags& f, const RunFolders& r) {
  return tr::CheckpointEvery({.dir = r.checkpoints,
                              .every = f.checkpointing_steps,
                              .keep_last = static_cast<std::size_t>(f.checkpoints_total_limit)});
}

/// Validation images into TensorBoard every --validation_steps (never without prompts).
inline tr::SampleEvery<Validation> validation_every(const SdRunFlags& f, Validation v) {
  return tr::SampleEvery<Validation>(f.validation_steps > 0 && !f.validation_prompts.empty()
                                         ? f.validation_steps
                                         : std::numeric_limits<std::int64_t>::max(),
                                     v, "validation", {.columns = f.num_validation_images});
}

/// With --resume_from_checkpoint: loads the named file (no fallback: it was named on purpose) or
/// the newest checkpoint that loads ("latest"; torn or unreadable ones are skipped with a note).
/// Returns the step the run continues from (0 for a fresh run).
template <class Trainer>
std::int64_t resume_if_asked(Trainer& trainer, const SdRunFlags& f, const RunFolders& r) {
  if (!r.resume) return 0;
  std::optional<fs::path> from;
  std::vector<std::string> skipped;
  if (f.resume_from_checkpoint != "latest") {
    trainer.load_checkpoint(f.resume_from_checkpoint);
    from = fs::path(f.resume_from_checkpoint);
  } else {
    from = tr::resume_latest(trainer, r.checkpoints, &skipped);
  }
  for (const auto& why : skipped) std::fprintf(stderr, "resume: skipped %s\n", why.c_str());
  if (!from)
    throw ConfigError("holds no readable checkpoint to resume from", r.checkpoints.string());
  std::fprintf(stderr, "resume: continuing from %s (step %lld)\n", from->string().c_str(),
               static_cast<long long>(trainer.global_step()));
  return trainer.global_step();
}

struct FitResult {
  bool finished = false;
  double seconds = 0;
};

/// Trains to --max_train_steps with `source(place)` giving micro-batch number `place` of the run;
/// Ctrl-C (or --stop_at) stops after the step, with a checkpoint.
template <class Trainer, class Source>
FitResult fit_until_done_or_stopped(Trainer& trainer, const SdRunFlags& f, Source&& source) {
  std::signal(SIGINT, on_sigint);
  const auto t0 = std::chrono::steady_clock::now();
  trainer.fit(
      [&](std::int64_t step, std::int64_t micro) {
        return source(step * f.gradient_accumulation_steps + micro);
      },
      f.max_train_steps);
  FitResult r{trainer.global_step() >= f.max_train_steps, seconds_since(t0)};
  std::signal(SIGINT, SIG_DFL);
  // What the program samples and saves: a schedule-free optimizer's average weights.
  if constexpr (requires { trainer.use_evaluation_weights(); })
    if (r.finished) trainer.use_evaluation_weights();
  if (!r.finished) {
    std::get<tr::CheckpointEvery>(trainer.callbacks()).save(trainer);
    std::fprintf(stderr,
                 "stopped at step %lld; checkpoint saved, rerun with "
                 "--resume_from_checkpoint latest to continue\n",
                 static_cast<long long>(trainer.global_step()));
  }
  return r;
}

/// What the closing line says the run wrote into `out`: the files `files` names (results.json's
/// "files") and results.json; a stopped run wrote no trained weights, only its checkpoint, and
/// the line says so rather than naming files it did not write.
inline std::string written_files(const fs::path& out, const nlohmann::json& files, bool finished) {
  std::string list;
  for (const auto& [key, value] : files.items()) {
    if (!value.is_string()) continue;
    const std::string name = value.get<std::string>();
    list += (list.empty() ? "" : ", ") + (name == "." ? std::string("the pipeline folder") : name);
  }
  list += std::string(list.empty() ? "" : ", ") + "results.json";
  std::string line = "wrote " + out.string() + ": " + list;
  if (!finished)
    line += " (stopped early: the trained weights are only in " + (out / "checkpoints").string() +
            "; --resume_from_checkpoint latest continues)";
  return line;
}

/// validation.png (a row per prompt) and validation/image-N.png (each with its prompt).
inline void write_validation_images(const at::Tensor& images, const ValidationOptions& v,
                                    const fs::path& out) {
  fs::create_directories(out / "validation");
  for (std::int64_t i = 0; i < images.size(0); ++i)
    difftrain::io::write_png(
        out / "validation" / ("image-" + std::to_string(i) + ".png"),
        difftrain::io::image_grid(images.narrow(0, i, 1), {.columns = 1}),
        {{"Description", v.prompts[static_cast<std::size_t>(i / v.images_per_prompt)]}});
  difftrain::io::write_png(
      out / "validation.png",
      difftrain::io::image_grid(images, {.columns = v.images_per_prompt, .padding = 2}),
      {{"Description", "one row per validation prompt"}});
}

/// results.json: the run's settings and `extra`, written atomically.
inline void write_results(const fs::path& out, const nlohmann::json& results) {
  const std::string text = results.dump(2) + "\n";
  difftrain::io::write_file_atomic(out / "results.json",
                                   std::span<const char>(text.data(), text.size()));
}

}  // namespace examples::sd
