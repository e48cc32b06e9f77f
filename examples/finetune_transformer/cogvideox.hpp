#pragma once
// finetune_transformer's CogVideoX family: the CogVideoXPipeline or CogVideoXImageToVideoPipeline
// folder, a data folder of captioned videos (video_clips.hpp), the v-prediction trainee (text- or
// image-to-video, CogVideoX 1.5's latent frames padded to patch_size_t) and the validation videos.

#include <difftrain/models/single_file/cogvideox_sat.hpp>

#include "run_common.hpp"
#include "video_clips.hpp"

namespace {

// ---- CogVideoX ----------------------------------------------------------------------------------
// A CogVideoXPipeline folder (T5 with its tokenizer, AutoencoderKLCogVideoX,
// CogVideoXTransformer3DModel, CogVideoXDDIMScheduler or CogVideoXDPMScheduler) trained as
// diffusers' train_cogvideox_lora.py trains it: videos encoded by the frozen 3-D VAE (a posterior
// sample × scaling_factor per step), captions by the frozen T5 (max_text_seq_length tokens, no
// mask), t ~ U{0, …, N−1}, x_t = add_noise, the v-prediction turned into x̂₀ (get_velocity(out,
// x_t, t)) and the loss (1/(1 − ᾱ_t))·|x̂₀ − x₀|².
//
// Image-to-video (a transformer taking twice the VAE's channels: CogVideoX-5B-I2V, 1.5-I2V) as
// train_cogvideox_image_to_video_lora.py: each clip's first frame, noised by σ = exp(N(−3, 0.5²))
// per clip, encoded and scaled, zero-padded to the clip's latent frames and concatenated on the
// channels (zeros instead at --noised_image_dropout of the steps); 1.5's ofs embedding gets --ofs.
// CogVideoX 1.5 (patch_size_t) trains on latent frames padded to a multiple of patch_size_t by
// repeating the first (CogVideo's fine-tuning code) and samples as its pipelines do: the noise
// padded at the front, the padding dropped before decoding.

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
  bool i2v = false;  // the transformer takes the first frame's latents beside the video's

  /// Latent frames CogVideoX 1.5 adds so `latent_frames` is a multiple of patch_size_t.
  [[nodiscard]] std::int64_t frame_padding(std::int64_t latent_frames) const {
    const std::int64_t pt = transformer->config().frame_patch();
    return (pt - latent_frames % pt) % pt;
  }
  /// The ofs input CogVideoX 1.5 I2V's transformer takes (undefined for the others).
  [[nodiscard]] models::CogVideoXConditions conditions(double ofs, at::Device device) const {
    models::CogVideoXConditions c;
    if (transformer->config().ofs_embed_dim)
      c.ofs = at::full({1}, ofs, at::TensorOptions().dtype(at::kFloat).device(device));
    return c;
  }

  [[nodiscard]] std::int64_t text_length() const {
    return transformer->config().max_text_seq_length;
  }
  [[nodiscard]] at::Tensor encode(const std::vector<std::string>& prompts) {
    return text::t5_prompt_embeds(*tokenizer, text_encoder, prompts, text_length());
  }
};

/// CogVideoX checkpoints of the SAT training code in place of the folder's weights: the
/// transformer's mp_rank_00_model_states.pt (--pretrained_model_name_or_path, with the folder as
/// --single_file_config), its LoRA merged with `lora_alpha` (--sat_lora_alpha), and the VAE's
/// 3d-vae.pt (--sat_vae).
struct SatCheckpoints {
  std::string transformer, vae;
  double lora_alpha = 1.0;
};

