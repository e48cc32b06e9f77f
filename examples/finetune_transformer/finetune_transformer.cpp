// Fine-tuning a Stable Diffusion 3 / 3.5 transformer on a folder of captioned images, as diffusers'
// train_dreambooth_lora_sd3.py and train_dreambooth_sd3.py do, or a CogVideoX transformer on
// captioned videos, as train_cogvideox_lora.py does, with their flag names. The pipeline folder's
// model_index.json says which:
//
// StableDiffusion3Pipeline: the transformer, the VAE, two CLIP encoders with projection,
// optionally T5, their tokenizers and the flow-matching scheduler; an image folder
// (metadata.jsonl/csv, sidecar captions, file names or kohya's N_name folders); either LoRA on the
// transformer's attention projections of both streams (--use_lora) or full fine-tuning.
//
//   finetune_transformer --pretrained_model_name_or_path SD3 --train_data_dir IMAGES
//                        --output_dir OUT [--use_lora --rank 4] [--weighting_scheme logit_normal]
//
// Training is SD3's rectified flow: σ drawn by --weighting_scheme's density (logit-normal, mode or
// uniform) and looked up in the scheduler's shifted table, x_σ = (1 − σ)·x₀ + σ·ε, the loss
// weighted by sigma_sqrt or cosmap when asked, against x₀ with --precondition_outputs (diffusers'
// default) or ε − x₀. Captions are encoded once each by the frozen text encoders
// (encode_prompt_sd3, as the pipeline does; zeros in place of T5 when the pipeline has none).
//
// CogVideoXPipeline: T5 and its tokenizer, the 3-D VAE, the transformer and CogVideoX's DDIM or
// DPM scheduler; a data folder (diffusers' --instance_data_root is --train_data_dir here) whose
// --caption_column and --video_column files list one caption and one video per line, a video being
// a folder of its frames (or one image); frames chosen as diffusers does (--skip_frames_start/end,
// --max_num_frames, then 4k + 1), resized to --height × --width. LoRA on the attention projections
// (to_q, to_k, to_v, to_out.0) or full fine-tuning with CogVideoX's v-prediction loss.
//
//   finetune_transformer --pretrained_model_name_or_path COGVIDEOX --train_data_dir VIDEOS
//                        --caption_column prompts.txt --video_column videos.txt
//                        --height 480 --width 720 --output_dir OUT [--use_lora --rank 128]
//
// What it writes to --output_dir:
//   --use_lora   pytorch_lora_weights.safetensors (PEFT keys under transformer. with diffusers'
//                adapter metadata: the pipeline's load_lora_weights reads it);
//   full         the pipeline folder with the trained transformer/;
//   always       checkpoints/ (every --checkpointing_steps; --resume_from_checkpoint),
//                tensorboard/, validation/ (images, or every frame of each video, of
//                --validation_prompt), validation.png and results.json.
// Ctrl-C stops after the current step and saves a checkpoint.
//
// Under torchrun (`torchrun --nproc-per-node N --no-python finetune_transformer ...`) every rank
// trains on its own batches (rank r takes batches r, r + N, ... of the epoch order), the
// gradients are averaged, and --sharding 1|2|3 shards the optimizer state, the gradients and the
// trained parameters (each transformer block a unit) as ZeRO and FSDP do; rank 0 validates and
// writes the outputs.

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
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "../common/cli_checks.hpp"
#include "../common/run_skeleton.hpp"
#include "../common/scheduler_config.hpp"
#include "../common/sd_pipeline.hpp"
#include "../common/sd_run.hpp"
#include "../common/sd_torchrun.hpp"

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

struct Settings : SdRunFlags, ImageFolderFlags, LoraFlags, TorchrunFlags {
  std::string weighting_scheme = "logit_normal";
  double logit_mean = 0.0, logit_std = 1.0, mode_scale = 1.29;
  bool precondition_outputs = true;
  std::int64_t max_sequence_length = 77;
  // CogVideoX folders (diffusers' train_cogvideox_lora.py flags).
  std::string video_column = "video";
  std::int64_t height = 480, width = 720, max_num_frames = 49;
  std::int64_t skip_frames_start = 0, skip_frames_end = 0;
  Settings() {
    out = "runs/finetune_transformer";
    learning_rate = 1e-4;
    guidance_scale = 5.0;
  }
};

// ---- the pipeline folder ------------------------------------------------------------------------

/// A StableDiffusion3Pipeline folder's components, read and checked before any work.
struct Sd3Pipeline {
  fs::path root;
  std::optional<text::CLIPTokenizer> tokenizer, tokenizer_2;
  std::optional<text::T5Tokenizer> tokenizer_3;
  Clip text_encoder{nullptr}, text_encoder_2{nullptr};
  T5 text_encoder_3{nullptr};  // null: the pipeline has no T5
  Vae vae{nullptr};
  Transformer transformer{nullptr};
  df::FlowMatchEuler::Options flow;

  [[nodiscard]] text::SD3TextEncoders<Clip, Clip, T5> encoders() {
    return {*tokenizer,
            text_encoder,
            *tokenizer_2,
            text_encoder_2,
            tokenizer_3 ? &*tokenizer_3 : nullptr,
            text_encoder_3 ? &text_encoder_3 : nullptr,
            transformer->config().joint_attention_dim};
  }
};

/// FlowMatchEulerDiscreteScheduler's config: the training table's length and shift.
df::FlowMatchEuler::Options read_flow_scheduler(const fs::path& file) {
  const nlohmann::json j = dt::io::read_json_object(file);
  const std::string cls = j.value("_class_name", std::string());
  if (cls != "FlowMatchEulerDiscreteScheduler")
    throw ConfigError("is a " + cls + "; SD3 trains with FlowMatchEulerDiscreteScheduler",
                      file.string() + ": _class_name");
  df::FlowMatchEuler::Options o;
  try {
    o.num_train_timesteps = j.value("num_train_timesteps", o.num_train_timesteps);
    o.shift = j.value("shift", o.shift);
    if (j.value("use_dynamic_shifting", false))
      throw ConfigError("is true; this program trains with a fixed shift (SD3's, SD3.5's)",
                        file.string() + ": use_dynamic_shifting");
  } catch (const nlohmann::json::exception& e) {
    throw ConfigError(std::string("a field has the wrong type: ") + e.what(), file.string());
  }
  return o;
}

