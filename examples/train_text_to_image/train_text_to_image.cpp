// Fine-tuning Stable Diffusion on a folder of captioned images, as diffusers'
// train_text_to_image.py and train_text_to_image_lora.py do, with their flag names: a pipeline
// folder (model_index.json naming unet, vae, text_encoder, tokenizer and scheduler), an image
// folder (metadata.jsonl/csv, sidecar captions, file names or kohya's N_name folders), and either
// full fine-tuning of the UNet (optionally with EMA) or LoRA on the UNet's attention and, with
// --train_text_encoder, on the text encoder's.
//
//   train_text_to_image --pretrained_model_name_or_path SD --train_data_dir IMAGES
//                       --output_dir OUT [--use_lora --rank 4] [--cache_latents] ...
//
// What it writes to --output_dir:
//   full fine-tuning   the pipeline folder: the trained unet/ (EMA weights with --use_ema) and
//                      the base's other components, which StableDiffusionPipeline.from_pretrained
//                      loads;
//   --use_lora         pytorch_lora_weights.safetensors (PEFT keys under unet. and text_encoder.,
//                      what load_lora_weights reads) and lora_kohya.safetensors (the web UI's);
//   always             checkpoints/ (every --checkpointing_steps; --resume_from_checkpoint),
//                      tensorboard/, validation/ (images of --validation_prompt) and results.json.
//
// Images become latents through the VAE each step, or once with --cache_latents (a cache on disk
// keyed by each image's content, its bucket and the VAE's weights; a later run reuses it). A
// frozen text encoder's outputs are cached the same way. --enable_bucket trains on kohya's
// aspect-ratio buckets instead of square crops. Ctrl-C stops after the current step and saves a
// checkpoint.
//
// Under torchrun (`torchrun --nproc-per-node N --no-python train_text_to_image ...`) every rank
// trains on its own batches of --train_batch_size (accelerate's rule: rank r takes batches r,
// r + N, ... of the epoch order), the gradients are averaged, and --sharding 1|2|3 shards the
// optimizer state (and the gradients, and the trained parameters during forward and backward) as
// ZeRO does. Rank 0 builds the caches, validates, writes
// the outputs; a checkpoint written by N ranks resumes on another count with
// --allow_world_size_change.

#include <CLI/CLI.hpp>
#include <difftrain/adapters/stable_diffusion_lora_files.hpp>
#include <difftrain/adapters/text_encoder_adapters.hpp>
#include <difftrain/adapters/unet_adapters.hpp>
#include <difftrain/data/data.hpp>
#include <difftrain/diffusion/ddim.hpp>
#include <difftrain/diffusion/sample.hpp>
#include <difftrain/diffusion/weighting.hpp>
#include <difftrain/distributed/sharded_data_parallel.hpp>
#include <difftrain/ema/ema.hpp>
#include <difftrain/io/atomic_file.hpp>
#include <difftrain/io/image_grid.hpp>
#include <difftrain/io/png.hpp>
#include <difftrain/io/read_file.hpp>
#include <difftrain/io/remove_tree.hpp>
#include <difftrain/io/safetensors.hpp>
#include <difftrain/models/models.hpp>
#include <difftrain/schedule/by_name.hpp>
#include <difftrain/text/clip_tokenizer.hpp>
#include <difftrain/text/encode_prompt.hpp>
#include <difftrain/train/callbacks.hpp>
#include <difftrain/train/seeding.hpp>
#include <difftrain/train/tensorboard.hpp>
#include <difftrain/train/trainer.hpp>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <optional>
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
#include "dreambooth.hpp"
#include "network_flags.hpp"

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

using namespace examples::sd;  // the pipeline folder, validation, callbacks

struct Settings : SdRunFlags,
                  ImageFolderFlags,
                  LoraFlags,
                  examples::NetworkFlags,
                  examples::DreamBoothFlags,
                  TorchrunFlags,
                  SingleFileSaveFlags {
  bool enable_bucket = false, bucket_no_upscale = false;
  std::int64_t min_bucket_reso = 256, max_bucket_reso = 1024, bucket_reso_steps = 64;
  double snr_gamma = 0.0;
  examples::KohyaFlags kohya;   // kohya's caption, noise and loss options
  std::string prediction_type;  // empty: the scheduler's
  bool use_ema = false;
  double ema_decay = 0.9999;
  bool train_text_encoder = false;
  bool cache_latents = false;
  std::string cache_dir;  // default OUT/cache
  // under torchrun
  Settings() { out = "runs/train_text_to_image"; }
};

// ---- the trainee --------------------------------------------------------------------------------