CogPipeline load_cogvideox_pipeline(const std::string& model, const std::string& variant = {},
                                    const SatCheckpoints& sat = {}) {
  models::LoadOptions lo;
  if (!variant.empty()) lo.variant = variant;
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
  const bool i2v_pipeline = index.value("_class_name", "") == "CogVideoXImageToVideoPipeline";
  p.scheduler = examples::read_scheduler_config(p.root / "scheduler" / "scheduler_config.json");
  p.tokenizer.emplace(text::T5Tokenizer::from_folder(p.root / "tokenizer"));
  p.text_encoder = models::from_pretrained<T5>(p.root / "text_encoder", lo);
  p.vae =
      sat.vae.empty()
          ? models::from_pretrained<CogVae>(p.root / "vae", lo)
          : models::cogvideox_vae_from_sat<CogVae>(
                sat.vae, component_config<models::AutoencoderKLCogVideoXConfig>(p.root / "vae"));
  p.transformer =
      sat.transformer.empty()
          ? models::from_pretrained<CogTransformer>(p.root / "transformer", lo)
          : models::cogvideox_transformer_from_sat<CogTransformer>(
                sat.transformer,
                component_config<models::CogVideoXTransformer3DConfig>(p.root / "transformer"),
                sat.lora_alpha);
  const auto& tc = p.transformer->config();
  const std::int64_t latent = p.vae->config().latent_channels;
  p.i2v = tc.in_channels == 2 * latent;
  if (tc.in_channels != latent && !p.i2v)
    throw ConfigError("takes " + std::to_string(tc.in_channels) + " channels; the VAE's latents " +
                          std::to_string(latent) + " (text-to-video) or " +
                          std::to_string(2 * latent) + " (image-to-video) would do",
                      (p.root / "transformer").string());
  if (p.i2v != i2v_pipeline)
    throw ConfigError(std::string("is a ") +
                          (i2v_pipeline ? "CogVideoXImageToVideoPipeline" : "CogVideoXPipeline") +
                          " whose transformer takes " + std::to_string(tc.in_channels) +
                          " channels, " + (p.i2v ? "an image" : "a text") + "-to-video model's",
                      index_file.string());
  if (tc.text_embed_dim != p.text_encoder->config().d_model)
    throw ConfigError("reads text of width " + std::to_string(tc.text_embed_dim) + ", T5 writes " +
                          std::to_string(p.text_encoder->config().d_model),
                      (p.root / "transformer").string());
  return p;
}

/// What image-to-video training adds: the frozen VAE that encodes each step's noised first frames.
struct ImageToVideoTraining {
  CogVae vae{nullptr};
  double noised_image_dropout = 0.05;
};

/// The transformer with CogVideoX's v-prediction loss on video latents (B, F, C, h, w).
struct CogTraineeImpl : torch::nn::Module {
  struct Batch {
    at::Tensor latents, embeds;
    at::Tensor images;  // image-to-video: the clips' first frames (B, 3, 1, H, W) in [−1, 1]
    [[nodiscard]] std::int64_t size() const { return latents.size(0); }
    [[nodiscard]] Batch slice(std::int64_t start, std::int64_t length) const {
      return {latents.narrow(0, start, length), embeds.narrow(0, start, length),
              images.defined() ? images.narrow(0, start, length) : at::Tensor()};
    }
  };
  CogTraineeImpl(CogTransformer t, const examples::SchedulerConfig& c,
                 const examples::KohyaFlags& kohya, models::CogVideoXConditions conditions,
                 std::optional<ImageToVideoTraining> i2v)
      : transformer(register_module("transformer", t)),
        schedule_(c.schedule),
        prediction_(c.prediction),
        kohya_(kohya),
        conditions_(std::move(conditions)),
        i2v_(std::move(i2v)) {}
  at::Tensor loss(const Batch& b) {
    const at::Tensor& x0 = b.latents;
    const std::int64_t n = x0.size(0);
    // kohya's ip_noise_gamma (diffusers' input perturbation): x_t from noise + γ·ξ.
    const examples::StepNoise noise = examples::step_noise(x0, kohya_);
    const at::Tensor t = schedule_.sample_timesteps(n, x0.options());
    const at::Tensor noisy = schedule_.add_noise(x0, noise.input_noise, t);
    const df::LossType type = df::loss_type_from(kohya_.loss_type, "--loss_type");
    at::Tensor c;
    if (type == df::LossType::huber || type == df::LossType::smooth_l1)
      c = df::huber_threshold(df::huber_schedule_from(kohya_.huber_schedule, "--huber_schedule"),
                              kohya_.huber_c, kohya_.huber_scale, t, schedule_)
              .to(x0.device());
    const at::Tensor input = i2v_ ? at::cat({noisy, image_latents(b.images, x0)}, 2) : noisy;
    return df::cogvideox_loss(schedule_, prediction_,
                              transformer->forward(input, b.embeds, t, conditions_), noisy, x0, t,
                              type, c);
  }
  CogTransformer transformer{nullptr};

