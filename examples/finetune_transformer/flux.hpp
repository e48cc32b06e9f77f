#pragma once
// finetune_transformer's Flux.1 family (dev and schnell), as diffusers'
// train_dreambooth_lora_flux.py and train_dreambooth_flux.py train it: the FluxPipeline folder,
// rectified flow on 2×2-packed latents with the guidance embedding given --guidance_scale, captions
// encoded once by CLIP-L (pooled) and T5 (states), and FluxPipeline's sampling for the validation
// images. On one device, kohya's memory options: --fp8_base (frozen weights in float8 with a
// per-tensor scale) and
// --blocks_to_swap N (the last blocks' frozen weights in host memory, brought in per block).

#include <difftrain/adapters/flux_lora_files.hpp>
#include <difftrain/models/single_file/flux.hpp>
#include <difftrain/nn/block_swap.hpp>

#include "image_batches.hpp"
#include "run_common.hpp"

namespace {

namespace dnn = difftrain::nn;
using FluxTransformer = models::FluxTransformer2DModel<>;

// ---- the pipeline folder ------------------------------------------------------------------------

/// A FluxPipeline folder's components, read and checked before any work.
struct FluxPipelineParts {
  fs::path root;
  std::optional<text::CLIPTokenizer> tokenizer;
  std::optional<text::T5Tokenizer> tokenizer_2;
  Clip text_encoder{nullptr};
  T5 text_encoder_2{nullptr};
  Vae vae{nullptr};
  FluxTransformer transformer{nullptr};
  df::FlowMatchEuler::Options flow;
  // The scheduler's dynamic shift: μ linear in the image's tokens between these.
  std::int64_t base_image_seq_len = 256, max_image_seq_len = 4096;
  double base_shift = 0.5, max_shift = 1.15;