/// The UNet (and the text encoders when they train) with diffusers' denoising loss on latents.
struct TextToImageImpl : torch::nn::Module {
  struct Batch {
    at::Tensor latents;                 ///< scaled by the VAE's scaling factor
    std::vector<std::string> captions;  ///< when the text encoders train
    at::Tensor embeds, pooled;          ///< from the frozen encoders otherwise (pooled: SDXL)
    at::Tensor time_ids;                ///< SDXL: original size, crop corner, target size
    /// Each sample's loss weight (DreamBooth's class images, kohya's regularization images);
    /// undefined: all 1.
    at::Tensor loss_weights;
    /// Each sample's loss mask (B, H, W) in [0, 1] (kohya's masked loss); undefined: none.
    at::Tensor masks;
    [[nodiscard]] std::int64_t size() const { return latents.size(0); }
    [[nodiscard]] Batch slice(std::int64_t start, std::int64_t length) const {
      auto part = [&](const at::Tensor& t) { return t.defined() ? t.narrow(0, start, length) : t; };
      std::vector<std::string> c;
      if (!captions.empty()) c.assign(captions.begin() + start, captions.begin() + start + length);
      return {part(latents),  std::move(c),       part(embeds), part(pooled),
              part(time_ids), part(loss_weights), part(masks)};
    }
    /// This batch followed by `other` (prior preservation's class images; masked where this
    /// batch is, fully where it has no masks).
    [[nodiscard]] Batch then(const Batch& other) const {
      auto join = [](const at::Tensor& a, const at::Tensor& b) {
        return a.defined() ? at::cat({a, b}) : a;
      };
      std::vector<std::string> c = captions;
      c.insert(c.end(), other.captions.begin(), other.captions.end());
      at::Tensor other_masks = other.masks;
      if (masks.defined() && !other_masks.defined())
        other_masks = at::ones({other.size(), masks.size(1), masks.size(2)}, masks.options());
      return {join(latents, other.latents),   std::move(c),
              join(embeds, other.embeds),     join(pooled, other.pooled),
              join(time_ids, other.time_ids), join(loss_weights, other.loss_weights),
              join(masks, other_masks)};
    }
  };
  /// `p`'s text encoders train (and are registered here) when `encoders_train`.
  TextToImageImpl(Pipeline& p, bool encoders_train, const df::NoiseSchedule& schedule,
                  const Settings& s)
      : unet(register_module("unet", p.unet)),
        pipeline_(&p),
        schedule_(schedule),
        prediction_(p.scheduler.prediction),
        snr_gamma_(s.snr_gamma),
        kohya_(s.kohya) {
    if (encoders_train) {
      register_module("text_encoder", p.text_encoder);
      if (p.xl) register_module("text_encoder_2", p.text_encoder_2);
    }
  }
  at::Tensor loss(const Batch& b) {
    const std::int64_t n = b.latents.size(0);
    models::UNetConditions cond;
    at::Tensor embeds = b.embeds;
    cond.text_embeds = b.pooled;
    cond.time_ids = b.time_ids;
    if (!embeds.defined()) {
      const TextConditioning text = encode_captions(*pipeline_, b.captions);
      embeds = text.hidden;
      cond.text_embeds = text.pooled;
    }
    // kohya's noise options (diffusers' --noise_offset is kohya's without the adaptive scale).
    const examples::StepNoise noise = examples::step_noise(b.latents, kohya_);
    const at::Tensor t =
        at::randint(schedule_.num_train_timesteps(), {n}, b.latents.options().dtype(at::kLong));
    const at::Tensor pred =
        unet->forward(schedule_.add_noise(b.latents, noise.input_noise, t), t, embeds, cond);
    const at::Tensor target = schedule_.target(prediction_, b.latents, noise.noise, t);
    // Per-sample weights (class and regularization images) multiply each sample's loss.
    auto mean = [&](const at::Tensor& per_sample) {
      return b.loss_weights.defined() ? (per_sample * b.loss_weights.to(per_sample.device())).mean()
                                      : per_sample.mean();
    };
    if (kohya_.changes_loss() || b.masks.defined())
      return mean(examples::step_loss_per_sample(pred, target, t, schedule_, prediction_,
                                                 snr_gamma_, kohya_, b.masks));
    if (snr_gamma_ <= 0 && !b.loss_weights.defined())
      return at::mse_loss(pred.to(at::kFloat), target.to(at::kFloat));
    // diffusers' min-SNR: per-sample MSE weighted by min(SNR, γ)/SNR (ε) or /(SNR + 1) (v).
    const at::Tensor per_sample =
        (pred.to(at::kFloat) - target.to(at::kFloat)).square().mean({1, 2, 3});
    if (snr_gamma_ <= 0) return mean(per_sample);
    const at::Tensor w =
        df::min_snr_weights(schedule_.snr(t.cpu()).to(at::kFloat), snr_gamma_, prediction_)
            .to(per_sample.device());
    return mean(per_sample * w);
  }
  Unet unet{nullptr};
  Pipeline* pipeline_;
  df::NoiseSchedule schedule_;
  df::Prediction prediction_;
  double snr_gamma_;
  examples::KohyaFlags kohya_;
};

struct NoEmaConfig : tr::DefaultConfig {
  using Optimizer = tr::OptimizerByName;
  using Precision = tr::PrecisionByName;  // --mixed_precision
  using Schedule = dt::schedule::ByName;  // --lr_scheduler, diffusers' names
  using Clipping = tr::ClipByNorm;
  // --sharding picks the stage at run time; 0 is DataParallel itself (and one process without
  // torchrun).
  using Parallel = dt::distributed::ShardedDataParallel;
  using Callbacks = std::tuple<tr::ProgressBar, tr::CheckpointEvery, tr::TensorBoard,
                               tr::SampleEvery<Validation>, StopOnInterrupt, LossRecord>;
};
struct EmaConfig : NoEmaConfig {
  using Ema = dt::ema::Ema<dt::ema::WarmupDecay>;  // diffusers' EMAModel
};

// ---- batches ------------------------------------------------------------------------------------