 private:
  /// train_cogvideox_image_to_video_lora.py's image latents: the first frames noised by
  /// σ = exp(N(−3, 0.5²)) each, a posterior sample × scaling_factor, zero-padded to the video's
  /// latent frames; all zeros at --noised_image_dropout of the steps.
  at::Tensor image_latents(const at::Tensor& images, const at::Tensor& x0) {
    at::NoGradGuard no_grad;
    const std::int64_t n = images.size(0);
    const at::Tensor sigma = at::normal(-3.0, 0.5, {n}, std::nullopt, images.options()).exp();
    const at::Tensor noised = images + at::randn_like(images) * sigma.view({n, 1, 1, 1, 1});
    at::Tensor z = i2v_->vae->encode_latents(noised).permute({0, 2, 1, 3, 4}).to(x0.dtype());
    z = at::cat({z, at::zeros({n, x0.size(1) - z.size(1), x0.size(2), x0.size(3), x0.size(4)},
                              x0.options())},
                1);
    if (at::rand({1}).item<double>() < i2v_->noised_image_dropout) z = at::zeros_like(z);
    return z;
  }

  df::NoiseSchedule schedule_;
  df::Prediction prediction_;
  examples::KohyaFlags kohya_;
  models::CogVideoXConditions conditions_;
  std::optional<ImageToVideoTraining> i2v_;
};

/// The run's batches by place in the run: shuffled clips per epoch (the same for a seed), their
/// posteriors encoded once per clip and flip, a latent sample drawn per step.
class VideoBatchStream {
 public:
  VideoBatchStream(const Settings& s, CogPipeline& p, const std::vector<VideoClip>& clips,
                   at::Device device)
      : s_(s), p_(p), clips_(clips), device_(device), epoch_batches_(batches(0)) {}

