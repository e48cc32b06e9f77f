// Teaches a Fashion-MNIST diffusion model a class it never saw, three ways, and scores each:
//
//   1. trains the main job's UNet on nine classes (every condition through its context-token
//      table, `pooled_context`), or loads it from OUT/base.safetensors;
//   2. textual inversion: a new embedding "ankle-boot" (4 vectors, one per context token) trained
//      with the web UI's loop while the model stays frozen, looked up through an
//      EmbeddingDatabase when prompts are encoded;
//   3. a web UI hypernetwork on every attention layer's context, trained with the web UI's loop,
//      prompted with the new class's never-trained token;
//   4. LoRA on the attention projections and the ResBlocks' condition projections, trained with
//      difftrain's Trainer on the same prompt, merged for sampling;
//   then samples the new class with classifier-free guidance under each (and under the base model
//   alone) and reports the share the main job's classifier calls the new class, and each adapter
//   file's size. `fashion_mnist_adapters --help` lists the flags.
//
// Writes to --out: base.safetensors (cached base model), adapters/ (ankle-boot.pt and .optim,
// ankle-boot-hn.pt and .optim, ankle-boot-lora.safetensors), log/ (the adapters' loss logs and
// periodic copies), samples.png (rows: real images, base, embedding, hypernetwork, LoRA) and
// results.json.

#include <CLI/CLI.hpp>
#include <difftrain/adapters/adapters.hpp>
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
#include <string>

#include "../common/cli_checks.hpp"
#include "../common/run_skeleton.hpp"
#include "../fashion_mnist/classifier.hpp"
#include "../fashion_mnist/data.hpp"
#include "../fashion_mnist/unet.hpp"

namespace fs = std::filesystem;
namespace tr = difftrain::train;
namespace df = difftrain::diffusion;
namespace ad = difftrain::adapters;
using difftrain::ConfigError;

namespace {

struct Settings : examples::RunFlags, examples::JudgeFlags {
  Settings() {
    data_dir = fmnist::kDefaultDataDir;
    out = "runs/fashion_mnist_adapters";
  }
  std::int64_t new_class = 9;
  std::string init_word = "sneaker";
  // base model
  std::int64_t channels = 16;
  std::int64_t base_steps = 1200;
  std::int64_t batch_size = 64;
  double lr = 2e-3;
  // adapters
  std::int64_t adapter_images = 300;
  std::int64_t adapter_steps = 300;
  std::int64_t adapter_batch = 32;
  std::string ti_lr = "0.05:150, 0.02";
  std::string hn_lr = "0.02:150, 0.01";
  std::string hn_structure = "1,2,1";
  double lora_lr = 1e-2;
  std::int64_t lora_rank = 4;
  double lora_alpha = 4.0;
  std::string lora_targets = "to_q,to_k,to_v,to_out.0,time_emb_proj";
  std::int64_t save_every = 100;
  // sampling and scoring
  std::int64_t samples = 100;
  std::int64_t sample_steps = 20;
  double guidance = 3.0;
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

/// "Ankle boot" → "ankle-boot": the word a prompt uses for a class.
std::string word_of(std::int64_t c) {
  std::string w = fmnist::kClassNames[static_cast<std::size_t>(c)];
  for (char& ch : w)
    ch = ch == ' ' || ch == '/' ? '-'
                                : static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return w;
}

/// The model's "text encoder": words → tokens (a class word is one token, read from the UNet's
/// context table as `context_tokens` vectors); an embedding's name in a prompt is replaced by its
/// vectors through the database, as the web UI does for CLIP.
class TextEncoder {
 public:
  static constexpr std::int64_t kPlaceholder = 0, kFirstClassToken = 1000;
  explicit TextEncoder(fmnist::UNet net) : net_(std::move(net)) {}