/// Each image's bucket and repeat count (the same choice the loaders and the cache make).
std::pair<std::vector<data::Bucket>, std::vector<std::int64_t>> assigned_buckets(
    const data::ImageFolder& folder, const data::BucketManager& buckets) {
  std::pair<std::vector<data::Bucket>, std::vector<std::int64_t>> out;
  for (const auto& r : folder.images) {
    out.first.push_back(buckets.select(r.width, r.height).bucket);
    out.second.push_back(r.repeats);
  }
  return out;
}

/// Batches in an epoch: each bucket's images cut into batches, counted without making one.
std::size_t epoch_batch_count(const data::ImageFolder& folder, const data::BucketManager& buckets,
                              const Settings& s) {
  const auto [assigned, repeats] = assigned_buckets(folder, buckets);
  return data::bucket_batches(assigned, repeats, static_cast<std::size_t>(s.train_batch_size),
                              s.seed, 0)
      .size();
}

/// The run's batches as a function of the micro-batch's place in the run, so a resumed run sees
/// the batches the uninterrupted one would have: epoch = place / batches per epoch.
class BatchStream {
 public:
  /// `weights`: each record's loss weight (null: all 1); `text_cache` false encodes the captions
  /// every step (a second stream beside one that owns the cache).
  BatchStream(const Settings& s, Pipeline& p, const data::ImageFolder& folder,
              const data::BucketManager& buckets, data::LatentCache* cache, bool encoder_trains,
              at::Device device, std::int64_t rank = 0, std::int64_t ranks = 1,
              const std::vector<float>* weights = nullptr, bool text_cache = true)
      : weights_(weights),
        rank_(rank),
        ranks_(ranks),
        s_(s),
        p_(p),
        folder_(folder),
        buckets_(buckets),
        cache_(cache),
        encoder_trains_(encoder_trains),
        device_(device) {
    per_epoch_ = epoch_batch_count(folder, buckets, s);
    if (!encoder_trains && !s.kohya.captions.any() && text_cache) {
      text_cache_.emplace(cache_root(s) / "text", text_fingerprint(p),
                          p.xl ? "SDXL text conditioning (hidden states, pooled)"
                               : "CLIP text encoder outputs (last_hidden_state)");
      // As the latent cache says it: a damaged shard is set aside and its captions encoded again.
      if (rank_ == 0)
        for (const auto& d : text_cache_->damaged())
          std::fprintf(stderr, "text cache: %s was damaged (%s); its captions are encoded again\n",
                       d.path.string().c_str(), d.reason.c_str());
    }
  }
  [[nodiscard]] std::size_t batches_per_epoch() const { return per_epoch_; }
  [[nodiscard]] double data_seconds() const { return data_seconds_; }

  /// Encodes every caption of the folder into the text cache now and writes it, so that the
  /// ranks of a distributed run only read it (rank 0 calls this before the others open it).
  void encode_every_caption() {
    if (!text_cache_) return;
    std::vector<std::string> captions;
    for (const auto& r : folder_.images) captions.push_back(r.caption);
    std::sort(captions.begin(), captions.end());
    captions.erase(std::unique(captions.begin(), captions.end()), captions.end());
    (void)text_cache_->entries_for_texts(
        captions, [&](const auto& texts) { return encode_entry(texts); },
        static_cast<std::size_t>(s_.train_batch_size));
    text_cache_->flush();
  }

  /// Micro-batch `place` of this rank: batch place · ranks + rank of the run's order.
  TextToImageImpl::Batch at_place(std::int64_t local_place) {
    const std::int64_t place = local_place * ranks_ + rank_;
    const auto t0 = std::chrono::steady_clock::now();
    const auto epoch = static_cast<std::uint64_t>(place) / per_epoch_;
    const auto pos = static_cast<std::size_t>(static_cast<std::uint64_t>(place) % per_epoch_);
    TextToImageImpl::Batch b;
    std::vector<std::string> captions;
    std::vector<std::array<std::int64_t, 2>> sizes, corners;
    if (cache_ != nullptr) {
      if (!latents_ || epoch != epoch_ || latents_->position() != pos) {
        latents_.emplace(*cache_, folder_, static_cast<std::size_t>(s_.train_batch_size),
                         s_.random_flip ? 0.5 : 0.0, s_.seed, epoch);
        latents_->seek(pos);
      }
      data::LatentBatch l = *latents_->next();
      b.latents = scale(l.latents.to(device_));
      b.loss_weights = weights_of(l.indices);
      captions = std::move(l.captions);
      sizes = std::move(l.original_sizes);
      corners = std::move(l.crop_top_left);
    } else {
      if (!pixels_ || epoch != epoch_ || pixels_->position() != pos)
        pixels_.emplace(folder_, buckets_, image_options(), epoch, pos);
      data::ImageBatch i = *pixels_->next();
      at::NoGradGuard no_grad;
      b.latents = p_.vae->encode_latents(i.pixels.to(device_, /*non_blocking=*/true));
      b.loss_weights = weights_of(i.indices);
      if (i.masks.defined()) b.masks = i.masks.to(device_);
      captions = std::move(i.captions);
      sizes = std::move(i.original_sizes);
      corners = std::move(i.crop_top_left);
    }
    epoch_ = epoch;
    // kohya's caption options, each time an image is used (epochs counted from 1, as kohya does).
    captions = examples::processed_captions(
        std::move(captions), s_.kohya, static_cast<std::uint64_t>(s_.seed), place,
        static_cast<std::int64_t>(epoch) + 1, local_place / s_.gradient_accumulation_steps,
        s_.max_train_steps);
    if (p_.xl) {  // SDXL's add_time_ids: original (h, w), crop (top, left), target (h, w)
      const std::int64_t down = p_.vae->downscale();
      std::vector<float> ids;
      for (std::size_t k = 0; k < sizes.size(); ++k)
        for (const std::int64_t v : {sizes[k][0], sizes[k][1], corners[k][0], corners[k][1],
                                     b.latents.size(2) * down, b.latents.size(3) * down})
          ids.push_back(static_cast<float>(v));
      b.time_ids = at::tensor(ids, at::kFloat)
                       .view({static_cast<std::int64_t>(sizes.size()), 6})
                       .to(device_);
    }
    if (encoder_trains_) {
      b.captions = std::move(captions);
    } else if (!text_cache_) {  // captions that change every time (or a second stream): encoded
      const data::TensorCache::Entry e = encode_entry(captions);
      b.embeds = e.at("hidden").to(device_);
      if (p_.xl) b.pooled = e.at("pooled").to(device_);
    } else {
      std::vector<at::Tensor> hidden, pooled;
      for (const auto& e : text_cache_->entries_for_texts(
               captions, [&](const auto& texts) { return encode_entry(texts); })) {
        hidden.push_back(e.at("hidden"));
        if (p_.xl) pooled.push_back(e.at("pooled"));
      }
      b.embeds = at::stack(hidden).to(device_);
      if (p_.xl) b.pooled = at::stack(pooled).to(device_);
    }
    data_seconds_ += examples::seconds_since(t0);
    return b;
  }