  [[nodiscard]] std::int64_t vae_scale_factor() const { return vae->downscale(); }
  [[nodiscard]] bool dev() const { return transformer->config().guidance_embeds; }
};

/// FlowMatchEulerDiscreteScheduler's config as Flux's folders hold it (dynamic shifting).
void read_flux_scheduler(FluxPipelineParts& p, const fs::path& file) {
  const nlohmann::json j = dt::io::read_json_object(file);
  const std::string cls = j.value("_class_name", std::string());
  if (cls != "FlowMatchEulerDiscreteScheduler")
    throw ConfigError("is a " + cls + "; Flux trains with FlowMatchEulerDiscreteScheduler",
                      file.string() + ": _class_name");
  try {
    p.flow.num_train_timesteps = j.value("num_train_timesteps", p.flow.num_train_timesteps);
    p.flow.shift = j.value("shift", p.flow.shift);
    p.flow.use_dynamic_shifting = j.value("use_dynamic_shifting", false);
    if (j.value("time_shift_type", std::string("exponential")) == "linear")
      p.flow.time_shift_type = df::FlowMatchEuler::TimeShift::linear;
    p.base_image_seq_len = j.value("base_image_seq_len", p.base_image_seq_len);
    p.max_image_seq_len = j.value("max_image_seq_len", p.max_image_seq_len);
    p.base_shift = j.value("base_shift", p.base_shift);
    p.max_shift = j.value("max_shift", p.max_shift);
  } catch (const nlohmann::json::exception& e) {
    throw ConfigError(std::string("a field has the wrong type: ") + e.what(), file.string());
  }
  if (p.max_image_seq_len <= p.base_image_seq_len)
    throw ConfigError("max_image_seq_len must exceed base_image_seq_len", file.string());
}

/// A FluxPipeline folder (black-forest-labs/FLUX.1-dev's or -schnell's layout); with
/// `single_file`, the transformer from that file (Black Forest Labs' or ComfyUI's layout), its
/// config from the folder's transformer/ (whose weights are not read).
FluxPipelineParts load_flux_pipeline(const fs::path& root, const std::string& variant,
                                     const std::optional<fs::path>& single_file = std::nullopt) {
  models::LoadOptions lo;
  if (!variant.empty()) lo.variant = variant;
  FluxPipelineParts p;
  p.root = root;
  const fs::path index_file = root / "model_index.json";
  const nlohmann::json index = dt::io::read_json_object(index_file);
  check_component(index, "transformer", {"FluxTransformer2DModel"}, index_file);
  check_component(index, "vae", {"AutoencoderKL"}, index_file);
  check_component(index, "text_encoder", {"CLIPTextModel"}, index_file);
  check_component(index, "tokenizer", {"CLIPTokenizer", "CLIPTokenizerFast"}, index_file);
  check_component(index, "text_encoder_2", {"T5EncoderModel"}, index_file);
  check_component(index, "tokenizer_2", {"T5TokenizerFast", "T5Tokenizer"}, index_file);
  check_component(index, "scheduler", {"FlowMatchEulerDiscreteScheduler"}, index_file);
  read_flux_scheduler(p, root / "scheduler" / "scheduler_config.json");
  p.tokenizer.emplace(text::CLIPTokenizer::from_folder(root / "tokenizer"));
  p.tokenizer_2.emplace(text::T5Tokenizer::from_folder(root / "tokenizer_2"));
  p.text_encoder = models::from_pretrained<Clip>(root / "text_encoder", lo);
  p.text_encoder_2 = models::from_pretrained<T5>(root / "text_encoder_2", lo);
  p.vae = models::from_pretrained<Vae>(root / "vae", lo);
  if (single_file) {
    p.transformer = models::flux_transformer_from_single_file<FluxTransformer>(
        models::read_flux_single_file(*single_file),
        component_config<models::FluxTransformer2DConfig>(root / "transformer"),
        single_file->string());
  } else {
    p.transformer = models::from_pretrained<FluxTransformer>(root / "transformer", lo);
  }
  const auto& tc = p.transformer->config();
  const std::string where = (root / "transformer").string();
  if (tc.in_channels != 4 * p.vae->config().latent_channels)
    throw ConfigError("takes " + std::to_string(tc.in_channels) +
                          " channels; 2×2 packed latents of the VAE's " +
                          std::to_string(p.vae->config().latent_channels) + " channels are " +
                          std::to_string(4 * p.vae->config().latent_channels),
                      where);
  if (tc.joint_attention_dim != p.text_encoder_2->config().d_model)
    throw ConfigError("reads text states of width " + std::to_string(tc.joint_attention_dim) +
                          ", T5's are " + std::to_string(p.text_encoder_2->config().d_model),
                      where);
  if (tc.pooled_projection_dim != p.text_encoder->config().hidden_size)
    throw ConfigError("reads pooled vectors of width " + std::to_string(tc.pooled_projection_dim) +
                          ", CLIP's are " + std::to_string(p.text_encoder->config().hidden_size),
                      where);
  if (p.tokenizer->vocab_size() > p.text_encoder->config().vocab_size)
    throw ConfigError("tokenizer has " + std::to_string(p.tokenizer->vocab_size()) +
                          " tokens, more than its text encoder's " +
                          std::to_string(p.text_encoder->config().vocab_size),
                      root.string());
  return p;
}

// ---- the trainee --------------------------------------------------------------------------------

/// The transformer with Flux's rectified-flow loss (train_dreambooth_lora_flux.py): σ drawn by
/// the weighting scheme's density and looked up in the scheduler's (unshifted) table, x_σ =
/// (1 − σ)·x₀ + σ·ε packed into 2×2 tokens, the velocity against ε − x₀, weighted by w(σ).
struct FluxTraineeImpl : torch::nn::Module {
  using Batch = TextImageBatch;
  FluxTraineeImpl(FluxTransformer t, const FluxPipelineParts& p, const Settings& s)
      : transformer(register_module("transformer", t)),
        flow_(p.flow),
        s_(s),
        vae_scale_(p.vae_scale_factor()) {
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
    const std::int64_t h = x0.size(2), w = x0.size(3);
    const examples::StepNoise noise = examples::step_noise(x0, s_.kohya);
    const at::Tensor u = df::density_for_timestep_sampling(
        density_, n,
        {.logit_mean = s_.logit_mean, .logit_std = s_.logit_std, .mode_scale = s_.mode_scale});
    const at::Tensor idx = (u * static_cast<double>(steps)).to(at::kLong).clamp(0, steps - 1);
    const at::Tensor sigmas = flow_.sigmas_for(idx).to(x0.device()).view({n, 1, 1, 1});
    const at::Tensor noisy = flow_.noisy_input(x0, noise.input_noise, sigmas);
    const at::Tensor timesteps = flow_.timesteps_for(idx).to(x0.device());
    const auto on = at::TensorOptions().device(x0.device());
    const at::Tensor img_ids = models::flux_latent_image_ids(h / 2, w / 2).to(x0.device());
    const at::Tensor txt_ids = at::zeros({b.embeds.size(1), 3}, on);
    // dev embeds the guidance scale it was distilled with; schnell has no guidance input.
    const at::Tensor guidance = transformer->config().guidance_embeds
                                    ? at::full({n}, s_.guidance_scale, on.dtype(at::kFloat))
                                    : at::Tensor();
    const at::Tensor packed =
        transformer->forward(models::flux_pack_latents(noisy), b.embeds, b.pooled, timesteps / 1000,
                             img_ids, txt_ids, guidance);
    const at::Tensor pred =
        models::flux_unpack_latents(packed, h * vae_scale_, w * vae_scale_, vae_scale_)
            .to(at::kFloat);
    const at::Tensor target = flow_.target(x0, noise.noise).to(at::kFloat);
    return weighted_flow_loss(pred, target, sigmas, timesteps, steps, weighting_, s_);
  }
  FluxTransformer transformer{nullptr};