  /// --cache_latents: opens the latent cache (the VAE's posteriors of every clip, and its mirror
  /// with --random_flip) and the text cache (T5's states of every caption) under --cache_dir,
  /// and encodes what they lack. Rank 0 calls it before the other ranks, which then only read.
  void open_caches(const std::string& vae_fingerprint, const std::string& text_fingerprint) {
    const fs::path root =
        s_.cache_dir.empty() ? fs::path(s_.out) / "cache" : fs::path(s_.cache_dir);
    latent_cache_.emplace(root / "video_latents", vae_fingerprint,
                          "CogVideoX VAE posteriors of video clips (mean, std; I2V first frames)");
    if (!s_.kohya.captions.any())
      text_cache_.emplace(root / "text", text_fingerprint, "T5 prompt embeddings (CogVideoX)");
    for (auto* cache : {&*latent_cache_, text_cache_ ? &*text_cache_ : nullptr})
      if (cache != nullptr)
        for (const auto& d : cache->damaged())
          std::fprintf(stderr, "cache: %s was damaged (%s); its entries are computed again\n",
                       d.path.string().c_str(), d.reason.c_str());
    std::size_t encoded = 0;
    for (std::size_t i = 0; i < clips_.size(); ++i)
      for (const bool flip : {false, true}) {
        if (flip && !s_.random_flip) continue;
        if (!latent_cache_->contains(cache_key(i, flip))) ++encoded;
        (void)posterior(i, flip);
      }
    if (text_cache_) {
      std::vector<std::string> captions;
      for (const auto& c : clips_) captions.push_back(c.caption);
      std::sort(captions.begin(), captions.end());
      captions.erase(std::unique(captions.begin(), captions.end()), captions.end());
      (void)text_cache_->entries_for_texts(
          captions, [&](const auto& texts) { return text_entry(texts); },
          1);  // one at a time, as the run without the cache encodes them: the same bits
      text_cache_->flush();
    }
    latent_cache_->flush();
    std::fprintf(stderr, "latent cache: %zu entries, %zu encoded now, in %s\n",
                 latent_cache_->size(), encoded, latent_cache_->folder().string().c_str());
  }

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
    std::vector<at::Tensor> latents, embeds, images;
    for (const std::size_t i : batch) {
      // The flip draw belongs to (seed, place, clip), so a resumed run flips as the first did.
      const bool flip =
          s_.random_flip && at::rand({1}, at::make_generator<at::CPUGeneratorImpl>(
                                              static_cast<std::uint64_t>(s_.seed) * 1'000'003 +
                                              static_cast<std::uint64_t>(place) * 131 + i))
                                    .item<double>() < 0.5;
      const Encoded e = posterior(i, flip);
      at::Tensor z;
      {
        at::NoGradGuard no_grad;
        z = (e.mean + e.std * at::randn(e.mean.sizes(), e.mean.options())) *
            p_.vae->config().scaling_factor;
        z = z.permute({0, 2, 1, 3, 4});  // (1, F, C, h, w), as the transformer reads
        // CogVideoX 1.5: the first latent frame repeated in front up to a multiple of
        // patch_size_t, as CogVideo's fine-tuning code pads.
        if (const std::int64_t pad = p_.frame_padding(z.size(1)); pad > 0)
          z = at::cat({z.narrow(1, 0, 1).expand({-1, pad, -1, -1, -1}), z}, 1);
      }
      latents.push_back(z);
      embeds.push_back(caption(i, place, epoch));
      if (p_.i2v) images.push_back(e.first_frame);
    }
    return {at::cat(latents).to(device_), at::cat(embeds).to(device_),
            p_.i2v ? at::cat(images).to(device_) : at::Tensor()};
  }

  [[nodiscard]] std::size_t latents_cached() const {
    return latent_cache_ ? latent_cache_->size() : 0;
  }

 private:
  /// One shape per batch: the clips' buckets (all one shape without --video_resolution_buckets).
  [[nodiscard]] std::vector<std::vector<std::size_t>> batches(std::uint64_t epoch) const {
    std::vector<data::VideoShape> shapes;
    for (const auto& c : clips_) shapes.push_back(c.shape());
    return data::video_bucket_batches(shapes, static_cast<std::size_t>(s_.train_batch_size),
                                      s_.seed, epoch);
  }
  /// A clip's posterior (and, for image-to-video, its first frame), computed once per flip: kept
  /// in memory, or with --cache_latents in the cache on disk.
  struct Encoded {
    at::Tensor mean, std, first_frame;
  };
  Encoded posterior(std::size_t i, bool flip) {
    std::string key;
    if (latent_cache_) {
      key = cache_key(i, flip);
      if (latent_cache_->contains(key)) {
        const auto e = latent_cache_->get(key);
        return {e.at("mean").unsqueeze(0).to(device_), e.at("std").unsqueeze(0).to(device_),
                p_.i2v ? e.at("first_frame").unsqueeze(0) : at::Tensor()};
      }
    } else if (auto it = posteriors_.find({i, flip}); it != posteriors_.end()) {
      return it->second;
    }
    at::NoGradGuard no_grad;
    const at::Tensor clip = load_clip(clips_[i], s_, flip).to(device_);
    const auto d = p_.vae->encode(clip);
    Encoded e{d.mean, d.std, p_.i2v ? clip.narrow(2, 0, 1).cpu() : at::Tensor()};
    if (latent_cache_) {
      data::TensorCache::Entry entry{{"mean", e.mean[0].to(at::kFloat).cpu().contiguous()},
                                     {"std", e.std[0].to(at::kFloat).cpu().contiguous()}};
      if (p_.i2v) entry["first_frame"] = e.first_frame[0].contiguous();
      latent_cache_->put(key, entry);
      return posterior(i, flip);  // as a cached run reads it, so both runs train alike
    }
    return posteriors_.emplace(std::make_pair(i, flip), e).first->second;
  }
  /// Clip `i`'s latent cache key: its source is read and hashed once, not at every step.
  const std::string& cache_key(std::size_t i, bool flip) {
    auto [it, fresh] = cache_keys_.try_emplace(std::make_pair(i, flip));
    if (fresh) it->second = clip_cache_key(clips_[i], s_, flip);
    return it->second;
  }
  data::TensorCache::Entry text_entry(const std::vector<std::string>& texts) {
    at::NoGradGuard no_grad;
    return {{"embeds", p_.encode(texts).to(at::kFloat).cpu().contiguous()}};
  }
  /// Clip `i`'s caption encoded, as kohya's caption options make it at `place` (then encoded
  /// afresh each time), or as written (encoded once).
  at::Tensor caption(std::size_t i, std::int64_t place, std::uint64_t epoch) {
    const std::string& c = clips_[i].caption;
    at::NoGradGuard no_grad;
    if (s_.kohya.captions.any()) {
      const auto processed = examples::processed_captions(
          {c}, s_.kohya, static_cast<std::uint64_t>(s_.seed) * 1'000'003 + i, place,
          static_cast<std::int64_t>(epoch) + 1, place / s_.gradient_accumulation_steps,
          s_.max_train_steps);
      return p_.encode(processed).cpu();
    }
    if (text_cache_)
      return text_cache_
          ->entries_for_texts(
              {c}, [&](const auto& texts) { return text_entry(texts); }, 1)
          .front()
          .at("embeds")
          .unsqueeze(0);
    auto it = text_.find(c);
    if (it != text_.end()) return it->second;
    return text_.emplace(c, p_.encode({c}).cpu()).first->second;
  }

  const Settings& s_;
  CogPipeline& p_;
  const std::vector<VideoClip>& clips_;
  at::Device device_;
  std::vector<std::vector<std::size_t>> epoch_batches_;  // epoch_'s order
  std::uint64_t epoch_ = 0;
  std::map<std::pair<std::size_t, bool>, Encoded> posteriors_;
  std::map<std::string, at::Tensor> text_;
  std::optional<data::TensorCache> latent_cache_, text_cache_;
  std::map<std::pair<std::size_t, bool>, std::string> cache_keys_;
};

