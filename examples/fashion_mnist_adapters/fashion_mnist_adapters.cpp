// Teaches a text-conditioned Fashion-MNIST diffusion model a class it never saw, three ways, and
// scores each:
//
//   1. trains a small model conditioned as Stable Diffusion is (text_model.hpp: captions through a
//      CLIP tokenizer and CLIPTextModel, read by the UNet only through cross-attention at 14×14
//      and 7×7) on captions of nine classes ("a photo of a sneaker") and on the tenth class's
//      images captioned only with the word its kind shares ("a photo of a shoe", a caption half
//      the sandals and sneakers get too: it has seen them, as Stable Diffusion has seen most
//      things a user names, but never with their own word; `--held-out-images uncaptioned` shows
//      them with the empty prompt only, `unseen` leaves them out), or loads it from
//      OUT/base.safetensors;
//   2. textual inversion: a new embedding "ankle-boot" (4 token vectors, started from "shoe")
//      trained with the web UI's loop while the model stays frozen, placed into prompts through an
//      EmbeddingDatabase;
//   3. a web UI hypernetwork on the text's width in every attention layer, trained with the web
//      UI's loop, prompted with the new class's words ("a photo of a ankle boot"), which the UNet
//      never saw in a caption;
//   4. LoRA on the UNet's attention projections, trained with difftrain's Trainer on the same
//      captions, merged for sampling (and, with --methods dora,loha,lokr, DoRA and LyCORIS' LoHa
//      and LoKr on the same layers at the same rank and alpha, LoHa and LoKr written in LyCORIS'
//      layout);
//   then samples the new class with classifier-free guidance under each and under the base model
//   alone (the other side is the base model's prediction for the empty prompt, so each adapter
//   changes only the prompt's side; `--unconditional-side adapted` puts the hypernetwork and LoRA
//   on both sides, as the web UI does), and reports the share the main job's classifier calls the
//   new class, each adapter file's size and the times. `--help` lists the flags.
//
// Writes to --out: tokenizer/ (the caption tokenizer, a transformers folder), base.safetensors
// (cached base model), adapters/ (ankle-boot.pt and .optim, ankle-boot-hn.pt and .optim,
// ankle-boot-lora.safetensors), log/ (the adapters' loss logs and periodic copies), samples.png
// (rows: real images, base, embedding, hypernetwork, LoRA) and results.json.

#include <CLI/CLI.hpp>
#include <difftrain/adapters/adapters.hpp>
#include <difftrain/adapters/stable_diffusion_lora_files.hpp>
#include <difftrain/adapters/unet_adapters.hpp>
#include <difftrain/adapters/weight_delta.hpp>
#include <difftrain/diffusion/dpm_solver.hpp>
#include <difftrain/diffusion/sample.hpp>
#include <difftrain/ema/ema.hpp>
#include <difftrain/io/image_grid.hpp>
#include <difftrain/io/png.hpp>
#include <difftrain/log/event_file.hpp>
#include <difftrain/nn/module_tensors.hpp>
#include <difftrain/schedule/step_string.hpp>
#include <difftrain/train/callbacks.hpp>
#include <difftrain/train/seeding.hpp>
#include <difftrain/train/tensorboard.hpp>
#include <difftrain/train/trainer.hpp>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "../common/cli_checks.hpp"
#include "../common/run_skeleton.hpp"
#include "../fashion_mnist/classifier.hpp"
#include "../fashion_mnist/data.hpp"
#include "text_model.hpp"

namespace fs = std::filesystem;
namespace tr = difftrain::train;
namespace df = difftrain::diffusion;
namespace ad = difftrain::adapters;
namespace tx = difftrain::text;
using difftrain::ConfigError;

namespace {

struct Settings : examples::RunFlags, examples::JudgeFlags {
  Settings() {
    data_dir = fmnist::kDefaultDataDir;
    out = "runs/fashion_mnist_adapters";
  }
  std::int64_t new_class = 9;
  // Seeds the adapters' starting weights, data order and noise (-1: --seed); the base model and the
  // sampling noise stay those of --seed, so runs that differ only here measure training's spread.
  std::int64_t adapter_seed = -1;
  // "generic": the base model sees the new class's images only under the word its kind shares
  // ("shoe", which also captions half the sandals and sneakers), as Stable Diffusion knows most
  // things a user names by a broader word; "uncaptioned": only with the empty prompt, never with
  // a caption that names them; "unseen": never.
  std::string held_out_images = "generic";
  // The embedding's starting words; empty: the broader word with "generic", else "sneaker".
  std::string init_word;
  // base model
  std::int64_t channels = 16;
  std::int64_t text_width = 64;
  std::int64_t text_layers = 2;
  std::int64_t base_steps = 1200;
  std::int64_t batch_size = 64;
  double lr = 2e-3;
  // adapters
  std::int64_t adapter_images = 300;
  std::int64_t adapter_steps = 500;
  std::int64_t adapter_batch = 32;
  std::string ti_lr = "0.05:150, 0.02";
  std::string hn_lr = "0.02:150, 0.01";
  std::string hn_structure = "1,2,1";
  double lora_lr = 1e-2;
  std::int64_t lora_rank = 4;
  double lora_alpha = 4.0;
  std::string lora_targets = "to_q,to_k,to_v,to_out.0";
  std::int64_t num_vectors = 4;
  std::string methods = "embedding,hypernetwork,lora";
  std::int64_t save_every = 100;
  // sampling and scoring
  std::int64_t samples = 500;
  std::int64_t sample_steps = 20;
  double guidance = 7.0;
  // "base": guidance contrasts the adapted prompt with the base model's unconditional prediction,
  // so each adapter changes only the prompt's side, as an embedding does by construction;
  // "adapted": the hypernetwork and LoRA are on for the empty prompt too, as in the web UI.
  std::string unconditional = "base";