 private:
  df::FlowMatchEuler flow_;
  const Settings& s_;
  std::int64_t vae_scale_;
  df::TimestepDensity density_;
  df::Sd3Weighting weighting_;
};

// ---- validation ---------------------------------------------------------------------------------

/// Images of the validation prompts as FluxPipeline draws them: packed noise from a CPU
/// generator seeded with --seed + 7, σ's linspace(1, 1/n, n) shifted by μ of the image's
/// tokens, the guidance embedding (no classifier-free guidance), decoded by the VAE (in [−1, 1],
/// CPU).
at::Tensor flux_validation_images(FluxPipelineParts& p, const Settings& s, at::Device device) {
  at::NoGradGuard no_grad;
  const bool was_training = p.transformer->is_training();
  p.transformer->eval();
  std::vector<std::string> prompts;
  for (const auto& prompt : s.validation_prompts)
    for (std::int64_t k = 0; k < s.num_validation_images; ++k) prompts.push_back(prompt);
  text::FluxPromptOptions po;
  po.max_sequence_length = s.max_sequence_length;
  const text::EncodedPrompt e = text::encode_prompt_flux(
      *p.tokenizer, p.text_encoder, *p.tokenizer_2, p.text_encoder_2, prompts, po);
  const auto n = static_cast<std::int64_t>(prompts.size());
  const std::int64_t vsf = p.vae_scale_factor(), side = 2 * (s.resolution / (vsf * 2));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(s.seed + 7);
  const at::Tensor noise =
      at::randn({n, p.vae->config().latent_channels, side, side}, gen).to(device);
  at::Tensor latents = models::flux_pack_latents(noise);
  const at::Tensor img_ids = models::flux_latent_image_ids(side / 2, side / 2).to(device);
  const at::Tensor txt_ids = at::zeros({s.max_sequence_length, 3}, noise.options());
  const double mu = models::flux_calculate_shift(latents.size(1), p.base_image_seq_len,
                                                 p.max_image_seq_len, p.base_shift, p.max_shift);
  df::FlowMatchEuler sampler(p.flow);
  std::vector<double> sigmas;
  for (std::int64_t i = 0; i < s.num_inference_steps; ++i)
    sigmas.push_back(df::numpy::linspace(1.0, 1.0 / static_cast<double>(s.num_inference_steps),
                                         s.num_inference_steps, i));
  sampler.set_sigmas(sigmas, mu);
  const at::Tensor embeds = e.prompt_embeds.to(device), pooled = e.pooled_prompt_embeds.to(device);
  const at::Tensor guidance =
      p.dev() ? at::full({n}, s.guidance_scale, noise.options()) : at::Tensor();
  for (const float t : sampler.timesteps()) {
    const at::Tensor timestep = at::full({n}, t, noise.options()) / 1000;
    const at::Tensor v =
        p.transformer->forward(latents, embeds, pooled, timestep, img_ids, txt_ids, guidance);
    latents = sampler.step(v, latents);
  }
  const at::Tensor z = models::flux_unpack_latents(latents, side * vsf, side * vsf, vsf);
  const at::Tensor images = p.vae->decode_latents(z).clamp(-1, 1).cpu();
  p.transformer->train(was_training);
  return images;
}

// ---- the run ------------------------------------------------------------------------------------

/// Flux's own flag checks and defaults (those of diffusers' Flux scripts where the SD3 family's
/// differ): guidance 3.5, no loss weighting, T5's 512 tokens for dev and 256 for schnell.
void check_flux_flags(Settings& s, bool dev) {
  check_flow_loss_flags(s);
  if (s.was_given("--precondition_outputs"))
    throw ConfigError("is SD3's; Flux's loss is on the velocity ε − x₀ (diffusers' Flux scripts)",
                      "--precondition_outputs");
  if (!s.was_given("--guidance_scale")) s.guidance_scale = 3.5;
  if (!s.was_given("--weighting_scheme")) s.weighting_scheme = "none";
  if (!s.was_given("--max_sequence_length")) s.max_sequence_length = dev ? 512 : 256;
  if (!dev && s.max_sequence_length > 256)
    throw ConfigError("is " + std::to_string(s.max_sequence_length) +
                          "; schnell was trained on at most 256 T5 tokens",
                      "--max_sequence_length");
  if (s.lora_format != "peft" && s.lora_format != "kohya")
    throw ConfigError("is '" + s.lora_format + "'; choose peft (diffusers') or kohya",
                      "--lora_format");
  if (!s.use_lora) {
    for (const auto& [set, flag] : std::initializer_list<std::pair<bool, const char*>>{
             {s.blocks_to_swap > 0, "--blocks_to_swap"},
             {s.fp8_base, "--fp8_base"},
             {s.lora_format != "peft", "--lora_format"},
             {!s.lora_layers.empty(), "--lora_layers"}})
      if (set)
        throw ConfigError(
            "goes with --use_lora: it keeps or names frozen weights, and a full fine-tune trains "
            "them all",
            flag);
  }
  if (s.blocks_to_swap > 0 && s.sharding == 3)
    throw ConfigError("moves parameters between host and device as stage 3 does; use one of them",
                      "--blocks_to_swap with --sharding 3");
  if (s.use_dora && s.lora_format == "kohya")
    throw ConfigError("kohya's Flux layout holds no DoRA magnitudes; write --lora_format peft",
                      "--use_dora with --lora_format kohya");
}

/// The modules LoRA adapts: --lora_layers (comma-separated, PEFT's suffix rule) or diffusers'.
ad::LoraTargets flux_targets(const Settings& s) {
  if (s.lora_layers.empty()) return ad::flux_lora_targets();
  ad::LoraTargets t;
  std::string rest = s.lora_layers;
  while (!rest.empty()) {
    const auto comma = rest.find(',');
    std::string name = rest.substr(0, comma);
    name.erase(0, name.find_first_not_of(' '));
    name.erase(name.find_last_not_of(' ') + 1);
    if (name.empty()) throw ConfigError("names an empty module", "--lora_layers " + s.lora_layers);
    t.target_modules.push_back(name);
    rest = comma == std::string::npos ? std::string() : rest.substr(comma + 1);
  }
  return t;
}

int run_flux(Settings s, const Ranks& ranks, const fs::path& root,
             const std::optional<fs::path>& single_file) {
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
  data::ImageFolderOptions fo;
  fo.image_column = s.image_column;
  fo.caption_column = s.caption_column;
  data::ImageFolder folder = examples::scan_training_folder(
      s.data_dir, fo, {.say = main_rank, .limit = s.limit, .require_captions = s.require_captions});
  tr::set_seed(s.seed);
  FluxPipelineParts p = load_flux_pipeline(root, s.variant, single_file);
  check_flux_flags(s, p.dev());
  const auto& tc = p.transformer->config();
  // Caught before the output folder exists.
  (void)dnn::split_blocks_to_swap(s.blocks_to_swap, tc.num_layers, tc.num_single_layers,
                                  "--blocks_to_swap");
  if (s.resolution % (p.vae_scale_factor() * 2) != 0)
    throw ConfigError("must be a multiple of twice the VAE's downscale (" +
                          std::to_string(p.vae_scale_factor() * 2) + ": 2×2 packed latents)",
                      "--resolution");
  const at::Device device = ranks.device;

  freeze(*p.vae);
  freeze(*p.text_encoder);
  freeze(*p.text_encoder_2);
  std::vector<std::string> adapted;
  if (s.use_lora) {
    try {
      adapted = ad::inject_lora(*p.transformer, flux_targets(s), s.lora_options());
    } catch (const ConfigError& e) {
      if (s.lora_layers.empty()) throw;
      throw ConfigError(e.message() + " (no module of the transformer ends so)",
                        "--lora_layers " + s.lora_layers);
    }
  }
  // Every flag checked: the output folder may be made.
  const examples::OutputFolder output_folder(s.out, main_rank);
  // kohya's --fp8_base: the frozen linear weights in float8 with a per-tensor scale, each
  // dequantised to the compute dtype in its layer's forward.
  dnn::Fp8Storage fp8;
  if (s.fp8_base) {
    const at::ScalarType compute = s.mixed_precision == "bf16"   ? at::kBFloat16
                                   : s.mixed_precision == "fp16" ? at::kHalf
                                                                 : at::kFloat;
    fp8 = dnn::store_frozen_weights_fp8(*p.transformer, compute);
  }
  for (torch::nn::Module* m : std::initializer_list<torch::nn::Module*>{
           p.vae.ptr().get(), p.text_encoder.ptr().get(), p.text_encoder_2.ptr().get()}) {
    m->to(device);
    m->eval();
  }
  // --blocks_to_swap: the swapped blocks' frozen weights go to the host before the rest of the
  // transformer goes to the device, so the whole model is never on it.
  const std::unique_ptr<dnn::BlockSwap> swap = models::flux_block_swap(
      p.transformer, s.blocks_to_swap, {.device = device}, "--blocks_to_swap");
  p.transformer->to(device);
  if (s.gradient_checkpointing) p.transformer->set_gradient_checkpointing(true);

  text::FluxPromptOptions po;
  po.max_sequence_length = s.max_sequence_length;
  BatchStream stream(
      s, p.vae, folder, buckets, CaptionConditioning([&](const std::string& caption) {
        const text::EncodedPrompt e = text::encode_prompt_flux(
            *p.tokenizer, p.text_encoder, *p.tokenizer_2, p.text_encoder_2, {caption}, po);
        return std::pair{e.prompt_embeds[0], e.pooled_prompt_embeds[0]};
      }),
      device);
  resolve_max_train_steps(
      s, ranks.batches_each(stream.batches_per_epoch(), "--train_data_dir / --train_batch_size"),
      main_rank);
  FluxTraineeImpl trainee(p.transformer, p, s);
  trainee.train();
  nlohmann::json run_settings = common_run_settings(s, ranks);
  run_settings.update(
      {{"model_type", "flux"},
       {"flux", p.dev() ? "dev" : "schnell"},
       {"images", folder.images.size()},
       {"resolution", s.resolution},
       {"lora_format", s.lora_format},
       {"weighting_scheme", s.weighting_scheme},
       {"guidance_scale", s.guidance_scale},
       {"max_sequence_length", s.max_sequence_length},
       {"fp8_base", s.fp8_base},
       {"fp8_layers", fp8.layers},
       {"fp8_weight_bytes", {{"before", fp8.bytes_before}, {"after", fp8.bytes_after}}},
       {"blocks_to_swap", s.blocks_to_swap},
       {"swapped_blocks", swap ? swap->stats().blocks : 0},
       {"swapped_bytes", swap ? swap->stats().host_bytes : 0}});
  // kohya's layout in place of PEFT's: the same branches under BFL's names (fused qkv and linear1
  // as block-diagonal branches), read by diffusers' load_lora_weights and ComfyUI.
  WriteSingleFile write_own;
  // A full fine-tune as one file in Black Forest Labs' layout (ComfyUI's diffusion model;
  // diffusers' FluxTransformer2DModel.from_single_file), when asked or when the base was one.
  if (!s.use_lora && (single_file || s.save_format == "single_file"))
    write_own = [&](nlohmann::json& files) {
      dt::io::save_safetensors(fs::path(s.out) / "flux_transformer.safetensors",
                               models::flux_single_file_tensors(*p.transformer, s.save_dtype()),
                               {{"format", "pt"}});
      files["single_file"] = "flux_transformer.safetensors";
    };
  if (s.use_lora && s.lora_format == "kohya")
    write_own = [&](nlohmann::json& files) {
      dt::io::save_safetensors(
          fs::path(s.out) / "flux_lora.safetensors",
          ad::flux_kohya_lora_state_dict(*p.transformer, tc.num_layers, tc.num_single_layers),
          {{"ss_network_module", "networks.lora_flux"},
           {"ss_network_dim", std::to_string(s.rank)},
           {"ss_network_alpha",
            std::to_string(s.lora_options().alpha.value_or(static_cast<double>(s.rank)))},
           {"ss_base_model_version", p.dev() ? "flux1" : "flux1_schnell"}});
      files["kohya"] = "flux_lora.safetensors";
    };
  return train_and_write(
      trainee, s, ranks, run_settings, stream, p.transformer, p.root, adapted.size(),
      [&](const fs::path& out) {
        write_validation_images(flux_validation_images(p, s, device),
                                validation_options(s, s.resolution), out);
      },
      t0, write_own);
}

}  // namespace
