// Fine-tuning a Stable Diffusion 3 / 3.5 or Flux.1 transformer on a folder of captioned images, as
// diffusers' train_dreambooth_lora_sd3.py / _flux.py and train_dreambooth_sd3.py / _flux.py do,
// or a CogVideoX transformer on captioned videos, as train_cogvideox_lora.py does, with their flag
// names. The pipeline folder's
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
// FluxPipeline (Flux.1 dev or schnell), as train_dreambooth_lora_flux.py and
// train_dreambooth_flux.py: CLIP-L (pooled) and T5 captions encoded once each, rectified flow on
// 2×2-packed latents (diffusers' Flux defaults: no loss weighting, --guidance_scale 3.5 into dev's
// guidance embedding, 512 T5 tokens for dev and 256 for schnell); LoRA on diffusers' Flux targets
// or --lora_layers, written in PEFT's layout or kohya's (--lora_format kohya:
// flux_lora.safetensors); kohya's --fp8_base and --blocks_to_swap N for one device.
//
//   finetune_transformer --pretrained_model_name_or_path FLUX.1-dev --train_data_dir IMAGES
//                        --output_dir OUT --use_lora --rank 16 --gradient_checkpointing
//                        [--fp8_base] [--blocks_to_swap 18]
//
// CogVideoXPipeline or CogVideoXImageToVideoPipeline (1.0 or 1.5): T5 and its tokenizer, the 3-D
// VAE, the transformer and CogVideoX's DDIM or DPM scheduler; a data folder (diffusers'
// --instance_data_root is --train_data_dir here) in diffusers' layout (--caption_column and
// --video_column files), SAT's (videos/ + labels/) or videos with .txt captions beside them, a
// video being a video file, a folder of its frames or one image; frames chosen as diffusers does
// (--skip_frames_start/end, --max_num_frames, then 4k + 1) or as SAT's dataset does
// (--frame_sampling sat at --video_fps), resized to --height × --width. LoRA on the attention
// projections (to_q, to_k, to_v, to_out.0) or full fine-tuning with CogVideoX's v-prediction loss;
// image-to-video with the noised first frame's latents beside the video's; CogVideoX 1.5's latent
// frames padded to patch_size_t; validation videos as PNG frames, MP4 and GIF
// (--use_dynamic_cfg for the pipelines' guidance schedule).
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

#include "cogvideox.hpp"
#include "flux.hpp"
#include "run_common.hpp"
#include "sd3.hpp"

