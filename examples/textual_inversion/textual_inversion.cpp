// Textual inversion as diffusers' examples/textual_inversion/textual_inversion.py does it, with its
// flag names: a new word (--placeholder_token, with --num_vectors vectors, each starting as the
// embedding of --initializer_token) is added to an SD 1.x/2.x pipeline's tokenizer and text
// encoder, and only its rows of the token table train, on a folder of images of the concept under
// prompts made from diffusers' "object" or "style" templates. Everything else stays as it was, to
// the bit (the other rows are put back after every step, as the script's index_no_updates does).
//
// On an SDXL pipeline (textual_inversion_sdxl.py's conditioning: both encoders' penultimate
// states side by side, the second's pooled projection and the time ids as added conditions) the
// word is added to both tokenizers and both tables learn it, so the result is the web UI's SDXL
// embedding (clip_l and clip_g); diffusers' script adds it to the first only (docs/parity.md).
//
//   textual_inversion --pretrained_model_name_or_path SD --train_data_dir IMAGES
//                     --placeholder_token "<my-thing>" --initializer_token thing --output_dir OUT
//
// What it writes to --output_dir:
//   learned_embeds.safetensors   {placeholder_token: (num_vectors, width)}, what diffusers'
//                                load_textual_inversion reads (and learned_embeds-steps-N
//                                copies every --save_steps); for SDXL also
//                                learned_embeds_2.safetensors, the second encoder's, which
//                                load_textual_inversion reads with text_encoder_2 and tokenizer_2;
//   NAME.pt                      the web UI's embedding file (string_to_param, name, step), NAME
//                                the placeholder without its angle brackets; for SDXL
//                                NAME.safetensors with clip_l and clip_g;
//   checkpoints/, tensorboard/, validation/ and results.json, as train_text_to_image.
//
// Under torchrun (`torchrun --nproc-per-node N --no-python textual_inversion ...`) every rank
// trains on its own batches of --train_batch_size (accelerate's rule, as diffusers' script under
// `accelerate launch`: rank r takes batches r, r + N, ... of the epoch order), the token tables'
// gradients are averaged, and every rank puts the other rows back after each step. Rank 0
// validates and writes the outputs; --sharding 1|2 shards the tables' optimizer state (and
// gradients) as ZeRO does (3 acts as 2: the tables lie in no unit).

#include <CLI/CLI.hpp>
#include <difftrain/adapters/embedding.hpp>
#include <difftrain/data/data.hpp>
#include <difftrain/io/atomic_file.hpp>
#include <difftrain/io/image_grid.hpp>
#include <difftrain/io/png.hpp>
#include <difftrain/io/remove_tree.hpp>
#include <difftrain/io/safetensors.hpp>
#include <difftrain/schedule/by_name.hpp>
#include <difftrain/text/textual_inversion.hpp>
#include <difftrain/train/callbacks.hpp>
#include <difftrain/train/seeding.hpp>
#include <difftrain/train/tensorboard.hpp>
#include <difftrain/train/trainer.hpp>

#include <array>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "../common/cli_checks.hpp"
#include "../common/kohya_flags.hpp"
#include "../common/prompt_templates.hpp"
#include "../common/run_skeleton.hpp"
#include "../common/sd_pipeline.hpp"
#include "../common/sd_run.hpp"
#include "../common/sd_torchrun.hpp"
#include "../common/training_folder.hpp"