  static fs::path cache_root(const Settings& s) {
    return s.cache_dir.empty() ? fs::path(s.out) / "cache" : fs::path(s.cache_dir);
  }

 private:
  [[nodiscard]] data::ImageBatchOptions image_options() const {
    data::ImageBatchOptions o;
    o.batch_size = static_cast<std::size_t>(s_.train_batch_size);
    o.random_crop = !s_.center_crop;
    o.flip_p = s_.random_flip ? 0.5 : 0.0;
    o.seed = s_.seed;
    o.workers = static_cast<std::size_t>(s_.dataloader_num_workers);
    o.pin_memory = device_.is_cuda();
    o.alpha_mask = s_.alpha_mask;
    return o;
  }
  data::TensorCache::Entry encode_entry(const std::vector<std::string>& texts) {
    at::NoGradGuard no_grad;
    const TextConditioning t = encode_captions(p_, texts);
    data::TensorCache::Entry entry{{"hidden", t.hidden}};
    if (t.pooled.defined()) entry.emplace("pooled", t.pooled);
    return entry;
  }
  /// The records' loss weights (undefined without weights).
  [[nodiscard]] at::Tensor weights_of(const std::vector<std::size_t>& indices) const {
    if (weights_ == nullptr) return {};
    std::vector<float> w;
    for (const std::size_t i : indices) w.push_back(weights_->at(i));
    return at::tensor(w, at::kFloat).to(device_);
  }
  at::Tensor scale(const at::Tensor& z) const {
    const auto& c = p_.vae->config();
    return (c.shift_factor ? z - *c.shift_factor : z) * c.scaling_factor;
  }

  const std::vector<float>* weights_;
  std::int64_t rank_, ranks_;
  const Settings& s_;
  Pipeline& p_;
  const data::ImageFolder& folder_;
  const data::BucketManager& buckets_;
  data::LatentCache* cache_;
  bool encoder_trains_;
  at::Device device_;
  std::size_t per_epoch_ = 1;
  std::uint64_t epoch_ = 0;
  std::optional<data::CachedLatentBatches> latents_;
  std::optional<data::ImageBatches> pixels_;
  std::optional<data::TensorCache> text_cache_;
  double data_seconds_ = 0;
};

// ---- the run ------------------------------------------------------------------------------------

/// Refuses flag combinations that cannot work, before anything is loaded.
void check_flags(const Settings& s) {
  s.kohya.check();
  check_loraplus_flags(s);
  examples::check_network_flags(s, s);
  if (s.loraplus_text_encoder_lr_ratio > 0 && !s.train_text_encoder)
    throw ConfigError("goes with --train_text_encoder", "--loraplus_text_encoder_lr_ratio");
  if (s.train_text_encoder && !s.use_lora)
    throw ConfigError("trains the text encoder with LoRA only; add --use_lora",
                      "--train_text_encoder");
  if (s.cache_latents && !s.center_crop && !s.enable_bucket)
    throw ConfigError(
        "needs a fixed crop: add --center_crop (a random crop differs every epoch and cannot be "
        "cached)",
        "--cache_latents");
  if (!s.enable_bucket && s.resolution % 8 != 0)
    throw ConfigError("must be a multiple of 8", "--resolution");
  if (!s.validation_prompts.empty() && s.num_validation_images < 1)
    throw ConfigError("must be at least 1 with --validation_prompt", "--num_validation_images");
  check_single_file_save_flags(s, s.use_lora);
  examples::check_dreambooth_flags(s, s.data_dir, s.enable_bucket);
  if (s.masks() && s.cache_latents)
    throw ConfigError("keeps no masks with the latents; masked loss encodes every step",
                      s.alpha_mask ? "--alpha_mask" : "--masked_loss");
}