  [[nodiscard]] std::string init_words() const;
  [[nodiscard]] std::uint64_t adapters_seed() const {
    return adapter_seed < 0 ? seed : static_cast<std::uint64_t>(adapter_seed);
  }
};

/// The TensorBoard run folder of one training (`base`, `lora`, ...), emptied of an earlier run's
/// event files; empty when TensorBoard is off.
fs::path tensorboard_run(const Settings& s, const std::string& name) {
  if (s.no_tensorboard) return {};
  const fs::path dir = s.tensorboard_folder() / name;
  difftrain::log::remove_event_files(dir);
  return dir;
}

/// The web UI trainers' steps into a TensorBoard run (loss and learning rate), and the progress
/// line every 25 steps.
struct AdapterLog {
  std::shared_ptr<difftrain::log::EventFileWriter> events;
  explicit AdapterLog(const fs::path& dir)
      : events(dir.empty() ? nullptr : std::make_shared<difftrain::log::EventFileWriter>(dir)) {}
  void operator()(const ad::AdapterStepInfo& i) const {
    if (events) events->add_scalars({{"train/loss", i.loss}, {"train/lr", i.learn_rate}}, i.step);
    if (i.step % 25 == 0) std::fprintf(stderr, "  %s\n", i.description.c_str());
  }
};

using examples::seconds_since;

/// "Ankle boot" → "ankle-boot": the embedding's name and the adapter files' stem.
std::string word_of(std::int64_t c) {
  std::string w = fmtext::class_words(c);
  std::replace(w.begin(), w.end(), ' ', '-');
  return w;
}

struct BaseConfig : tr::DefaultConfig {
  using Schedule = difftrain::schedule::Cosine;
  using Ema = difftrain::ema::Ema<difftrain::ema::WarmupDecay>;
  using Callbacks = std::tuple<tr::ProgressBar, tr::TensorBoard>;
};
struct LoraConfig : tr::DefaultConfig {
  using Callbacks = std::tuple<tr::ProgressBar, tr::TensorBoard>;
};

fmtext::TextModelOptions model_options(const Settings& s, const tx::CLIPTokenizer& tok) {
  return {.channels = s.channels,
          .text_width = s.text_width,
          .text_layers = s.text_layers,
          .text_heads = std::max<std::int64_t>(1, s.text_width / 32),
          .vocab_size = tok.vocab_size()};
}

std::string base_key(const Settings& s) {
  return "unet=text,v,snr=5,templates=" + std::to_string(fmtext::caption_templates().size()) +
         ",C=" + std::to_string(s.channels) + ",text=" + std::to_string(s.text_width) + "x" +
         std::to_string(s.text_layers) + ",steps=" + std::to_string(s.base_steps) +
         ",batch=" + std::to_string(s.batch_size) + ",lr=" + std::to_string(s.lr) +
         ",seed=" + std::to_string(s.seed) + ",limit=" + std::to_string(s.limit) +
         ",without=" + std::to_string(s.new_class) +
         (s.held_out_images == "unseen" ? std::string() : "," + s.held_out_images);
}

/// The words several classes share (footwear, tops), and those classes.
const std::vector<std::pair<std::string, std::vector<std::int64_t>>>& shared_words() {
  static const std::vector<std::pair<std::string, std::vector<std::int64_t>>> table = {
      {"shoe", {5, 7, 9}}, {"top", {0, 2, 4, 6}}};
  return table;
}

/// The broader word a class shares with others of its kind ("shoe" for sandals, sneakers and
/// ankle boots), and those classes; empty for a class of its own kind.
std::pair<std::string, std::vector<std::int64_t>> broader_word(std::int64_t c) {
  for (const auto& kind : shared_words())
    if (std::find(kind.second.begin(), kind.second.end(), c) != kind.second.end()) return kind;
  return {};
}

std::string Settings::init_words() const {
  if (!init_word.empty()) return init_word;
  const std::string broader = held_out_images == "generic" ? broader_word(new_class).first : "";
  return broader.empty() ? "sneaker" : broader;
}

/// Every caption's token ids: row c · templates + k is class c under template k; after the ten
/// classes, the broader word's captions when there is one.
at::Tensor caption_table(const fmtext::TextUNet& net, const std::string& broader) {
  std::vector<at::Tensor> rows;
  for (std::int64_t c = 0; c < fmnist::kClasses; ++c)
    for (const auto& t : fmtext::caption_templates())
      rows.push_back(net->tokens(fmtext::fill_template(t, fmtext::class_words(c))));
  if (!broader.empty())
    for (const auto& t : fmtext::caption_templates())
      rows.push_back(net->tokens(fmtext::fill_template(t, broader)));
  return at::stack(rows);
}

/// The base model's EMA weights (text encoder and UNet): from the cache when it was made with
/// these settings, else trained on the captions of every class but the new one.
void base_model(const Settings& s, const fmnist::Dataset& data, const df::NoiseSchedule& schedule,
                const tx::CLIPTokenizer& tok, const fs::path& path, bool& from_cache,
                double& seconds) {
  const auto t = std::chrono::steady_clock::now();
  from_cache = false;
  if (fs::exists(path)) {
    try {
      const auto file = difftrain::io::load_safetensors(path, true);
      const auto key = file.metadata.find("settings");
      if (key != file.metadata.end() && key->second == base_key(s)) {
        from_cache = true;
        seconds = seconds_since(t);
        return;
      }
      std::fprintf(stderr, "base: %s was made with other settings; retraining\n", path.c_str());
    } catch (const difftrain::Error& e) {
      std::fprintf(stderr, "base: cannot use %s (%s); retraining\n", path.c_str(), e.what());
    }
  }
  tr::set_seed(s.seed);
  const at::Device device(s.device);
  fmtext::TextUNet net(model_options(s, tok), schedule, tok);
  net->to(device);
  const bool uncaptioned = s.held_out_images == "uncaptioned";
  const bool generic = s.held_out_images == "generic";
  const auto broad_kind =
      generic ? broader_word(s.new_class) : std::pair<std::string, std::vector<std::int64_t>>{};
  const std::string& broader = broad_kind.first;
  const std::vector<std::int64_t>& kin = broad_kind.second;
  const at::Tensor keep = uncaptioned || generic
                              ? at::arange(data.train.labels.size(0), at::kLong)
                              : data.train.labels.ne(s.new_class).nonzero().flatten();
  const at::Tensor images = data.train.images.index_select(0, keep).to(device);
  const at::Tensor labels = data.train.labels.index_select(0, keep).to(device);
  // The captions, and after them the empty prompt: the new class's only caption when its images
  // are seen uncaptioned.
  const at::Tensor captions =
      at::cat({caption_table(net, broader), net->tokens("").unsqueeze(0)}).to(device);
  const std::int64_t empty_row = captions.size(0) - 1;
  const auto templates = static_cast<std::int64_t>(fmtext::caption_templates().size());
  const std::int64_t n = images.size(0);
  tr::Trainer<fmtext::TextUNetImpl, BaseConfig>::Options o;
  o.optimizer.lr = s.lr;
  o.schedule.num_warmup_steps = std::min<std::int64_t>(100, s.base_steps);
  o.schedule.num_training_steps = s.base_steps;
  o.ema.rule.decay = 0.995;
  tr::Trainer<fmtext::TextUNetImpl, BaseConfig> trainer(
      *net, o,
      {tr::ProgressBar({.total_steps = s.base_steps, .every = 10}),
       tr::TensorBoard({.dir = tensorboard_run(s, "base")})});
  fmnist::EpochBatches batches(n, s.batch_size, s.seed, device);
  std::fprintf(stderr, "base: %lld steps on %lld images, nine classes captioned (%s %s)\n",
               static_cast<long long>(s.base_steps), static_cast<long long>(n),
               fmnist::kClassNames[static_cast<std::size_t>(s.new_class)],
               uncaptioned ? "seen with the empty prompt only"
               : generic   ? ("captioned only as '" + broader + "'").c_str()
                           : "unseen");
  trainer.fit(
      [&](std::int64_t step, std::int64_t) {
        const at::Tensor idx = batches.indices(step);
        // Each image's caption template is drawn per step, the same for a seed.
        at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(s.seed * 7919 + step);
        const at::Tensor k = at::randint(templates, {idx.size(0)}, gen, at::kLong).to(device);
        const at::Tensor label = labels.index_select(0, idx);
        at::Tensor rows =
            at::where(label == s.new_class, at::full_like(label, empty_row), label * templates + k);
        if (generic) {
          // The new class always under the broader word, its kin half the time.
          const at::Tensor broad = fmnist::kClasses * templates + k;
          const at::Tensor coin = (at::rand({idx.size(0)}, gen) < 0.5).to(device);
          at::Tensor kin_mask = at::zeros_like(label, at::kBool);
          for (const std::int64_t c : kin) kin_mask = kin_mask.logical_or(label == c);
          rows = at::where(label == s.new_class, broad,
                           at::where(kin_mask.logical_and(coin), broad, rows));
        }
        return fmtext::TextUNetImpl::Batch{images.index_select(0, idx),
                                           captions.index_select(0, rows)};
      },
      s.base_steps);
  difftrain::ema::EmaScope scope(trainer.ema());
  difftrain::io::save_safetensors(path, difftrain::nn::module_tensors(*net, false),
                                  {{"settings", base_key(s)}});
  seconds = seconds_since(t);
}

fmtext::TextUNet load_base(const Settings& s, const df::NoiseSchedule& schedule,
                           const tx::CLIPTokenizer& tok, const fs::path& path) {
  fmtext::TextUNet net(model_options(s, tok), schedule, tok);
  net->to(at::Device(s.device));  // loading copies the file's tensors onto the device
  difftrain::nn::load_module_tensors(*net, difftrain::io::load_safetensors(path, true).tensors,
                                     path.string(), /*buffers=*/false);
  net->eval();
  for (auto& p : net->parameters()) p.set_requires_grad(false);
  return net;
}

/// The new class's images the adapters learn from: the first `count` of the training split.
at::Tensor new_class_images(const Settings& s, const fmnist::Dataset& data) {
  const at::Tensor idx = data.train.labels.eq(s.new_class).nonzero().flatten();
  if (idx.size(0) == 0)
    throw ConfigError("the training split holds no image of class " + std::to_string(s.new_class),
                      "--new-class");
  return data.train.images.index_select(0,
                                        idx.narrow(0, 0, std::min(s.adapter_images, idx.size(0))));
}

/// One adapter micro-batch: which images, and the epoch (it turns the caption templates).
struct AdapterBatch {
  at::Tensor idx;
  std::int64_t epoch = 0;
};

/// The captions of a micro-batch: the templates with `words`, image i of epoch e under template
/// (i + e) mod templates, so every image meets every template.
std::vector<std::string> adapter_prompts(const AdapterBatch& b, const std::string& words) {
  const auto& t = fmtext::caption_templates();
  std::vector<std::string> out;
  const at::Tensor idx = b.idx.cpu();
  for (std::int64_t i = 0; i < idx.size(0); ++i)
    out.push_back(
        fmtext::fill_template(t[static_cast<std::size_t>((idx[i].item<std::int64_t>() + b.epoch) %
                                                         static_cast<std::int64_t>(t.size()))],
                              words));
  return out;
}

/// Micro-batch j of an epoch: a fixed permutation per epoch; `loss` gets the images and captions.
ad::AdapterData<AdapterBatch> adapter_data(
    const Settings& s, const at::Tensor& images, const std::string& words,
    std::function<at::Tensor(const at::Tensor&, const std::vector<std::string>&)> loss) {
  ad::AdapterData<AdapterBatch> d;
  d.dataset_size = images.size(0);
  d.batch = [&s, n = images.size(0)](std::int64_t epoch, std::int64_t j) {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(s.adapters_seed() * 7919 + epoch);
    const at::Tensor perm = at::randperm(n, gen, at::TensorOptions().dtype(at::kLong));
    return AdapterBatch{perm.narrow(0, j * s.adapter_batch, s.adapter_batch), epoch};
  };
  d.loss = [images, words, loss = std::move(loss)](const AdapterBatch& b) {
    return loss(images.index_select(0, b.idx.to(images.device())), adapter_prompts(b, words));
  };
  return d;
}

ad::AdapterTrainOptions adapter_options(const Settings& s, const std::string& lr,
                                        const fs::path& log, const fs::path& output) {
  ad::AdapterTrainOptions o;
  o.learn_rate = lr;
  o.batch_size = s.adapter_batch;
  o.steps = s.adapter_steps;
  o.clip_grad_mode = "norm";
  o.clip_grad_value = "1.0";
  o.save_every = s.save_every;
  o.write_csv_every = 1;
  o.log_directory = log;
  o.output = output;
  return o;
}

std::vector<double> parse_numbers(const std::string& text, const std::string& where) {
  std::vector<double> out;
  std::size_t i = 0;
  while (i <= text.size()) {
    const std::size_t j = std::min(text.find(',', i), text.size());
    try {
      out.push_back(std::stod(text.substr(i, j - i)));
    } catch (const std::exception&) {
      throw ConfigError("must be numbers separated by commas, got '" + text + "'", where);
    }
    i = j + 1;
  }
  return out;
}

std::vector<std::string> split_words(const std::string& text) {
  std::vector<std::string> out;
  std::size_t i = 0;
  while (i <= text.size()) {
    const std::size_t j = std::min(text.find(',', i), text.size());
    if (j > i) out.push_back(text.substr(i, j - i));
    i = j + 1;
  }
  return out;
}

/// Samples under text states `cond` with guidance against `uncond`, from fixed noise; the
/// unconditional side is `unconditional`'s prediction when one is given (the base model beside an
/// adapted `net`).
at::Tensor sample(const Settings& s, const df::NoiseSchedule& schedule, fmtext::TextUNet& net,
                  const at::Tensor& cond, const at::Tensor& uncond,
                  fmtext::TextUNet* unconditional = nullptr) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(s.seed + 1);
  const at::Tensor noise = at::randn({cond.size(0), 1, 28, 28}, gen).to(cond.device());
  df::DpmSolverPP2M dpm(schedule, {.prediction_type = net->options().prediction,
                                   .clipping = df::Clipping{.clip_sample = true}});
  const df::SampleOptions opts{
      .num_inference_steps = s.sample_steps, .guidance_scale = s.guidance, .chunk_size = 250};
  at::NoGradGuard no_grad;
  // With guidance, df::sample asks for both sides in one batch: the conditional half first.
  auto model = [&](const at::Tensor& x, const at::Tensor& t, const at::Tensor& c) {
    if (unconditional == nullptr || s.guidance == 1.0) return net->forward(x, t, c);
    const std::int64_t h = x.size(0) / 2;
    return at::cat(
        {net->forward(x.narrow(0, 0, h), t.narrow(0, 0, h), c.narrow(0, 0, h)),
         (*unconditional)->forward(x.narrow(0, h, h), t.narrow(0, h, h), c.narrow(0, h, h))});
  };
  return df::sample(dpm, model, noise, opts, cond, uncond).clamp(-1, 1);
}