namespace {
namespace ad = difftrain::adapters;
using namespace examples::sd;  // the pipeline folder, validation, callbacks

std::string fill(const std::string& pattern, const std::string& word) {
  const auto at = pattern.find("{}");
  return pattern.substr(0, at) + word + pattern.substr(at + 2);
}

struct Settings : SdRunFlags, TorchrunFlags {
  std::string placeholder_token, initializer_token, learnable_property = "object";
  std::int64_t num_vectors = 1, repeats = 100, resolution = 512;
  bool center_crop = false, scale_lr = false;
  double flip_p = 0.5;
  std::int64_t save_steps = 500;
  examples::KohyaFlags kohya;  // kohya's noise and loss options (the prompts are templates)
  Settings() {                 // diffusers' textual_inversion.py defaults
    out = "text-inversion-model";
    max_train_steps = 5000;
    lr_warmup_steps = 500;
    num_validation_images = 4;
    validation_steps = 100;
  }
};

/// Only the text encoder's token table trains; the UNet and the VAE are used frozen.
struct InversionImpl : torch::nn::Module {
  struct Batch {
    at::Tensor latents, ids;
    at::Tensor ids_2, time_ids;  // SDXL: the second tokenizer's ids, the time ids
    [[nodiscard]] std::int64_t size() const { return latents.size(0); }
    [[nodiscard]] Batch slice(std::int64_t start, std::int64_t length) const {
      const auto part = [&](const at::Tensor& x) {
        return x.defined() ? x.narrow(0, start, length) : x;
      };
      return {part(latents), part(ids), part(ids_2), part(time_ids)};
    }
  };
  InversionImpl(Pipeline& p, const df::NoiseSchedule& schedule, const examples::KohyaFlags& kohya)
      : text_encoder(register_module("text_encoder", p.text_encoder)),
        unet_(p.unet),
        schedule_(schedule),
        prediction_(p.scheduler.prediction),
        kohya_(kohya) {
    if (p.xl) text_encoder_2 = register_module("text_encoder_2", p.text_encoder_2);
  }
  at::Tensor loss(const Batch& b) {
    at::Tensor embeds;
    models::UNetConditions cond;
    if (text_encoder_2) {  // textual_inversion_sdxl.py: the penultimate layers, side by side
      const auto one = text_encoder->forward(b.ids, std::nullopt, true);
      const auto two = text_encoder_2->forward(b.ids_2, std::nullopt, true);
      embeds = at::cat({one.hidden_states[one.hidden_states.size() - 2],
                        two.hidden_states[two.hidden_states.size() - 2]},
                       -1);
      cond.text_embeds = two.text_embeds;
      cond.time_ids = b.time_ids;
    } else {
      embeds = text_encoder->forward(b.ids).last_hidden_state;
    }
    // kohya's noise options (offset, pyramid, input perturbation) and loss types, as
    // train_textual_inversion.py applies them; without them diffusers' script exactly.
    const examples::StepNoise noise = examples::step_noise(b.latents, kohya_);
    const at::Tensor t = at::randint(schedule_.num_train_timesteps(), {b.latents.size(0)},
                                     b.latents.options().dtype(at::kLong));
    const at::Tensor pred =
        unet_->forward(schedule_.add_noise(b.latents, noise.input_noise, t), t, embeds, cond);
    const at::Tensor target = schedule_.target(prediction_, b.latents, noise.noise, t);
    if (kohya_.changes_loss())
      return examples::step_loss(pred, target, t, schedule_, prediction_, 0.0, kohya_);
    return at::mse_loss(pred.to(at::kFloat), target.to(at::kFloat));
  }
  TextEncoder text_encoder{nullptr}, text_encoder_2{nullptr};
  Unet unet_;
  df::NoiseSchedule schedule_;
  df::Prediction prediction_;
  examples::KohyaFlags kohya_;
};

/// After every optimizer step: every row of the token tables but the new word's is put back (on
/// every rank: each holds the tables).
struct KeepOtherRows {
  static constexpr bool every_rank = true;
  std::vector<text::TokenRowsKeeper*> keepers;
  template <class T>
  void on_step_end(T& /*trainer*/, const tr::StepInfo& s) {
    if (s.stepped)
      for (auto* k : keepers) k->restore();
  }
};

/// The learned vectors as diffusers' save_progress writes them.
struct LearnedEmbeds {
  TextEncoder encoder;
  std::vector<std::int64_t> ids;
  std::string token;
  [[nodiscard]] at::Tensor vectors() const {
    return encoder->token_embedding->weight.detach()
        .slice(0, ids.front(), ids.back() + 1)
        .to(at::kCPU)
        .clone();
  }
  void save(const fs::path& path) const {
    dt::io::save_safetensors(path, {{token, vectors()}}, {{"format", "pt"}});
  }
};

/// diffusers' --save_steps: learned_embeds-steps-N.safetensors (and, for SDXL's second encoder,
/// learned_embeds_2-steps-N).
struct SaveEvery {
  std::int64_t every;
  std::vector<std::pair<const LearnedEmbeds*, std::string>> embeds;  // and their file stems
  fs::path dir;
  template <class T>
  void on_step_end(T& /*trainer*/, const tr::StepInfo& s) {
    if (s.stepped && every > 0 && s.step % every == 0)
      for (const auto& [e, stem] : embeds)
        e->save(dir / (stem + "-steps-" + std::to_string(s.step) + ".safetensors"));
  }
};

struct InversionConfig : tr::DefaultConfig {
  using Parallel = dt::distributed::ShardedDataParallel;  // --sharding: 0 is DataParallel
  using Optimizer = tr::OptimizerByName;
  using Precision = tr::PrecisionByName;  // --mixed_precision
  using Schedule = dt::schedule::ByName;
  using Callbacks =
      std::tuple<KeepOtherRows, SaveEvery, tr::ProgressBar, tr::CheckpointEvery, tr::TensorBoard,
                 tr::SampleEvery<Validation>, StopOnInterrupt, LossRecord>;
};
using InversionTrainer = tr::Trainer<InversionImpl, InversionConfig>;

/// diffusers' TextualInversionDataset: every image `repeats` times per epoch, shuffled per epoch;
/// each sample center-cropped to a square when asked, resized (bicubic) to the resolution,
/// mirrored with probability flip_p, and given a template filled with the word's tokens.
class Samples {
 public:
  Samples(const Settings& s, const data::ImageFolder& folder, std::string word, Pipeline& p,
          at::Device device, std::int64_t rank = 0, std::int64_t ranks = 1)
      : s_(s),
        folder_(folder),
        word_(std::move(word)),
        p_(p),
        device_(device),
        rank_(rank),
        ranks_(ranks) {
    per_epoch_ = static_cast<std::int64_t>(folder.images.size()) * s.repeats / s.train_batch_size;
    if (per_epoch_ < 1)
      throw ConfigError("leave no full batch of " + std::to_string(s.train_batch_size) + " (" +
                            std::to_string(folder.images.size()) + " images × " +
                            std::to_string(s.repeats) + " repeats)",
                        "--train_batch_size / --repeats");
  }
  [[nodiscard]] double data_seconds() const { return data_seconds_; }