data::BucketOptions bucket_options(const Settings& s) {
  data::BucketOptions o;
  o.max_width = o.max_height = s.resolution;
  if (s.enable_bucket) {
    o.min_size = s.min_bucket_reso;
    o.max_size = s.max_bucket_reso;
    o.steps = s.bucket_reso_steps;
    o.no_upscale = s.bucket_no_upscale;
  } else {  // diffusers' square: the shorter side resized to the resolution, then cropped
    o.min_size = o.max_size = s.resolution;
    o.steps = 8;
  }
  o.check(s.enable_bucket ? "--resolution / --*_bucket_reso" : "--resolution");
  return o;
}

/// Copies the base pipeline's files other than the UNet's into `out` (the trained UNet goes to
/// out/unet), so `out` is a pipeline folder of its own.
template <class Config>
int train(const Settings& s, Pipeline& p, const data::ImageFolder& folder,
          const data::BucketManager& buckets, const std::shared_ptr<dt::distributed::World>& world,
          at::Device device, std::chrono::steady_clock::time_point t0,
          const std::vector<float>& weights, const data::ImageFolder* class_folder) {
  using Trainer = tr::Trainer<TextToImageImpl, Config>;
  const fs::path out(s.out);
  const df::NoiseSchedule schedule(p.scheduler.schedule);
  const bool main_rank = world->is_main();

  // Latents, once, when asked (the VAE stays frozen). Rank 0 encodes; the other ranks open the
  // cache once it is written and find every entry there.
  std::optional<data::LatentCache> cache;
  data::LatentCacheReport cache_report;
  if (s.cache_latents)
    world->rank0_first([&] {
      data::LatentCacheOptions co;
      co.flipped = s.random_flip;
      co.workers = static_cast<std::size_t>(s.dataloader_num_workers);
      co.batch_size = static_cast<std::size_t>(s.train_batch_size);
      co.progress = [](std::size_t done, std::size_t total) {
        std::fprintf(stderr, "\rcaching latents: %zu/%zu", done, total);
        if (done == total) std::fprintf(stderr, "\n");
      };
      cache.emplace(BatchStream::cache_root(s) / "latents", vae_fingerprint(p), folder, buckets,
                    co);
      for (const auto& d : cache->store().damaged())
        std::fprintf(stderr, "latent cache: %s was damaged (%s); its entries are encoded again\n",
                     d.path.string().c_str(), d.reason.c_str());
      p.vae->eval();
      cache_report = cache->build([&](const at::Tensor& px) {
        at::NoGradGuard no_grad;
        const auto posterior = p.vae->encode(px.to(device));
        return std::make_pair(posterior.mean.cpu(), posterior.std.cpu());
      });
      if (main_rank || cache_report.encoded > 0)  // another rank finds rank 0's entries
        std::fprintf(stderr, "latent cache: %zu entries, %zu reused, %zu encoded (%.1f s) in %s\n",
                     cache_report.entries, cache_report.reused, cache_report.encoded,
                     cache_report.seconds, cache->store().folder().string().c_str());
    });

  // LoRA: frozen base, new branches; full: the UNet trains.
  std::vector<TextEncoder> encoders{p.text_encoder};
  if (p.xl) encoders.push_back(p.text_encoder_2);
  for (auto& e : encoders) freeze(*e);
  freeze(*p.vae);
  std::vector<std::string> unet_lora, te_lora;
  if (s.use_lora) {  // LoRA (+ LoCon, DoRA, ranks per block), or LyCORIS' LoHa / LoKr
    unet_lora = examples::inject_unet_network(*p.unet, s, s);
    if (s.train_text_encoder)
      for (auto& e : encoders) {
        const auto added =
            s.network_algo == "lora"
                ? ad::inject_lora(*e, ad::text_encoder_lora_targets(), s.lora_options())
                : ad::inject_weight_delta(
                      *e, ad::text_encoder_lora_targets(),
                      ad::DeltaOptions{.kind = s.network_algo == "loha" ? ad::DeltaKind::loha
                                                                        : ad::DeltaKind::lokr,
                                       .rank = s.rank,
                                       .alpha = *s.lora_options().alpha,
                                       .factor = s.lokr_factor});
        te_lora.insert(te_lora.end(), added.begin(), added.end());
      }
  }
  p.unet->to(device);
  for (auto& e : encoders) {
    e->to(device);
    e->eval();  // trained ones are put in training mode with the trainee
  }
  p.vae->to(device);
  p.vae->eval();
  if (s.gradient_checkpointing) {
    p.unet->set_gradient_checkpointing(true);
    if (s.train_text_encoder)
      for (auto& e : encoders) e->set_gradient_checkpointing(true);
  }

  TextToImageImpl trainee(p, s.train_text_encoder, schedule, s);
  trainee.train();
  typename Trainer::Options o;
  set_optimizer_and_schedule(o, s, s.learning_rate);
  if (s.use_lora) {  // LoRA+: the UNet's B matrices, and the text encoders' when they train
    if (auto r = loraplus_rule("unet", s.loraplus_ratio(false), s.learning_rate))
      o.groups.rules.push_back(*r);
    if (s.train_text_encoder)
      if (auto r = loraplus_rule("text_encoder(_2)?", s.loraplus_ratio(true), s.learning_rate))
        o.groups.rules.push_back(*r);
  }
  o.clipping.max_norm = s.max_grad_norm;
  if constexpr (Trainer::has_ema) o.ema.rule.decay = s.ema_decay;
  set_parallel(o, s, world);

  const RunFolders folders = prepare_run_folders(s, main_rank);
  const nlohmann::json run_settings = {
      {"pretrained_model_name_or_path", s.model},
      {"train_data_dir", s.data_dir},
      {"images", folder.images.size()},
      {"resolution", s.resolution},
      {"enable_bucket", s.enable_bucket},
      {"train_batch_size", s.train_batch_size},
      {"gradient_accumulation_steps", s.gradient_accumulation_steps},
      {"max_train_steps", s.max_train_steps},
      {"learning_rate", s.learning_rate},
      {"lr_scheduler", s.lr_scheduler},
      {"use_lora", s.use_lora},
      {"rank", s.rank},
      {"train_text_encoder", s.train_text_encoder},
      {"use_ema", s.use_ema},
      {"snr_gamma", s.snr_gamma},
      {"kohya", s.kohya.settings()},
      {"dataset_config", s.dataset_config},
      {"with_prior_preservation", s.with_prior_preservation},
      {"alpha_mask", s.alpha_mask},
      {"masked_loss", s.masked_loss},
      {"prior_loss_weight", s.prior_loss_weight},
      {"prediction_type", std::string(df::to_string(p.scheduler.prediction))},
      {"cache_latents", s.cache_latents},
      {"mixed_precision", s.mixed_precision},
      {"gradient_checkpointing", s.gradient_checkpointing},
      {"ranks", world->size()},
      {"sharding", s.sharding},
      {"seed", s.seed}};
  std::vector<double> losses;
  const ValidationOptions vo = validation_options(s, s.resolution);
  Validation validation{&vo, &p, &schedule, device};
  Trainer trainer(
      trainee, o,
      typename Config::Callbacks{
          progress_bar(s), checkpoint_every(s, folders),
          tr::TensorBoard({.dir = folders.tensorboard, .config = run_settings}),
          validation_every(s, validation), StopOnInterrupt{s.stop_at}, LossRecord{&losses}});
  const std::int64_t resumed_from = resume_if_asked(trainer, s, folders);
  // Each rank its own noise (a resumed run restores each rank's generator).
  if (world->rank() > 0 && resumed_from == 0) tr::set_seed(s.seed + 7919 * world->rank());

  // A frozen text encoder's outputs: rank 0 fills the cache before the other ranks open it.
  std::optional<BatchStream> stream, class_stream;
  world->rank0_first([&] {
    stream.emplace(s, p, folder, buckets, cache ? &*cache : nullptr, s.train_text_encoder, device,
                   world->rank(), world->size(), weights.empty() ? nullptr : &weights);
    if (main_rank && world->distributed()) stream->encode_every_caption();
  });
  // Prior preservation: the class images of the same places, their prompt encoded each step;
  // diffusers' loss as per-sample weights (times kohya's, when the instances carry them).
  if (class_folder != nullptr)
    class_stream.emplace(s, p, *class_folder, buckets, nullptr, s.train_text_encoder, device,
                         world->rank(), world->size(), nullptr, /*text_cache=*/false);
  auto batch_at = [&](std::int64_t place) {
    if (!class_stream) return stream->at_place(place);
    TextToImageImpl::Batch b = stream->at_place(place);
    const std::int64_t n = b.size();
    const at::Tensor own = b.loss_weights.defined() ? b.loss_weights.cpu() : at::ones({n});
    b.loss_weights = at::Tensor();
    TextToImageImpl::Batch both = b.then(class_stream->at_place(place));
    both.loss_weights =
        (df::prior_preservation_weights(n, s.prior_loss_weight) * at::cat({own, at::ones({n})}))
            .to(both.latents.device());
    return both;
  };

  if (main_rank) {
    const auto [assigned, repeats] = assigned_buckets(folder, buckets);
    std::fprintf(stderr, "%s", data::describe_buckets(assigned, repeats).c_str());
  }
  const FitResult fit = fit_until_done_or_stopped(trainer, s, batch_at);
  // Every rank: under --sharded_mixed_precision the parameters hold the float32 masters from
  // here on, for what rank 0 writes (nothing otherwise: they are whole between steps), and the
  // EMA's weights are in the model when kept (under --sharding its shadows travel here).
  const auto whole = trainer.whole_parameters();
  std::optional<typename Trainer::EmaWeights> ema_weights;
  if constexpr (Trainer::has_ema)
    if (fit.finished) ema_weights.emplace(trainer.ema_weights());
  if (!main_rank) return fit.finished ? 0 : 130;  // rank 0 writes what the run leaves

  // What the run leaves: weights (EMA when kept), validation images, results.
  nlohmann::json files;
  auto write_outputs = [&] {
    if (s.use_lora) {
      // Both layouts; the PEFT file carries diffusers' adapter metadata (rank and alpha per
      // component), so load_lora_weights applies the scale the run trained at.
      const double alpha = s.lora_alpha > 0 ? s.lora_alpha : static_cast<double>(s.rank);
      ad::StableDiffusionLoraModules modules{.unet = p.unet.get(), .sdxl = p.xl};
      if (s.train_text_encoder) {
        modules.text_encoder = p.text_encoder.get();
        if (p.xl) modules.text_encoder_2 = p.text_encoder_2.get();
      }
      const ad::StableDiffusionLoraFiles names;
      const std::map<std::string, std::string> meta{{"lora_rank", std::to_string(s.rank)},
                                                    {"lora_alpha", std::to_string(alpha)},
                                                    {"network_algo", s.network_algo},
                                                    {"base_model", s.model}};
      if (s.network_algo == "lora" && s.use_dora && !s.dora_wd_on_output) {
        // DoRA per input column has no PEFT form: kohya's layout (the web UI's) alone.
        (void)ad::save_stable_diffusion_lora_files(out, modules, meta, names, /*peft=*/false);
      } else {
        if (s.network_algo == "lora")
          (void)ad::save_stable_diffusion_lora_files(out, modules, meta, names);
        else
          (void)ad::save_stable_diffusion_weight_delta_files(out, modules, meta, names);
        files["peft"] = names.peft.string();
      }
      files["kohya"] = names.kohya.string();
    } else if (s.save_format == "single_file") {
      // The original layout the web UI, ComfyUI and stable-diffusion.cpp load: UNet, VAE and text
      // encoders in one file, with what the base's single file held beyond them.
      models::SingleFileSaveOptions so;
      so.family = single_file_layout(p);
      so.keep = p.single_file_leftovers;
      so.dtype = s.save_dtype();
      if (p.xl)
        models::save_stable_diffusion_xl_single_file(out / "model.safetensors", p.unet, p.vae,
                                                     p.text_encoder, p.text_encoder_2, so);
      else
        models::save_stable_diffusion_single_file(out / "model.safetensors", p.unet, p.vae,
                                                  p.text_encoder, so);
      files["single_file"] = "model.safetensors";
    } else {
      if (p.single_file)
        write_single_file_pipeline_except_unet(p, out);
      else
        copy_pipeline_except_unet(p.root, out);
      // In the variant the base was read in, so the folder loads with the same --variant.
      models::SaveOptions so;
      if (!s.variant.empty()) so.variant = s.variant;
      // diffusers' fp16 and bf16 variants hold weights of that dtype.
      if (s.variant == "fp16") so.dtype = at::kHalf;
      if (s.variant == "bf16") so.dtype = at::kBFloat16;
      models::save_pretrained(p.unet, out / "unet", so);
      files["pipeline"] = ".";
    }
    if (!s.validation_prompts.empty()) {
      write_validation_images(validation.images(), vo, out);
      files["validation"] = "validation.png";
    }
  };
  if (fit.finished) write_outputs();
  const std::size_t tenth = std::max<std::size_t>(1, losses.size() / 10);
  nlohmann::json results = run_settings;
  results["files"] = files;
  results["steps"] = trainer.global_step();
  results["resumed_from"] = resumed_from;
  results["finished"] = fit.finished;
  results["first_loss"] = mean_of(losses, tenth, false);
  results["last_loss"] = mean_of(losses, tenth, true);
  results["lora_layers"] = {{"unet", unet_lora.size()}, {"text_encoder", te_lora.size()}};
  if (s.use_lora) results["network_algo"] = s.network_algo;
  // The optimizer's groups as they start (LoRA+ puts the B matrices in groups of their own).
  results["optimizer"] = chosen_optimizer(s);
  results["param_groups"] = nlohmann::json::array();
  for (const auto& g : trainer.param_groups())
    results["param_groups"].push_back({{"label", g.label},
                                       {"parameters", g.params.size()},
                                       {"lr", g.lr.value_or(s.learning_rate)}});
  results["batches_per_epoch"] = stream->batches_per_epoch();
  results["train_seconds"] = fit.seconds;
  results["data_seconds"] = stream->data_seconds();
  results["data_share"] = fit.seconds > 0 ? stream->data_seconds() / fit.seconds : 0.0;
  results["skipped_images"] = folder.skipped.size();
  if (cache)
    results["latent_cache"] = {{"entries", cache_report.entries},
                               {"reused", cache_report.reused},
                               {"encoded", cache_report.encoded},
                               {"seconds", cache_report.seconds}};
  results["total_seconds"] = examples::seconds_since(t0);
  write_results(out, results);
  std::printf("%s %lld steps (loss %.4f → %.4f, data %.1f%% of the time); %s\n",
              s.use_lora ? "LoRA" : "full fine-tuning",
              static_cast<long long>(trainer.global_step()), results["first_loss"].get<double>(),
              results["last_loss"].get<double>(), 100.0 * results["data_share"].get<double>(),
              written_files(out, files, fit.finished).c_str());
  return fit.finished ? 0 : 130;
}

