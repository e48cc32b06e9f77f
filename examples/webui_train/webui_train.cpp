// The Stable Diffusion web UI's "Train" tab on a real SD 1.x/2.x pipeline: an embedding
// (textual inversion as the web UI does it: vectors placed into the prompt's sequence, the token
// table never touched) or a hypernetwork (residual MLPs on the cross-attention's keys and values),
// trained by the web UI's loops (adapters/webui_training.hpp: step-string learning rates, gradient
// accumulation, clipping, the CSV loss log, periodic copies with .optim sidecars, resuming from
// the sidecar) on an image folder with the web UI's prompt templates ([name], [filewords]) and its
// latent sampling methods.
//
//   webui_train --pretrained_model_name_or_path SD --train_data_dir IMAGES --embedding NAME
//               --init_text "*" --num_vectors_per_token 2 --template_file subject.txt ...
//   webui_train ... --hypernetwork NAME --layer_structure 1,2,1 --activation_func relu ...
//
// What it writes to --output_dir: embeddings/NAME.pt or hypernetworks/NAME.pt (the files the web
// UI's folders take) with NAME.pt.optim, the periodic copies, the loss log and the previews
// (images/NAME-STEP.png; for embeddings also image_embeddings/NAME-STEP.png, a PNG the web UI
// loads as the embedding) under --log_directory, and results.json. Running it again continues the
// file's steps (to --steps) with the optimizer state of its sidecar. --device cuda trains on a GPU
// (the latents are drawn in host memory, so "once" and "random" draw the same on every device;
// the files hold host tensors, as the web UI's loader expects).
//
// Under torchrun (`torchrun --nproc-per-node N --no-python webui_train ...`), which the web UI
// does not have, rank r takes micro-batches r, r + N, ... of the web UI's epoch order, the
// gradients are averaged before clipping and the optimizer step, and rank 0 writes every file:
// N ranks at --gradient_step G train as one process at --gradient_step N·G. Each sample's noise and
// timestep come from its place in the epoch, so the two agree up to the order of float sums. Each
// rank encodes every N-th image and the ranks exchange the latents.

#include <CLI/CLI.hpp>
#include <difftrain/adapters/embedding_database.hpp>
#include <difftrain/adapters/unet_adapters.hpp>
#include <difftrain/adapters/webui_training.hpp>
#include <difftrain/core/agreed.hpp>
#include <difftrain/data/data.hpp>
#include <difftrain/distributed/world.hpp>
#include <difftrain/io/read_file.hpp>
#include <difftrain/text/webui_conditioning.hpp>
#include <difftrain/train/seeding.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "../common/cli_checks.hpp"
#include "../common/run_skeleton.hpp"
#include "../common/sd_pipeline.hpp"
#include "../common/sd_run.hpp"
#include "../common/training_folder.hpp"

namespace {
namespace ad = difftrain::adapters;
using namespace examples::sd;

struct Settings : examples::RunFlags {
  std::string model, embedding, hypernetwork;
  std::string single_file_config;  // configs, tokenizer, scheduler for a single-file model
  std::string tokenizer_name;      // a single file's tokenizer without a config folder
  std::string original_config;     // a single file's original .yaml (else model.yaml beside it)
  bool use_ema_weights = false;    // a single file's EMA weights (model_ema.*) in place of its own
  std::string init_text = "*";
  std::int64_t num_vectors_per_token = 1;
  std::string layer_structure = "1,2,1", activation_func = "linear", weight_init = "Normal";
  // The web UI's "Modules" of a new hypernetwork: SD 1.x's text width (cross-attention) and its
  // three block widths (self-attention, whose keys and values see the image features).
  std::string hypernetwork_layer_sizes = "768,320,640,1280";
  bool add_layer_norm = false, use_dropout = false;
  std::string optimizer = "AdamW";
  std::string learn_rate = "0.005", clip_grad_mode = "disabled", clip_grad_value = "0.1";
  std::int64_t batch_size = 1, gradient_step = 1, steps = 100000, width = 512, height = 512;
  std::string template_file;  // default: "[name], [filewords]"
  std::string latent_sampling_method = "once";
  bool shuffle_tags = false;
  double tag_drop_out = 0.0;
  std::int64_t save_every = 500, write_csv_every = 500;
  std::string log_directory;  // default OUT/log
  // Previews, as the web UI's: every N steps (0: none), prompted with the current batch's first
  // caption unless a preview prompt is given.
  std::int64_t create_image_every = 500;
  bool save_image_with_stored_embedding = true;
  std::string preview_prompt, preview_negative_prompt;
  std::int64_t preview_steps = 20, preview_seed = -1, preview_width = 0, preview_height = 0;
  double preview_cfg_scale = 7.0;
  double rank_timeout = 1800;
  Settings() { out = "runs/webui_train"; }
};

std::vector<double> parse_numbers(const std::string& text, const std::string& flag) {
  std::vector<double> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    try {
      std::size_t used = 0;
      out.push_back(std::stod(item, &used));
      if (item.find_first_not_of(" \t", used) != std::string::npos)
        throw std::invalid_argument(item);
    } catch (const std::exception&) {
      throw ConfigError("'" + text + "' is not a comma-separated list of numbers", flag);
    }
  }
  return out;
}