namespace {

/// SD3 or CogVideoX, by the folder's model_index.json (a single file: SD3's, with its config
/// folder).
int run(const Settings& s) {
  const bool single = fs::is_regular_file(s.model);
  if (single && s.single_file_config.empty() &&
      fs::path(s.model).filename() == "mp_rank_00_model_states.pt")
    throw ConfigError(
        "is a SAT checkpoint (CogVideoX's), which holds no configs, T5 or scheduler: pass "
        "--single_file_config FOLDER, a CogVideoXPipeline folder of the same model (its "
        "transformer's weights are not read), and --sat_vae 3d-vae.pt for SAT's VAE",
        "--pretrained_model_name_or_path " + s.model);
  // A Flux transformer file (Black Forest Labs' or ComfyUI's) holds the transformer alone.
  if (single && s.single_file_config.empty() && fs::path(s.model).extension() == ".safetensors") {
    bool flux = false;
    try {
      flux = !models::read_flux_single_file(s.model).empty();
    } catch (const dt::FormatError&) {  // another family's file: its own loader says what it is
    }
    if (flux)
      throw ConfigError(
          "is a Flux transformer file, which holds no text encoders, VAE or scheduler: pass "
          "--single_file_config FOLDER, a FluxPipeline folder of the same model (its "
          "transformer's config is read, not its weights)",
          "--pretrained_model_name_or_path " + s.model);
  }
  const fs::path root(single ? s.single_file_config : s.model);
  if (!fs::is_directory(root) && !single)
    throw dt::IoError("is not a folder (name a diffusers pipeline folder)",
                      "--pretrained_model_name_or_path " + s.model);
  const nlohmann::json index = fs::is_directory(root)
                                   ? dt::io::read_json_object(root / "model_index.json")
                                   : nlohmann::json::object();
  // The ranks of a torchrun launch. Every rank checks the same flags and folders, and so fails
  // the same way before this point.
  auto [world, device] = torchrun_world(s, s.device);
  const Ranks ranks{std::move(world), device};
  const std::string pipeline = index.value("_class_name", std::string());
  if (pipeline == "FluxPipeline") {
    for (const auto& [set, flag] : std::initializer_list<std::pair<bool, const char*>>{
             {!s.sat_vae.empty(), "--sat_vae"},
             {!s.tokenizer_name.empty(), "--tokenizer_name"},
             {!s.t5_tokenizer.empty(), "--t5_tokenizer"}})
      if (set)
        throw ConfigError("is not a Flux option (the FluxPipeline folder has its own)", flag);
    return run_flux(s, ranks, root,
                    single ? std::optional<fs::path>(s.model) : std::optional<fs::path>());
  }
  for (const auto& [set, flag] : std::initializer_list<std::pair<bool, const char*>>{
           {s.blocks_to_swap > 0, "--blocks_to_swap"},
           {s.fp8_base, "--fp8_base"},
           {s.lora_format != "peft", "--lora_format"},
           {!s.lora_layers.empty(), "--lora_layers"}})
    if (set)
      throw ConfigError("is a Flux option; the model is a " +
                            (pipeline.empty() ? std::string("single file") : pipeline),
                        flag);
  const bool cogvideox =
      pipeline == "CogVideoXPipeline" || pipeline == "CogVideoXImageToVideoPipeline";
  if (!cogvideox)
    for (const auto& [set, flag] : std::initializer_list<std::pair<bool, const char*>>{
             {!s.sat_vae.empty(), "--sat_vae"},
             {s.use_dynamic_cfg, "--use_dynamic_cfg"},
             {!s.validation_images.empty(), "--validation_images"},
             {s.frame_sampling != "diffusers", "--frame_sampling"},
             {!s.video_resolution_buckets.empty(), "--video_resolution_buckets"},
             {s.cache_latents, "--cache_latents"},
             {s.was_given("--ofs"), "--ofs"},
             {s.was_given("--noised_image_dropout"), "--noised_image_dropout"}})
      if (set) throw ConfigError("is CogVideoX's; the model is not a CogVideoX pipeline", flag);
  if (cogvideox) {
    if (s.save_format == "single_file")
      throw ConfigError(
          "CogVideoX writes pipeline folders (its SAT checkpoints are read: "
          "--pretrained_model_name_or_path mp_rank_00_model_states.pt with --single_file_config)",
          "--save_format single_file");
    if (single && !s.tokenizer_name.empty())
      throw ConfigError("takes the tokenizer from --single_file_config's CogVideoX folder",
                        "--tokenizer_name " + s.tokenizer_name);
    return run_cogvideox(s, ranks);
  }
  return run_sd3(s, ranks);
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  CLI::App app{
      "Fine-tune a Stable Diffusion 3 or Flux.1 transformer on captioned images, or a CogVideoX "
      "transformer on captioned videos (LoRA or full)."};
  app.get_formatter()->column_width(44);
  using examples::count_in;
  using examples::number_in;
  const SdFlagGroups g = add_sd_run_flags(app, s, "folder of images with captions");
  auto* img = add_image_folder_flags(app, g, s, s.limit, "training size (square)");
  auto* t = g.training;
  add_lora_flags(g, s, "transformer");
  add_single_file_save_flags(
      g, s,
      "Stability's SD3 layout (ComfyUI's; a single-file base is written back "
      "as one)");
  t->add_option("--weighting_scheme", s.weighting_scheme,
                "sigma_sqrt, logit_normal, mode, cosmap or none")
      ->capture_default_str();
  t->add_option("--logit_mean", s.logit_mean)->capture_default_str();
  t->add_option("--logit_std", s.logit_std)->check(number_in(0, 100, true))->capture_default_str();
  t->add_option("--mode_scale", s.mode_scale)->capture_default_str();
  t->add_option("--precondition_outputs", s.precondition_outputs,
                "1: the loss on x̂₀ (diffusers' default); 0: on ε − x₀")
      ->capture_default_str();
  g.run->add_option("--t5_tokenizer", s.t5_tokenizer,
                    "with an SD3 single file holding T5 and no --single_file_config: T5's "
                    "SentencePiece model (spiece.model) or tokenizer folder");
  g.run->add_option("--sat_vae", s.sat_vae,
                    "CogVideoX: the SAT training code's 3d-vae.pt in place of the folder's VAE "
                    "(the transformer's mp_rank_00_model_states.pt goes in "
                    "--pretrained_model_name_or_path, its folder in --single_file_config)");
  g.run
      ->add_option("--sat_lora_alpha", s.sat_lora_alpha,
                   "CogVideoX: the lora_alpha a SAT LoRA checkpoint was trained with (SAT's "
                   "LoraMixin default 1: a scale of 1/r)")
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
  video
      ->add_option("--frame_sampling", s.frame_sampling,
                   "diffusers: train_cogvideox_lora.py's frames, resized; sat: the SAT code's "
                   "window at --video_fps padded to --max_num_frames, resized to cover and "
                   "centre-cropped (SAT's skip_frms_num is --skip_frames_start)")
      ->capture_default_str();
  video
      ->add_option("--video_fps", s.video_fps,
                   "the frame rate --frame_sampling sat trains at (a stride of the file's rate / "
                   "this); folders of frames are taken at it")
      ->check(number_in(0, 1000, true))
      ->capture_default_str();
  video->add_option("--validation_images", s.validation_images,
                    "image-to-video: the first frame of each --validation_prompt's video (one per "
                    "prompt, or one for all; default: the training clips' first frames)");
  video
      ->add_option("--noised_image_dropout", s.noised_image_dropout,
                   "image-to-video: the chance a step trains without its first frame")
      ->check(number_in(0, 1))
      ->capture_default_str();
  video->add_option("--ofs", s.ofs, "CogVideoX 1.5 image-to-video: the ofs embedding's input")
      ->capture_default_str();
  video->add_flag("--use_dynamic_cfg", s.use_dynamic_cfg,
                  "validation videos with the pipelines' cosine guidance schedule");
  video->add_option("--video_resolution_buckets", s.video_resolution_buckets,
                    "FRAMESxHEIGHTxWIDTH buckets (finetrainers'): each clip takes the nearest "
                    "frame count and size, batches hold one shape; validation uses the first");
  video->add_flag("--cache_latents", s.cache_latents,
                  "encode each clip (and caption) once into a cache on disk");
  video->add_option("--cache_dir", s.cache_dir,
                    "the latent and text cache (default OUTPUT_DIR/cache)");
  auto* flux = app.add_option_group("Flux (FluxPipeline folders)");
  flux->add_option("--lora_layers", s.lora_layers,
                   "comma-separated modules LoRA adapts (PEFT's suffix rule) in place of "
                   "diffusers' Flux targets");
  flux->add_option(
          "--lora_format", s.lora_format,
          "peft: diffusers' pytorch_lora_weights.safetensors; kohya: flux_lora.safetensors "
          "in kohya's Flux names (ComfyUI's, the web UI's)")
      ->capture_default_str();
  flux->add_option("--blocks_to_swap", s.blocks_to_swap,
                   "the last N / 2 double and 2(N − N / 2) single blocks keep their frozen weights "
                   "in host memory, copied to the device per block (at most 35 for Flux.1)")
      ->check(count_in(0, 1000))
      ->capture_default_str();
  flux->add_flag("--fp8_base", s.fp8_base,
                 "frozen linear weights in float8_e4m3fn with a per-tensor scale");
  auto* d = add_torchrun_flags(app, s, "each transformer block");
  examples::add_kohya_flags(app, s.kohya);
  last_value_wins({g.run, g.training, g.saving, img, video, flux, d});
  if (const auto rc = examples::parse_command_line(app, argc, argv)) return *rc;
  // The flags whose defaults differ between the families (Flux takes diffusers' Flux scripts').
  for (const char* flag : {"--precondition_outputs", "--guidance_scale", "--weighting_scheme",
                           "--max_sequence_length", "--ofs", "--noised_image_dropout"})
    if (app.count(flag) > 0) s.given.insert(flag);
  return examples::run_reporting_errors([&] { return run(s); });
}