/// The first frame of each validation video of an image-to-video run, (3, height, width) in
/// [−1, 1]: --validation_images (one per prompt, or one for all; resized to the training size
/// when they differ), or else the training clips' first frames in turn.
std::vector<at::Tensor> validation_first_frames(const Settings& s,
                                                const std::vector<VideoClip>& clips,
                                                const data::VideoShape& shape) {
  const std::size_t prompts = s.validation_prompts.size();
  if (!s.validation_images.empty() && s.validation_images.size() != 1 &&
      s.validation_images.size() != prompts)
    throw ConfigError(std::to_string(s.validation_images.size()) + " images for " +
                          std::to_string(prompts) +
                          " --validation_prompt (give one per prompt, "
                          "or one for all)",
                      "--validation_images");
  std::vector<at::Tensor> frames;
  for (std::size_t k = 0; k < prompts; ++k) {
    if (s.validation_images.empty()) {
      at::Tensor first = load_clip(clips[k % clips.size()], s, false)[0].select(1, 0);
      if (first.size(1) != shape.height || first.size(2) != shape.width)  // another bucket's
        first =
            at::_upsample_bilinear2d_aa(first.unsqueeze(0), {shape.height, shape.width}, false)[0];
      frames.push_back(first);
      continue;
    }
    const std::string& file = s.validation_images[s.validation_images.size() == 1 ? 0 : k];
    if (!fs::is_regular_file(file))
      throw dt::IoError("does not exist", "--validation_images " + file);
    frames.push_back(data::to_unit_range(data::resize(
        data::read_image(file).pixels.permute({2, 0, 1}), {shape.height, shape.width})));
  }
  return frames;
}