Sd3Pipeline load_sd3_pipeline(const std::string& model) {
  Sd3Pipeline p;
  p.root = model;
  if (!fs::is_directory(p.root))
    throw dt::IoError("is not a folder (name a diffusers pipeline folder)",
                      "--pretrained_model_name_or_path " + model);
  const fs::path index_file = p.root / "model_index.json";
  const nlohmann::json index = dt::io::read_json_object(index_file);
  const std::string cls = index.value("_class_name", std::string());
  if (cls != "StableDiffusion3Pipeline")
    throw ConfigError("is a " + (cls.empty() ? std::string("pipeline without _class_name") : cls) +
                          "; this program trains StableDiffusion3Pipeline and CogVideoXPipeline "
                          "folders",
                      index_file.string() + ": _class_name");
  check_component(index, "transformer", {"SD3Transformer2DModel"}, index_file);
  check_component(index, "vae", {"AutoencoderKL"}, index_file);
  for (const char* name : {"text_encoder", "text_encoder_2"})
    check_component(index, name, {"CLIPTextModelWithProjection"}, index_file);
  for (const char* name : {"tokenizer", "tokenizer_2"})
    check_component(index, name, {"CLIPTokenizer", "CLIPTokenizerFast"}, index_file);
  check_component(index, "scheduler", {"FlowMatchEulerDiscreteScheduler"}, index_file);
  // T5 is optional (diffusers' text_encoder_3=None): [null, null] in model_index.json.
  const bool t5 = index.contains("text_encoder_3") && index["text_encoder_3"].is_array() &&
                  !index["text_encoder_3"].empty() && !index["text_encoder_3"][0].is_null();
  if (t5) {
    check_component(index, "text_encoder_3", {"T5EncoderModel"}, index_file);
    check_component(index, "tokenizer_3", {"T5TokenizerFast", "T5Tokenizer"}, index_file);
  }
  p.flow = read_flow_scheduler(p.root / "scheduler" / "scheduler_config.json");
  p.tokenizer.emplace(text::CLIPTokenizer::from_folder(p.root / "tokenizer"));
  p.tokenizer_2.emplace(text::CLIPTokenizer::from_folder(p.root / "tokenizer_2"));
  p.text_encoder = models::from_pretrained<Clip>(p.root / "text_encoder");
  p.text_encoder_2 = models::from_pretrained<Clip>(p.root / "text_encoder_2");
  if (t5) {
    p.tokenizer_3.emplace(text::T5Tokenizer::from_folder(p.root / "tokenizer_3"));
    p.text_encoder_3 = models::from_pretrained<T5>(p.root / "text_encoder_3");
  }
  p.vae = models::from_pretrained<Vae>(p.root / "vae");
  p.transformer = models::from_pretrained<Transformer>(p.root / "transformer");
  if (p.transformer->config().in_channels != p.vae->config().latent_channels)
    throw ConfigError("takes " + std::to_string(p.transformer->config().in_channels) +
                          " channels but the VAE's latents have " +
                          std::to_string(p.vae->config().latent_channels),
                      (p.root / "transformer").string());
  return p;
}

// ---- the trainee --------------------------------------------------------------------------------

/// The transformer with SD3's rectified-flow loss on latents.
struct Sd3TraineeImpl : torch::nn::Module {
  struct Batch {
    at::Tensor latents, embeds, pooled;
    [[nodiscard]] std::int64_t size() const { return latents.size(0); }
    [[nodiscard]] Batch slice(std::int64_t start, std::int64_t length) const {
      return {latents.narrow(0, start, length), embeds.narrow(0, start, length),
              pooled.narrow(0, start, length)};
    }
  };
  Sd3TraineeImpl(Transformer t, const df::FlowMatchEuler::Options& flow, const Settings& s)
      : transformer(register_module("transformer", t)), flow_(flow), s_(s) {
    const std::string& w = s.weighting_scheme;
    density_ = w == "logit_normal" ? df::TimestepDensity::logit_normal
               : w == "mode"       ? df::TimestepDensity::mode
                                   : df::TimestepDensity::uniform;
    weighting_ = w == "sigma_sqrt" ? df::Sd3Weighting::sigma_sqrt
                 : w == "cosmap"   ? df::Sd3Weighting::cosmap
                                   : df::Sd3Weighting::none;
  }
  at::Tensor loss(const Batch& b) {
    const at::Tensor& x0 = b.latents;
    const std::int64_t n = x0.size(0), steps = flow_.options().num_train_timesteps;
    const at::Tensor noise = at::randn_like(x0);
    // diffusers' compute_density_for_timestep_sampling, then indices = ⌊u · N⌋ into the
    // scheduler's (shifted) table.
    const at::Tensor u = df::density_for_timestep_sampling(
        density_, n,
        {.logit_mean = s_.logit_mean, .logit_std = s_.logit_std, .mode_scale = s_.mode_scale});
    const at::Tensor idx = (u * static_cast<double>(steps)).to(at::kLong).clamp(0, steps - 1);
    const at::Tensor sigmas = flow_.sigmas_for(idx).to(x0.device()).view({n, 1, 1, 1});
    const at::Tensor noisy = flow_.noisy_input(x0, noise, sigmas);
    at::Tensor pred =
        transformer->forward(noisy, b.embeds, b.pooled, flow_.timesteps_for(idx).to(x0.device()))
            .to(at::kFloat);
    at::Tensor target;
    if (s_.precondition_outputs) {  // the prediction turned into x̂₀
      pred = pred * (-sigmas) + noisy.to(at::kFloat);
      target = x0.to(at::kFloat);
    } else {
      target = flow_.target(x0, noise).to(at::kFloat);
    }
    const at::Tensor w = df::sd3_loss_weighting(weighting_, sigmas.to(at::kFloat));
    return (w * (pred - target).square()).reshape({n, -1}).mean(1).mean();
  }
  Transformer transformer{nullptr};

 private:
  df::FlowMatchEuler flow_;
  const Settings& s_;
  df::TimestepDensity density_;
  df::Sd3Weighting weighting_;
};

struct Sd3Config : tr::DefaultConfig {
  using Optimizer = tr::AdamW;
  using Precision = tr::PrecisionByName;  // --mixed_precision
  using Schedule = dt::schedule::ByName;  // --lr_scheduler, diffusers' names
  using Clipping = tr::ClipByNorm;
  // --sharding picks the stage at run time; 0 is DataParallel itself (one process without
  // torchrun).
  using Parallel = dt::distributed::ShardedDataParallel;
  using Callbacks = std::tuple<tr::ProgressBar, tr::CheckpointEvery, tr::TensorBoard,
                               StopOnInterrupt, LossRecord>;
};

// ---- text and images ----------------------------------------------------------------------------