int run(Settings s) {
  const auto t0 = std::chrono::steady_clock::now();
  check_sd_run_flags(s);
  check_flags(s);
  examples::apply_threads(s);
  // The ranks of a torchrun launch (a world of one without it). Every rank checks the same flags
  // and so fails the same way before this point.
  const auto ranks = torchrun_world(s, s.device);
  const auto& world = ranks.first;
  const at::Device device = ranks.second;
  // The images first: a wrong folder or caption column is found before the models load. kohya's
  // dataset config names its folders and sets the dataset's batch size, resolution and buckets.
  const bool say = world->is_main();  // every rank scans the same folder; rank 0 reports it
  data::ImageFolder folder;
  std::vector<float> weights;  // per record; empty: all 1
  if (!s.dataset_config.empty()) {
    examples::TrainingImages images = examples::images_from_dataset_config(s, s, say);
    folder = std::move(images.folder);
    weights = std::move(images.weights);
    check_flags(s);  // the file's settings, checked as the flags are
  } else {
    data::ImageFolderOptions fo;
    fo.image_column = s.image_column;
    fo.caption_column = s.caption_column;
    folder = examples::scan_training_folder(
        s.data_dir, fo, {.say = say, .limit = s.limit, .require_captions = s.require_captions});
    if (s.masked_loss)
      examples::attach_masks(folder, s.conditioning_data_dir, "--conditioning_data_dir");
  }
  const data::BucketManager buckets(bucket_options(s));
  // The epoch's batches (one bucket each) decide the steps of --num_train_epochs; the ranks share
  // them.
  const auto batches = static_cast<std::int64_t>(epoch_batch_count(folder, buckets, s));
  if (batches < world->size())
    throw ConfigError("make " + std::to_string(batches) + " batches an epoch, fewer than the " +
                          std::to_string(world->size()) + " ranks",
                      "--train_data_dir / --train_batch_size");
  resolve_max_train_steps(s, (batches + world->size() - 1) / world->size(), say);
  const examples::OutputFolder output_folder(s.out, say);
  tr::set_seed(s.seed);
  Pipeline p = load_pipeline(s.model, s.prediction_type, s.variant, s.single_file_config,
                             s.tokenizer_name, s.original_config, s.use_ema_weights);
  if (!s.enable_bucket && s.resolution % p.vae->downscale() != 0)
    throw ConfigError(
        "must be a multiple of the VAE's downscale " + std::to_string(p.vae->downscale()),
        "--resolution");
  // diffusers' prior preservation: the class images, drawn by the model where too few (rank 0
  // first; the other ranks find them), beside the instance images.
  std::optional<data::ImageFolder> class_folder;
  if (s.with_prior_preservation) {
    world->rank0_first([&] {
      const df::NoiseSchedule schedule(p.scheduler.schedule);
      p.unet->to(device);
      p.text_encoder->to(device);
      if (p.xl) p.text_encoder_2->to(device);
      p.vae->to(device);
      (void)examples::generate_class_images(p, schedule, s, s.resolution, s.num_inference_steps,
                                            s.guidance_scale, static_cast<std::uint64_t>(s.seed),
                                            device, say);
    });
    const data::ImageFolder classes = data::scan_image_folder(s.class_data_dir, {});
    class_folder = examples::aligned_class_folder(folder, classes, s.class_prompt);
    if (say)
      std::fprintf(stderr, "%zu class images of \"%s\" (%zu skipped), prior loss weight %g\n",
                   classes.images.size(), s.class_prompt.c_str(), classes.skipped.size(),
                   s.prior_loss_weight);
  }
  const data::ImageFolder* classes = class_folder ? &*class_folder : nullptr;
  return s.use_ema ? train<EmaConfig>(s, p, folder, buckets, world, device, t0, weights, classes)
                   : train<NoEmaConfig>(s, p, folder, buckets, world, device, t0, weights, classes);
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  CLI::App app{
      "Fine-tune a Stable Diffusion pipeline (full or LoRA) on a folder of captioned images."};
  app.get_formatter()->column_width(44);
  using examples::count_in;
  using examples::number_in;
  const SdFlagGroups g = add_sd_run_flags(app, s, "folder of images with captions");
  auto* img = add_image_folder_flags(app, g, s, s.limit,
                                     "training size (bucket area with --enable_bucket)");
  img->add_flag("--enable_bucket", s.enable_bucket, "kohya's aspect-ratio buckets");
  img->add_option("--min_bucket_reso", s.min_bucket_reso)
      ->check(count_in(8, 8192))
      ->capture_default_str();
  img->add_option("--max_bucket_reso", s.max_bucket_reso)
      ->check(count_in(8, 8192))
      ->capture_default_str();
  img->add_option("--bucket_reso_steps", s.bucket_reso_steps)
      ->check(count_in(1, 1024))
      ->capture_default_str();
  img->add_flag("--bucket_no_upscale", s.bucket_no_upscale, "only shrink images into buckets");
  img->add_flag("--cache_latents", s.cache_latents, "encode each image once (a cache on disk)");
  img->add_option("--cache_dir", s.cache_dir, "latent and text cache (default OUTPUT_DIR/cache)");
  auto* t = g.training;
  t->add_option("--snr_gamma", s.snr_gamma, "min-SNR γ (0: plain MSE)")
      ->check(number_in(0, 1e6))
      ->capture_default_str();
  t->add_option("--prediction_type", s.prediction_type,
                "epsilon or v_prediction (default: the scheduler's)");
  t->add_flag("--use_ema", s.use_ema, "keep an EMA of the trained weights and save it");
  add_single_file_save_flags(g, s, "the original layout (the web UI's, ComfyUI's)");
  t->add_option("--ema_decay", s.ema_decay)->check(number_in(0, 1))->capture_default_str();
  add_lora_flags(g, s, "UNet");
  t->add_flag("--train_text_encoder", s.train_text_encoder, "LoRA on the text encoders too");
  examples::add_network_flags(t, s);
  examples::add_dreambooth_flags(app, s);
  app.get_option("--train_data_dir")->required(false);  // or --dataset_config
  auto* d = add_torchrun_flags(app, s, "each UNet block");
  examples::add_kohya_flags(app, s.kohya);
  last_value_wins({g.run, g.training, g.saving, img, d});
  if (const auto rc = examples::parse_command_line(app, argc, argv)) return *rc;
  return examples::run_reporting_errors([&] {
    examples::apply_network_args(s, s);
    return run(s);
  });
}