  /// Token ids: class words are kFirstClassToken + class; other words get ids from 100 up.
  std::vector<std::int64_t> tokenize(const std::string& text) {
    std::vector<std::int64_t> out;
    std::size_t i = 0;
    while (i < text.size()) {
      const std::size_t j = std::min(text.find(' ', i), text.size());
      const std::string w = text.substr(i, j - i);
      if (!w.empty()) out.push_back(id_of(w));
      i = j + 1;
    }
    return out;
  }
  ad::EmbeddingDatabase::Tokenize tokenizer() {
    return [this](const std::string& s) { return tokenize(s); };
  }

  /// (B, context_tokens, 2C) for the prompts; a prompt must give exactly the model's tokens.
  at::Tensor encode(const std::vector<std::string>& prompts, const ad::EmbeddingDatabase& db) {
    const std::int64_t n = net_->options().context_tokens, width = 2 * net_->options().channels;
    std::vector<at::Tensor> rows;
    std::vector<std::vector<std::pair<std::int64_t, ad::EmbeddingDatabase::Ptr>>> fixes;
    for (const auto& p : prompts) {
      const auto x = db.expand(tokenize(p));
      std::vector<at::Tensor> parts;
      std::vector<std::pair<std::int64_t, ad::EmbeddingDatabase::Ptr>> f;
      std::int64_t pos = 0;
      std::size_t next_fix = 0;
      for (std::size_t i = 0; i < x.tokens.size(); ++i) {
        if (next_fix < x.fixes.size() && x.fixes[next_fix].first == static_cast<std::int64_t>(i))
          f.emplace_back(pos, x.fixes[next_fix++].second);
        const std::int64_t tok = x.tokens[i];
        if (tok == kPlaceholder) {
          parts.push_back(at::zeros({1, width}, device()));
          pos += 1;
        } else if (tok >= kFirstClassToken && tok <= kFirstClassToken + fmnist::kClasses) {
          parts.push_back(
              net_->context(at::tensor({tok - kFirstClassToken}, at::kLong).to(device()))[0]);
          pos += n;
        } else {
          throw ConfigError("names no class and no embedding of the database",
                            "prompt '" + p + "'");
        }
      }
      if (pos != n)
        throw difftrain::ShapeError("gives " + std::to_string(pos) +
                                        " context vectors, the model reads " + std::to_string(n),
                                    "prompt '" + p + "'");
      rows.push_back(at::cat(parts));
      fixes.push_back(std::move(f));
    }
    return ad::apply_embeddings(at::stack(rows), fixes, /*first_position=*/0);
  }