/// Each caption's conditioning, encoded once by the frozen encoders.
class CaptionConditioning {
 public:
  CaptionConditioning(Sd3Pipeline& p, const Settings& s) : p_(p), s_(s) {}
  /// (embeds, pooled) for `captions`, stacked, on `device`.
  std::pair<at::Tensor, at::Tensor> operator()(const std::vector<std::string>& captions,
                                               at::Device device) {
    for (const auto& c : captions) {
      if (known_.contains(c)) continue;
      // One caption at a time: a matrix product's last bits depend on the batch it is in, and a
      // resumed run meets its captions in other batches than the uninterrupted one.
      at::NoGradGuard no_grad;
      text::SD3PromptOptions o;
      o.do_classifier_free_guidance = false;
      o.max_sequence_length = s_.max_sequence_length;
      const text::EncodedPrompt e = text::encode_prompt_sd3(p_.encoders(), {c}, o);
      known_[c] = {e.prompt_embeds[0].cpu(), e.pooled_prompt_embeds[0].cpu()};
    }
    std::vector<at::Tensor> embeds, pooled;
    for (const auto& c : captions) {
      embeds.push_back(known_.at(c).first);
      pooled.push_back(known_.at(c).second);
    }
    return {at::stack(embeds).to(device), at::stack(pooled).to(device)};
  }

 private:
  Sd3Pipeline& p_;
  const Settings& s_;
  std::map<std::string, std::pair<at::Tensor, at::Tensor>> known_;
};

/// The run's batches as a function of the micro-batch's place in the run (a resumed run sees the
/// batches the uninterrupted one would have).
class BatchStream {
 public:
  BatchStream(const Settings& s, Sd3Pipeline& p, const data::ImageFolder& folder,
              const data::BucketManager& buckets, at::Device device)
      : s_(s), p_(p), folder_(folder), buckets_(buckets), text_(p, s), device_(device) {
    std::vector<data::Bucket> assigned;
    std::vector<std::int64_t> repeats;
    for (const auto& r : folder.images) {
      assigned.push_back(buckets.select(r.width, r.height).bucket);
      repeats.push_back(r.repeats);
    }
    per_epoch_ = data::bucket_batches(assigned, repeats,
                                      static_cast<std::size_t>(s.train_batch_size), s.seed, 0)
                     .size();
  }
  [[nodiscard]] std::size_t batches_per_epoch() const { return per_epoch_; }

  Sd3TraineeImpl::Batch at_place(std::int64_t place) {
    const auto epoch = static_cast<std::uint64_t>(place) / per_epoch_;
    const auto pos = static_cast<std::size_t>(static_cast<std::uint64_t>(place) % per_epoch_);
    if (!pixels_ || epoch != epoch_ || pixels_->position() != pos) {
      data::ImageBatchOptions o;
      o.batch_size = static_cast<std::size_t>(s_.train_batch_size);
      o.random_crop = !s_.center_crop;
      o.flip_p = s_.random_flip ? 0.5 : 0.0;
      o.seed = s_.seed;
      o.workers = static_cast<std::size_t>(s_.dataloader_num_workers);
      o.pin_memory = device_.is_cuda();
      pixels_.emplace(folder_, buckets_, o, epoch, pos);
    }
    epoch_ = epoch;
    data::ImageBatch i = *pixels_->next();
    Sd3TraineeImpl::Batch b;
    {
      at::NoGradGuard no_grad;
      b.latents = p_.vae->encode_latents(i.pixels.to(device_, /*non_blocking=*/true));
    }
    std::tie(b.embeds, b.pooled) = text_(i.captions, device_);
    return b;
  }
  CaptionConditioning& text() { return text_; }

 private:
  const Settings& s_;
  Sd3Pipeline& p_;
  const data::ImageFolder& folder_;
  const data::BucketManager& buckets_;
  CaptionConditioning text_;
  at::Device device_;
  std::size_t per_epoch_ = 1;
  std::uint64_t epoch_ = 0;
  std::optional<data::ImageBatches> pixels_;
};

/// Images of the validation prompts: flow-matching Euler with classifier-free guidance against
/// the empty prompt, as StableDiffusion3Pipeline samples, decoded by the VAE (in [−1, 1], CPU).
at::Tensor validation_images(Sd3Pipeline& p, const Settings& s, at::Device device) {
  at::NoGradGuard no_grad;
  const bool was_training = p.transformer->is_training();
  p.transformer->eval();
  std::vector<std::string> prompts;
  for (const auto& prompt : s.validation_prompts)
    for (std::int64_t k = 0; k < s.num_validation_images; ++k) prompts.push_back(prompt);
  text::SD3PromptOptions o;
  o.max_sequence_length = s.max_sequence_length;
  const text::EncodedPrompt e = text::encode_prompt_sd3(p.encoders(), prompts, o);
  const auto n = static_cast<std::int64_t>(prompts.size());
  // Rows 0..n−1 the prompts, n..2n−1 the empty prompt: the sampler's conditioning is the row.
  const at::Tensor embeds = at::cat({e.prompt_embeds, e.negative_prompt_embeds}).to(device);
  const at::Tensor pooled =
      at::cat({e.pooled_prompt_embeds, e.negative_pooled_prompt_embeds}).to(device);
  const at::Tensor rows = at::arange(n, at::TensorOptions().dtype(at::kLong).device(device));
  const std::int64_t side = s.resolution / p.vae->downscale();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(s.seed + 7);
  const at::Tensor noise =
      at::randn({n, p.transformer->config().in_channels, side, side}, gen).to(device);
  df::FlowMatchEuler sampler(p.flow);
  const at::Tensor z = df::sample(
      sampler,
      [&](const at::Tensor& x, const at::Tensor& t, const at::Tensor& row) {
        return p.transformer->forward(x, embeds.index_select(0, row), pooled.index_select(0, row),
                                      t);
      },
      noise,
      {.num_inference_steps = s.num_inference_steps,
       .guidance_scale = s.guidance_scale,
       .chunk_size = n},
      rows, rows + n);
  const at::Tensor images = p.vae->decode_latents(z).clamp(-1, 1).cpu();
  p.transformer->train(was_training);
  return images;
}

// ---- what both kinds of run write --------------------------------------------------------------