/// --hypernetwork_layer_sizes for a new hypernetwork: positive widths, at least one of which this
/// UNet's attention layers use (otherwise it would train nothing).
std::vector<std::int64_t> hypernetwork_sizes(const std::string& text,
                                             const std::set<std::int64_t>& widths) {
  const std::string flag = "--hypernetwork_layer_sizes";
  std::vector<std::int64_t> sizes;
  for (const double v : parse_numbers(text, flag)) {
    if (v < 1 || v > 65536 || v != std::floor(v))
      throw ConfigError("'" + text + "' holds " + examples::short_number(v) +
                            ", not a width (a whole number from 1 to 65536)",
                        flag);
    if (std::find(sizes.begin(), sizes.end(), static_cast<std::int64_t>(v)) == sizes.end())
      sizes.push_back(static_cast<std::int64_t>(v));
  }
  if (sizes.empty()) throw ConfigError("names no width", flag);
  std::string have;
  for (const auto w : widths) have += (have.empty() ? "" : ",") + std::to_string(w);
  if (std::none_of(sizes.begin(), sizes.end(), [&](std::int64_t v) { return widths.contains(v); }))
    throw ConfigError(text + " fits none of this UNet's attention contexts (widths " + have +
                          "): the hypernetwork would train nothing; name some of them, e.g. " +
                          flag + " " + have,
                      flag);
  return sizes;
}

/// The web UI's template file: one prompt pattern per line ([name], [filewords]).
std::vector<std::string> read_templates(const std::string& file) {
  if (file.empty()) return {"[name], [filewords]"};
  const std::vector<char> bytes = dt::io::read_file(file);
  std::vector<std::string> lines;
  std::stringstream in(std::string(bytes.begin(), bytes.end()));
  for (std::string line; std::getline(in, line);) {
    while (!line.empty() && (line.back() == '\r' || line.back() == ' ')) line.pop_back();
    if (!line.empty()) lines.push_back(line);
  }
  if (lines.empty()) throw ConfigError("holds no prompt template", file);
  return lines;
}

void replace_all(std::string& s, const std::string& what, const std::string& with) {
  for (auto at = s.find(what); at != std::string::npos; at = s.find(what, at + with.size()))
    s.replace(at, what.size(), with);
}

/// The web UI's PersonalizedBase, made once: each image squashed to width × height (bicubic,
/// as its PIL resize), encoded by the VAE; "once" keeps one latent drawn then, "deterministic"
/// the posterior's mean, "random" the posterior to draw from each time.
struct Dataset {
  std::vector<at::Tensor> mean, std, fixed;
  std::vector<std::string> captions;
  std::string method;
  [[nodiscard]] at::Tensor latent(std::size_t i, at::Generator& gen) const {
    if (method == "once") return fixed[i];
    if (method == "deterministic") return mean[i];
    return mean[i] + std[i] * at::randn(mean[i].sizes(), gen);
  }
};