/// Videos of the validation prompts, as CogVideoXPipeline (or CogVideoXImageToVideoPipeline,
/// from `first_frames`) samples them: its scheduler, classifier-free guidance against the empty
/// prompt (by the cosine schedule with --use_dynamic_cfg), CogVideoX 1.5's padded noise, decoded
/// by the VAE: (n, 3, F, height, width) in [−1, 1] on the CPU.
at::Tensor validation_videos(CogPipeline& p, const Settings& s, const data::VideoShape& shape,
                             const std::vector<at::Tensor>& first_frames, at::Device device) {
  const std::int64_t frames = shape.frames;
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
  const std::int64_t padding = p.frame_padding(latent_frames), padded = latent_frames + padding;
  const std::int64_t down = p.vae->spatial_downscale(), c = vc.latent_channels;
  const std::int64_t h = shape.height / down, w = shape.width / down;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(s.seed + 7);
  const at::Tensor noise = at::randn({n, padded, c, h, w}, gen).to(device);
  // Image-to-video: each first frame's posterior sampled (the pipeline's generator, after the
  // noise), scaled as the pipeline scales it, then zero frames up to the video's length.
  at::Tensor image_latents;
  if (p.i2v) {
    std::vector<at::Tensor> zs;
    for (std::int64_t k = 0; k < n; ++k) {
      const at::Tensor image = first_frames[static_cast<std::size_t>(k / s.num_validation_images)];
      // Drawn on the CPU from the CPU generator and moved, as diffusers' randn_tensor does.
      const auto d = p.vae->encode(image.unsqueeze(0).unsqueeze(2).to(device));
      at::Tensor z =
          d.mean + d.std * at::randn(d.mean.sizes(), gen, at::kFloat).to(d.mean.options());
      z = p.vae->image_latents_scaled(z).permute({0, 2, 1, 3, 4});
      zs.push_back(at::cat({z, at::zeros({1, padded - 1, c, h, w}, z.options())}, 1));
    }
    image_latents = at::cat(zs);
  }
  const df::NoiseSchedule schedule(p.scheduler.schedule);
  df::CogVideoXSamplerOptions so;
  so.prediction_type = p.scheduler.prediction;
  so.set_alpha_to_one = p.scheduler.ddim.set_alpha_to_one;
  so.steps_offset = p.scheduler.ddim.steps_offset;
  so.timestep_spacing = p.scheduler.ddim.timestep_spacing;
  const models::CogVideoXConditions cond = p.conditions(s.ofs, device);
  auto model = [&](const at::Tensor& x, const at::Tensor& t, const at::Tensor& row) {
    const at::Tensor in =
        p.i2v ? at::cat({x, image_latents.index_select(0, row.remainder(n))}, 2) : x;
    return p.transformer->forward(in, embeds.index_select(0, row), t, cond);
  };
  df::SampleOptions o{.num_inference_steps = s.num_inference_steps,
                      .guidance_scale = s.guidance_scale,
                      .chunk_size = n};
  if (s.use_dynamic_cfg)
    o.guidance_at = [&](std::size_t, std::int64_t t) {
      return df::cogvideox_dynamic_guidance(s.guidance_scale, s.num_inference_steps, t);
    };
  at::Tensor z;
  if (p.dpm) {
    df::CogVideoXDpm sampler(schedule, so);
    z = df::sample(sampler, model, noise, o, rows, rows + n, gen);
  } else {
    df::CogVideoXDdim sampler(schedule, so);
    z = df::sample(sampler, model, noise, o, rows, rows + n);
  }
  // CogVideoX 1.5: the padding frames (in front) are dropped before decoding.
  z = z.narrow(1, padding, latent_frames);
  const at::Tensor videos = p.vae->decode_latents(z.permute({0, 2, 1, 3, 4})).clamp(-1, 1).cpu();
  p.transformer->train(was_training);
  return videos;
}

/// validation/video-<i>/frame-<k>.png for every frame, validation/video-<i>.mp4 and .gif (with
/// FFmpeg), and validation.png: one row per video of up to eight evenly spaced frames. An
/// image-to-video run also says how close each video's first frame is to the image it started
/// from (PSNR), in validation/videos.json.
void write_validation_videos(const at::Tensor& videos, const Settings& s, const fs::path& out,
                             const std::vector<at::Tensor>& first_frames) {
  nlohmann::json report = nlohmann::json::array();
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
#if defined(DIFFTRAIN_HAS_VIDEO)
    // And the video itself: H.264 MP4 at CogVideoX's 8 frames a second (export_to_video's).
    const at::Tensor rgb =
        ((v.permute({0, 2, 3, 1}) + 1) * 127.5).round().clamp(0, 255).to(at::kByte).contiguous();
    data::write_video(out / "validation" / ("video-" + std::to_string(i) + ".mp4"), rgb,
                      {.fps = 8});
    data::write_video(out / "validation" / ("video-" + std::to_string(i) + ".gif"), rgb,
                      {.fps = 8});
#endif
    nlohmann::json entry{{"video", i}, {"prompt", prompt}};
    if (!first_frames.empty()) {
      const at::Tensor given =
          first_frames[static_cast<std::size_t>(i / s.num_validation_images)].clamp(-1, 1);
      const double mse = ((v[0] - given) * 127.5).square().mean().item<double>();
      entry["first_frame_psnr"] = 10 * std::log10(255.0 * 255.0 / std::max(mse, 1e-12));
    }
    report.push_back(entry);
    for (std::int64_t j = 0; j < shown; ++j)
      strip.push_back(v[shown == 1 ? 0 : j * (frames - 1) / (shown - 1)]);
  }
  dt::io::write_png(out / "validation.png",
                    dt::io::image_grid(at::stack(strip), {.columns = shown, .padding = 2}),
                    {{"Description", "one row per validation video, frames left to right"}});
  const std::string text = report.dump(1) + "\n";
  dt::io::write_file_atomic(out / "validation" / "videos.json",
                            std::span<const char>(text.data(), text.size()));
}