/// The trained transformer: with --use_lora, pytorch_lora_weights.safetensors (PEFT keys under
/// transformer. with diffusers' adapter metadata); otherwise the pipeline folder at `base` with the
/// trained transformer/.
template <class Transformer>
void save_trained_transformer(Transformer& transformer, const fs::path& base, const Settings& s,
                              nlohmann::json& files) {
  const fs::path out(s.out);
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
    models::save_pretrained(transformer, out / "transformer");
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
  results["first_loss"] = mean_of(losses, tenth, false);
  results["last_loss"] = mean_of(losses, tenth, true);
  results["train_seconds"] = fit.seconds;
  results["total_seconds"] = examples::seconds_since(t0);
  write_results(fs::path(s.out), results);
  std::printf("%s: %lld steps (loss %.4f → %.4f)%s\n",
              s.use_lora ? ("LoRA on " + std::to_string(lora_layers) + " layers").c_str()
                         : "full fine-tuning",
              static_cast<long long>(global_step), results["first_loss"].get<double>(),
              results["last_loss"].get<double>(), fit.finished ? "" : ", stopped early");
  return fit.finished ? 0 : 130;
}

// ---- the run ------------------------------------------------------------------------------------

void check_flags(const Settings& s) {
  const std::set<std::string> schemes{"sigma_sqrt", "logit_normal", "mode", "cosmap", "none"};
  if (!schemes.contains(s.weighting_scheme))
    throw ConfigError("is '" + s.weighting_scheme +
                          "'; diffusers' schemes are sigma_sqrt, logit_normal, mode, cosmap, none",
                      "--weighting_scheme");
  if (s.resolution % 8 != 0) throw ConfigError("must be a multiple of 8", "--resolution");
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

int run_sd3(Settings s, const Ranks& ranks) {
  const auto t0 = std::chrono::steady_clock::now();
  check_sd_run_flags(s);
  check_flags(s);
  examples::apply_threads(s);
  const bool main_rank = ranks.main();
  data::BucketOptions bo;  // diffusers' square: the shorter side resized, then cropped
  bo.max_width = bo.max_height = bo.min_size = bo.max_size = s.resolution;
  bo.steps = 8;
  bo.check("--resolution");
  const data::BucketManager buckets(bo);
  // The images first: a wrong folder or caption column is found before the models load.
  data::ImageFolderOptions fo;
  fo.image_column = s.image_column;
  fo.caption_column = s.caption_column;
  data::ImageFolder folder = data::scan_image_folder(s.data_dir, fo);
  if (main_rank)  // every rank scans the same folder; rank 0 reports it
    for (const auto& skipped : folder.skipped)
      std::fprintf(stderr, "skipped %s: %s\n", skipped.path.string().c_str(),
                   skipped.reason.c_str());
  if (s.limit > 0 && static_cast<std::int64_t>(folder.images.size()) > s.limit)
    folder.images.resize(static_cast<std::size_t>(s.limit));
  dt::io::ensure_writable_folder(s.out);
  tr::set_seed(s.seed);
  Sd3Pipeline p = load_sd3_pipeline(s.model);
  if (s.resolution % p.vae->downscale() != 0 ||
      (s.resolution / p.vae->downscale()) % p.transformer->config().patch_size != 0)
    throw ConfigError("must be a multiple of the VAE's downscale × the patch size (" +
                          std::to_string(p.vae->downscale() * p.transformer->config().patch_size) +
                          ")",
                      "--resolution");
  const at::Device device = ranks.device;

  // Frozen: the VAE and the text encoders; LoRA: the base transformer too.
  freeze(*p.vae);
  freeze(*p.text_encoder);
  freeze(*p.text_encoder_2);
  if (p.text_encoder_3) freeze(*p.text_encoder_3);
  std::vector<std::string> adapted;
  if (s.use_lora) {
    const double alpha = s.lora_alpha > 0 ? s.lora_alpha : static_cast<double>(s.rank);
    // diffusers' SD3 LoRA targets: both streams' attention projections.
    adapted = ad::inject_lora(*p.transformer,
                              {.target_modules = {"attn.add_k_proj", "attn.add_q_proj",
                                                  "attn.add_v_proj", "attn.to_add_out", "attn.to_k",
                                                  "attn.to_out.0", "attn.to_q", "attn.to_v"}},
                              {.rank = s.rank, .alpha = alpha});
  }
  for (torch::nn::Module* m : std::initializer_list<torch::nn::Module*>{
           p.vae.ptr().get(), p.text_encoder.ptr().get(), p.text_encoder_2.ptr().get()}) {
    m->to(device);
    m->eval();
  }
  if (p.text_encoder_3) {
    p.text_encoder_3->to(device);
    p.text_encoder_3->eval();
  }
  p.transformer->to(device);
  if (s.gradient_checkpointing) p.transformer->set_gradient_checkpointing(true);

  BatchStream stream(s, p, folder, buckets, device);
  resolve_max_train_steps(
      s, ranks.batches_each(stream.batches_per_epoch(), "--train_data_dir / --train_batch_size"),
      main_rank);
  Sd3TraineeImpl trainee(p.transformer, p.flow, s);
  trainee.train();
  using Trainer = tr::Trainer<Sd3TraineeImpl, Sd3Config>;
  Trainer::Options o;
  set_optimizer_and_schedule(o, s, s.learning_rate);
  o.clipping.max_norm = s.max_grad_norm;
  set_parallel(o, s, ranks.world);
  const RunFolders folders = prepare_run_folders(s, main_rank);
  const nlohmann::json run_settings = {
      {"pretrained_model_name_or_path", s.model},
      {"train_data_dir", s.data_dir},
      {"images", folder.images.size()},
      {"resolution", s.resolution},
      {"train_batch_size", s.train_batch_size},
      {"gradient_accumulation_steps", s.gradient_accumulation_steps},
      {"max_train_steps", s.max_train_steps},
      {"learning_rate", s.learning_rate},
      {"lr_scheduler", s.lr_scheduler},
      {"use_lora", s.use_lora},
      {"rank", s.rank},
      {"weighting_scheme", s.weighting_scheme},
      {"precondition_outputs", s.precondition_outputs},
      {"shift", p.flow.shift},
      {"t5", static_cast<bool>(p.text_encoder_3)},
      {"mixed_precision", s.mixed_precision},
      {"gradient_checkpointing", s.gradient_checkpointing},
      {"ranks", ranks.world->size()},
      {"sharding", s.sharding},
      {"seed", s.seed}};
  std::vector<double> losses;
  Trainer trainer(
      trainee, o,
      Sd3Config::Callbacks{progress_bar(s), checkpoint_every(s, folders),
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
    save_trained_transformer(p.transformer, p.root, s, files);
    if (!s.validation_prompts.empty()) {
      const at::Tensor images = validation_images(p, s, device);
      write_validation_images(images, validation_options(s, s.resolution), out);
      files["validation"] = "validation.png";
    }
  }
  return write_run_results(s, run_settings, files, fit, resumed_from, trainer.global_step(),
                           adapted.size(), losses, t0);
}

// ---- CogVideoX ----------------------------------------------------------------------------------
// A CogVideoXPipeline folder (T5 with its tokenizer, AutoencoderKLCogVideoX,
// CogVideoXTransformer3DModel, CogVideoXDDIMScheduler or CogVideoXDPMScheduler) trained as
// diffusers' train_cogvideox_lora.py trains it: videos encoded by the frozen 3-D VAE (a posterior
// sample × scaling_factor per step), captions by the frozen T5 (max_text_seq_length tokens, no
// mask), t ~ U{0, …, N−1}, x_t = add_noise, the v-prediction turned into x̂₀ (get_velocity(out,
// x_t, t)) and the loss (1/(1 − ᾱ_t))·|x̂₀ − x₀|².

using CogTransformer = models::CogVideoXTransformer3DModel<>;
using CogVae = models::AutoencoderKLCogVideoX<>;

struct CogPipeline {
  fs::path root;
  std::optional<text::T5Tokenizer> tokenizer;
  T5 text_encoder{nullptr};
  CogVae vae{nullptr};
  CogTransformer transformer{nullptr};
  examples::SchedulerConfig scheduler;
  bool dpm = false;  // CogVideoXDPMScheduler (else DDIM) samples the validation videos

  [[nodiscard]] std::int64_t text_length() const {
    return transformer->config().max_text_seq_length;
  }
  [[nodiscard]] at::Tensor encode(const std::vector<std::string>& prompts) {
    return text::t5_prompt_embeds(*tokenizer, text_encoder, prompts, text_length());
  }
};

CogPipeline load_cogvideox_pipeline(const std::string& model) {
  CogPipeline p;
  p.root = model;
  const fs::path index_file = p.root / "model_index.json";
  const nlohmann::json index = dt::io::read_json_object(index_file);
  check_component(index, "transformer", {"CogVideoXTransformer3DModel"}, index_file);
  check_component(index, "vae", {"AutoencoderKLCogVideoX"}, index_file);
  check_component(index, "text_encoder", {"T5EncoderModel"}, index_file);
  check_component(index, "tokenizer", {"T5TokenizerFast", "T5Tokenizer"}, index_file);
  check_component(index, "scheduler", {"CogVideoXDDIMScheduler", "CogVideoXDPMScheduler"},
                  index_file);
  p.dpm = index["scheduler"][1].get<std::string>() == "CogVideoXDPMScheduler";
  p.scheduler = examples::read_scheduler_config(p.root / "scheduler" / "scheduler_config.json");
  p.tokenizer.emplace(text::T5Tokenizer::from_folder(p.root / "tokenizer"));
  p.text_encoder = models::from_pretrained<T5>(p.root / "text_encoder");
  p.vae = models::from_pretrained<CogVae>(p.root / "vae");
  p.transformer = models::from_pretrained<CogTransformer>(p.root / "transformer");
  const auto& tc = p.transformer->config();
  const std::int64_t latent = p.vae->config().latent_channels;
  if (tc.in_channels != latent)
    throw ConfigError("takes " + std::to_string(tc.in_channels) + " channels, the VAE's latents " +
                          std::to_string(latent) +
                          (tc.in_channels == 2 * latent
                               ? " (an image-to-video model: this program trains text-to-video)"
                               : std::string()),
                      (p.root / "transformer").string());
  if (tc.text_embed_dim != p.text_encoder->config().d_model)
    throw ConfigError("reads text of width " + std::to_string(tc.text_embed_dim) + ", T5 writes " +
                          std::to_string(p.text_encoder->config().d_model),
                      (p.root / "transformer").string());
  return p;
}

/// One training video: the frames chosen from its folder (or a single image) and its caption.
struct VideoClip {
  fs::path source;
  std::vector<fs::path> frames;
  std::string caption;
};

std::vector<std::string> read_lines(const fs::path& file, const std::string& flag) {
  if (!fs::is_regular_file(file))
    throw dt::IoError(
        "does not exist (" + flag + " names a file of the data folder, one entry per line)",
        file.string());
  const std::vector<char> bytes = dt::io::read_file(file);
  std::vector<std::string> lines;
  std::string line;
  for (const char c : bytes) {
    if (c != '\n') {
      line += c;
      continue;
    }
    if (!line.empty() && line.back() == '\r') line.pop_back();
    lines.push_back(line);
    line.clear();
  }
  if (!line.empty()) lines.push_back(line);
  while (!lines.empty() && lines.back().empty()) lines.pop_back();
  return lines;
}

/// diffusers' frame choice: skip the first and last frames asked, take every k-th frame when more
/// than max_num_frames remain, cut to max_num_frames and then to 4k + 1 (what the VAE compresses).
std::vector<std::size_t> chosen_frames(std::size_t count, const Settings& s) {
  const auto start = std::min<std::size_t>(static_cast<std::size_t>(s.skip_frames_start), count);
  const std::size_t end =
      count > static_cast<std::size_t>(s.skip_frames_end) ? count - s.skip_frames_end : 0;
  const auto max = static_cast<std::size_t>(s.max_num_frames);
  std::vector<std::size_t> idx;
  if (end <= start) {
    idx.push_back(std::min(start, count - 1));
  } else if (end - start <= max) {
    for (std::size_t i = start; i < end; ++i) idx.push_back(i);
  } else {
    const std::size_t step = (end - start) / max;
    for (std::size_t i = start; i < end; i += step) idx.push_back(i);
  }
  if (idx.size() > max) idx.resize(max);
  const std::size_t remainder = (3 + idx.size() % 4) % 4;
  idx.resize(idx.size() - remainder);
  return idx;
}

/// diffusers' local dataset layout: `--caption_column` and `--video_column` name two files in the
/// data folder, one caption and one video per line. A video is a folder of its frames (JPEG, PNG
/// or WebP, in name order) or one image; every clip is cut to the shortest clip's frame count so
/// clips batch together.
std::vector<VideoClip> scan_videos(const Settings& s) {
  const fs::path root(s.data_dir);
  if (!fs::is_directory(root))
    throw dt::IoError("is not a folder", "--train_data_dir " + s.data_dir);
  const auto captions = read_lines(root / s.caption_column, "--caption_column");
  const auto videos = read_lines(root / s.video_column, "--video_column");
  if (captions.size() != videos.size())
    throw ConfigError(std::to_string(captions.size()) + " captions for " +
                          std::to_string(videos.size()) + " videos",
                      (root / s.caption_column).string());
  if (videos.empty()) throw ConfigError("lists no videos", (root / s.video_column).string());
  std::vector<VideoClip> clips;
  std::size_t shortest = std::numeric_limits<std::size_t>::max();
  for (std::size_t i = 0; i < videos.size(); ++i) {
    VideoClip c{root / videos[i], {}, captions[i]};
    const std::string where = (root / s.video_column).string() + " line " + std::to_string(i + 1);
    if (fs::is_directory(c.source)) {
      for (const auto& e : fs::directory_iterator(c.source))
        if (e.is_regular_file() && data::is_image_name(e.path())) c.frames.push_back(e.path());
      std::sort(c.frames.begin(), c.frames.end());
      if (c.frames.empty())
        throw ConfigError("names " + c.source.string() + ", a folder without frames", where);
    } else if (fs::is_regular_file(c.source) && data::is_image_name(c.source)) {
      c.frames.push_back(c.source);
    } else {
      throw ConfigError("names " + c.source.string() +
                            ", which is not a folder of frames or an image (decode a video file "
                            "to frames first, e.g. ffmpeg -i clip.mp4 clip/%04d.png)",
                        where);
    }
    std::vector<fs::path> kept;
    for (const std::size_t k : chosen_frames(c.frames.size(), s)) kept.push_back(c.frames[k]);
    c.frames = std::move(kept);
    shortest = std::min(shortest, c.frames.size());
    clips.push_back(std::move(c));
    if (s.limit > 0 && static_cast<std::int64_t>(clips.size()) >= s.limit) break;
  }
  for (auto& c : clips) c.frames.resize(shortest);
  return clips;
}

/// A clip's frames (1, 3, F, height, width) in [−1, 1], each resized to the training size (as
/// decord's reader does: no crop), mirrored when asked.
at::Tensor load_clip(const VideoClip& c, const Settings& s, bool flip) {
  std::vector<at::Tensor> frames;
  for (const auto& f : c.frames) {
    const at::Tensor chw = data::read_image(f).pixels.permute({2, 0, 1});
    at::Tensor x = data::resize(chw, {s.height, s.width});
    if (flip) x = data::horizontal_flip(x);
    frames.push_back(data::to_unit_range(x));
  }
  return at::stack(frames, 1).unsqueeze(0);
}

/// The transformer with CogVideoX's v-prediction loss on video latents (B, F, C, h, w).
struct CogTraineeImpl : torch::nn::Module {
  struct Batch {
    at::Tensor latents, embeds;
    [[nodiscard]] std::int64_t size() const { return latents.size(0); }
    [[nodiscard]] Batch slice(std::int64_t start, std::int64_t length) const {
      return {latents.narrow(0, start, length), embeds.narrow(0, start, length)};
    }
  };
  CogTraineeImpl(CogTransformer t, const examples::SchedulerConfig& c)
      : transformer(register_module("transformer", t)),
        schedule_(c.schedule),
        prediction_(c.prediction) {}
  at::Tensor loss(const Batch& b) {
    const at::Tensor& x0 = b.latents;
    const std::int64_t n = x0.size(0);
    const at::Tensor noise = at::randn_like(x0);
    const at::Tensor t = schedule_.sample_timesteps(n, x0.options());
    const at::Tensor noisy = schedule_.add_noise(x0, noise, t);
    return df::cogvideox_loss(schedule_, prediction_, transformer->forward(noisy, b.embeds, t),
                              noisy, x0, t);
  }
  CogTransformer transformer{nullptr};

 private:
  df::NoiseSchedule schedule_;
  df::Prediction prediction_;
};

/// The run's batches by place in the run: shuffled clips per epoch (the same for a seed), their
/// posteriors encoded once per clip and flip, a latent sample drawn per step.
class VideoBatchStream {
 public:
  VideoBatchStream(const Settings& s, CogPipeline& p, const std::vector<VideoClip>& clips,
                   at::Device device)
      : s_(s), p_(p), clips_(clips), device_(device), epoch_batches_(batches(0)) {}

  [[nodiscard]] std::size_t batches_per_epoch() const { return epoch_batches_.size(); }

  CogTraineeImpl::Batch at_place(std::int64_t place) {
    const std::size_t per_epoch = batches_per_epoch();
    const auto epoch = static_cast<std::uint64_t>(place) / per_epoch;
    if (epoch != epoch_) {  // one shuffle per epoch, not per micro-batch
      epoch_batches_ = batches(epoch);
      epoch_ = epoch;
    }
    const std::vector<std::size_t> batch =
        epoch_batches_.at(static_cast<std::size_t>(place) % per_epoch);
    std::vector<at::Tensor> latents, embeds;
    for (const std::size_t i : batch) {
      // The flip draw belongs to (seed, place, clip), so a resumed run flips as the first did.
      const bool flip =
          s_.random_flip && at::rand({1}, at::make_generator<at::CPUGeneratorImpl>(
                                              static_cast<std::uint64_t>(s_.seed) * 1'000'003 +
                                              static_cast<std::uint64_t>(place) * 131 + i))
                                    .item<double>() < 0.5;
      const auto& [mean, std] = posterior(i, flip);
      at::Tensor z;
      {
        at::NoGradGuard no_grad;
        z = (mean + std * at::randn(mean.sizes(), mean.options())) *
            p_.vae->config().scaling_factor;
      }
      latents.push_back(z.permute({0, 2, 1, 3, 4}));  // (1, F, C, h, w), as the transformer reads
      embeds.push_back(caption(clips_[i].caption));
    }
    return {at::cat(latents).to(device_), at::cat(embeds).to(device_)};
  }

  /// Frames the training videos have (the same for every clip).
  [[nodiscard]] std::int64_t frames() const {
    return static_cast<std::int64_t>(clips_.front().frames.size());
  }

 private:
  [[nodiscard]] std::vector<std::vector<std::size_t>> batches(std::uint64_t epoch) const {
    const std::vector<data::Bucket> one(clips_.size(), data::Bucket{s_.width, s_.height});
    return data::bucket_batches(one, {}, static_cast<std::size_t>(s_.train_batch_size), s_.seed,
                                epoch);
  }
  const std::pair<at::Tensor, at::Tensor>& posterior(std::size_t i, bool flip) {
    const auto key = std::make_pair(i, flip);
    auto it = posteriors_.find(key);
    if (it != posteriors_.end()) return it->second;
    at::NoGradGuard no_grad;
    const auto d = p_.vae->encode(load_clip(clips_[i], s_, flip).to(device_));
    return posteriors_.emplace(key, std::make_pair(d.mean, d.std)).first->second;
  }
  at::Tensor caption(const std::string& c) {
    auto it = text_.find(c);
    if (it != text_.end()) return it->second;
    at::NoGradGuard no_grad;
    return text_.emplace(c, p_.encode({c}).cpu()).first->second;
  }

  const Settings& s_;
  CogPipeline& p_;
  const std::vector<VideoClip>& clips_;
  at::Device device_;
  std::vector<std::vector<std::size_t>> epoch_batches_;  // epoch_'s order
  std::uint64_t epoch_ = 0;
  std::map<std::pair<std::size_t, bool>, std::pair<at::Tensor, at::Tensor>> posteriors_;
  std::map<std::string, at::Tensor> text_;
};

/// Videos of the validation prompts, as CogVideoXPipeline samples them (its scheduler, classifier-
/// free guidance against the empty prompt), decoded by the VAE: (n, 3, F, height, width) in
/// [−1, 1] on the CPU.
at::Tensor validation_videos(CogPipeline& p, const Settings& s, std::int64_t frames,
                             at::Device device) {
  at::NoGradGuard no_grad;
  const bool was_training = p.transformer->is_training();
  p.transformer->eval();
  std::vector<std::string> prompts;
  for (const auto& prompt : s.validation_prompts)
    for (std::int64_t k = 0; k < s.num_validation_images; ++k) prompts.push_back(prompt);
  const auto n = static_cast<std::int64_t>(prompts.size());
  const at::Tensor embeds =
      at::cat({p.encode(prompts), p.encode(std::vector<std::string>(prompts.size(), ""))})
          .to(device);
  const at::Tensor rows = at::arange(n, at::TensorOptions().dtype(at::kLong).device(device));
  const auto& vc = p.vae->config();
  const std::int64_t latent_frames =
      (frames - 1) / static_cast<std::int64_t>(vc.temporal_compression_ratio) + 1;
  const std::int64_t down = p.vae->spatial_downscale();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(s.seed + 7);
  const at::Tensor noise =
      at::randn({n, latent_frames, vc.latent_channels, s.height / down, s.width / down}, gen)
          .to(device);
  const df::NoiseSchedule schedule(p.scheduler.schedule);
  df::CogVideoXSamplerOptions so;
  so.prediction_type = p.scheduler.prediction;
  so.set_alpha_to_one = p.scheduler.ddim.set_alpha_to_one;
  so.steps_offset = p.scheduler.ddim.steps_offset;
  so.timestep_spacing = p.scheduler.ddim.timestep_spacing;
  auto model = [&](const at::Tensor& x, const at::Tensor& t, const at::Tensor& row) {
    return p.transformer->forward(x, embeds.index_select(0, row), t);
  };
  const df::SampleOptions o{.num_inference_steps = s.num_inference_steps,
                            .guidance_scale = s.guidance_scale,
                            .chunk_size = n};
  at::Tensor z;
  if (p.dpm) {
    df::CogVideoXDpm sampler(schedule, so);
    z = df::sample(sampler, model, noise, o, rows, rows + n, gen);
  } else {
    df::CogVideoXDdim sampler(schedule, so);
    z = df::sample(sampler, model, noise, o, rows, rows + n);
  }
  const at::Tensor videos = p.vae->decode_latents(z.permute({0, 2, 1, 3, 4})).clamp(-1, 1).cpu();
  p.transformer->train(was_training);
  return videos;
}

/// validation/video-<i>/frame-<k>.png for every frame, and validation.png: one row per video of
/// up to eight evenly spaced frames.
void write_validation_videos(const at::Tensor& videos, const Settings& s, const fs::path& out) {
  const std::int64_t frames = videos.size(2);
  const std::int64_t shown = std::min<std::int64_t>(frames, 8);
  std::vector<at::Tensor> strip;
  for (std::int64_t i = 0; i < videos.size(0); ++i) {
    const fs::path dir = out / "validation" / ("video-" + std::to_string(i));
    fs::create_directories(dir);
    const at::Tensor v = videos[i].permute({1, 0, 2, 3});  // (F, 3, H, W)
    const std::string prompt =
        s.validation_prompts[static_cast<std::size_t>(i / s.num_validation_images)];
    for (std::int64_t k = 0; k < frames; ++k) {
      char name[32];
      std::snprintf(name, sizeof name, "frame-%04lld.png", static_cast<long long>(k));
      dt::io::write_png(dir / name,
                        dt::io::image_grid(v.narrow(0, k, 1), {.columns = 1, .padding = 0}),
                        {{"Description", prompt}});
    }
    for (std::int64_t j = 0; j < shown; ++j)
      strip.push_back(v[shown == 1 ? 0 : j * (frames - 1) / (shown - 1)]);
  }
  dt::io::write_png(out / "validation.png",
                    dt::io::image_grid(at::stack(strip), {.columns = shown, .padding = 2}),
                    {{"Description", "one row per validation video, frames left to right"}});
}

int run_cogvideox(Settings s, const Ranks& ranks) {
  const auto t0 = std::chrono::steady_clock::now();
  check_sd_run_flags(s);
  examples::apply_threads(s);
  const bool main_rank = ranks.main();
  // The videos first: a wrong data folder is found before the models load.
  const std::vector<VideoClip> clips = scan_videos(s);
  dt::io::ensure_writable_folder(s.out);
  tr::set_seed(s.seed);
  CogPipeline p = load_cogvideox_pipeline(s.model);
  const auto& tc = p.transformer->config();
  const std::int64_t unit = p.vae->spatial_downscale() * tc.patch_size;
  if (s.height % unit != 0)
    throw ConfigError(
        "must be a multiple of " + std::to_string(unit) + " (the VAE's downscale × the patch size)",
        "--height");
  if (s.width % unit != 0)
    throw ConfigError(
        "must be a multiple of " + std::to_string(unit) + " (the VAE's downscale × the patch size)",
        "--width");
  const auto frames = static_cast<std::int64_t>(clips.front().frames.size());
  const std::int64_t latent_frames =
      (frames - 1) / static_cast<std::int64_t>(p.vae->config().temporal_compression_ratio) + 1;
  if (latent_frames % tc.frame_patch() != 0)
    throw ConfigError(std::to_string(frames) + " frames give " + std::to_string(latent_frames) +
                          " latent frames, not a multiple of patch_size_t " +
                          std::to_string(tc.frame_patch()) + "; choose another --max_num_frames",
                      "--max_num_frames");
  const at::Device device = ranks.device;

  freeze(*p.vae);
  freeze(*p.text_encoder);
  std::vector<std::string> adapted;
  if (s.use_lora) {
    const double alpha = s.lora_alpha > 0 ? s.lora_alpha : static_cast<double>(s.rank);
    // diffusers' CogVideoX LoRA targets: the attention projections.
    adapted =
        ad::inject_lora(*p.transformer, {.target_modules = {"to_k", "to_q", "to_v", "to_out.0"}},
                        {.rank = s.rank, .alpha = alpha});
  }
  p.vae->to(device);
  p.vae->eval();
  p.text_encoder->to(device);
  p.text_encoder->eval();
  p.transformer->to(device);
  if (s.gradient_checkpointing) p.transformer->set_gradient_checkpointing(true);

  VideoBatchStream stream(s, p, clips, device);
  resolve_max_train_steps(
      s, ranks.batches_each(stream.batches_per_epoch(), "--train_data_dir / --train_batch_size"),
      main_rank);
  CogTraineeImpl trainee(p.transformer, p.scheduler);
  trainee.train();
  using Trainer = tr::Trainer<CogTraineeImpl, Sd3Config>;
  Trainer::Options o;
  set_optimizer_and_schedule(o, s, s.learning_rate);
  o.clipping.max_norm = s.max_grad_norm;
  set_parallel(o, s, ranks.world);
  const RunFolders folders = prepare_run_folders(s, main_rank);
  const nlohmann::json run_settings = {
      {"pretrained_model_name_or_path", s.model},
      {"train_data_dir", s.data_dir},
      {"videos", clips.size()},
      {"frames", frames},
      {"latent_frames", latent_frames},
      {"height", s.height},
      {"width", s.width},
      {"train_batch_size", s.train_batch_size},
      {"gradient_accumulation_steps", s.gradient_accumulation_steps},
      {"max_train_steps", s.max_train_steps},
      {"learning_rate", s.learning_rate},
      {"lr_scheduler", s.lr_scheduler},
      {"use_lora", s.use_lora},
      {"rank", s.rank},
      {"scheduler", std::string(p.dpm ? "CogVideoXDPMScheduler" : "CogVideoXDDIMScheduler")},
      {"snr_shift_scale", p.scheduler.schedule.snr_shift_scale.value_or(1.0)},
      {"mixed_precision", s.mixed_precision},
      {"gradient_checkpointing", s.gradient_checkpointing},
      {"ranks", ranks.world->size()},
      {"sharding", s.sharding},
      {"seed", s.seed}};
  if (main_rank)
    std::printf("%zu videos of %lld frames (%lld latent frames) at %lldx%lld\n", clips.size(),
                static_cast<long long>(frames), static_cast<long long>(latent_frames),
                static_cast<long long>(s.width), static_cast<long long>(s.height));
  std::vector<double> losses;
  Trainer trainer(
      trainee, o,
      Sd3Config::Callbacks{progress_bar(s), checkpoint_every(s, folders),
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
    save_trained_transformer(p.transformer, p.root, s, files);
    if (!s.validation_prompts.empty()) {
      write_validation_videos(validation_videos(p, s, frames, device), s, out);
      files["validation"] = "validation.png";
    }
  }
  return write_run_results(s, run_settings, files, fit, resumed_from, trainer.global_step(),
                           adapted.size(), losses, t0);
}

/// SD3 or CogVideoX, by the folder's model_index.json.
int run(const Settings& s) {
  const fs::path root(s.model);
  if (!fs::is_directory(root))
    throw dt::IoError("is not a folder (name a diffusers pipeline folder)",
                      "--pretrained_model_name_or_path " + s.model);
  const nlohmann::json index = dt::io::read_json_object(root / "model_index.json");
  // The ranks of a torchrun launch. Every rank checks the same flags and folders, and so fails
  // the same way before this point.
  auto [world, device] = torchrun_world(s, s.device);
  const Ranks ranks{std::move(world), device};
  if (index.value("_class_name", std::string()) == "CogVideoXPipeline")
    return run_cogvideox(s, ranks);
  return run_sd3(s, ranks);
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  CLI::App app{
      "Fine-tune a Stable Diffusion 3 transformer on captioned images, or a CogVideoX transformer "
      "on captioned videos (LoRA or full)."};
  app.get_formatter()->column_width(44);
  using examples::count_in;
  using examples::number_in;
  const SdFlagGroups g = add_sd_run_flags(app, s, "folder of images with captions");
  auto* img = add_image_folder_flags(app, g, s, s.limit, "training size (square)");
  auto* t = g.training;
  add_lora_flags(g, s, "transformer");
  t->add_option("--weighting_scheme", s.weighting_scheme,
                "sigma_sqrt, logit_normal, mode, cosmap or none")
      ->capture_default_str();
  t->add_option("--logit_mean", s.logit_mean)->capture_default_str();
  t->add_option("--logit_std", s.logit_std)->check(number_in(0, 100, true))->capture_default_str();
  t->add_option("--mode_scale", s.mode_scale)->capture_default_str();
  t->add_option("--precondition_outputs", s.precondition_outputs,
                "1: the loss on x̂₀ (diffusers' default); 0: on ε − x₀")
      ->capture_default_str();
  t->add_option("--max_sequence_length", s.max_sequence_length, "T5's tokens")
      ->check(count_in(1, 4096))
      ->capture_default_str();
  auto* video = app.add_option_group("videos (CogVideoX folders)");
  video
      ->add_option("--video_column", s.video_column,
                   "file in the data folder naming one video (a folder of frames) per line")
      ->capture_default_str();
  video->add_option("--height", s.height, "frame height")
      ->check(count_in(8, 8192))
      ->capture_default_str();
  video->add_option("--width", s.width, "frame width")
      ->check(count_in(8, 8192))
      ->capture_default_str();
  video->add_option("--max_num_frames", s.max_num_frames, "frames per video at most (4k + 1 used)")
      ->check(count_in(1, 100'000))
      ->capture_default_str();
  video->add_option("--skip_frames_start", s.skip_frames_start)
      ->check(count_in(0, 100'000))
      ->capture_default_str();
  video->add_option("--skip_frames_end", s.skip_frames_end)
      ->check(count_in(0, 100'000))
      ->capture_default_str();
  auto* d = add_torchrun_flags(app, s, "each transformer block");
  last_value_wins({g.run, g.training, g.saving, img, video, d});
  if (const auto rc = examples::parse_command_line(app, argc, argv)) return *rc;
  return examples::run_reporting_errors([&] { return run(s); });
}