  /// Micro-batch `local_place` of this rank: batch local_place · ranks + rank of the run's order.
  InversionImpl::Batch at_place(std::int64_t local_place) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::int64_t place = local_place * ranks_ + rank_;
    const std::int64_t epoch = place / per_epoch_, pos = place % per_epoch_;
    if (!loader_ || epoch != epoch_ || pos != next_) {
      // This rank's batches of the epoch from `pos` on: every ranks-th.
      const auto order = epoch_order(epoch);
      const std::size_t bs = static_cast<std::size_t>(s_.train_batch_size);
      const std::int64_t stride = ranks_;
      loader_.emplace(
          static_cast<std::size_t>((per_epoch_ - pos + stride - 1) / stride),
          [this, order, bs, epoch, pos, stride](std::size_t b) {
            return make(order, bs, static_cast<std::uint64_t>(epoch),
                        static_cast<std::size_t>(pos + static_cast<std::int64_t>(b) * stride));
          },
          static_cast<std::size_t>(s_.dataloader_num_workers), 2);
      epoch_ = epoch;
      next_ = pos;
    }
    Made m = *loader_->next();
    next_ += ranks_;
    InversionImpl::Batch b;
    {
      at::NoGradGuard no_grad;
      b.latents = p_.vae->encode_latents(m.pixels.to(device_));
    }
    const auto ids_of = [&](const text::CLIPTokenizer& tok) {
      const text::BatchEncoding enc = tok(m.prompts);
      std::vector<std::int64_t> flat;
      for (const auto& row : enc.input_ids) flat.insert(flat.end(), row.begin(), row.end());
      return at::tensor(flat, at::kLong)
          .view({static_cast<std::int64_t>(m.prompts.size()), -1})
          .to(device_);
    };
    b.ids = ids_of(*p_.tokenizer);
    if (p_.xl) {
      b.ids_2 = ids_of(*p_.tokenizer_2);
      b.time_ids = m.time_ids.to(device_);
    }
    data_seconds_ += examples::seconds_since(t0);
    return b;
  }