// The latents stay in host memory (a batch moves to the device when it is used). Under torchrun
// rank r encodes images r, r + N, ... and the ranks exchange them, so the folder is encoded once
// over all devices. "once" draws each image's latent from that image's own generator (seeded by
// the run), so the draw is the same whichever rank or device makes it.
Dataset make_dataset(const Settings& s, const data::ImageFolder& folder, Pipeline& p,
                     at::Device device, const dt::distributed::World& world) {
  Dataset d;
  d.method = s.latent_sampling_method;
  const auto& vc = p.vae->config();
  const std::size_t n = folder.images.size();
  const auto ranks = static_cast<std::size_t>(world.size());
  const auto rank = static_cast<std::size_t>(world.rank());
  at::NoGradGuard no_grad;
  // A file damaged past its header fails on one rank only: the ranks agree before they exchange,
  // so that rank reports the file and the others stop at once instead of waiting for it.
  const std::vector<at::Tensor> own = dt::agreed(  // per image: (mean, std, once) stacked
      [&] {
        std::vector<at::Tensor> encoded;
        for (std::size_t i = rank; i < n; i += ranks) {
          const data::DecodedImage img = data::read_image(folder.images[i].path);
          const at::Tensor x =
              data::to_unit_range(data::resize(img.pixels.permute({2, 0, 1}), {s.height, s.width},
                                               data::Interpolation::bicubic)
                                      .contiguous());
          const auto posterior = p.vae->encode(x.unsqueeze(0).to(device));
          auto scaled = [&](const at::Tensor& z) {
            return ((vc.shift_factor ? z - *vc.shift_factor : z) * vc.scaling_factor)[0];
          };
          const at::Tensor mean = posterior.mean.cpu(), std = posterior.std.cpu();
          at::Generator gen = data::sample_generator(s.seed + 1, 0, i, 0);
          encoded.push_back(
              at::stack({scaled(mean), std[0] * vc.scaling_factor,
                         scaled(mean + std * at::randn(mean.sizes(), gen, mean.options()))}));
        }
        return encoded;
      },
      [&](bool ok) { return world.all_true(ok); },
      [&] {
        return dt::DistributedError(
            "another rank could not encode its share of the images (its error names the file)",
            "rank " + std::to_string(world.rank()) + " of " + std::to_string(world.size()));
      });
  // Every rank holds at least one image (the folder was checked against the ranks), and every
  // image has the same size, so the ranks' shares stack into equal blocks padded with zeros.
  at::Tensor mine = at::stack(own);
  const auto per_rank = static_cast<std::int64_t>((n + ranks - 1) / ranks);
  if (mine.size(0) < per_rank) {
    std::vector<std::int64_t> pad = mine.sizes().vec();
    pad[0] = per_rank - mine.size(0);
    mine = at::cat({mine, at::zeros(pad, mine.options())});
  }
  const std::vector<at::Tensor> all = world.all_gather(mine);
  for (std::size_t i = 0; i < n; ++i) {
    const at::Tensor t = all[i % ranks][static_cast<std::int64_t>(i / ranks)];
    d.mean.push_back(t[0].clone());
    d.std.push_back(t[1].clone());
    d.fixed.push_back(t[2].clone());
    d.captions.push_back(folder.images[i].caption);
  }
  return d;
}

struct Batch {
  at::Tensor latents, noise, timesteps;
  std::vector<std::string> prompts;
};