/// The text states of `count` copies of a prompt, and of the empty prompt (guidance's other side).
std::pair<at::Tensor, at::Tensor> prompt_states(fmtext::TextUNet& net, const std::string& prompt,
                                                std::int64_t count,
                                                const tx::EmbeddingFinder& finder = {},
                                                const tx::EmbeddingVectors& vectors = {}) {
  at::NoGradGuard no_grad;
  const at::Tensor cond = net->encode({prompt}, finder, vectors);
  const at::Tensor uncond = net->encode({""});
  return {cond.expand({count, -1, -1}).contiguous(), uncond.expand({count, -1, -1}).contiguous()};
}

/// The hypernetwork's modules onto `device` (its files are read onto the CPU).
void hypernetwork_to(ad::Hypernetwork& hn, at::Device device) {
  for (auto& [size, pair] : hn.layers) {
    pair.first->to(device);
    pair.second->to(device);
  }
}

int run(const Settings& s) {
  const auto t_start = std::chrono::steady_clock::now();
  if (s.new_class < 0 || s.new_class >= fmnist::kClasses)
    throw ConfigError("must be a class 0-9, got " + std::to_string(s.new_class), "--new-class");
  if (s.init_words() == fmtext::class_words(s.new_class))
    throw ConfigError("must be words other than the new class's, got '" + s.init_words() + "'",
                      "--init-word");
  if (s.out.empty()) throw ConfigError("is empty; name the output folder", "--out");
  if (s.held_out_images == "generic" && broader_word(s.new_class).first.empty()) {
    std::string kinds;
    for (const auto& [word, classes] : shared_words()) {
      if (!kinds.empty()) kinds += "; ";
      kinds += word;
      kinds += ":";
      for (const std::int64_t c : classes) {
        kinds += ' ';
        kinds += std::to_string(c);
      }
    }
    throw ConfigError(std::string("is generic, but ") +
                          fmnist::kClassNames[static_cast<std::size_t>(s.new_class)] +
                          " shares no broader word with another class (" + kinds + ")",
                      "--held-out-images");
  }
  const std::vector<std::string> methods = split_words(s.methods);
  for (const auto& m : methods)
    if (m != "embedding" && m != "hypernetwork" && m != "lora" && m != "dora" && m != "loha" &&
        m != "lokr")
      throw ConfigError(
          "names '" + m + "'; choose from embedding, hypernetwork, lora, dora, loha, lokr",
          "--methods");
  if (methods.empty()) throw ConfigError("names no adapter", "--methods");
  const auto wanted = [&](const char* m) {
    return std::find(methods.begin(), methods.end(), m) != methods.end();
  };
  const at::Device device = examples::device_from(s.device);
  examples::apply_threads(s);
  // The step strings are read before any work, so a bad one costs no classifier or base model.
  for (const auto& [flag, text] : {std::pair<std::string, std::string>{"--embedding-lr", s.ti_lr},
                                   {"--hypernetwork-lr", s.hn_lr}}) {
    try {
      (void)difftrain::schedule::StepString({.text = text});
    } catch (const difftrain::ConfigError& e) {
      throw ConfigError(e.message() + " (" + e.where() + ")", flag);
    }
  }
  const fs::path out(s.out), adapters = out / "adapters", log = out / "log";
  difftrain::io::ensure_writable_folder(out);
  difftrain::io::ensure_writable_folder(adapters);
  const std::string name = word_of(s.new_class), words = fmtext::class_words(s.new_class);

  // The tokenizer: every class's words are in its vocabulary (the held-out class's too).
  std::vector<std::string> texts = fmtext::caption_templates();
  for (std::int64_t c = 0; c < fmnist::kClasses; ++c) texts.push_back(fmtext::class_words(c));
  if (s.held_out_images == "generic") texts.push_back(broader_word(s.new_class).first);
  fmtext::write_caption_tokenizer(out / "tokenizer", texts);
  const tx::CLIPTokenizer tok = tx::CLIPTokenizer::from_folder(out / "tokenizer");

  const fmnist::Dataset data = fmnist::load(s.data_dir, s.limit);
  const fs::path classifier_path = s.classifier_file(s.out);
  auto judge = fmnist::judge_for(data, {.epochs = s.classifier_epochs, .seed = s.seed},
                                 classifier_path, device, s.min_classifier_accuracy);

  const df::NoiseSchedule schedule;
  const fs::path base_path = out / "base.safetensors";
  bool base_cached = false;
  double base_seconds = 0;
  base_model(s, data, schedule, tok, base_path, base_cached, base_seconds);
  std::fprintf(stderr, "base: %s (%.1f s)\n", base_cached ? "cached" : "trained", base_seconds);

  const at::Tensor images = new_class_images(s, data).to(device);
  const std::string prompt = fmtext::fill_template("a photo of a {}", words);
  const std::string ti_prompt = fmtext::fill_template("a photo of a {}", name);
  nlohmann::json results, files, sizes, timing, prompts;
  std::vector<at::Tensor> rows;
  rows.push_back(data.test.images.index_select(
      0, data.test.labels.eq(s.new_class).nonzero().flatten().narrow(0, 0, 10)));
  const auto classify = [&](const at::Tensor& samples) {
    auto& cls = judge.net;
    cls->eval();
    return fmnist::batched(samples, 500,
                           [&](const at::Tensor& x) { return cls->forward(x).argmax(1); });
  };
  // `method`'s share of samples classified as the new class, and (with `grid_row`) its row of
  // samples.png.
  auto score = [&](const std::string& method, const at::Tensor& samples, bool grid_row = true) {
    const double acc = classify(samples).eq(s.new_class).to(at::kDouble).mean().item<double>();
    results["new_class_accuracy"][method] = acc;
    if (grid_row)
      rows.push_back(samples.narrow(0, 0, std::min<std::int64_t>(10, samples.size(0))).cpu());
    std::printf("%-15s %5.1f %% of %lld samples classified as %s\n", method.c_str(), 100 * acc,
                static_cast<long long>(samples.size(0)),
                fmnist::kClassNames[static_cast<std::size_t>(s.new_class)]);
  };

  {
    fmtext::TextUNet net = load_base(s, schedule, tok, base_path);
    // What the base model learned: each known class prompted by its words.
    const std::int64_t per_class = std::max<std::int64_t>(1, s.samples / 10);
    std::vector<at::Tensor> conds, unconds, want;
    for (std::int64_t c = 0; c < fmnist::kClasses; ++c) {
      if (c == s.new_class) continue;
      const auto [cond, uncond] = prompt_states(
          net, fmtext::fill_template("a photo of a {}", fmtext::class_words(c)), per_class);
      conds.push_back(cond);
      unconds.push_back(uncond);
      want.push_back(at::full({per_class}, c, at::kLong));
    }
    const at::Tensor known = sample(s, schedule, net, at::cat(conds), at::cat(unconds));
    const double acc =
        classify(known).cpu().eq(at::cat(want)).to(at::kDouble).mean().item<double>();
    results["base_known_class_accuracy"] = acc;
    std::printf("%-15s %5.1f %% of %lld samples of the nine known classes classified as prompted\n",
                "base (known)", 100 * acc, static_cast<long long>(known.size(0)));
    // The base model alone, prompted with the new class's (never trained) words.
    const auto [cond, uncond] = prompt_states(net, prompt, s.samples);
    score("base", sample(s, schedule, net, cond, uncond));
    for (const auto& p : {prompt, ti_prompt, std::string()}) prompts[p] = tok.encode(p, false);
  }

  // Guidance's unconditional side for the hypernetwork and LoRA: the base model itself with
  // --unconditional-side base, none (the adapted model) with adapted.
  const auto unconditional_model = [&]() -> std::optional<fmtext::TextUNet> {
    if (s.unconditional != "base") return std::nullopt;
    return load_base(s, schedule, tok, base_path);
  };

  // 1. Textual inversion: only the embedding's vectors train; prompts find it in the database.
  if (wanted("embedding")) {
    auto t = std::chrono::steady_clock::now();
    tr::set_seed(s.adapters_seed() + 10);
    fmtext::TextUNet net = load_base(s, schedule, tok, base_path);
    const auto tokenize = [&tok](const std::string& text) { return tok.encode(text, false); };
    ad::EmbeddingDatabase db(tokenize, s.text_width);
    // The web UI's create_embedding: the init words' token vectors, repeated.
    const auto ids = tokenize(s.init_words());
    if (ids.empty()) throw ConfigError("gives no token", "--init-word");
    const at::Tensor table = net->text_encoder->token_embedding->weight.detach();
    ad::Embedding e;
    e.name = name;
    e.vec = at::zeros({s.num_vectors, s.text_width}, table.options());
    for (std::int64_t v = 0; v < s.num_vectors; ++v)
      e.vec[v].copy_(table[ids[static_cast<std::size_t>(v) % ids.size()]]);
    e.step = 0;
    db.register_embedding(e);  // shares e's vectors, which train in place
    const auto finder = db.prompt_finder();
    const auto vectors = db.prompt_vectors();
    {
      // Where training starts: the embedding as created (the init words' vectors), so the figure
      // after training shows what the training added.
      const auto [cond, uncond] = prompt_states(net, ti_prompt, s.samples, finder, vectors);
      score("embedding_start", sample(s, schedule, net, cond, uncond), false);
    }
    t = std::chrono::steady_clock::now();  // the training's time, not the sampling's
    const fs::path file = adapters / (name + ".pt");
    const auto r = ad::train_embedding(
        e, adapter_options(s, s.ti_lr, log / "embedding", file),
        adapter_data(s, images, name,
                     [&](const at::Tensor& x0, const std::vector<std::string>& p) {
                       return net->context_loss(x0, net->encode(p, finder, vectors));
                     }),
        {.on_step = AdapterLog(tensorboard_run(s, "embedding"))});
    timing["embedding_train_seconds"] = seconds_since(t);
    // Sampling reads the file back, as a user of the embedding would.
    ad::EmbeddingDatabase fresh(tokenize, s.text_width);
    fresh.load_from_file(file);
    const auto [cond, uncond] =
        prompt_states(net, ti_prompt, s.samples, fresh.prompt_finder(), fresh.prompt_vectors());
    score("embedding", sample(s, schedule, net, cond, uncond));
    files["embedding"] = fs::relative(file, out).string();
    results["embedding_vectors"] = e.vectors();
    results["embedding_statistics"] = r.recent_statistics;
  }

  // 2. Hypernetwork: a (k, v) pair for the text's width on every attention layer (the web UI's
  // hook; self-attention contexts of other widths pass unchanged), prompted with the new words.
  if (wanted("hypernetwork")) {
    auto t = std::chrono::steady_clock::now();
    tr::set_seed(s.adapters_seed() + 20);
    fmtext::TextUNet net = load_base(s, schedule, tok, base_path);
    ad::Hypernetwork hn(name + "-hn", {s.text_width},
                        {.layer_structure = parse_numbers(s.hn_structure, "--hn-structure"),
                         .activation_func = "relu",
                         .weight_init = "Normal"});
    hypernetwork_to(hn, device);
    const std::size_t hooked = ad::attach_hypernetwork(*net->unet, hn);
    const fs::path file = adapters / (name + "-hn.pt");
    const auto r = ad::train_hypernetwork(
        hn, adapter_options(s, s.hn_lr, log / "hypernetwork", file),
        adapter_data(s, images, words,
                     [&](const at::Tensor& x0, const std::vector<std::string>& p) {
                       return net->context_loss(x0, net->encode(p));
                     }),
        {.on_step = AdapterLog(tensorboard_run(s, "hypernetwork"))});
    timing["hypernetwork_train_seconds"] = seconds_since(t);
    hn = ad::Hypernetwork::load(file);  // the hooks read `hn`: sample with the saved file
    hypernetwork_to(hn, device);
    const auto [cond, uncond] = prompt_states(net, prompt, s.samples);
    auto base = unconditional_model();
    score("hypernetwork", sample(s, schedule, net, cond, uncond, base ? &*base : nullptr));
    ad::detach_hypernetwork(*net->unet);
    files["hypernetwork"] = fs::relative(file, out).string();
    results["hypernetwork_statistics"] = r.recent_statistics;
    results["hypernetwork_attention_layers"] = hooked;
  }

  // 3. LoRA, DoRA, and LyCORIS' LoHa and LoKr: adapters on the UNet's named layers, everything
  // else frozen, trained with the Trainer on the same captions at the same rank and alpha.
  for (const std::string kind : {"lora", "dora", "loha", "lokr"}) {
    if (!wanted(kind.c_str())) continue;
    const bool lora = kind == "lora" || kind == "dora";
    const ad::LoraOptions lora_options{
        .rank = s.lora_rank, .alpha = s.lora_alpha, .use_dora = kind == "dora"};
    auto t = std::chrono::steady_clock::now();
    tr::set_seed(s.adapters_seed() + 30);
    fmtext::TextUNet net = load_base(s, schedule, tok, base_path);
    net->set_p_uncond(0.0);
    const ad::LoraTargets targets{.target_modules = split_words(s.lora_targets)};
    const ad::DeltaOptions delta{.kind = kind == "loha" ? ad::DeltaKind::loha : ad::DeltaKind::lokr,
                                 .rank = s.lora_rank,
                                 .alpha = s.lora_alpha};
    const auto injected = lora ? ad::inject_lora(*net->unet, targets, lora_options)
                               : ad::inject_weight_delta(*net->unet, targets, delta);
    net->train();
    tr::Trainer<fmtext::TextUNetImpl, LoraConfig>::Options o;
    o.optimizer.lr = s.lora_lr;
    o.optimizer.weight_decay = 0.0;
    tr::Trainer<fmtext::TextUNetImpl, LoraConfig> trainer(
        *net, o,
        {tr::ProgressBar({.total_steps = s.adapter_steps, .every = 25}),
         tr::TensorBoard({.dir = tensorboard_run(s, kind)})});
    const auto data_ = adapter_data(s, images, words, {});
    const std::int64_t per_epoch = std::max<std::int64_t>(1, images.size(0) / s.adapter_batch);
    trainer.fit(
        [&](std::int64_t step, std::int64_t) {
          const AdapterBatch b = data_.batch(step / per_epoch, step % per_epoch);
          std::vector<at::Tensor> ids;
          for (const auto& p : adapter_prompts(b, words)) ids.push_back(net->tokens(p));
          return fmtext::TextUNetImpl::Batch{images.index_select(0, b.idx.to(device)),
                                             at::stack(ids).to(device)};
        },
        s.adapter_steps);
    timing[kind + "_train_seconds"] = seconds_since(t);
    const fs::path file = adapters / (name + "-" + kind + ".safetensors");
    const std::map<std::string, std::string> meta{{"lora_rank", std::to_string(s.lora_rank)},
                                                  {"lora_alpha", std::to_string(s.lora_alpha)},
                                                  {"target_modules", s.lora_targets},
                                                  {"network_algo", kind},
                                                  {"base_model", base_key(s)}};
    // LoRA and DoRA in the PEFT layout diffusers reads; LoHa and LoKr in LyCORIS' (the web UI's).
    const ad::LoraKeyOptions lycoris{ad::LoraLayout::kohya, "lora_unet_"};
    if (lora)
      difftrain::io::save_safetensors(
          file,
          ad::lora_state_dict(*net->unet, {.layout = ad::LoraLayout::peft, .prefix = "unet."}),
          ad::stable_diffusion_peft_metadata({.unet = net->unet.get()}, meta));
    else
      difftrain::io::save_safetensors(file, ad::weight_delta_state_dict(*net->unet, lycoris), meta);
    // A fresh base with the file loaded (a LoRA merged: sampling costs what the base costs).
    fmtext::TextUNet fresh = load_base(s, schedule, tok, base_path);
    const auto saved = difftrain::io::load_safetensors(file, true).tensors;
    if (lora) {
      (void)ad::load_lora_state_dict(
          *fresh->unet, saved, {.layout = ad::LoraLayout::peft, .prefix = "unet."}, lora_options);
      for (const auto& [layer_name, layer] : ad::lora_layers(*fresh->unet)) layer->merge();
    } else {
      (void)ad::load_weight_delta_state_dict(*fresh->unet, saved, lycoris);
    }
    fresh->eval();
    const auto [cond, uncond] = prompt_states(fresh, prompt, s.samples);
    auto base = unconditional_model();
    score(kind, sample(s, schedule, fresh, cond, uncond, base ? &*base : nullptr));
    files[kind] = fs::relative(file, out).string();
    results[kind + "_layers"] = injected.size();
  }

  for (const auto& [key, f] : files.items()) sizes[key] = fs::file_size(out / f.get<std::string>());
  difftrain::io::write_png(
      out / "samples.png", difftrain::io::image_grid(at::cat(rows), {.columns = 10, .padding = 2}),
      {{"Description",
        "rows: real " + words + " images, base model, then each adapter of --methods"}});
  results["files"] = files;
  results["file_bytes"] = sizes;
  results["tokenizer"] = "tokenizer";
  results["prompt_ids"] = prompts;
  results["lora_rank"] = s.lora_rank;
  results["lora_alpha"] = std::to_string(s.lora_alpha);
  results["new_class"] = fmnist::kClassNames[static_cast<std::size_t>(s.new_class)];
  results["held_out_images"] = s.held_out_images;
  results["init_word"] = s.init_words();
  results["adapter_images"] = images.size(0);
  results["adapter_steps"] = s.adapter_steps;
  results["samples"] = s.samples;
  results["guidance"] = s.guidance;
  results["unconditional_side"] = s.unconditional;
  results["adapter_seed"] = s.adapters_seed();
  results["classifier_test_accuracy"] = judge.test_accuracy;
  results["base_from_cache"] = base_cached;
  timing["base_seconds"] = base_seconds;
  timing["total_seconds"] = seconds_since(t_start);
  results["timing"] = timing;
  const std::string text = results.dump(2) + "\n";
  difftrain::io::write_file_atomic(out / "results.json",
                                   std::span<const char>(text.data(), text.size()));
  for (const auto& [key, bytes] : sizes.items())
    std::printf("%-15s file %s: %lld bytes\n", key.c_str(), files[key].get<std::string>().c_str(),
                static_cast<long long>(bytes.get<std::int64_t>()));
  std::printf("wrote %s/{samples.png,results.json} in %.0f s\n", s.out.c_str(),
              seconds_since(t_start));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  CLI::App app{
      "Teach a text-conditioned Fashion-MNIST diffusion model (trained on nine classes' captions) "
      "the tenth class with a textual-inversion "
      "embedding, a hypernetwork and a LoRA, and score each with a classifier."};
  app.get_formatter()->column_width(34);
  auto* g = app.add_option_group("data and run");
  examples::add_run_flags(g, s, "directory with the IDX files",
                          "TensorBoard's folder, a run per training (default: OUT/tensorboard)");
  g->add_option("--new-class", s.new_class, "the class the base model has no words for (0-9)")
      ->check(examples::count_in(0, 9))
      ->capture_default_str();
  g->add_option("--adapter-seed", s.adapter_seed,
                "seeds only the adapters' training (-1: --seed): runs that differ here share the "
                "base model and the sampling noise")
      ->check(CLI::Range(std::int64_t{-1}, std::int64_t{1} << 40))
      ->capture_default_str();
  g->add_option("--held-out-images", s.held_out_images,
                "generic: the base model sees the new class's images only under a word its kind "
                "shares ('shoe'); uncaptioned: only with the empty prompt; unseen: never")
      ->check(CLI::IsMember({"unseen", "uncaptioned", "generic"}))
      ->capture_default_str();
  auto* b = app.add_option_group("base model");
  b->add_option("--channels", s.channels, "UNet width C")
      ->check(examples::count_in(16, 4096))
      ->capture_default_str();
  b->add_option("--text-width", s.text_width, "text encoder width (= cross_attention_dim)")
      ->check(examples::count_in(32, 4096))
      ->capture_default_str();
  b->add_option("--text-layers", s.text_layers, "text encoder layers")
      ->check(examples::count_in(1, 48))
      ->capture_default_str();
  b->add_option("--base-steps", s.base_steps, "steps on the nine classes")
      ->check(examples::count_in(1, 100'000'000))
      ->capture_default_str();
  b->add_option("--batch-size", s.batch_size, "base model batch")
      ->check(examples::count_in(1, 1'000'000))
      ->capture_default_str();
  b->add_option("--lr", s.lr, "base model peak learning rate")
      ->check(examples::number_in(0, 1e4, true))
      ->capture_default_str();
  auto* a = app.add_option_group("adapters");
  a->add_option("--adapter-images", s.adapter_images, "images of the new class the adapters see")
      ->check(examples::count_in(1, 100'000'000))
      ->capture_default_str();
  a->add_option("--adapter-steps,--max_train_steps", s.adapter_steps, "steps per adapter")
      ->check(examples::count_in(1, 100'000'000))
      ->capture_default_str();
  a->add_option("--adapter-batch,--train_batch_size", s.adapter_batch, "images per adapter step")
      ->check(examples::count_in(1, 1'000'000))
      ->capture_default_str();
  a->add_option("--init-word", s.init_word,
                "words whose token vectors start the embedding (default: the broader word "
                "with generic, else 'sneaker')")
      ->capture_default_str();
  a->add_option("--num-vectors,--num_vectors", s.num_vectors, "embedding vectors")
      ->check(examples::count_in(1, 75))
      ->capture_default_str();
  a->add_option("--embedding-lr", s.ti_lr, "embedding learning rates (step string)")
      ->capture_default_str();
  a->add_option("--hypernetwork-lr", s.hn_lr, "hypernetwork learning rates (step string)")
      ->capture_default_str();
  a->add_option("--hn-structure", s.hn_structure, "hypernetwork layer structure")
      ->capture_default_str();
  a->add_option("--lora-lr,--learning_rate", s.lora_lr, "LoRA learning rate")
      ->check(examples::number_in(0, 1e4, true))
      ->capture_default_str();
  a->add_option("--lora-rank,--rank", s.lora_rank, "LoRA rank")
      ->check(examples::count_in(1, 4096))
      ->capture_default_str();
  a->add_option("--lora-alpha", s.lora_alpha, "LoRA alpha")
      ->check(examples::number_in(0, 1e6, true))
      ->capture_default_str();
  a->add_option("--lora-targets", s.lora_targets, "LoRA target modules (PEFT rule)")
      ->capture_default_str();
  a->add_option("--methods", s.methods, "which adapters to train (comma-separated)")
      ->capture_default_str();
  a->add_option("--save-every", s.save_every, "periodic adapter copies (0: none)")
      ->check(examples::count_in(0, 100'000'000))
      ->capture_default_str();
  auto* e = app.add_option_group("sampling and scoring");
  e->add_option("--samples", s.samples, "samples of the new class per method")
      ->check(CLI::Range(10, 100000))
      ->capture_default_str();
  e->add_option("--sample-steps", s.sample_steps, "DPM-Solver++ steps")
      ->check(examples::count_in(1, 1000))
      ->capture_default_str();
  e->add_option("--guidance", s.guidance, "classifier-free guidance scale")
      ->check(examples::number_in(0, 1e4))
      ->capture_default_str();
  e->add_option("--unconditional-side", s.unconditional,
                "base: guidance's unconditional side is the base model's, so an adapter changes "
                "only the prompt's side; adapted: the hypernetwork and LoRA act on the empty "
                "prompt too (the web UI)")
      ->check(CLI::IsMember({"base", "adapted"}))
      ->capture_default_str();
  examples::add_judge_flags(e, s);
  if (const auto rc = examples::parse_command_line(app, argc, argv)) return *rc;
  return examples::run_reporting_errors([&] { return run(s); });
}
