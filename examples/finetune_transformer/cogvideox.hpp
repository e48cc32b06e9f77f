#pragma once
// finetune_transformer's CogVideoX family: the CogVideoXPipeline folder, a data folder of captioned
// videos (frames chosen as diffusers' train_cogvideox_lora.py does), the v-prediction trainee and
// the validation videos.

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

/// The transformer with CogVideoX's v-prediction loss on video latents (B, F, C, h, w).
struct CogTraineeImpl : torch::nn::Module {
  struct Batch {
    at::Tensor latents, embeds;
    [[nodiscard]] std::int64_t size() const { return latents.size(0); }
    [[nodiscard]] Batch slice(std::int64_t start, std::int64_t length) const {
      return {latents.narrow(0, start, length), embeds.narrow(0, start, length)};
    }
  };
  CogTraineeImpl(CogTransformer t, const examples::SchedulerConfig& c,
                 const examples::KohyaFlags& kohya)
      : transformer(register_module("transformer", t)),
        schedule_(c.schedule),
        prediction_(c.prediction),
        kohya_(kohya) {}
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
    return df::cogvideox_loss(schedule_, prediction_, transformer->forward(noisy, b.embeds, t),
                              noisy, x0, t, type, c);
  }
  CogTransformer transformer{nullptr};

 private:
  df::NoiseSchedule schedule_;
  df::Prediction prediction_;
  examples::KohyaFlags kohya_;
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
      embeds.push_back(caption(i, place, epoch));
    }
    return {at::cat(latents).to(device_), at::cat(embeds).to(device_)};
  }

  /// Frames the training videos have (the same for every clip).
  [[nodiscard]] std::int64_t frames() const {
    return static_cast<std::int64_t>(clips_.front().count());
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

/// validation/video-<i>/frame-<k>.png for every frame, validation/video-<i>.mp4 (with FFmpeg),
/// and validation.png: one row per video of up to eight evenly spaced frames.
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
#if defined(DIFFTRAIN_HAS_VIDEO)
    // And the video itself: H.264 MP4 at CogVideoX's 8 frames a second (export_to_video's).
    const at::Tensor rgb =
        ((v.permute({0, 2, 3, 1}) + 1) * 127.5).round().clamp(0, 255).to(at::kByte).contiguous();
    data::write_video(out / "validation" / ("video-" + std::to_string(i) + ".mp4"), rgb,
                      {.fps = 8});
#endif
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
  const examples::OutputFolder output_folder(s.out, main_rank);
  tr::set_seed(s.seed);
  const bool sat = fs::is_regular_file(s.model);
  CogPipeline p =
      load_cogvideox_pipeline(sat ? s.single_file_config : s.model, s.variant,
                              {sat ? s.model : std::string(), s.sat_vae, s.sat_lora_alpha});
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
  const auto frames = static_cast<std::int64_t>(clips.front().count());
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
  resolve_max_train_steps(
      s, ranks.batches_each(stream.batches_per_epoch(), "--train_data_dir / --train_batch_size"),
      main_rank);
  CogTraineeImpl trainee(p.transformer, p.scheduler, s.kohya);
  trainee.train();
  nlohmann::json run_settings = common_run_settings(s, ranks);
  run_settings.update(
      {{"videos", clips.size()},
       {"frames", frames},
       {"latent_frames", latent_frames},
       {"height", s.height},
       {"width", s.width},
       {"scheduler", std::string(p.dpm ? "CogVideoXDPMScheduler" : "CogVideoXDDIMScheduler")},
       {"snr_shift_scale", p.scheduler.schedule.snr_shift_scale.value_or(1.0)}});
  if (main_rank)
    std::printf("%zu videos of %lld frames (%lld latent frames) at %lldx%lld\n", clips.size(),
                static_cast<long long>(frames), static_cast<long long>(latent_frames),
                static_cast<long long>(s.width), static_cast<long long>(s.height));
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
        write_validation_videos(validation_videos(p, s, frames, device), s, out);
      },
      t0, write_sat_folder);
}

}  // namespace
