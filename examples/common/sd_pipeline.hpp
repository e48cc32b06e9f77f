#pragma once
// What the Stable Diffusion training programs share: the pipeline folder (model_index.json and its
// components, checked before any work), the captions' conditioning as the pipelines compute it,
// the validation images, and the small callbacks (Ctrl-C, the loss record).

#include <difftrain/core/error.hpp>
#include <difftrain/data/tensor_cache.hpp>
#include <difftrain/diffusion/ddim.hpp>
#include <difftrain/diffusion/sample.hpp>
#include <difftrain/io/json_file.hpp>
#include <difftrain/io/sha256.hpp>
#include <difftrain/models/models.hpp>
#include <difftrain/models/single_file/stable_diffusion.hpp>
#include <difftrain/models/single_file/stable_diffusion_configs.hpp>
#include <difftrain/text/clip_bpe_vocab.hpp>
#include <difftrain/text/clip_tokenizer.hpp>
#include <difftrain/text/encode_prompt.hpp>
#include <difftrain/train/trainer.hpp>

#include <atomic>
#include <csignal>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "original_config.hpp"
#include "run_skeleton.hpp"
#include "scheduler_config.hpp"

namespace examples::sd {
using examples::on_sigint;
using examples::StopOnInterrupt;
namespace dt = difftrain;
namespace df = difftrain::diffusion;
namespace data = difftrain::data;
namespace models = difftrain::models;
namespace text = difftrain::text;
namespace tr = difftrain::train;
namespace fs = std::filesystem;
using dt::ConfigError;

using Unet = models::UNet2DConditionModel<>;
using Vae = models::AutoencoderKL<>;
using TextEncoder = models::CLIPTextModel<>;

// ---- the pipeline folder ------------------------------------------------------------------------

/// The components of a Stable Diffusion pipeline folder, read and checked before any work.
struct Pipeline {
  fs::path root;
  bool xl = false;  // StableDiffusionXLPipeline: two text encoders, pooled text and time ids
  bool force_zeros_for_empty_prompt = true;  // SDXL's null conditioning for validation
  std::optional<text::CLIPTokenizer> tokenizer, tokenizer_2;  // read once model_index is checked
  TextEncoder text_encoder{nullptr}, text_encoder_2{nullptr};
  Vae vae{nullptr};
  Unet unet{nullptr};
  std::optional<std::string> variant;  // the weights' variant the models were read in (--variant)
  /// The single file the models were read from (the configs, tokenizer and scheduler from `root`).
  std::optional<fs::path> single_file;
  std::optional<models::SingleFileFamily> single_file_family;
  /// What the single file held beyond the models (written back with a full fine-tune).
  std::map<std::string, at::Tensor> single_file_leftovers;
  /// A single file read without a config folder: the configs told from its keys, the tokenizers
  /// from this (a tokenizer or pipeline folder, or CLIP's BPE merges file), and the original config
  /// read beside them, if any.
  std::optional<fs::path> tokenizer_source, original_config;
  examples::SchedulerConfig scheduler;
};

/// The layout a full fine-tune of `p` is written back in as one file: its single file's, SDXL's
/// for an SDXL pipeline, or SD 2.x's (OpenCLIP's text tower) for a text encoder with GELU
/// (OpenCLIP ViT-H's; CLIP ViT-L's is quick_gelu).
inline models::SingleFileFamily single_file_layout(const Pipeline& p) {
  if (p.single_file_family) return *p.single_file_family;
  if (p.xl) return models::SingleFileFamily::sdxl;
  return p.text_encoder->config().hidden_act == "gelu" ? models::SingleFileFamily::sd2
                                                       : models::SingleFileFamily::sd1;
}

/// Each tokenizer pads prompts to its model_max_length: it must fit its encoder's positions.
inline void check_tokenizers_fit(const Pipeline& p) {
  for (const auto& [tok, enc, name] :
       {std::tuple{&p.tokenizer, &p.text_encoder, "tokenizer"},
        std::tuple{&p.tokenizer_2, &p.text_encoder_2, "tokenizer_2"}})
    if (*tok && (*tok)->model_max_length() > (*enc)->config().max_position_embeddings)
      throw ConfigError("pads prompts to " + std::to_string((*tok)->model_max_length()) +
                            " tokens (model_max_length), more than the text encoder's " +
                            std::to_string((*enc)->config().max_position_embeddings) +
                            " positions (max_position_embeddings)",
                        (p.root / name / "tokenizer_config.json").string());
}

/// model_index.json's entry `name` must be [library, class] with one of `classes`.
inline void check_component(const nlohmann::json& index, const std::string& name,
                            const std::vector<std::string>& classes, const fs::path& file) {
  const std::string where = file.string() + ": " + name;
  if (!index.contains(name) || !index[name].is_array() || index[name].size() != 2 ||
      !index[name][1].is_string())
    throw ConfigError("must name the pipeline's " + name + " as [library, class]", where);
  const std::string cls = index[name][1].get<std::string>();
  if (std::find(classes.begin(), classes.end(), cls) == classes.end()) {
    std::string want;
    for (const auto& c : classes) want += (want.empty() ? "" : " or ") + c;
    throw ConfigError("is a " + cls + "; this program trains with a " + want, where);
  }
}

/// The pipeline's parts fit each other: the UNet takes the VAE's latents and attends to text as
/// wide as the encoders give, and takes SDXL's added conditions exactly when it is SDXL's.
inline void check_pipeline_parts(const Pipeline& p, const std::string& unet_where) {
  const auto& uc = p.unet->config();
  if (uc.in_channels != p.vae->config().latent_channels)
    throw ConfigError("takes " + std::to_string(uc.in_channels) +
                          " channels but the VAE's latents have " +
                          std::to_string(p.vae->config().latent_channels),
                      unet_where);
  const std::int64_t text_width = p.text_encoder->config().hidden_size +
                                  (p.xl ? p.text_encoder_2->config().hidden_size : std::int64_t{0});
  if (uc.cross_attention_dim.front() != text_width)
    throw ConfigError("attends to " + std::to_string(uc.cross_attention_dim.front()) +
                          "-wide text but the text encoder" + (p.xl ? "s give " : " gives ") +
                          std::to_string(text_width),
                      unet_where);
  if (uc.class_embed_type || uc.num_class_embeds)
    throw ConfigError("takes class labels; a Stable Diffusion UNet takes text", unet_where);
  if (p.xl != (uc.addition_embed_type == std::optional<std::string>("text_time")))
    throw ConfigError(p.xl ? "has no SDXL added conditions (addition_embed_type \"text_time\")"
                           : "takes added conditions; an SD 1.x/2.x UNet takes text only",
                      unet_where);
}

/// model_index.json of a Stable Diffusion (1.x/2.x or XL) pipeline folder: its class checked, SDXL
/// and its null conditioning taken into `p`.
inline nlohmann::json read_sd_model_index(Pipeline& p, const fs::path& index_file) {
  const nlohmann::json index = dt::io::read_json_object(index_file);
  const std::string cls = index.value("_class_name", std::string());
  if (cls != "StableDiffusionPipeline" && cls != "StableDiffusionXLPipeline")
    throw ConfigError("is a " + (cls.empty() ? std::string("pipeline without _class_name") : cls) +
                          "; this program trains StableDiffusionPipeline (SD 1.x/2.x) and "
                          "StableDiffusionXLPipeline folders",
                      index_file.string() + ": _class_name");
  p.xl = cls == "StableDiffusionXLPipeline";
  if (p.xl && index.contains("force_zeros_for_empty_prompt") &&
      index["force_zeros_for_empty_prompt"].is_boolean())
    p.force_zeros_for_empty_prompt = index["force_zeros_for_empty_prompt"].get<bool>();
  return index;
}

/// The pipeline's tokenizer (and SDXL's second) from its folder.
inline void read_folder_tokenizers(Pipeline& p) {
  p.tokenizer.emplace(text::CLIPTokenizer::from_folder(p.root / "tokenizer"));
  if (p.xl) p.tokenizer_2.emplace(text::CLIPTokenizer::from_folder(p.root / "tokenizer_2"));
}

/// A component's config from its folder's config.json.
template <class Config>
Config component_config(const fs::path& folder) {
  return Config::from_json(models::read_model_config(folder), (folder / "config.json").string());
}

/// The tokenizers of a single file read without a config folder, from `name`
/// (--tokenizer_name): CLIP's BPE merges file (`bpe_simple_vocab_16e6.txt.gz`, as open_clip ships
/// it), from which SD 1.x's tokenizer follows and SD 2.x's and SDXL's second (padding with "!");
/// a pipeline folder holding tokenizer/ (and SDXL's tokenizer_2/); or, for SD 1.x and 2.x, a
/// tokenizer folder.
inline void read_single_file_tokenizers(Pipeline& p, const std::string& name,
                                        models::SingleFileFamily family) {
  const std::string flag = "--tokenizer_name " + name;
  const fs::path path(name);
  if (fs::is_regular_file(path)) {
    p.tokenizer.emplace(text::clip_tokenizer_from_bpe_merges(
        path, family == models::SingleFileFamily::sd2 ? "!" : "<|endoftext|>"));
    if (p.xl) p.tokenizer_2.emplace(text::clip_tokenizer_from_bpe_merges(path, "!"));
  } else if (fs::is_directory(path / "tokenizer")) {
    p.tokenizer.emplace(text::CLIPTokenizer::from_folder(path / "tokenizer"));
    if (p.xl) {
      if (!fs::is_directory(path / "tokenizer_2"))
        throw dt::IoError("holds tokenizer/ but no tokenizer_2/, which an SDXL model needs", flag);
      p.tokenizer_2.emplace(text::CLIPTokenizer::from_folder(path / "tokenizer_2"));
    }
  } else if (fs::is_directory(path)) {
    if (p.xl)
      throw ConfigError(
          "is one tokenizer folder; an SDXL model has two (the second pads with \"!\"): name a "
          "pipeline folder holding tokenizer/ and tokenizer_2/, or CLIP's BPE merges file",
          flag);
    p.tokenizer.emplace(text::CLIPTokenizer::from_folder(path));
  } else {
    throw dt::IoError(
        "is neither a tokenizer or pipeline folder nor CLIP's BPE merges file "
        "(bpe_simple_vocab_16e6.txt.gz)",
        flag);
  }
  p.tokenizer_source = path;
}

/// An SD 1.x, 2.x or XL single file (the web UI's, ComfyUI's layout) as a pipeline: its UNet, VAE
/// and text encoders from the file. With `config_folder` (--single_file_config), a diffusers
/// pipeline folder of the same model (diffusers' `from_single_file(config=)`, whose weights are not
/// read), their configs, the tokenizers and the scheduler come from there; without it the configs
/// are told from the file's keys and shapes, the tokenizers come from `tokenizer_name`
/// (--tokenizer_name) and the scheduler is Stable Diffusion's (1000 scaled-linear steps; SD 2.x's
/// prediction is v as diffusers takes SD 2.1's config, unless `prediction_type` says).
inline Pipeline load_single_file_pipeline(const std::string& file,
                                          const std::string& prediction_type,
                                          const std::string& config_folder,
                                          const std::string& tokenizer_name = {},
                                          const std::string& original_config = {},
                                          bool use_ema_weights = false) {
  const std::string flag = "--pretrained_model_name_or_path " + file;
  if (config_folder.empty() && tokenizer_name.empty())
    throw ConfigError(
        "is a single file, which holds no tokenizer: pass --tokenizer_name (CLIP's BPE merges "
        "file bpe_simple_vocab_16e6.txt.gz, or a tokenizer or pipeline folder), or "
        "--single_file_config FOLDER, a diffusers pipeline folder of the same model (its "
        "configs, tokenizer and scheduler are used; its weights are not read)",
        flag);
  Pipeline p;
  p.single_file = file;
  // The original trainer's EMA weights (model_ema.*) in place of the trained ones, as the web UI
  // loads them.
  const models::SingleFile f = models::read_single_file(file, use_ema_weights);
  p.single_file_family = f.family;
  if (config_folder.empty()) {
    p.xl = f.family == models::SingleFileFamily::sdxl;
    // The original config (--original_config, or model.yaml beside the file as the web UI reads
    // it) says what the keys cannot: the prediction, the heads, the VAE's scale.
    std::optional<examples::OriginalConfig> original;
    if (!original_config.empty())
      original = examples::read_original_config(original_config);
    else if (const auto yaml = examples::sibling_original_config(file))
      original = examples::read_original_config(*yaml);
    const bool v = f.family == models::SingleFileFamily::sd2;
    const std::string prediction = !prediction_type.empty() ? prediction_type
                                   : original               ? original->prediction
                                   : v                      ? "v_prediction"
                                                            : "epsilon";
    p.scheduler = examples::read_scheduler_config({}, prediction);
    p.original_config = original ? std::optional(original->path) : std::nullopt;
    read_single_file_tokenizers(p, tokenizer_name, f.family);
    const std::string where = file + " (told from its keys)";
    p.text_encoder = models::clip_from_single_file<TextEncoder>(
        f, models::CLIPTextConfig::from_json(models::clip_config_from_single_file(f), where));
    if (p.xl)
      p.text_encoder_2 = models::clip_2_from_single_file<TextEncoder>(
          f, models::CLIPTextConfig::from_json(models::clip_config_from_single_file(f, 1), where));
    nlohmann::json vae_config = models::vae_config_from_single_file(f);
    nlohmann::json unet_config = models::unet_config_from_single_file(f);
    if (original) {
      examples::apply_original_heads(unet_config, *original);
      if (original->scale_factor) vae_config["scaling_factor"] = *original->scale_factor;
    }
    p.vae = models::vae_from_single_file<Vae>(
        f, models::AutoencoderKLConfig::from_json(vae_config, where));
    p.unet = models::unet_from_single_file<Unet>(
        f, models::UNet2DConditionConfig::from_json(unet_config, where));
  } else {
    if (!original_config.empty())
      throw ConfigError("goes with configs told from the file; --single_file_config gives them",
                        "--original_config " + original_config);
    if (!tokenizer_name.empty())
      throw ConfigError("takes the tokenizer from --single_file_config's folder; name one of them",
                        "--tokenizer_name " + tokenizer_name);
    p.root = config_folder;
    if (!fs::is_directory(p.root))
      throw dt::IoError("is not a folder (name a diffusers pipeline folder)",
                        "--single_file_config " + config_folder);
    const fs::path index_file = p.root / "model_index.json";
    const nlohmann::json index = read_sd_model_index(p, index_file);
    if (p.xl != (f.family == models::SingleFileFamily::sdxl))
      throw ConfigError("is a " + std::string(models::single_file_family_name(f.family)) +
                            " file but --single_file_config names a " +
                            index.value("_class_name", std::string()) + " folder",
                        flag);
    p.scheduler = examples::read_scheduler_config(p.root / "scheduler" / "scheduler_config.json",
                                                  prediction_type);
    read_folder_tokenizers(p);
    p.text_encoder = models::clip_from_single_file<TextEncoder>(
        f, component_config<models::CLIPTextConfig>(p.root / "text_encoder"));
    if (p.xl) {
      p.text_encoder_2 = models::clip_2_from_single_file<TextEncoder>(
          f, component_config<models::CLIPTextConfig>(p.root / "text_encoder_2"));
    }
    p.vae = models::vae_from_single_file<Vae>(
        f, component_config<models::AutoencoderKLConfig>(p.root / "vae"));
    p.unet = models::unet_from_single_file<Unet>(
        f, component_config<models::UNet2DConditionConfig>(p.root / "unet"));
  }
  p.single_file_leftovers = models::single_file_leftovers(f);
  check_tokenizers_fit(p);
  check_pipeline_parts(p, file + " (UNet)");
  return p;
}

/// Reads the pipeline folder `model` (what --pretrained_model_name_or_path names); a non-empty
/// `prediction_type` replaces the scheduler's. A non-empty `variant` (diffusers' --variant, e.g.
/// "fp16") reads every model's weights from its variant files; they load into float32 models.
/// A single file (`.safetensors`, `.ckpt`) is read with `single_file_config`'s configs, or with
/// configs told from its keys and the tokenizers from `tokenizer_name`.
inline Pipeline load_pipeline(const std::string& model, const std::string& prediction_type,
                              const std::string& variant = {},
                              const std::string& single_file_config = {},
                              const std::string& tokenizer_name = {},
                              const std::string& original_config = {},
                              bool use_ema_weights = false) {
  if (fs::is_regular_file(model))
    return load_single_file_pipeline(model, prediction_type, single_file_config, tokenizer_name,
                                     original_config, use_ema_weights);
  if (!single_file_config.empty() || !tokenizer_name.empty() || !original_config.empty() ||
      use_ema_weights)
    throw ConfigError(
        "is a pipeline folder; --single_file_config, --tokenizer_name, --original_config and "
        "--use_ema_weights go with a single file",
        "--pretrained_model_name_or_path " + model);
  models::LoadOptions lo;
  if (!variant.empty()) lo.variant = variant;
  Pipeline p;
  p.variant = lo.variant;
  p.root = model;
  const fs::path index_file = p.root / "model_index.json";
  if (!fs::is_directory(p.root))
    throw dt::IoError("is not a folder (name a diffusers pipeline folder)",
                      "--pretrained_model_name_or_path " + model);
  const nlohmann::json index = read_sd_model_index(p, index_file);
  check_component(index, "unet", {"UNet2DConditionModel"}, index_file);
  check_component(index, "vae", {"AutoencoderKL"}, index_file);
  check_component(index, "text_encoder", {"CLIPTextModel"}, index_file);
  check_component(index, "tokenizer", {"CLIPTokenizer", "CLIPTokenizerFast"}, index_file);
  if (p.xl) {
    check_component(index, "text_encoder_2", {"CLIPTextModelWithProjection"}, index_file);
    check_component(index, "tokenizer_2", {"CLIPTokenizer", "CLIPTokenizerFast"}, index_file);
  }
  check_component(index, "scheduler",
                  {"DDPMScheduler", "DDIMScheduler", "PNDMScheduler", "EulerDiscreteScheduler",
                   "EulerAncestralDiscreteScheduler", "DPMSolverMultistepScheduler",
                   "LMSDiscreteScheduler", "HeunDiscreteScheduler", "UniPCMultistepScheduler"},
                  index_file);
  p.scheduler = examples::read_scheduler_config(p.root / "scheduler" / "scheduler_config.json",
                                                prediction_type);
  read_folder_tokenizers(p);
  p.text_encoder = models::from_pretrained<TextEncoder>(p.root / "text_encoder", lo);
  if (p.xl) p.text_encoder_2 = models::from_pretrained<TextEncoder>(p.root / "text_encoder_2", lo);
  check_tokenizers_fit(p);
  p.vae = models::from_pretrained<Vae>(p.root / "vae", lo);
  p.unet = models::from_pretrained<Unet>(p.root / "unet", lo);
  check_pipeline_parts(p, (p.root / "unet").string());
  return p;
}

// What the caches are keyed by: the weights as stored, so no model is needed to read them. Hashed
// only by the runs that use a cache (a real pipeline's weights take seconds to hash).

/// The fingerprint of the pipeline's VAE weights.
inline std::string vae_fingerprint(const Pipeline& p) {
  if (p.single_file) return data::module_fingerprint(*p.vae);
  return data::tensors_fingerprint(models::read_model_weights(p.root / "vae", p.variant));
}

/// The fingerprint of the pipeline's text encoders and tokenizers.
inline std::string text_fingerprint(const Pipeline& p) {
  std::string fp;
  for (const std::string part : {"text_encoder", "text_encoder_2"}) {
    if (!p.xl && part == "text_encoder_2") continue;
    if (p.single_file) {
      fp += data::module_fingerprint(part == "text_encoder" ? *p.text_encoder : *p.text_encoder_2) +
            "|";
      continue;
    }
    fp += data::tensors_fingerprint(
              models::read_model_weights(p.root / part, p.variant, models::kTransformersWeights)) +
          "|";
  }
  for (const auto* tok : {&p.tokenizer, &p.tokenizer_2})
    if (*tok) fp += c10::str((*tok)->size(), "|", (*tok)->model_max_length(), "|");
  return dt::io::sha256_hex(fp + (p.xl ? "sdxl" : "sd"));
}

/// The captions' conditioning as the pipelines' encode_prompt gives it: the last hidden state
/// (SD), or both encoders' penultimate ones side by side and the second's pooled projection (SDXL).
struct TextConditioning {
  at::Tensor hidden, pooled;
};
inline TextConditioning encode_captions(Pipeline& p, const std::vector<std::string>& captions) {
  text::EncodePromptOptions eo;
  eo.do_classifier_free_guidance = false;
  if (p.xl) {
    const auto e = text::encode_prompt_sdxl(*p.tokenizer, p.text_encoder, *p.tokenizer_2,
                                            p.text_encoder_2, captions, eo);
    return {e.prompt_embeds, e.pooled_prompt_embeds};
  }
  return {text::encode_prompt(*p.tokenizer, p.text_encoder, captions, eo).prompt_embeds, {}};
}

// ---- callbacks ----------------------------------------------------------------------------------

/// Every step's loss, for the report.
struct LossRecord {
  std::vector<double>* losses;
  template <class T>
  void on_step_end(T& /*trainer*/, const tr::StepInfo& s) {
    losses->push_back(s.loss);
  }
};

/// Images of the validation prompts with the current (EMA) weights: DDIM with classifier-free
/// guidance, decoded by the VAE; (N, 3, H, W) in [-1, 1].
struct ValidationOptions {
  std::vector<std::string> prompts;
  std::int64_t images_per_prompt = 2, resolution = 512, num_inference_steps = 25;
  double guidance_scale = 7.5;
  std::uint64_t seed = 0;
};

struct Validation {
  const ValidationOptions* s;
  Pipeline* p;
  const df::NoiseSchedule* schedule;
  at::Device device;
  at::Tensor images() {
    std::vector<torch::nn::Module*> parts{p->unet.get(), p->text_encoder.get()};
    if (p->xl) parts.push_back(p->text_encoder_2.get());
    std::vector<bool> training;
    for (auto* m : parts) {
      training.push_back(m->is_training());
      m->eval();
    }
    at::NoGradGuard no_grad;
    text::EncodePromptOptions eo;
    eo.num_images_per_prompt = s->images_per_prompt;
    eo.do_classifier_free_guidance = s->guidance_scale != 1.0;
    eo.force_zeros_for_empty_prompt = p->force_zeros_for_empty_prompt;
    const text::EncodedPrompt e =
        p->xl ? text::encode_prompt_sdxl(*p->tokenizer, p->text_encoder, *p->tokenizer_2,
                                         p->text_encoder_2, s->prompts, eo)
              : text::encode_prompt(*p->tokenizer, p->text_encoder, s->prompts, eo);
    const std::int64_t n = e.prompt_embeds.size(0);
    const std::int64_t h = s->resolution / p->vae->downscale();
    auto gen = at::make_generator<at::CPUGeneratorImpl>(s->seed + 4);
    const at::Tensor noise = at::randn({n, p->unet->config().in_channels, h, h}, gen).to(device);
    // SDXL's added conditions: the pooled text (the guided call's halves: prompts, then the null
    // prompts) and the time ids of an uncropped square image of the resolution.
    models::UNetConditions cond;
    if (p->xl) {
      cond.text_embeds = eo.do_classifier_free_guidance
                             ? at::cat({e.pooled_prompt_embeds, e.negative_pooled_prompt_embeds})
                             : e.pooled_prompt_embeds;
      const double r = static_cast<double>(s->resolution);
      cond.time_ids = at::tensor({r, r, 0.0, 0.0, r, r}, at::kFloat)
                          .repeat({cond.text_embeds.size(0), 1})
                          .to(device);
    }
    df::Ddim ddim(*schedule, p->scheduler.ddim);
    const at::Tensor z = df::sample(
        ddim,
        [&](const at::Tensor& x, const at::Tensor& t, const at::Tensor& c) {
          return p->unet->forward(x, t, c, cond);
        },
        noise,
        {.num_inference_steps = s->num_inference_steps,
         .guidance_scale = s->guidance_scale,
         .chunk_size = n},
        e.prompt_embeds,
        eo.do_classifier_free_guidance ? std::optional<at::Tensor>(e.negative_prompt_embeds)
                                       : std::nullopt);
    at::Tensor decoded = p->vae->decode_latents(z).clamp(-1, 1);
    for (std::size_t i = 0; i < parts.size(); ++i) parts[i]->train(training[i]);
    return decoded.cpu();
  }
  at::Tensor operator()(auto& /*trainer*/) { return images(); }
};

/// Copies the pipeline folder `base` into `out` except its `trained` component (which the program
/// writes itself), so `out` is a pipeline folder of its own.
/// A diffusers pipeline folder at `out` for a pipeline read from a single file: the VAE and text
/// encoders written from the models; the tokenizers, scheduler and model_index.json copied from
/// its config folder, or, for a file read without one, written (the tokenizers from their BPE
/// merges file or copied from their folders; Stable Diffusion's scheduler with the run's
/// prediction type). The UNet is the caller's to write.
inline void write_single_file_pipeline_except_unet(const Pipeline& p, const fs::path& out) {
  models::save_pretrained(p.vae, out / "vae");
  models::save_pretrained(p.text_encoder, out / "text_encoder");
  if (p.xl) models::save_pretrained(p.text_encoder_2, out / "text_encoder_2");
  std::vector<std::string> parts = {"tokenizer", "scheduler"};
  if (p.xl) parts.emplace_back("tokenizer_2");
  const auto copy_folder = [](const fs::path& from, const fs::path& to) {
    for (const auto& f : fs::recursive_directory_iterator(from)) {
      if (!f.is_regular_file()) continue;
      const auto target = to / fs::relative(f.path(), from);
      fs::create_directories(target.parent_path());
      fs::copy_file(f.path(), target, fs::copy_options::overwrite_existing);
    }
  };
  if (!p.root.empty()) {
    for (const auto& part : parts) copy_folder(p.root / part, out / part);
    fs::copy_file(p.root / "model_index.json", out / "model_index.json",
                  fs::copy_options::overwrite_existing);
    return;
  }
  const fs::path& tok = *p.tokenizer_source;
  if (fs::is_regular_file(tok)) {
    const bool sd2 = p.single_file_family == models::SingleFileFamily::sd2;
    text::write_clip_tokenizer_folder(tok, out / "tokenizer", sd2 ? "!" : "<|endoftext|>");
    if (p.xl) text::write_clip_tokenizer_folder(tok, out / "tokenizer_2", "!");
  } else if (fs::is_directory(tok / "tokenizer")) {
    copy_folder(tok / "tokenizer", out / "tokenizer");
    if (p.xl) copy_folder(tok / "tokenizer_2", out / "tokenizer_2");
  } else {
    copy_folder(tok, out / "tokenizer");
  }
  const std::string scheduler = p.xl ? "EulerDiscreteScheduler" : "DDIMScheduler";
  const nlohmann::json sched = {
      {"_class_name", scheduler},
      {"_diffusers_version", "0.42.1"},
      {"num_train_timesteps", p.scheduler.schedule.num_train_timesteps},
      {"beta_start", 0.00085},
      {"beta_end", 0.012},
      {"beta_schedule", "scaled_linear"},
      {"prediction_type",
       p.scheduler.prediction == dt::diffusion::Prediction::v_prediction ? "v_prediction"
       : p.scheduler.prediction == dt::diffusion::Prediction::sample     ? "sample"
                                                                         : "epsilon"},
      {"steps_offset", 1},
      {"timestep_spacing", "leading"},
      {"clip_sample", false},
      {"set_alpha_to_one", false}};
  const auto write_text_file = [](const fs::path& file, const std::string& text) {
    fs::create_directories(file.parent_path());
    dt::io::write_file_atomic(file, std::span<const char>(text.data(), text.size()));
  };
  write_text_file(out / "scheduler" / "scheduler_config.json", sched.dump(2));
  nlohmann::json index = {
      {"_class_name", p.xl ? "StableDiffusionXLPipeline" : "StableDiffusionPipeline"},
      {"_diffusers_version", "0.42.1"},
      {"unet", {"diffusers", "UNet2DConditionModel"}},
      {"vae", {"diffusers", "AutoencoderKL"}},
      {"text_encoder", {"transformers", "CLIPTextModel"}},
      {"tokenizer", {"transformers", "CLIPTokenizer"}},
      {"scheduler", {"diffusers", scheduler}}};
  if (p.xl) {
    index["text_encoder_2"] = {"transformers", "CLIPTextModelWithProjection"};
    index["tokenizer_2"] = {"transformers", "CLIPTokenizer"};
    index["force_zeros_for_empty_prompt"] = p.force_zeros_for_empty_prompt;
  } else {
    index["safety_checker"] = {nullptr, nullptr};
    index["feature_extractor"] = {nullptr, nullptr};
    index["requires_safety_checker"] = false;
  }
  write_text_file(out / "model_index.json", index.dump(2));
}

inline void copy_pipeline_except_unet(const fs::path& base, const fs::path& out,
                                      const std::string& trained = "unet") {
  for (const auto& e : fs::directory_iterator(base)) {
    const auto name = e.path().filename();
    if (name == trained) continue;
    if (e.is_directory()) {
      for (const auto& f : fs::recursive_directory_iterator(e.path())) {
        if (!f.is_regular_file()) continue;
        const auto rel = fs::relative(f.path(), base);
        fs::create_directories((out / rel).parent_path());
        fs::copy_file(f.path(), out / rel, fs::copy_options::overwrite_existing);
      }
    } else if (e.is_regular_file()) {
      fs::copy_file(e.path(), out / name, fs::copy_options::overwrite_existing);
    }
  }
}

inline void freeze(torch::nn::Module& m) {
  for (auto& param : m.parameters()) param.set_requires_grad(false);
}

inline double mean_of(const std::vector<double>& v, std::size_t n, bool back) {
  n = std::min(n, v.size());
  double sum = 0;
  for (std::size_t i = 0; i < n; ++i) sum += back ? v[v.size() - 1 - i] : v[i];
  return n == 0 ? 0.0 : sum / static_cast<double>(n);
}

}  // namespace examples::sd