 private:
  struct Made {
    at::Tensor pixels;
    std::vector<std::string> prompts;
    at::Tensor time_ids;  // (B, 6): original size (after the square crop), crop (0, 0), target
  };
  [[nodiscard]] std::vector<std::size_t> epoch_order(std::int64_t epoch) const {
    std::vector<std::size_t> order;
    for (std::int64_t r = 0; r < s_.repeats; ++r)
      for (std::size_t i = 0; i < folder_.images.size(); ++i) order.push_back(i);
    std::mt19937_64 rng(s_.seed * 0x9E3779B97F4A7C15ULL + static_cast<std::uint64_t>(epoch));
    std::shuffle(order.begin(), order.end(), rng);
    return order;
  }
  Made make(const std::vector<std::size_t>& order, std::size_t bs, std::uint64_t epoch,
            std::size_t b) const {
    Made m;
    std::vector<at::Tensor> pixels;
    std::vector<float> time_ids;
    const auto& tpl = examples::textual_inversion_templates(s_.learnable_property == "style");
    for (std::size_t k = 0; k < bs; ++k) {
      const std::size_t i = order[b * bs + k];
      at::Generator gen = data::sample_generator(s_.seed, epoch, b, k);
      const data::DecodedImage img = data::read_image(folder_.images[i].path);
      at::Tensor x = img.pixels.permute({2, 0, 1});
      if (s_.center_crop) {  // the script's crop: the centered square of the shorter side
        const std::int64_t h = x.size(1), w = x.size(2), c = std::min(h, w);
        x = x.narrow(1, (h - c) / 2, c).narrow(2, (w - c) / 2, c);
      }
      // SDXL's time ids, as textual_inversion_sdxl.py: the size before the resize, no crop
      // (the resize makes the square), the resolution.
      const auto r = static_cast<float>(s_.resolution);
      time_ids.insert(time_ids.end(), {static_cast<float>(x.size(1)), static_cast<float>(x.size(2)),
                                       0.0F, 0.0F, r, r});
      x = data::resize(x, std::vector<std::int64_t>{s_.resolution, s_.resolution},
                       data::Interpolation::bicubic);
      if (data::draw_flip(s_.flip_p, gen)) x = data::horizontal_flip(x);
      pixels.push_back(data::to_unit_range(x.contiguous()));
      const auto pick = at::randint(static_cast<std::int64_t>(tpl.size()), {1}, gen, at::kLong)
                            .item<std::int64_t>();
      m.prompts.push_back(fill(tpl[static_cast<std::size_t>(pick)], word_));
    }
    m.pixels = at::stack(pixels);
    m.time_ids = at::tensor(time_ids, at::kFloat).view({static_cast<std::int64_t>(bs), 6});
    return m;
  }

  const Settings& s_;
  const data::ImageFolder& folder_;
  std::string word_;
  Pipeline& p_;
  at::Device device_;
  std::int64_t rank_, ranks_;
  std::int64_t per_epoch_ = 1, epoch_ = -1, next_ = 0;
  std::optional<data::ParallelLoader<Made>> loader_;
  double data_seconds_ = 0;
};

void check_flags(const Settings& s) {
  s.kohya.check();
  if (s.kohya.captions.any())
    throw ConfigError(
        "changes captions; textual inversion's prompts come from --learnable_property's "
        "templates",
        "--shuffle_caption / --caption_*");
  if (s.learnable_property != "object" && s.learnable_property != "style")
    throw ConfigError("is '" + s.learnable_property + "'; choose object or style",
                      "--learnable_property");
  if (s.placeholder_token.empty()) throw ConfigError("must not be empty", "--placeholder_token");
  if (s.placeholder_token.find_first_of(" \t\n") != std::string::npos)
    throw ConfigError("'" + s.placeholder_token + "' must be one word (no spaces)",
                      "--placeholder_token");
  if (s.resolution % 8 != 0) throw ConfigError("must be a multiple of 8", "--resolution");
  if (s.sharded_mixed_precision)
    throw ConfigError(
        "is not for textual inversion: the other rows are put back into the table "
        "the optimizer steps, which would then be a float32 copy",
        "--sharded_mixed_precision");
}

