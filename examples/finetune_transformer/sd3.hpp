#pragma once
// finetune_transformer's Stable Diffusion 3 / 3.5 family: the StableDiffusion3Pipeline folder, the
// rectified-flow trainee, captions encoded once by the frozen text encoders, an image folder's
// batches and the validation images.

#include <difftrain/models/single_file/sd3.hpp>

#include "image_batches.hpp"
#include "run_common.hpp"

namespace {

// ---- the pipeline folder ------------------------------------------------------------------------

/// A StableDiffusion3Pipeline folder's components, read and checked before any work.
struct Sd3Pipeline {
  fs::path root;
  /// The single file the models were read from (configs, tokenizers and scheduler from `root`),
  /// and what it held beyond them.
  std::optional<fs::path> single_file;
  std::map<std::string, at::Tensor> single_file_leftovers;
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

/// Where a single file's configs and tokenizers come from: a pipeline folder of the same model
/// (--single_file_config), or the file's keys with the tokenizers named (--tokenizer_name: CLIP's
/// BPE merges file or a pipeline folder with tokenizer/ and tokenizer_2/; --t5_tokenizer: T5's
/// spiece.model or tokenizer folder, for a file holding T5).
struct Sd3SingleFileSources {
  std::string config_folder, tokenizer_name, t5_tokenizer, original_config;
};

/// An SD3 / 3.5 single file; another family's is refused by name (`flag`).
models::SingleFile read_sd3_file(const std::string& model, const std::string& flag) {
  models::SingleFile f = models::read_single_file(model);
  if (f.family != models::SingleFileFamily::sd3)
    throw ConfigError(
        "is a " + std::string(models::single_file_family_name(f.family)) +
            " file; this program trains Stable Diffusion 3 files (train_text_to_image "
            "trains the others)",
        flag);
  return f;
}

/// The CLIP tokenizers (and T5's, when `t5`) of an SD3 file read without a config folder.
void read_sd3_told_tokenizers(Sd3Pipeline& p, const Sd3SingleFileSources& src, bool t5,
                              const std::string& file_flag) {
  const std::string flag = "--tokenizer_name " + src.tokenizer_name;
  const fs::path name(src.tokenizer_name);
  if (fs::is_regular_file(name)) {  // SD3's CLIP-L pads with <|endoftext|>, CLIP-G with "!"
    p.tokenizer.emplace(text::clip_tokenizer_from_bpe_merges(name, "<|endoftext|>"));
    p.tokenizer_2.emplace(text::clip_tokenizer_from_bpe_merges(name, "!"));
  } else if (fs::is_directory(name / "tokenizer") && fs::is_directory(name / "tokenizer_2")) {
    p.tokenizer.emplace(text::CLIPTokenizer::from_folder(name / "tokenizer"));
    p.tokenizer_2.emplace(text::CLIPTokenizer::from_folder(name / "tokenizer_2"));
  } else {
    throw dt::IoError(
        "is neither CLIP's BPE merges file (bpe_simple_vocab_16e6.txt.gz) nor a pipeline folder "
        "holding tokenizer/ and tokenizer_2/ (an SD3 model has two CLIP tokenizers)",
        flag);
  }
  if (!t5) {
    if (!src.t5_tokenizer.empty())
      throw ConfigError("names T5's tokenizer but the file holds no T5 encoder",
                        "--t5_tokenizer " + src.t5_tokenizer);
    return;
  }
  const fs::path t5_name = !src.t5_tokenizer.empty()                ? fs::path(src.t5_tokenizer)
                           : fs::is_directory(name / "tokenizer_3") ? name / "tokenizer_3"
                                                                    : fs::path();
  if (t5_name.empty())
    throw ConfigError(
        "the file holds T5-XXL, whose tokenizer it lacks: pass --t5_tokenizer (T5's spiece.model, "
        "or a T5 tokenizer folder), or name a pipeline folder with tokenizer_3/ in "
        "--tokenizer_name",
        file_flag);
  p.tokenizer_3.emplace(fs::is_directory(t5_name)
                            ? text::T5Tokenizer::from_folder(t5_name)
                            : text::T5Tokenizer::from_sentencepiece_model(t5_name));
}

/// The models of an SD3 single file with configs told from its keys (SD3's scheduler: 1000
/// steps, shift 3, what SD3 medium's and 3.5's folders say).
void read_sd3_told(Sd3Pipeline& p, const models::SingleFile& f, const Sd3SingleFileSources& src,
                   const std::string& flag) {
  using models::kSd3ClipGPrefix;
  using models::kSd3ClipLPrefix;
  if (!src.original_config.empty())
    throw ConfigError("is for SD 1.x and 2.x files; an SD3 file's configs follow from its keys",
                      "--original_config " + src.original_config);
  for (std::string_view prefix : {kSd3ClipLPrefix, kSd3ClipGPrefix})
    if (!f.tensors.contains(std::string(prefix) + "text_model.embeddings.token_embedding.weight"))
      throw ConfigError(
          "holds no " + std::string(prefix == kSd3ClipLPrefix ? "CLIP-L" : "CLIP-G") +
              " text encoder (Stability's sd3_medium.safetensors holds the MMDiT and VAE alone): "
              "pass --single_file_config FOLDER, a StableDiffusion3Pipeline folder of the same "
              "model, whose text encoders and tokenizers are read, or a file with the encoders "
              "(sd3_medium_incl_clips*.safetensors)",
          flag);
  const bool t5 = f.tensors.contains(std::string(models::kSd3T5Prefix) + "shared.weight");
  read_sd3_told_tokenizers(p, src, t5, flag);
  p.flow = df::FlowMatchEuler::Options{};
  p.flow.num_train_timesteps = 1000;
  p.flow.shift = 3.0;
  const std::string where = f.where + " (told from its keys)";
  p.text_encoder = models::sd3_clip_from_single_file<Clip>(
      f, models::CLIPTextConfig::from_json(models::sd3_clip_config_from_single_file(f, 0), where),
      0);
  p.text_encoder_2 = models::sd3_clip_from_single_file<Clip>(
      f, models::CLIPTextConfig::from_json(models::sd3_clip_config_from_single_file(f, 1), where),
      1);
  if (t5)
    p.text_encoder_3 = models::sd3_t5_from_single_file<T5>(
        f, models::T5EncoderConfig::from_json(models::sd3_t5_config_from_single_file(f), where));
  p.vae = models::vae_from_single_file<Vae>(
      f, models::AutoencoderKLConfig::from_json(models::vae_config_from_single_file(f), where));
  p.transformer = models::sd3_transformer_from_single_file<Transformer>(
      f, models::SD3Transformer2DConfig::from_json(
             models::sd3_transformer_config_from_single_file(f), where));
}

/// A StableDiffusion3Pipeline folder, or an SD3 / 3.5 single file (Stability's, ComfyUI's) with
/// its configs, tokenizers and scheduler from `src` (a pipeline folder of the same model, whose
/// weights are not read, or the file's keys and the tokenizers named).
Sd3Pipeline load_sd3_pipeline(const std::string& model, const std::string& variant = {},
                              const Sd3SingleFileSources& src = {}) {
  models::LoadOptions lo;
  if (!variant.empty()) lo.variant = variant;
  Sd3Pipeline p;
  const std::string flag = "--pretrained_model_name_or_path " + model;
  const bool single = fs::is_regular_file(model);
  const bool told = single && src.config_folder.empty();
  if (told && src.tokenizer_name.empty())
    throw ConfigError(
        "is a single file, which holds no tokenizers or scheduler: pass --tokenizer_name (CLIP's "
        "BPE merges file bpe_simple_vocab_16e6.txt.gz, or a pipeline folder with the tokenizers) "
        "and, for a file with T5, --t5_tokenizer (T5's spiece.model); or --single_file_config "
        "FOLDER, a StableDiffusion3Pipeline folder of the same model (its weights are not read)",
        flag);
  if (!single)
    for (const auto& [given, name] : {std::pair{src.config_folder, "--single_file_config "},
                                      {src.tokenizer_name, "--tokenizer_name "},
                                      {src.t5_tokenizer, "--t5_tokenizer "},
                                      {src.original_config, "--original_config "}})
      if (!given.empty())
        throw ConfigError("goes with a single file (the folder has its own)", name + given);
  if (single && !told)
    for (const auto& [given, name] : {std::pair{src.tokenizer_name, "--tokenizer_name "},
                                      {src.t5_tokenizer, "--t5_tokenizer "},
                                      {src.original_config, "--original_config "}})
      if (!given.empty())
        throw ConfigError("goes with configs told from the file; --single_file_config gives them",
                          name + given);
  if (told) {
    const models::SingleFile f = read_sd3_file(model, flag);
    p.single_file = model;
    read_sd3_told(p, f, src, flag);
    p.single_file_leftovers = models::single_file_leftovers(f);
  } else {
    p.root = single ? src.config_folder : model;
    if (!fs::is_directory(p.root))
      throw dt::IoError("is not a folder (name a diffusers pipeline folder)",
                        single ? "--single_file_config " + src.config_folder : flag);
    const fs::path index_file = p.root / "model_index.json";
    const nlohmann::json index = dt::io::read_json_object(index_file);
    const std::string cls = index.value("_class_name", std::string());
    if (cls != "StableDiffusion3Pipeline")
      throw ConfigError(
          "is a " + (cls.empty() ? std::string("pipeline without _class_name") : cls) +
              "; this program trains StableDiffusion3Pipeline and CogVideoXPipeline folders",
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
    if (t5) p.tokenizer_3.emplace(text::T5Tokenizer::from_folder(p.root / "tokenizer_3"));
    if (single) {
      const models::SingleFile f = read_sd3_file(model, flag);
      p.single_file = model;
      p.text_encoder = models::sd3_clip_from_single_file<Clip>(
          f, component_config<models::CLIPTextConfig>(p.root / "text_encoder"), 0);
      p.text_encoder_2 = models::sd3_clip_from_single_file<Clip>(
          f, component_config<models::CLIPTextConfig>(p.root / "text_encoder_2"), 1);
      if (t5)
        p.text_encoder_3 = models::sd3_t5_from_single_file<T5>(
            f, component_config<models::T5EncoderConfig>(p.root / "text_encoder_3"));
      p.vae = models::vae_from_single_file<Vae>(
          f, component_config<models::AutoencoderKLConfig>(p.root / "vae"));
      p.transformer = models::sd3_transformer_from_single_file<Transformer>(
          f, component_config<models::SD3Transformer2DConfig>(p.root / "transformer"));
      p.single_file_leftovers = models::single_file_leftovers(f);
    } else {
      p.text_encoder = models::from_pretrained<Clip>(p.root / "text_encoder", lo);
      p.text_encoder_2 = models::from_pretrained<Clip>(p.root / "text_encoder_2", lo);
      if (t5) p.text_encoder_3 = models::from_pretrained<T5>(p.root / "text_encoder_3", lo);
      p.vae = models::from_pretrained<Vae>(p.root / "vae", lo);
      p.transformer = models::from_pretrained<Transformer>(p.root / "transformer", lo);
    }
  }
  const std::string transformer_where =
      told ? model + " (MMDiT)" : (p.root / "transformer").string();
  if (p.transformer->config().in_channels != p.vae->config().latent_channels)
    throw ConfigError("takes " + std::to_string(p.transformer->config().in_channels) +
                          " channels but the VAE's latents have " +
                          std::to_string(p.vae->config().latent_channels),
                      transformer_where);
  for (const auto& [tok, enc, name] : {std::tuple{&*p.tokenizer, &p.text_encoder, "tokenizer"},
                                       {&*p.tokenizer_2, &p.text_encoder_2, "tokenizer_2"}})
    if (tok->vocab_size() > (*enc)->config().vocab_size)
      throw ConfigError(std::string(name) + " has " + std::to_string(tok->vocab_size()) +
                            " tokens, more than its text encoder's " +
                            std::to_string((*enc)->config().vocab_size),
                        told ? "--tokenizer_name " + src.tokenizer_name : p.root.string());
  return p;
}

// ---- the trainee --------------------------------------------------------------------------------

/// The transformer with SD3's rectified-flow loss on latents.
struct Sd3TraineeImpl : torch::nn::Module {
  using Batch = TextImageBatch;
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
    // kohya's ip_noise_gamma (diffusers' input perturbation): x_t from noise + γ·ξ, the target
    // from the noise alone.
    const examples::StepNoise noise = examples::step_noise(x0, s_.kohya);
    // diffusers' compute_density_for_timestep_sampling, then indices = ⌊u · N⌋ into the
    // scheduler's (shifted) table.
    const at::Tensor u = df::density_for_timestep_sampling(
        density_, n,
        {.logit_mean = s_.logit_mean, .logit_std = s_.logit_std, .mode_scale = s_.mode_scale});
    const at::Tensor idx = (u * static_cast<double>(steps)).to(at::kLong).clamp(0, steps - 1);
    const at::Tensor sigmas = flow_.sigmas_for(idx).to(x0.device()).view({n, 1, 1, 1});
    const at::Tensor noisy = flow_.noisy_input(x0, noise.input_noise, sigmas);
    const at::Tensor timesteps = flow_.timesteps_for(idx).to(x0.device());
    at::Tensor pred = transformer->forward(noisy, b.embeds, b.pooled, timesteps).to(at::kFloat);
    at::Tensor target;
    if (s_.precondition_outputs) {  // the prediction turned into x̂₀
      pred = pred * (-sigmas) + noisy.to(at::kFloat);
      target = x0.to(at::kFloat);
    } else {
      target = flow_.target(x0, noise.noise).to(at::kFloat);
    }
    return weighted_flow_loss(pred, target, sigmas, timesteps, steps, weighting_, s_);
  }
  Transformer transformer{nullptr};

 private:
  df::FlowMatchEuler flow_;
  const Settings& s_;
  df::TimestepDensity density_;
  df::Sd3Weighting weighting_;
};

// ---- text and images ----------------------------------------------------------------------------

/// SD3's encoders on one caption: (embeds, pooled), as encode_prompt_sd3 gives them.
struct Sd3CaptionEncoder {
  Sd3Pipeline* p;
  const Settings* s;
  std::pair<at::Tensor, at::Tensor> operator()(const std::string& caption) const {
    text::SD3PromptOptions o;
    o.do_classifier_free_guidance = false;
    o.max_sequence_length = s->max_sequence_length;
    const text::EncodedPrompt e = text::encode_prompt_sd3(p->encoders(), {caption}, o);
    return {e.prompt_embeds[0], e.pooled_prompt_embeds[0]};
  }
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

// ---- the run ------------------------------------------------------------------------------------

int run_sd3(Settings s, const Ranks& ranks) {
  const auto t0 = std::chrono::steady_clock::now();
  check_sd_run_flags(s);
  check_flags(s);
  check_flow_loss_flags(s);
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
  // Every rank scans the same folder; rank 0 reports it.
  data::ImageFolder folder = examples::scan_training_folder(
      s.data_dir, fo, {.say = main_rank, .limit = s.limit, .require_captions = s.require_captions});
  const examples::OutputFolder output_folder(s.out, main_rank);
  tr::set_seed(s.seed);
  Sd3Pipeline p = load_sd3_pipeline(
      s.model, s.variant,
      {s.single_file_config, s.tokenizer_name, s.t5_tokenizer, s.original_config});
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
    // diffusers' SD3 LoRA targets: both streams' attention projections.
    adapted = ad::inject_lora(*p.transformer,
                              {.target_modules = {"attn.add_k_proj", "attn.add_q_proj",
                                                  "attn.add_v_proj", "attn.to_add_out", "attn.to_k",
                                                  "attn.to_out.0", "attn.to_q", "attn.to_v"}},
                              s.lora_options());
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

  BatchStream stream(s, p.vae, folder, buckets, CaptionConditioning(Sd3CaptionEncoder{&p, &s}),
                     device);
  resolve_max_train_steps(
      s, ranks.batches_each(stream.batches_per_epoch(), "--train_data_dir / --train_batch_size"),
      main_rank);
  Sd3TraineeImpl trainee(p.transformer, p.flow, s);
  trainee.train();
  nlohmann::json run_settings = common_run_settings(s, ranks);
  run_settings.update({{"images", folder.images.size()},
                       {"resolution", s.resolution},
                       {"weighting_scheme", s.weighting_scheme},
                       {"precondition_outputs", s.precondition_outputs},
                       {"shift", p.flow.shift},
                       {"t5", static_cast<bool>(p.text_encoder_3)}});
  // A full fine-tune of a single file goes back as one (with what the file held beyond the
  // models), as --save_format single_file writes one of a folder.
  WriteSingleFile write_single_file;
  if (!s.use_lora && (p.single_file || s.save_format == "single_file"))
    write_single_file = [&](nlohmann::json& files) {
      models::SingleFileSaveOptions so;
      so.family = models::SingleFileFamily::sd3;
      so.keep = p.single_file_leftovers;
      so.dtype = s.save_dtype();
      dt::io::save_safetensors(fs::path(s.out) / "model.safetensors",
                               models::stable_diffusion_3_single_file_tensors(
                                   p.transformer, p.vae, &p.text_encoder, &p.text_encoder_2,
                                   p.text_encoder_3 ? &p.text_encoder_3 : nullptr, so),
                               {{"format", "pt"}});
      files["single_file"] = "model.safetensors";
    };
  return train_and_write(
      trainee, s, ranks, run_settings, stream, p.transformer, p.root, adapted.size(),
      [&](const fs::path& out) {
        write_validation_images(validation_images(p, s, device),
                                validation_options(s, s.resolution), out);
      },
      t0, write_single_file);
}
}  // namespace