 private:
  [[nodiscard]] at::TensorOptions device() const {
    return at::TensorOptions().device(net_->parameters().front().device());
  }
  std::int64_t id_of(const std::string& w) {
    for (std::int64_t c = 0; c < fmnist::kClasses; ++c)
      if (w == word_of(c)) return kFirstClassToken + c;
    if (w == "<null>") return kFirstClassToken + fmnist::kClasses;
    auto [it, _] = others_.emplace(w, 100 + static_cast<std::int64_t>(others_.size()));
    return it->second;
  }
  fmnist::UNet net_;
  std::map<std::string, std::int64_t> others_;
};

struct BaseConfig : tr::DefaultConfig {
  using Schedule = difftrain::schedule::Cosine;
  using Ema = difftrain::ema::Ema<difftrain::ema::WarmupDecay>;
  using Callbacks = std::tuple<tr::ProgressBar, tr::TensorBoard>;
};
struct LoraConfig : tr::DefaultConfig {
  using Callbacks = std::tuple<tr::ProgressBar, tr::TensorBoard>;
};

fmnist::UNetOptions unet_options(const Settings& s) {
  return {.channels = s.channels, .classes = fmnist::kClasses, .pooled_context = true};
}

std::string base_key(const Settings& s) {
  return "unet=pooled,C=" + std::to_string(s.channels) + ",steps=" + std::to_string(s.base_steps) +
         ",batch=" + std::to_string(s.batch_size) + ",lr=" + std::to_string(s.lr) +
         ",seed=" + std::to_string(s.seed) + ",limit=" + std::to_string(s.limit) +
         ",without=" + std::to_string(s.new_class);
}

/// The base model's EMA weights: from the cache when it was made with these settings, else
/// trained on every class but the new one.
void base_model(const Settings& s, const fmnist::Dataset& data, const df::NoiseSchedule& schedule,
                const fs::path& path, bool& from_cache, double& seconds) {
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
  fmnist::UNet net(unet_options(s), schedule);
  net->to(device);
  const at::Tensor keep = data.train.labels.ne(s.new_class).nonzero().flatten();
  const at::Tensor images = data.train.images.index_select(0, keep).to(device);
  const at::Tensor labels = data.train.labels.index_select(0, keep).to(device);
  const std::int64_t n = images.size(0);
  tr::Trainer<fmnist::UNetImpl, BaseConfig>::Options o;
  o.optimizer.lr = s.lr;
  o.schedule.num_warmup_steps = std::min<std::int64_t>(100, s.base_steps);
  o.schedule.num_training_steps = s.base_steps;
  o.ema.rule.decay = 0.995;
  tr::Trainer<fmnist::UNetImpl, BaseConfig> trainer(
      *net, o,
      {tr::ProgressBar({.total_steps = s.base_steps, .every = 10}),
       tr::TensorBoard({.dir = tensorboard_run(s, "base")})});
  fmnist::EpochBatches batches(n, s.batch_size, s.seed, device);
  std::fprintf(stderr, "base: %lld steps on %lld images of nine classes (without %s)\n",
               static_cast<long long>(s.base_steps), static_cast<long long>(n),
               fmnist::kClassNames[static_cast<std::size_t>(s.new_class)]);
  trainer.fit(
      [&](std::int64_t step, std::int64_t) {
        const at::Tensor idx = batches.indices(step);
        return fmnist::UNetImpl::Batch{images.index_select(0, idx), labels.index_select(0, idx)};
      },
      s.base_steps);
  difftrain::ema::EmaScope scope(trainer.ema());
  difftrain::io::save_safetensors(path, difftrain::nn::module_tensors(*net, false),
                                  {{"settings", base_key(s)}});
  seconds = seconds_since(t);
}

fmnist::UNet load_base(const Settings& s, const df::NoiseSchedule& schedule, const fs::path& path) {
  fmnist::UNet net(unet_options(s), schedule);
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

/// Micro-batch j of an epoch: a fixed permutation per epoch.
ad::AdapterData<at::Tensor> adapter_data(const Settings& s, const at::Tensor& images,
                                         std::function<at::Tensor(const at::Tensor&)> loss) {
  ad::AdapterData<at::Tensor> d;
  d.dataset_size = images.size(0);
  d.batch = [&s, n = images.size(0)](std::int64_t epoch, std::int64_t j) {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(s.seed * 7919 + epoch);
    const at::Tensor perm = at::randperm(n, gen, at::TensorOptions().dtype(at::kLong));
    return perm.narrow(0, j * s.adapter_batch, s.adapter_batch);
  };
  d.loss = [images, loss = std::move(loss)](const at::Tensor& idx) {
    return loss(images.index_select(0, idx.to(images.device())));
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

/// Samples `cond` contexts with guidance against the null context, from fixed noise.
at::Tensor sample(const Settings& s, const df::NoiseSchedule& schedule, fmnist::UNet& net,
                  const at::Tensor& cond, const at::Tensor& uncond, bool by_label) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(s.seed + 1);
  const at::Tensor noise = at::randn({cond.size(0), 1, 28, 28}, gen).to(cond.device());
  df::DpmSolverPP2M dpm(schedule, {.prediction_type = net->options().prediction,
                                   .clipping = df::Clipping{.clip_sample = true}});
  const df::SampleOptions opts{
      .num_inference_steps = s.sample_steps, .guidance_scale = s.guidance, .chunk_size = 250};
  at::NoGradGuard no_grad;
  auto model = [&](const at::Tensor& x, const at::Tensor& t, const at::Tensor& c) {
    return by_label ? net->forward(x, t, c) : net->forward_context(x, t, c);
  };
  return df::sample(dpm, model, noise, opts, cond, uncond).clamp(-1, 1);
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
  std::int64_t init_class = -1;
  for (std::int64_t c = 0; c < fmnist::kClasses; ++c)
    if (word_of(c) == s.init_word) init_class = c;
  if (init_class < 0 || init_class == s.new_class)
    throw ConfigError("must name one of the nine known classes, got '" + s.init_word + "'",
                      "--init-word");
  if (s.out.empty()) throw ConfigError("is empty; name the output folder", "--out");
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
  const std::string word = word_of(s.new_class);

  const fmnist::Dataset data = fmnist::load(s.data_dir, s.limit);
  const fs::path classifier_path = s.classifier_file(s.out);
  auto judge = fmnist::judge_for(data, {.epochs = s.classifier_epochs, .seed = s.seed},
                                 classifier_path, device, s.min_classifier_accuracy);

  const df::NoiseSchedule schedule;
  const fs::path base_path = out / "base.safetensors";
  bool base_cached = false;
  double base_seconds = 0;
  base_model(s, data, schedule, base_path, base_cached, base_seconds);
  std::fprintf(stderr, "base: %s (%.1f s)\n", base_cached ? "cached" : "trained", base_seconds);

  const at::Tensor images = new_class_images(s, data).to(device);
  const std::vector<std::string> prompts(static_cast<std::size_t>(s.samples), word);
  nlohmann::json results, files, sizes, timing;
  std::vector<at::Tensor> rows;
  rows.push_back(data.test.images.index_select(
      0, data.test.labels.eq(s.new_class).nonzero().flatten().narrow(0, 0, 10)));
  auto score = [&](const std::string& method, const at::Tensor& samples) {
    auto& cls = judge.net;
    cls->eval();
    const at::Tensor pred = fmnist::batched(
        samples, 500, [&](const at::Tensor& x) { return cls->forward(x).argmax(1); });
    const double acc = pred.eq(s.new_class).to(at::kDouble).mean().item<double>();
    results["new_class_accuracy"][method] = acc;
    rows.push_back(samples.narrow(0, 0, std::min<std::int64_t>(10, samples.size(0))).cpu());
    std::printf("%-13s %5.1f %% of %lld samples classified as %s\n", method.c_str(), 100 * acc,
                static_cast<long long>(samples.size(0)),
                fmnist::kClassNames[static_cast<std::size_t>(s.new_class)]);
  };
  const auto on_device = at::TensorOptions().dtype(at::kLong).device(device);
  const at::Tensor null_labels = at::full({s.samples}, fmnist::kClasses, on_device);
  const at::Tensor new_labels = at::full({s.samples}, s.new_class, on_device);

  // The base model alone, prompted with the new class's (never trained) token.
  {
    fmnist::UNet net = load_base(s, schedule, base_path);
    score("base", sample(s, schedule, net, new_labels, null_labels, true));
  }

  // 1. Textual inversion: only the embedding's vectors train; prompts find it in the database.
  {
    auto t = std::chrono::steady_clock::now();
    tr::set_seed(s.seed + 10);
    fmnist::UNet net = load_base(s, schedule, base_path);
    TextEncoder text(net);
    ad::EmbeddingDatabase db(text.tokenizer(), 2 * s.channels);
    ad::Embedding e;
    e.name = word;
    e.vec = net->context(at::tensor({init_class}, at::kLong).to(device))[0].detach().clone();
    e.step = 0;
    db.register_embedding(e);  // shares e's vectors, which train in place
    const std::vector<std::string> batch_prompts(static_cast<std::size_t>(s.adapter_batch), word);
    const fs::path file = adapters / (word + ".pt");
    const auto r = ad::train_embedding(e, adapter_options(s, s.ti_lr, log / "embedding", file),
                                       adapter_data(s, images,
                                                    [&](const at::Tensor& x0) {
                                                      return net->context_loss(
                                                          x0, text.encode(batch_prompts, db));
                                                    }),
                                       {.on_step = AdapterLog(tensorboard_run(s, "embedding"))});
    timing["embedding_train_seconds"] = seconds_since(t);
    // Sampling reads the file back, as a user of the embedding would.
    ad::EmbeddingDatabase fresh(text.tokenizer(), 2 * s.channels);
    fresh.load_from_file(file);
    at::Tensor cond, uncond;
    {
      at::NoGradGuard g;
      cond = text.encode(prompts, fresh);
      uncond = text.encode(std::vector<std::string>(prompts.size(), "<null>"), fresh);
    }
    score("embedding", sample(s, schedule, net, cond, uncond, false));
    files["embedding"] = fs::relative(file, out).string();
    results["embedding_vectors"] = e.vectors();
    results["embedding_statistics"] = r.recent_statistics;
  }

  // 2. Hypernetwork: a (k, v) pair for the context width, on every attention layer.
  {
    auto t = std::chrono::steady_clock::now();
    tr::set_seed(s.seed + 20);
    fmnist::UNet net = load_base(s, schedule, base_path);
    ad::Hypernetwork hn(word + "-hn", {2 * s.channels},
                        {.layer_structure = parse_numbers(s.hn_structure, "--hn-structure"),
                         .activation_func = "relu",
                         .weight_init = "Normal"});
    hypernetwork_to(hn, device);
    for (const auto& item : net->named_modules()) {
      if (auto attn = std::dynamic_pointer_cast<
              difftrain::nn::blocks::CrossAttentionImpl<fmnist::AttentionBackend>>(item.value()))
        attn->set_context_hook([&hn](const at::Tensor& c) { return hn.apply(c, c); });
    }
    const fs::path file = adapters / (word + "-hn.pt");
    const auto r = ad::train_hypernetwork(
        hn, adapter_options(s, s.hn_lr, log / "hypernetwork", file),
        adapter_data(s, images,
                     [&](const at::Tensor& x0) {
                       return net->context_loss(
                           x0, net->context(at::full({x0.size(0)}, s.new_class, on_device)));
                     }),
        {.on_step = AdapterLog(tensorboard_run(s, "hypernetwork"))});
    timing["hypernetwork_train_seconds"] = seconds_since(t);
    hn = ad::Hypernetwork::load(file);  // the hooks read `hn`: sample with the saved file
    hypernetwork_to(hn, device);
    score("hypernetwork", sample(s, schedule, net, new_labels, null_labels, true));
    files["hypernetwork"] = fs::relative(file, out).string();
    results["hypernetwork_statistics"] = r.recent_statistics;
  }

  // 3. LoRA: branches on the named layers, everything else frozen, trained with the Trainer.
  {
    auto t = std::chrono::steady_clock::now();
    tr::set_seed(s.seed + 30);
    fmnist::UNet net = load_base(s, schedule, base_path);
    net->set_p_uncond(0.0);
    const auto injected = ad::inject_lora(*net, {.target_modules = split_words(s.lora_targets)},
                                          {.rank = s.lora_rank, .alpha = s.lora_alpha});
    net->train();
    tr::Trainer<fmnist::UNetImpl, LoraConfig>::Options o;
    o.optimizer.lr = s.lora_lr;
    o.optimizer.weight_decay = 0.0;
    tr::Trainer<fmnist::UNetImpl, LoraConfig> trainer(
        *net, o,
        {tr::ProgressBar({.total_steps = s.adapter_steps, .every = 25}),
         tr::TensorBoard({.dir = tensorboard_run(s, "lora")})});
    const auto data_ = adapter_data(s, images, {});
    const std::int64_t per_epoch = images.size(0) / s.adapter_batch;
    trainer.fit(
        [&](std::int64_t step, std::int64_t) {
          const at::Tensor idx = data_.batch(step / per_epoch, step % per_epoch);
          return fmnist::UNetImpl::Batch{images.index_select(0, idx.to(device)),
                                         at::full({idx.size(0)}, s.new_class, on_device)};
        },
        s.adapter_steps);
    timing["lora_train_seconds"] = seconds_since(t);
    const fs::path file = adapters / (word + "-lora.safetensors");
    difftrain::io::save_safetensors(
        file, ad::lora_state_dict(*net, {.layout = ad::LoraLayout::peft, .prefix = "unet."}),
        {{"lora_rank", std::to_string(s.lora_rank)},
         {"lora_alpha", std::to_string(s.lora_alpha)},
         {"target_modules", s.lora_targets},
         {"base_model", base_key(s)}});
    // A fresh base with the file loaded, merged: sampling costs what the base model costs.
    fmnist::UNet fresh = load_base(s, schedule, base_path);
    (void)ad::load_lora_state_dict(*fresh, difftrain::io::load_safetensors(file, true).tensors,
                                   {.layout = ad::LoraLayout::peft, .prefix = "unet."},
                                   {.rank = s.lora_rank, .alpha = s.lora_alpha});
    for (const auto& [name, layer] : ad::lora_layers(*fresh)) layer->merge();
    fresh->eval();
    score("lora", sample(s, schedule, fresh, new_labels, null_labels, true));
    files["lora"] = fs::relative(file, out).string();
    results["lora_layers"] = injected.size();
  }

  for (const auto& [name, f] : files.items())
    sizes[name] = fs::file_size(out / f.get<std::string>());
  difftrain::io::write_png(
      out / "samples.png", difftrain::io::image_grid(at::cat(rows), {.columns = 10, .padding = 2}),
      {{"Description",
        "rows: real " + word + " images, base model, embedding, hypernetwork, LoRA"}});
  results["files"] = files;
  results["file_bytes"] = sizes;
  results["lora_rank"] = s.lora_rank;
  results["lora_alpha"] = std::to_string(s.lora_alpha);
  results["new_class"] = fmnist::kClassNames[static_cast<std::size_t>(s.new_class)];
  results["adapter_images"] = images.size(0);
  results["adapter_steps"] = s.adapter_steps;
  results["samples"] = s.samples;
  results["classifier_test_accuracy"] = judge.test_accuracy;
  results["base_from_cache"] = base_cached;
  timing["base_seconds"] = base_seconds;
  timing["total_seconds"] = seconds_since(t_start);
  results["timing"] = timing;
  const std::string text = results.dump(2) + "\n";
  difftrain::io::write_file_atomic(out / "results.json",
                                   std::span<const char>(text.data(), text.size()));
  for (const auto& [name, bytes] : sizes.items())
    std::printf("%-13s file %s: %lld bytes\n", name.c_str(), files[name].get<std::string>().c_str(),
                static_cast<long long>(bytes.get<std::int64_t>()));
  std::printf("wrote %s/{samples.png,results.json} in %.0f s\n", s.out.c_str(),
              seconds_since(t_start));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  CLI::App app{
      "Teach a nine-class Fashion-MNIST diffusion model the tenth class with a textual-inversion "
      "embedding, a hypernetwork and a LoRA, and score each with a classifier."};
  app.get_formatter()->column_width(34);
  auto* g = app.add_option_group("data and run");
  examples::add_run_flags(g, s, "directory with the IDX files",
                          "TensorBoard's folder, a run per training (default: OUT/tensorboard)");
  g->add_option("--new-class", s.new_class, "the class the base model never sees (0-9)")
      ->check(examples::count_in(0, 9))
      ->capture_default_str();
  auto* b = app.add_option_group("base model");
  b->add_option("--channels", s.channels, "UNet width C")
      ->check(examples::count_in(16, 4096))
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
  a->add_option("--init-word", s.init_word, "class whose vectors start the embedding")
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
  examples::add_judge_flags(e, s);
  CLI11_PARSE(app, argc, argv);
  return examples::run_reporting_errors([&] { return run(s); });
}