/// The web UI names an embedding by its file; brackets are not allowed in many file systems'
/// habits and are no part of the name people type.
std::string webui_name(const std::string& token) {
  std::string out;
  for (const char c : token)
    if (c != '<' && c != '>' && c != '/' && c != '\\') out += c;
  return out.empty() ? "embedding" : out;
}

int run(Settings s) {
  const auto t0 = std::chrono::steady_clock::now();
  check_sd_run_flags(s);
  check_flags(s);
  examples::apply_threads(s);
  // The ranks of a torchrun launch (a world of one without it); every rank checks the same flags.
  const auto ranks = torchrun_world(s, s.device);
  const auto& world = ranks.first;
  const at::Device device = ranks.second;
  const bool main_rank = world->is_main();
  data::ImageFolderOptions fo;
  // Its prompts come from templates, not captions: the folder is reported, captions or not.
  data::ImageFolder folder = examples::scan_training_folder(s.data_dir, fo, {.say = main_rank});
  if (folder.images.empty()) throw ConfigError("holds no image", s.data_dir);
  const std::int64_t batches =
      static_cast<std::int64_t>(folder.images.size()) * s.repeats / s.train_batch_size;
  if (batches < world->size())
    throw ConfigError("make " + std::to_string(batches) + " batches an epoch, fewer than the " +
                          std::to_string(world->size()) + " ranks",
                      "--train_data_dir / --repeats / --train_batch_size");
  resolve_max_train_steps(s, (batches + world->size() - 1) / world->size(), main_rank);
  const fs::path out(s.out);
  const examples::OutputFolder output_folder(out, main_rank);
  tr::set_seed(s.seed);
  Pipeline p = load_pipeline(s.model, "", s.variant, s.single_file_config, s.tokenizer_name,
                             s.original_config, s.use_ema_weights);

  // The new word: tokens and rows, each row the initializer's embedding (in both tokenizers and
  // tables of an SDXL pipeline). Every check comes before the first table grows.
  std::vector<std::pair<text::CLIPTokenizer*, TextEncoder*>> sides{
      {&*p.tokenizer, &p.text_encoder}};
  if (p.xl) sides.emplace_back(&*p.tokenizer_2, &p.text_encoder_2);
  std::vector<at::Tensor> starts;
  for (std::size_t k = 0; k < sides.size(); ++k) {
    const std::string which = k == 0 ? "the tokenizer" : "tokenizer_2";
    const auto init = (*sides[k].first)({s.initializer_token}, {.add_special_tokens = false,
                                                                .truncation = false,
                                                                .padding = text::Padding::none})
                          .input_ids.front();
    if (init.size() != 1)
      throw ConfigError("'" + s.initializer_token + "' is " + std::to_string(init.size()) +
                            " tokens in " + which + "; the initializer must be a single token",
                        "--initializer_token");
    if (sides[k].first->token_to_id(s.placeholder_token))
      throw ConfigError(which + " already contains '" + s.placeholder_token +
                            "'; pass a different placeholder_token",
                        "--placeholder_token");
    starts.push_back((*sides[k].second)
                         ->token_embedding->weight.detach()[init.front()]
                         .clone()
                         .repeat({s.num_vectors, 1}));
  }
  std::vector<std::vector<std::int64_t>> side_ids;
  for (std::size_t k = 0; k < sides.size(); ++k)
    side_ids.push_back(text::load_textual_inversion(*sides[k].first, *sides[k].second,
                                                    s.placeholder_token, starts[k]));
  const std::vector<std::int64_t>& ids = side_ids.front();
  std::string word;
  for (const auto id : ids) word += (word.empty() ? "" : " ") + p.tokenizer->id_to_token(id);

  // Everything frozen but the token tables; the other rows are restored after every step.
  freeze(*p.unet);
  freeze(*p.vae);
  p.unet->to(device);
  p.vae->to(device);
  p.unet->eval();
  p.vae->eval();
  std::vector<std::unique_ptr<text::TokenRowsKeeper>> keepers;
  for (std::size_t k = 0; k < sides.size(); ++k) {
    TextEncoder& encoder = *sides[k].second;
    freeze(*encoder);
    encoder->token_embedding->weight.set_requires_grad(true);
    encoder->to(device);
    if (s.gradient_checkpointing) encoder->set_gradient_checkpointing(true);
    keepers.push_back(
        std::make_unique<text::TokenRowsKeeper>(encoder->token_embedding->weight, side_ids[k]));
  }
  if (s.gradient_checkpointing) {  // as the script: the UNet in training mode to recompute
    p.unet->train();
    p.unet->set_gradient_checkpointing(true);
  }
  const df::NoiseSchedule schedule(p.scheduler.schedule);
  InversionImpl trainee(p, schedule, s.kohya);
  trainee.train();

  InversionTrainer::Options o;
  set_optimizer_and_schedule(
      o, s,
      s.scale_lr ? s.learning_rate *
                       static_cast<double>(s.gradient_accumulation_steps * s.train_batch_size)
                 : s.learning_rate);
  set_parallel(o, s, world);

  const RunFolders folders = prepare_run_folders(s, main_rank);
  const nlohmann::json run_settings = {{"pretrained_model_name_or_path", s.model},
                                       {"train_data_dir", s.data_dir},
                                       {"images", folder.images.size()},
                                       {"placeholder_token", s.placeholder_token},
                                       {"initializer_token", s.initializer_token},
                                       {"num_vectors", s.num_vectors},
                                       {"learnable_property", s.learnable_property},
                                       {"kohya", s.kohya.settings()},
                                       {"repeats", s.repeats},
                                       {"resolution", s.resolution},
                                       {"train_batch_size", s.train_batch_size},
                                       {"max_train_steps", s.max_train_steps},
                                       {"learning_rate", o.optimizer.lr},
                                       {"lr_scheduler", s.lr_scheduler},
                                       {"ranks", world->size()},
                                       {"sharding", s.sharding},
                                       {"seed", s.seed}};
  const LearnedEmbeds embeds{p.text_encoder, ids, s.placeholder_token};
  std::optional<LearnedEmbeds> embeds_2;
  if (p.xl) embeds_2.emplace(LearnedEmbeds{p.text_encoder_2, side_ids[1], s.placeholder_token});
  SaveEvery save_every{s.save_steps, {{&embeds, "learned_embeds"}}, out};
  if (embeds_2) save_every.embeds.emplace_back(&*embeds_2, "learned_embeds_2");
  std::vector<text::TokenRowsKeeper*> keeper_list;
  for (const auto& k : keepers) keeper_list.push_back(k.get());
  const ValidationOptions vo = validation_options(s, s.resolution);
  Validation validation{&vo, &p, &schedule, device};
  std::vector<double> losses;
  InversionTrainer trainer(
      trainee, o,
      InversionConfig::Callbacks{
          KeepOtherRows{keeper_list}, save_every, progress_bar(s), checkpoint_every(s, folders),
          tr::TensorBoard({.dir = folders.tensorboard, .config = run_settings}),
          validation_every(s, validation), StopOnInterrupt{s.stop_at}, LossRecord{&losses}});
  const std::int64_t resumed_from = resume_if_asked(trainer, s, folders);
  // Each rank its own noise (a resumed run restores each rank's generator).
  if (world->rank() > 0 && resumed_from == 0) tr::set_seed(s.seed + 7919 * world->rank());

  Samples samples(s, folder, word, p, device, world->rank(), world->size());
  const FitResult fit = fit_until_done_or_stopped(
      trainer, s, [&](std::int64_t place) { return samples.at_place(place); });
  if (!main_rank) return fit.finished ? 0 : 130;  // rank 0 writes what the run leaves
  nlohmann::json files;
  if (fit.finished) {
    embeds.save(out / "learned_embeds.safetensors");
    files["diffusers"] = "learned_embeds.safetensors";
    ad::Embedding e;
    e.name = webui_name(s.placeholder_token);
    e.step = trainer.global_step();
    e.sd_checkpoint_name = fs::path(s.model).filename().string();
    if (embeds_2) {  // the web UI's SDXL embedding: both sides in one safetensors file
      embeds_2->save(out / "learned_embeds_2.safetensors");
      files["diffusers_2"] = "learned_embeds_2.safetensors";
      e.pair = {{"clip_l", embeds.vectors()}, {"clip_g", embeds_2->vectors()}};
      e.save(out / (e.name + ".safetensors"));
      files["webui"] = e.name + ".safetensors";
    } else {
      e.vec = embeds.vectors();
      e.save(out / (e.name + ".pt"));
      files["webui"] = e.name + ".pt";
    }
    if (!s.validation_prompts.empty()) {
      write_validation_images(validation.images(), vo, out);
      files["validation"] = "validation.png";
    }
  }
  const std::size_t tenth = std::max<std::size_t>(1, losses.size() / 10);
  nlohmann::json results = run_settings;
  results["files"] = files;
  results["steps"] = trainer.global_step();
  results["resumed_from"] = resumed_from;
  results["finished"] = fit.finished;
  results["placeholder_ids"] = ids;
  results["first_loss"] = mean_of(losses, tenth, false);
  results["last_loss"] = mean_of(losses, tenth, true);
  results["train_seconds"] = fit.seconds;
  results["data_share"] = fit.seconds > 0 ? samples.data_seconds() / fit.seconds : 0.0;
  results["total_seconds"] = examples::seconds_since(t0);
  write_results(out, results);
  std::printf("textual inversion of %s (%lld vectors): %lld steps (loss %.4f → %.4f); %s\n",
              s.placeholder_token.c_str(), static_cast<long long>(s.num_vectors),
              static_cast<long long>(trainer.global_step()), results["first_loss"].get<double>(),
              results["last_loss"].get<double>(), written_files(out, files, fit.finished).c_str());
  return fit.finished ? 0 : 130;
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  CLI::App app{
      "Teach an SD 1.x/2.x or SDXL pipeline a new word from a folder of images (textual "
      "inversion)."};
  app.get_formatter()->column_width(44);
  using examples::count_in;
  using examples::number_in;
  const SdFlagGroups g = add_sd_run_flags(app, s, "folder of images of the concept");
  auto* d = add_torchrun_flags(app, s, "here no module is");
  examples::add_kohya_flags(app, s.kohya);
  auto* w = app.add_option_group("the word");
  w->add_option("--placeholder_token", s.placeholder_token, "the new word, e.g. \"<cat-toy>\"")
      ->required();
  w->add_option("--initializer_token", s.initializer_token, "a single-token word it starts from")
      ->required();
  w->add_option("--num_vectors", s.num_vectors, "vectors (tokens) of the word")
      ->check(count_in(1, 75))
      ->capture_default_str();
  w->add_option("--learnable_property", s.learnable_property, "object or style (the templates)")
      ->capture_default_str();
  auto* img = app.add_option_group("images");
  img->add_option("--repeats", s.repeats, "times each image is seen per epoch")
      ->check(count_in(1, 100'000))
      ->capture_default_str();
  img->add_option("--resolution", s.resolution)->check(count_in(8, 8192))->capture_default_str();
  img->add_flag("--center_crop", s.center_crop, "crop the centered square before resizing");
  img->add_option("--flip_p", s.flip_p, "probability of mirroring")
      ->check(number_in(0, 1))
      ->capture_default_str();
  g.training->add_flag("--scale_lr", s.scale_lr, "multiply the LR by batch size × accumulation");
  g.saving
      ->add_option("--save_steps", s.save_steps, "learned_embeds-steps-N every N steps (0: none)")
      ->check(count_in(0, 100'000'000))
      ->capture_default_str();
  last_value_wins({g.run, g.training, g.saving, w, img, d});
  if (const auto rc = examples::parse_command_line(app, argc, argv)) return *rc;
  return examples::run_reporting_errors([&] { return run(s); });
}