int run(Settings s) {
  const auto t0 = std::chrono::steady_clock::now();
  if (s.embedding.empty() == s.hypernetwork.empty())
    throw ConfigError("name what to train: --embedding NAME or --hypernetwork NAME (one of them)",
                      "flags");
  if (s.latent_sampling_method != "once" && s.latent_sampling_method != "deterministic" &&
      s.latent_sampling_method != "random")
    throw ConfigError("is '" + s.latent_sampling_method + "'; choose once, deterministic or random",
                      "--latent_sampling_method");
  if (s.width % 8 != 0 || s.height % 8 != 0)
    throw ConfigError("must be multiples of 8", "--width / --height");
  const std::vector<std::string> templates = read_templates(s.template_file);
  examples::apply_threads(s);
  // The ranks of a torchrun launch (a world of one without it); with CUDA each its own GPU.
  const auto world = dt::distributed::World::from_environment(
      {.timeout = std::chrono::milliseconds(static_cast<std::int64_t>(s.rank_timeout * 1000))});
  const std::int64_t ranks = world->size(), rank = world->rank();
  const at::Device device =
      s.device == "cuda" && world->distributed()
          ? at::Device(at::kCUDA, static_cast<at::DeviceIndex>(world->local_rank()))
          : examples::device_from(s.device);
  // [filewords] are the file names: the folder is reported, captions or not.
  data::ImageFolder folder =
      examples::scan_training_folder(s.data_dir, {}, {.say = world->is_main()});
  // Each rank's share of an epoch's micro-batches (every image is one); every rank needs a whole
  // optimizer step, which is known before any image is encoded.
  const auto images = static_cast<std::int64_t>(folder.images.size());
  const std::int64_t local_batches = images / s.batch_size / ranks;
  if (ranks > 1 && local_batches < s.gradient_step)
    throw ConfigError(
        std::to_string(images) + " images give " + std::to_string(images / s.batch_size) +
            " micro-batches of " + std::to_string(s.batch_size) + " an epoch, fewer than " +
            std::to_string(ranks) + " ranks × --gradient_step " + std::to_string(s.gradient_step),
        s.data_dir);
  const fs::path out(s.out);
  const examples::OutputFolder output_folder(out, world->is_main());
  const fs::path log = s.log_directory.empty() ? out / "log" : fs::path(s.log_directory);
  tr::set_seed(s.seed);
  Pipeline p = load_pipeline(s.model, "", "", s.single_file_config, s.tokenizer_name,
                             s.original_config, s.use_ema_weights);
  // The web UI trains embeddings and hypernetworks on SD 1.x/2.x only (on SDXL its loops fail);
  // an SDXL embedding in its clip_l/clip_g file comes from the textual_inversion program.
  if (p.xl)
    throw ConfigError(
        "is an SDXL pipeline: the web UI's embedding and hypernetwork training is "
        "for SD 1.x/2.x pipelines (train an SDXL embedding, which the web UI loads, "
        "with textual_inversion)",
        s.model);
  for (auto* m : std::vector<torch::nn::Module*>{p.unet.get(), p.vae.get(), p.text_encoder.get()}) {
    freeze(*m);
    m->eval();
    m->to(device);
  }
  const Dataset d = make_dataset(s, folder, p, device, *world);
  // The global generator draws only the hypernetwork's dropout; each rank its own.
  if (rank > 0) tr::set_seed(s.seed + 7919 * rank);
  const df::NoiseSchedule schedule(p.scheduler.schedule);
  const std::string name = s.embedding.empty() ? s.hypernetwork : s.embedding;

  // One micro-batch: the web UI's order (shuffled per epoch), its templates and tag options; this
  // rank's local_index-th is the epoch's (local_index · ranks + rank)-th. Each sample's draws
  // (latent, tags, template, noise, timestep) come from its place in the epoch.
  const std::int64_t timesteps = schedule.num_train_timesteps();
  auto batch = [&](std::int64_t epoch, std::int64_t local_index) {
    const std::int64_t index = local_index * ranks + rank;
    std::vector<std::size_t> order(d.captions.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::mt19937_64 rng(s.seed * 0x9E3779B97F4A7C15ULL + static_cast<std::uint64_t>(epoch));
    std::shuffle(order.begin(), order.end(), rng);
    Batch b;
    std::vector<at::Tensor> latents, noise, ts;
    for (std::int64_t k = 0; k < s.batch_size; ++k) {
      const auto pos = static_cast<std::size_t>(index * s.batch_size + k);
      const std::size_t i = order[pos];
      at::Generator gen =
          data::sample_generator(s.seed, static_cast<std::uint64_t>(epoch),
                                 static_cast<std::size_t>(index), static_cast<std::size_t>(k));
      latents.push_back(d.latent(i, gen));
      // [filewords]: the caption's comma-separated tags, dropped and shuffled when asked.
      std::vector<std::string> tags;
      std::stringstream in(d.captions[i]);
      for (std::string tag; std::getline(in, tag, ',');) {
        const auto a = tag.find_first_not_of(' '), e = tag.find_last_not_of(' ');
        if (a == std::string::npos) continue;
        if (s.tag_drop_out > 0 && at::rand({1}, gen, at::kDouble).item<double>() < s.tag_drop_out)
          continue;
        tags.push_back(tag.substr(a, e - a + 1));
      }
      if (s.shuffle_tags)
        for (std::size_t t = tags.size(); t > 1; --t)
          std::swap(tags[t - 1],
                    tags[static_cast<std::size_t>(
                        at::randint(static_cast<std::int64_t>(t), {1}, gen).item<std::int64_t>())]);
      std::string filewords;
      for (const auto& t : tags) filewords += (filewords.empty() ? "" : ", ") + t;
      std::string prompt = templates[static_cast<std::size_t>(
          at::randint(static_cast<std::int64_t>(templates.size()), {1}, gen).item<std::int64_t>())];
      replace_all(prompt, "[name]", name);
      replace_all(prompt, "[filewords]", filewords);
      b.prompts.push_back(prompt);
      noise.push_back(at::randn(latents.back().sizes(), gen));
      ts.push_back(at::randint(timesteps, {1}, gen));
    }
    b.latents = at::stack(latents).to(device);
    b.noise = at::stack(noise).to(device);
    b.timesteps = at::cat(ts).to(device);
    return b;
  };
  auto denoising_loss = [&](const Batch& b, const at::Tensor& cond) {
    const at::Tensor pred =
        p.unet->forward(schedule.add_noise(b.latents, b.noise, b.timesteps), b.timesteps, cond);
    return at::mse_loss(pred,
                        schedule.target(p.scheduler.prediction, b.latents, b.noise, b.timesteps));
  };

  ad::AdapterTrainOptions o;
  o.learn_rate = s.learn_rate;
  o.batch_size = s.batch_size;
  o.gradient_step = s.gradient_step;
  o.steps = s.steps;
  o.clip_grad_mode = s.clip_grad_mode;
  o.clip_grad_value = s.clip_grad_value;
  o.save_every = s.save_every;
  o.write_csv_every = s.write_csv_every;
  o.create_image_every = s.create_image_every;
  o.save_image_with_stored_embedding = s.save_image_with_stored_embedding;
  o.write_files = world->is_main();
  const std::int64_t dataset_size = ranks > 1 ? local_batches * s.batch_size : images;
  std::vector<double> losses;
  // The preview: the web UI's txt2img with the adapter as it is at that step (DDIM here, the
  // pipeline's scheduler settings), from a seed (-1: the run's seed + the step).
  std::string last_prompt;  // the current batch's first caption
  auto preview_with = [&](const text::EmbeddingFinder& finder,
                          const text::EmbeddingVectors& vectors) {
    return [&, finder, vectors](std::int64_t step) {
      const std::string prompt = s.preview_prompt.empty() ? last_prompt : s.preview_prompt;
      const std::int64_t w = s.preview_width > 0 ? s.preview_width : s.width;
      const std::int64_t h = s.preview_height > 0 ? s.preview_height : s.height;
      const std::int64_t seed = s.preview_seed >= 0 ? s.preview_seed : s.seed + step;
      at::NoGradGuard no_grad;
      // Both sides in one call, so a long prompt's chunks pad the other side to its count.
      const at::Tensor both = text::encode_webui_prompts(
          p.text_encoder,
          {text::tokenize_prompt(*p.tokenizer, prompt, {}, finder),
           text::tokenize_prompt(*p.tokenizer, s.preview_negative_prompt, {}, finder)},
          {}, vectors);
      const std::int64_t f = p.vae->downscale();
      auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<std::uint64_t>(seed));
      const at::Tensor noise =
          at::randn({1, p.unet->config().in_channels, h / f, w / f}, gen).to(device);
      df::Ddim ddim(schedule, p.scheduler.ddim);
      const at::Tensor z = df::sample(
          ddim,
          [&](const at::Tensor& x, const at::Tensor& t, const at::Tensor& c) {
            return p.unet->forward(x, t, c);
          },
          noise,
          {.num_inference_steps = s.preview_steps,
           .guidance_scale = s.preview_cfg_scale,
           .chunk_size = 2},
          both.narrow(0, 0, 1), std::optional<at::Tensor>(both.narrow(0, 1, 1)));
      const at::Tensor image = p.vae->decode_latents(z).clamp(-1, 1).cpu();
      char info[256];
      std::snprintf(info, sizeof info,
                    "Steps: %lld, Sampler: DDIM, CFG scale: %g, Seed: %lld, Size: %lldx%lld",
                    static_cast<long long>(s.preview_steps), s.preview_cfg_scale,
                    static_cast<long long>(seed), static_cast<long long>(w),
                    static_cast<long long>(h));
      return ad::AdapterPreview{dt::io::image_grid(image, {.columns = 1}),
                                prompt +
                                    (s.preview_negative_prompt.empty()
                                         ? ""
                                         : "\nNegative prompt: " + s.preview_negative_prompt) +
                                    "\n" + info};
    };
  };
  ad::AdapterHooks hooks{.on_step =
                             [&](const ad::AdapterStepInfo& i) {
                               losses.push_back(i.loss);
                               if (i.step % 10 == 0 && world->is_main())
                                 std::fprintf(stderr, "%s\n", i.description.c_str());
                             },
                         .interrupted = [] { return examples::g_interrupted.load(); }};
  if (ranks > 1) {
    // Every rank stops at the same micro-batch when any was interrupted.
    hooks.interrupted = [&] { return !world->all_true(!examples::g_interrupted.load()); };
    hooks.average = [&](const std::vector<at::Tensor>& weights, double loss) {
      for (const auto& w : weights) {
        at::Tensor g = w.grad();
        if (!g.defined()) g = w.mutable_grad() = at::zeros_like(w);
        world->all_reduce_sum(g);
        g.div_(static_cast<double>(ranks));
      }
      return world->mean(loss);
    };
  }
  // Every rank starts from rank 0's weights (a new hypernetwork's are drawn at random).
  auto same_start = [&](const std::vector<at::Tensor>& weights) {
    if (ranks == 1) return;
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> w(weights.begin(), weights.end());
    world->broadcast(w);
  };
  std::signal(SIGINT, examples::on_sigint);
  ad::AdapterTrainResult r;
  nlohmann::json results;
  const auto tokenize = [&](const std::string& text) { return p.tokenizer->encode(text, false); };
  if (!s.embedding.empty()) {
    o.log_directory = log / "embedding";
    o.output = out / "embeddings" / (name + ".pt");
    fs::create_directories(o.output.parent_path());
    ad::EmbeddingDatabase db(tokenize, p.text_encoder->config().hidden_size);
    ad::Embedding e;
    if (fs::exists(o.output)) {  // the web UI trains on from the file (and its sidecar)
      e = *ad::load_embedding(o.output);
      e.name = name;
    } else {  // the web UI's create_embedding: the init text's token vectors, repeated
      const auto ids = tokenize(s.init_text);
      if (ids.empty()) throw ConfigError("gives no token", "--init_text");
      const at::Tensor table = p.text_encoder->token_embedding->weight.detach();
      e.vec = at::zeros({s.num_vectors_per_token, table.size(1)});
      for (std::int64_t v = 0; v < s.num_vectors_per_token; ++v)
        e.vec[v].copy_(table[ids[static_cast<std::size_t>(v) % ids.size()]]);
      e.name = name;
      e.step = 0;
    }
    e.vec = e.vec.to(device);  // the files are written from host copies
    same_start({e.vec});
    db.register_embedding(e);  // shares e's vectors, which train in place
    const auto finder = db.prompt_finder();
    const auto vectors = db.prompt_vectors();
    hooks.preview = preview_with(finder, vectors);
    r = ad::train_embedding(
        e, o,
        ad::AdapterData<Batch>{
            dataset_size, batch,
            [&](const Batch& b) {
              last_prompt = b.prompts.front();
              std::vector<text::TokenizedPrompt> tp;
              for (const auto& prompt : b.prompts)
                tp.push_back(text::tokenize_prompt(*p.tokenizer, prompt, {}, finder));
              return denoising_loss(b, text::encode_webui_prompts(p.text_encoder, tp, {}, vectors));
            }},
        hooks);
    results["vectors"] = e.vectors();
    results["checksum"] = e.checksum();
  } else {
    o.log_directory = log / "hypernetwork";
    o.output = out / "hypernetworks" / (name + ".pt");
    const bool exists = fs::exists(o.output);
    std::vector<std::int64_t> sizes;
    if (!exists)
      sizes =
          hypernetwork_sizes(s.hypernetwork_layer_sizes, ad::hypernetwork_context_widths(*p.unet));
    fs::create_directories(o.output.parent_path());
    ad::Hypernetwork hn =
        exists ? ad::Hypernetwork::load(o.output)
               : ad::Hypernetwork(
                     name, sizes,
                     {.layer_structure = parse_numbers(s.layer_structure, "--layer_structure"),
                      .activation_func = s.activation_func,
                      .weight_init = s.weight_init,
                      .add_layer_norm = s.add_layer_norm},
                     s.use_dropout);
    for (auto& [size, pair] : hn.layers) {
      (void)size;
      pair.first->to(device);
      pair.second->to(device);
    }
    same_start(hn.weights());
    const std::size_t hooked = ad::attach_hypernetwork(*p.unet, hn);
    hooks.preview = preview_with({}, {});
    r = ad::train_hypernetwork(
        hn, o,
        ad::AdapterData<Batch>{dataset_size, batch,
                               [&](const Batch& b) {
                                 last_prompt = b.prompts.front();
                                 std::vector<text::TokenizedPrompt> tp;
                                 for (const auto& prompt : b.prompts)
                                   tp.push_back(text::tokenize_prompt(*p.tokenizer, prompt));
                                 return denoising_loss(
                                     b, text::encode_webui_prompts(p.text_encoder, tp));
                               }},
        hooks, s.optimizer);
    ad::detach_hypernetwork(*p.unet);
    results["attention_layers"] = hooked;
  }
  std::signal(SIGINT, SIG_DFL);
  if (!world->is_main()) return r.interrupted ? 130 : 0;  // rank 0 writes what the run leaves
  results["file"] = fs::relative(o.output, out).string();
  results["steps_done"] = r.steps_done;
  results["final_step"] = r.final_step;
  results["already_trained"] = r.already_trained;
  results["interrupted"] = r.interrupted;
  results["resumed_optimizer"] = r.resumed_optimizer == ad::SidecarStatus::loaded;
  results["statistics"] = r.recent_statistics;
  for (const auto& [key, files] :
       {std::pair{"previews", &r.previews}, std::pair{"embedded_previews", &r.embedded_previews}}) {
    results[key] = nlohmann::json::array();
    for (const auto& f : *files) results[key].push_back(fs::relative(f, out).string());
  }
  results["first_loss"] = mean_of(losses, std::max<std::size_t>(1, losses.size() / 10), false);
  results["last_loss"] = mean_of(losses, std::max<std::size_t>(1, losses.size() / 10), true);
  results["images"] = images;
  results["ranks"] = ranks;
  results["latent_sampling_method"] = s.latent_sampling_method;
  results["total_seconds"] = examples::seconds_since(t0);
  write_results(out, results);
  std::printf("%s '%s': %lld steps this run, %lld in all; wrote %s\n",
              s.embedding.empty() ? "hypernetwork" : "embedding", name.c_str(),
              static_cast<long long>(r.steps_done), static_cast<long long>(r.final_step),
              o.output.string().c_str());
  return r.interrupted ? 130 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  CLI::App app{"Train a web UI embedding or hypernetwork on a Stable Diffusion pipeline."};
  app.get_formatter()->column_width(44);
  using examples::count_in;
  using examples::number_in;
  auto* g = app.add_option_group("run");
  g->add_option("--pretrained_model_name_or_path", s.model,
                "diffusers pipeline folder, or a single file (.safetensors, .ckpt)")
      ->required();
  g->add_option("--tokenizer_name", s.tokenizer_name,
                "with a single-file model and no --single_file_config: CLIP's BPE merges file "
                "(bpe_simple_vocab_16e6.txt.gz), or a tokenizer or pipeline folder; the configs "
                "are told from the file's keys");
  g->add_option("--original_config", s.original_config,
                "with a single-file model: its original .yaml config (the prediction, heads, VAE "
                "scale); model.yaml beside model.safetensors is read without it");
  g->add_flag("--use_ema_weights", s.use_ema_weights,
              "with a single file that holds EMA weights (model_ema.*): train on them instead of "
              "the trained ones (the web UI's model_ema)");
  g->add_option("--single_file_config", s.single_file_config,
                "with a single-file model (.safetensors, .ckpt in the web UI's layout): a "
                "diffusers pipeline folder of the same model for its configs, tokenizer and "
                "scheduler");
  g->add_option("--train_data_dir", s.data_dir, "dataset directory (captions: [filewords])")
      ->required();
  g->add_option("--output_dir", s.out, "output folder")->capture_default_str();
  g->add_option("--log_directory", s.log_directory, "copies and loss log (default OUT/log)");
  g->add_option("--seed", s.seed)->capture_default_str();
  g->add_option("--threads", s.threads)->check(count_in(0, 4096));
  g->add_option("--device", s.device, "cpu, cuda or cuda:N")->capture_default_str();
  g->add_option("--rank_timeout", s.rank_timeout,
                "under torchrun: seconds a rank waits for the others before it stops")
      ->check(number_in(1, 1e7))
      ->capture_default_str();
  auto* w = app.add_option_group("what to train");
  w->add_option("--embedding", s.embedding, "train (or create) this embedding");
  w->add_option("--init_text", s.init_text, "a new embedding's initial text")
      ->capture_default_str();
  w->add_option("--num_vectors_per_token", s.num_vectors_per_token)
      ->check(count_in(1, 75))
      ->capture_default_str();
  w->add_option("--hypernetwork", s.hypernetwork, "train (or create) this hypernetwork");
  w->add_option("--hypernetwork_layer_sizes", s.hypernetwork_layer_sizes,
                "a new hypernetwork's modules, by the width they act on (the web UI's "
                "\"Modules\": the text width for cross-attention, block widths for "
                "self-attention)")
      ->capture_default_str();
  w->add_option("--layer_structure", s.layer_structure)->capture_default_str();
  w->add_option("--activation_func", s.activation_func)->capture_default_str();
  w->add_option("--weight_init", s.weight_init)->capture_default_str();
  w->add_flag("--add_layer_norm", s.add_layer_norm);
  w->add_flag("--use_dropout", s.use_dropout);
  w->add_option("--optimizer", s.optimizer, "the hypernetwork's: AdamW, Adam or SGD")
      ->capture_default_str();
  auto* t = app.add_option_group("training");
  t->add_option("--learn_rate", s.learn_rate, "step string, e.g. 0.005:100, 1e-3:1000, 1e-5")
      ->capture_default_str();
  t->add_option("--batch_size", s.batch_size)->check(count_in(1, 10'000))->capture_default_str();
  t->add_option("--gradient_step", s.gradient_step)
      ->check(count_in(1, 10'000))
      ->capture_default_str();
  t->add_option("--steps", s.steps, "train until the file has this many steps")
      ->check(count_in(1, 100'000'000))
      ->capture_default_str();
  t->add_option("--clip_grad_mode", s.clip_grad_mode, "disabled, value or norm")
      ->capture_default_str();
  t->add_option("--clip_grad_value", s.clip_grad_value)->capture_default_str();
  t->add_option("--width", s.width)->check(count_in(8, 8192))->capture_default_str();
  t->add_option("--height", s.height)->check(count_in(8, 8192))->capture_default_str();
  t->add_option("--template_file", s.template_file, "prompt templates ([name], [filewords])");
  t->add_option("--latent_sampling_method", s.latent_sampling_method,
                "once, deterministic or random")
      ->capture_default_str();
  t->add_flag("--shuffle_tags", s.shuffle_tags, "shuffle the caption's comma-separated tags");
  t->add_option("--tag_drop_out", s.tag_drop_out)->check(number_in(0, 1))->capture_default_str();
  t->add_option("--save_every", s.save_every, "a copy every N steps (0: none)")
      ->check(count_in(0, 100'000'000))
      ->capture_default_str();
  t->add_option("--write_csv_every", s.write_csv_every)
      ->check(count_in(0, 100'000'000))
      ->capture_default_str();
  auto* v = app.add_option_group("previews");
  v->add_option("--create_image_every", s.create_image_every, "a preview every N steps (0: none)")
      ->check(count_in(0, 100'000'000))
      ->capture_default_str();
  v->add_option("--save_image_with_stored_embedding", s.save_image_with_stored_embedding,
                "also write the preview after each copy with the copy inside (PNG)")
      ->capture_default_str();
  v->add_option("--preview_prompt", s.preview_prompt, "default: the batch's first caption");
  v->add_option("--preview_negative_prompt", s.preview_negative_prompt);
  v->add_option("--preview_steps", s.preview_steps)
      ->check(count_in(1, 1000))
      ->capture_default_str();
  v->add_option("--preview_cfg_scale", s.preview_cfg_scale)
      ->check(number_in(0, 1e4))
      ->capture_default_str();
  v->add_option("--preview_seed", s.preview_seed, "-1: the run's seed + the step")
      ->check(CLI::Range(std::int64_t{-1}, std::int64_t{1} << 62))
      ->capture_default_str();
  v->add_option("--preview_width", s.preview_width, "0: --width")->check(count_in(0, 8192));
  v->add_option("--preview_height", s.preview_height, "0: --height")->check(count_in(0, 8192));
  last_value_wins({g, w, t, v});
  if (const auto rc = examples::parse_command_line(app, argc, argv)) return *rc;
  return examples::run_reporting_errors([&] { return run(s); });
}