int run_cogvideox(Settings s, const Ranks& ranks) {
  const auto t0 = std::chrono::steady_clock::now();
  check_sd_run_flags(s);
  examples::apply_threads(s);
  const bool main_rank = ranks.main();
  // The videos first: a wrong data folder is found before the models load.
  check_frame_sampling(s);
  const std::vector<data::VideoShape> buckets =
      s.video_resolution_buckets.empty()
          ? std::vector<data::VideoShape>()
          : data::parse_video_buckets(s.video_resolution_buckets, "--video_resolution_buckets");
  for (const auto& b : buckets)
    if ((b.frames - 1) % 4 != 0)
      throw ConfigError(
          "has " + std::to_string(b.frames) + " frames; the 3-D VAE takes 4k + 1 (e.g. 49, 17)",
          "--video_resolution_buckets " + b.str());
  const std::vector<VideoClip> clips = scan_videos(s, buckets);
  const examples::OutputFolder output_folder(s.out, main_rank);
  tr::set_seed(s.seed);
  const bool sat = fs::is_regular_file(s.model);
  CogPipeline p =
      load_cogvideox_pipeline(sat ? s.single_file_config : s.model, s.variant,
                              {sat ? s.model : std::string(), s.sat_vae, s.sat_lora_alpha});
  const auto& tc = p.transformer->config();
  const std::int64_t unit = p.vae->spatial_downscale() * tc.patch_size;
  // The sizes clips train at: --height × --width, or each bucket's.
  std::vector<std::pair<std::int64_t, std::string>> sides{{s.height, "--height"},
                                                          {s.width, "--width"}};
  for (const auto& b : buckets) {
    sides.emplace_back(b.height, "--video_resolution_buckets " + b.str());
    sides.emplace_back(b.width, "--video_resolution_buckets " + b.str());
  }
  for (const auto& [side, flag] : sides)
    if (side % unit != 0)
      throw ConfigError("must be a multiple of " + std::to_string(unit) +
                            " (the VAE's downscale × the patch size)",
                        flag);
  // Validation videos: the first bucket's shape, or the clips' frames at --height × --width.
  const data::VideoShape shape = buckets.empty() ? clips.front().shape() : buckets.front();
  const std::int64_t frames = shape.frames;
  const std::int64_t latent_frames =
      (frames - 1) / static_cast<std::int64_t>(p.vae->config().temporal_compression_ratio) + 1;
  const at::Device device = ranks.device;

  freeze(*p.vae);
  freeze(*p.text_encoder);
  std::vector<std::string> adapted;
  if (s.use_lora) {
    // diffusers' CogVideoX LoRA targets: the attention projections.
    adapted = ad::inject_lora(
        *p.transformer, {.target_modules = {"to_k", "to_q", "to_v", "to_out.0"}}, s.lora_options());
  }
  p.vae->to(device);
  p.vae->eval();
  p.text_encoder->to(device);
  p.text_encoder->eval();
  p.transformer->to(device);
  if (s.gradient_checkpointing) p.transformer->set_gradient_checkpointing(true);

  VideoBatchStream stream(s, p, clips, device);
  if (s.cache_latents)
    ranks.world->rank0_first([&] {
      const fs::path root = p.root;
      const std::optional<std::string> variant =
          s.variant.empty() ? std::nullopt : std::optional<std::string>(s.variant);
      const std::string vae_fp =
          s.sat_vae.empty()
              ? data::tensors_fingerprint(models::read_model_weights(root / "vae", variant))
              : data::module_fingerprint(*p.vae);
      const std::string text_fp = dt::io::sha256_hex(
          data::tensors_fingerprint(models::read_model_weights(root / "text_encoder", variant,
                                                               models::kTransformersWeights)) +
          "|" + std::to_string(p.tokenizer->size()) + "|" + std::to_string(p.text_length()));
      stream.open_caches(vae_fp, text_fp);
    });
  resolve_max_train_steps(
      s, ranks.batches_each(stream.batches_per_epoch(), "--train_data_dir / --train_batch_size"),
      main_rank);
  std::optional<ImageToVideoTraining> i2v;
  if (p.i2v) i2v = ImageToVideoTraining{p.vae, s.noised_image_dropout};
  CogTraineeImpl trainee(p.transformer, p.scheduler, s.kohya, p.conditions(s.ofs, device), i2v);
  if (!p.i2v && !s.validation_images.empty())
    throw ConfigError(
        "are first frames for an image-to-video model; " + s.model + " is text-to-video",
        "--validation_images");
  if (!p.i2v && s.was_given("--noised_image_dropout"))
    throw ConfigError("is for image-to-video models; " + s.model + " is text-to-video",
                      "--noised_image_dropout");
  if (!tc.ofs_embed_dim && s.was_given("--ofs"))
    throw ConfigError("is for CogVideoX 1.5's image-to-video model (ofs_embed_dim); " + s.model +
                          " has no ofs embedding",
                      "--ofs");
  const std::vector<at::Tensor> first_frames =
      p.i2v ? validation_first_frames(s, clips, shape) : std::vector<at::Tensor>();
  trainee.train();
  nlohmann::json run_settings = common_run_settings(s, ranks);
  run_settings.update(
      {{"videos", clips.size()},
       {"frames", frames},
       {"latent_frames", latent_frames},
       {"padded_latent_frames", latent_frames + p.frame_padding(latent_frames)},
       {"image_to_video", p.i2v},
       {"frame_sampling", s.frame_sampling},
       {"height", shape.height},
       {"width", shape.width},
       {"video_buckets", data::describe_video_buckets([&] {
          std::vector<data::VideoShape> all;
          for (const auto& c : clips) all.push_back(c.shape());
          return all;
        }())},
       {"latents_cached", stream.latents_cached()},
       {"scheduler", std::string(p.dpm ? "CogVideoXDPMScheduler" : "CogVideoXDDIMScheduler")},
       {"snr_shift_scale", p.scheduler.schedule.snr_shift_scale.value_or(1.0)}});
  if (main_rank) {
    if (buckets.empty())
      std::printf("%zu videos of %lld frames (%lld latent frames) at %lldx%lld\n", clips.size(),
                  static_cast<long long>(frames), static_cast<long long>(latent_frames),
                  static_cast<long long>(s.width), static_cast<long long>(s.height));
    else
      std::printf("%zu videos in buckets (frames x height x width):\n%s", clips.size(),
                  run_settings["video_buckets"].get<std::string>().c_str());
  }
  // A full fine-tune of SAT checkpoints: the folder (its configs, T5, scheduler) with the trained
  // transformer and, with --sat_vae, the VAE the videos were encoded by.
  WriteSingleFile write_sat_folder;
  if (sat && !s.use_lora)
    write_sat_folder = [&](nlohmann::json& files) {
      const fs::path out(s.out);
      copy_pipeline_except_unet(p.root, out, "transformer");
      models::save_pretrained(p.transformer, out / "transformer");
      if (!s.sat_vae.empty()) {
        dt::io::remove_tree(out / "vae");
        models::save_pretrained(p.vae, out / "vae");
      }
      files["pipeline"] = ".";
    };
  return train_and_write(
      trainee, s, ranks, run_settings, stream, p.transformer, p.root, adapted.size(),
      [&](const fs::path& out) {
        write_validation_videos(validation_videos(p, s, shape, first_frames, device), s, out,
                                first_frames);
      },
      t0, write_sat_folder);
}

}  // namespace
