#pragma once
// Training textual-inversion embeddings and hypernetworks as the Stable Diffusion web UI does:
// only the adapter's weights are optimised (the model is frozen), with
//   * the web UI's input checks, its sentences as ConfigErrors naming the field;
//   * learning rate and gradient-clipping limits from step strings ("0.005:100, 1e-3:1000, 1e-5"),
//     consulted at every micro-batch, and training ends when the rate schedule does;
//   * gradient accumulation over `gradient_step` micro-batches of `batch_size`, the loss divided
//     by `gradient_step`; an epoch's trailing micro-batches that cannot fill a step are dropped;
//   * a CSV loss log (step, epoch, epoch_step, loss, learn_rate) every `write_csv_every` steps;
//   * a copy of the adapter every `save_every` steps, named `<name>-<step>.pt`, each with its
//     `.optim` sidecar; the final file likewise, and a run continues from the sidecar's optimizer
//     state when the sidecar belongs to the file;
//   * loss statistics (mean ± standard error over the last three epochs and the last 32 steps).
// Where the web UI saves `<name>-<N+1>` holding N steps (its `steps_done` is one ahead), files
// here are named by the steps they hold. A NaN or infinite loss stops training with a
// NumericError before anything is applied, so every file saved so far stays good.
//
// The data is the caller's: `dataset_size` items, and `batch(epoch, index)` gives the index-th
// micro-batch of an epoch (the caller shuffles per epoch as it likes); `loss(batch)` runs the
// frozen model with the adapter in place. Under data parallelism (which the web UI does not have)
// each rank passes its share of the epoch as its data, AdapterHooks::average averages the
// gradients before clipping, and only the first rank writes files (AdapterTrainOptions).

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "difftrain/adapters/embedding.hpp"
#include "difftrain/adapters/hypernetwork.hpp"
#include "difftrain/adapters/optimizer_sidecar.hpp"
#include "difftrain/core/error.hpp"
#include "difftrain/io/csv_log.hpp"
#include "difftrain/io/embedded_data.hpp"
#include "difftrain/io/png.hpp"
#include "difftrain/schedule/step_string.hpp"
#include "difftrain/train/clipping.hpp"

namespace difftrain::adapters {

struct AdapterTrainOptions {
  std::string learn_rate = "0.005";  ///< step string
  std::int64_t batch_size = 1;
  std::int64_t gradient_step = 1;           ///< micro-batches per optimizer step
  std::int64_t steps = 100000;              ///< train until the adapter has this many steps
  std::string clip_grad_mode = "disabled";  ///< "disabled", "value" or "norm"
  std::string clip_grad_value = "0.1";      ///< step string of clipping limits
  std::int64_t save_every = 500;            ///< 0: only the final file
  std::int64_t write_csv_every = 500;       ///< 0: no loss log
  bool save_optimizer_state = true;         ///< write `.optim` sidecars
  /// A preview image every this many steps (0: none), from AdapterHooks::preview, written to
  /// `log_directory/images/<name>-<step>.png` with its infotext as the PNG's "parameters".
  std::int64_t create_image_every = 0;
  /// Embeddings: the first preview after each periodic copy is also written to
  /// `log_directory/image_embeddings/<name>-<step>.png` with that copy inside (its text chunk and
  /// the image-data border), the file the web UI loads as an embedding.
  bool save_image_with_stored_embedding = true;
  std::filesystem::path log_directory;  ///< CSV log and the periodic copies
  std::filesystem::path output;         ///< the final adapter file (`<name>.pt`)
  /// False on the ranks of a data-parallel run other than the first: they read `output` and its
  /// sidecar to continue as the first does, and write nothing (copies, log, previews, file).
  bool write_files = true;
};

/// What a step reports to the caller (progress display, interruption).
struct AdapterStepInfo {
  std::int64_t step = 0;  ///< the adapter's steps after this one
  std::int64_t epoch = 0, epoch_step = 0, steps_per_epoch = 0;
  double loss = 0, learn_rate = 0;
  std::string description;  ///< the web UI's progress line
};

struct AdapterTrainResult {
  bool already_trained = false;  ///< the adapter had `steps` steps before the run
  bool interrupted = false;
  std::int64_t steps_done = 0;  ///< optimizer steps of this run
  std::int64_t final_step = 0;
  double last_loss = std::nan("");
  std::string statistics, recent_statistics;
  SidecarStatus resumed_optimizer = SidecarStatus::missing;
  std::vector<std::filesystem::path> saved;  ///< periodic copies, then the final file
  std::vector<std::filesystem::path> previews, embedded_previews;
};

/// The web UI's validate_train_inputs for what a C++ caller can get wrong; `what` is "embedding"
/// or "hypernetwork".
inline void validate_train_inputs(const std::string& name, const AdapterTrainOptions& o,
                                  std::int64_t dataset_size, const std::string& what) {
  auto require = [](bool ok, const std::string& text, const std::string& field) {
    if (!ok) throw ConfigError(text, field);
  };
  require(!name.empty(), what + " not selected", what + " name");
  require(!o.learn_rate.empty() && o.learn_rate != "0", "Learning rate is empty or 0",
          "learn_rate");
  require(o.batch_size > 0, "Batch size must be positive", "batch_size");
  require(o.gradient_step > 0, "Gradient accumulation step must be positive", "gradient_step");
  require(dataset_size > 0, "Dataset directory is empty", "dataset");
  require(o.steps > 0, "Max steps must be positive", "steps");
  require(o.save_every >= 0, "Save " + what + " must be positive or 0", "save_every");
  require(o.write_csv_every >= 0, "CSV interval must be positive or 0", "write_csv_every");
  require(
      o.clip_grad_mode == "disabled" || o.clip_grad_mode == "value" || o.clip_grad_mode == "norm",
      "must be disabled, value or norm, got '" + o.clip_grad_mode + "'", "clip_grad_mode");
  require(!((o.save_every > 0 || o.write_csv_every > 0) && o.log_directory.empty()),
          "Log directory is empty", "log_directory");
  require(dataset_size / o.batch_size >= o.gradient_step,
          "The dataset of " + std::to_string(dataset_size) + " items gives fewer than " +
              std::to_string(o.gradient_step) + " batches of " + std::to_string(o.batch_size) +
              " per epoch, so no step could be taken",
          "dataset");
}

/// The web UI's loss statistics: "loss:m±(se)" over `data` and over its last 32 values.
inline std::pair<std::string, std::string> loss_statistics(const std::deque<double>& data) {
  auto fmt = [](const char* label, auto first, auto last) {
    const auto n = static_cast<double>(std::distance(first, last));
    if (n == 0) return std::string(label) + "nan";
    const double mean = std::accumulate(first, last, 0.0) / n;
    double var = 0;
    for (auto it = first; it != last; ++it) var += (*it - mean) * (*it - mean);
    const double sd = n < 2 ? 0.0 : std::sqrt(var / (n - 1));
    char buf[96];
    std::snprintf(buf, sizeof buf, "%s%.3f\u00b1(%.3f)", label, mean, sd / std::sqrt(n));
    return std::string(buf);
  };
  const auto recent = data.size() > 32 ? data.end() - 32 : data.begin();
  return {fmt("loss:", data.begin(), data.end()), fmt("recent 32 loss:", recent, data.end())};
}

template <class Batch>
struct AdapterData {
  std::int64_t dataset_size = 0;
  std::function<Batch(std::int64_t epoch, std::int64_t index)> batch;
  std::function<at::Tensor(const Batch&)> loss;
};

/// A preview picture and its infotext (the web UI's "parameters": prompt, steps, seed...).
struct AdapterPreview {
  io::RgbImage image;
  std::string infotext;
};

struct AdapterHooks {
  std::function<void(const AdapterStepInfo&)> on_step{};  ///< after every optimizer step
  std::function<bool()> interrupted{};                    ///< checked before every micro-batch
  /// Makes the preview of step `step` (every create_image_every steps), with the adapter as it
  /// is then; the web UI prompts it with the current batch's first caption.
  std::function<AdapterPreview(std::int64_t step)> preview{};
  /// Data parallelism: called on every rank once per optimizer step, before clipping, with the
  /// trained weights (gradients of this rank's micro-batches) and this rank's loss of the step;
  /// averages the gradients over the ranks in place and returns the ranks' mean loss. With
  /// several ranks, `interrupted` must give every rank the same answer (a collective).
  std::function<double(const std::vector<at::Tensor>& weights, double loss)> average{};
};

namespace webui_detail {

/// The loop shared by both adapters. `step` is the adapter's step counter; `save(path)` writes
/// the adapter and its sidecar.
template <class Batch>
AdapterTrainResult run(
    const std::vector<at::Tensor>& weights, torch::optim::Optimizer& optimizer, std::int64_t& step,
    const AdapterTrainOptions& o, const AdapterData<Batch>& data, const AdapterHooks& hooks,
    const std::string& name, const std::string& what, const std::string& csv_name,
    const std::function<void(const std::filesystem::path&)>& save,
    const std::function<c10::IValue(const std::filesystem::path&)>& stored_state = {}) {
  AdapterTrainResult r;
  const std::int64_t initial_step = step;
  r.final_step = step;
  const schedule::StepString lr_schedule({o.learn_rate, o.steps, initial_step, o.gradient_step});
  std::optional<train::ScheduledClip> clip;
  if (o.clip_grad_mode != "disabled")
    clip.emplace(train::ScheduledClip::Options{
        o.clip_grad_mode == "norm" ? train::ScheduledClip::Mode::norm
                                   : train::ScheduledClip::Mode::value,
        o.clip_grad_value, o.steps, initial_step, o.gradient_step});
  const std::int64_t batches = data.dataset_size / o.batch_size;
  const std::int64_t steps_per_epoch = batches / o.gradient_step;
  const std::int64_t max_batches_per_epoch = batches - batches % o.gradient_step;
  std::optional<io::CsvLog> csv;
  if (o.write_files && o.write_csv_every > 0)
    csv.emplace(o.log_directory / csv_name,
                std::vector<std::string>{"step", "epoch", "epoch_step", "loss", "learn_rate"});
  const std::filesystem::path copies = o.log_directory / (what + "s");
  if (o.create_image_every < 0)
    throw ConfigError("Create image must be positive or 0", "create_image_every");
  // The web UI embeds the last periodic copy into the first preview made after it.
  std::filesystem::path last_copy;
  bool yet_to_be_embedded = false;
  std::deque<double> loss_log;
  const std::size_t loss_log_max = static_cast<std::size_t>(data.dataset_size * 3);
  double accumulated = 0;
  int steps_without_grad = 0;
  for (auto& p : weights) p.mutable_grad() = at::Tensor();

  // Training ends with the rate schedule: at `steps`, or earlier if its last entry ends earlier.
  const std::int64_t end = lr_schedule.entries().back().second;
  for (std::int64_t epoch = step / steps_per_epoch; step < end; ++epoch) {
    for (std::int64_t j = 0; j < max_batches_per_epoch && step < end; ++j) {
      if (hooks.interrupted && hooks.interrupted()) {
        r.interrupted = true;
        break;
      }
      const double lr = lr_schedule.value_at(step);
      for (auto& g : optimizer.param_groups()) g.options().set_lr(lr);
      const at::Tensor loss =
          data.loss(data.batch(epoch, j)) / static_cast<double>(o.gradient_step);
      // Backward is queued before the loss is read, so a GPU does not wait between the two; a
      // non-finite loss still stops before the optimizer sees its gradients.
      loss.backward();
      const double value = loss.item<double>();
      if (!std::isfinite(value))
        throw NumericError("the loss is " + std::string(std::isnan(value) ? "NaN" : "infinite") +
                               " at step " + std::to_string(step + 1) +
                               "; nothing of this step was applied and the files saved so far "
                               "are intact",
                           what + " '" + name + "' training");
      accumulated += value;
      if ((j + 1) % o.gradient_step != 0) continue;

      bool any_grad = false;
      for (const auto& p : weights) any_grad = any_grad || p.grad().defined();
      steps_without_grad = any_grad ? 0 : steps_without_grad + 1;
      if (steps_without_grad >= 10)
        throw NumericError(
            "no gradient found for the trained weights after backward() for 10 steps in a row: "
            "the loss does not depend on the adapter",
            what + " '" + name + "' training");
      if (hooks.average) accumulated = hooks.average(weights, accumulated);
      if (clip) (void)clip->apply(weights, step);
      optimizer.step();
      optimizer.zero_grad(/*set_to_none=*/true);
      ++step;
      ++r.steps_done;
      r.last_loss = accumulated;
      accumulated = 0;
      loss_log.push_back(r.last_loss);
      if (loss_log.size() > loss_log_max) loss_log.pop_front();

      AdapterStepInfo info;
      info.step = step;
      info.steps_per_epoch = steps_per_epoch;
      info.epoch = (step - 1) / steps_per_epoch;
      info.epoch_step = (step - 1) % steps_per_epoch;
      info.loss = r.last_loss;
      info.learn_rate = lr;
      char desc[160];
      std::snprintf(desc, sizeof desc, "Training %s [Epoch %lld: %lld/%lld] loss: %.7f",
                    what == "embedding" ? "textual inversion" : "hypernetwork",
                    static_cast<long long>(info.epoch), static_cast<long long>(info.epoch_step + 1),
                    static_cast<long long>(steps_per_epoch), r.last_loss);
      info.description = desc;
      if (o.write_files && o.save_every > 0 && step % o.save_every == 0) {
        const auto file = copies / (name + "-" + std::to_string(step) + ".pt");
        save(file);  // the atomic writer creates the folder (an IoError if it cannot)
        r.saved.push_back(file);
        last_copy = file;
        yet_to_be_embedded = true;
      }
      if (csv && step % o.write_csv_every == 0) {
        char loss_text[32];
        std::snprintf(loss_text, sizeof loss_text, "%.7f", r.last_loss);
        csv->row(step, info.epoch, info.epoch_step, std::string(loss_text), lr);
      }
      if (o.write_files && hooks.preview && o.create_image_every > 0 &&
          step % o.create_image_every == 0) {
        const std::string stem = name + "-" + std::to_string(step);
        const AdapterPreview preview = hooks.preview(step);
        const auto file = o.log_directory / "images" / (stem + ".png");
        std::map<std::string, std::string> text;
        if (!preview.infotext.empty()) text["parameters"] = preview.infotext;
        io::write_png(file, preview.image, text);
        r.previews.push_back(file);
        if (stored_state && o.save_image_with_stored_embedding && yet_to_be_embedded) {
          const auto embedded = o.log_directory / "image_embeddings" / (stem + ".png");
          io::write_embedded_data(embedded, preview.image, stored_state(last_copy));
          r.embedded_previews.push_back(embedded);
          yet_to_be_embedded = false;
        }
      }
      if (hooks.on_step) hooks.on_step(info);
    }
    if (r.interrupted) break;
  }
  r.final_step = step;
  std::tie(r.statistics, r.recent_statistics) = loss_statistics(loss_log);
  if (o.write_files && !o.output.empty()) {
    save(o.output);
    r.saved.push_back(o.output);
  }
  return r;
}

inline std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& name,
                                                               std::vector<at::Tensor> params,
                                                               double weight_decay_adamw) {
  if (name == "Adam") return std::make_unique<torch::optim::Adam>(params);
  if (name == "SGD")
    return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1));
  return std::make_unique<torch::optim::AdamW>(
      params, torch::optim::AdamWOptions().weight_decay(weight_decay_adamw));
}

}  // namespace webui_detail

/// Trains `embedding`'s vectors (the web UI's train_embedding). The periodic copies go to
/// `log_directory/embeddings/`, the loss log to `log_directory/textual_inversion_loss.csv`. If
/// `o.output` has a `.optim` sidecar whose hash is the embedding's checksum, the optimizer
/// continues from it.
template <class Batch>
AdapterTrainResult train_embedding(Embedding& embedding, const AdapterTrainOptions& o,
                                   const AdapterData<Batch>& data, const AdapterHooks& hooks = {}) {
  validate_train_inputs(embedding.name, o, data.dataset_size, "embedding");
  if (embedding.is_sdxl())
    throw ConfigError("SDXL pairs are not trained here; train clip_l and clip_g as two embeddings",
                      "embedding '" + embedding.name + "'");
  std::int64_t step = embedding.step.value_or(0);
  if (step >= o.steps) {
    AdapterTrainResult r;
    r.already_trained = true;
    r.final_step = step;
    return r;
  }
  // Trained in place, so copies of the embedding (a database's) see the new vectors.
  if (!embedding.vec.is_leaf()) embedding.vec = embedding.vec.detach();
  embedding.vec.requires_grad_(true);
  const std::vector<at::Tensor> weights{embedding.vec};
  torch::optim::AdamW optimizer(weights, torch::optim::AdamWOptions().weight_decay(0.0));
  SidecarStatus resumed = SidecarStatus::missing;
  if (o.save_optimizer_state && !o.output.empty())
    resumed = load_optim_sidecar(o.output, embedding.checksum(), optimizer);
  const std::string name = embedding.name;
  auto save = [&](const std::filesystem::path& file) {
    Embedding copy = embedding;
    copy.step = step;
    copy.vec = embedding.vec.detach();
    copy.name = file == o.output ? name : file.stem().string();
    copy.save(file);
    if (o.save_optimizer_state) save_optim_sidecar(file, copy.checksum(), optimizer, false);
  };
  AdapterTrainResult r;
  try {
    // The picture carries the copy as the web UI reads it back from its file.
    const auto stored = [](const std::filesystem::path& file) {
      return load_embedding(file)->state();
    };
    r = webui_detail::run(weights, optimizer, step, o, data, hooks, name, "embedding",
                          "textual_inversion_loss.csv", save, stored);
  } catch (...) {
    embedding.vec.requires_grad_(false);
    embedding.step = step;
    throw;
  }
  embedding.vec.requires_grad_(false);
  embedding.step = step;
  r.resumed_optimizer = resumed;
  return r;
}

/// Trains `hn`'s weights (the web UI's train_hypernetwork): copies in
/// `log_directory/hypernetworks/`, log in `log_directory/hypernetwork_loss.csv`. The optimizer is
/// `optimizer_name` (AdamW, Adam or SGD, with torch's defaults; AdamW for any other name, as the
/// web UI falls back) and continues from `o.output`'s sidecar when its hash is the file's.
template <class Batch>
AdapterTrainResult train_hypernetwork(Hypernetwork& hn, const AdapterTrainOptions& o,
                                      const AdapterData<Batch>& data,
                                      const AdapterHooks& hooks = {},
                                      const std::string& optimizer_name = "AdamW") {
  validate_train_inputs(hn.name, o, data.dataset_size, "hypernetwork");
  if (hn.layers.empty())
    throw ConfigError("has no layers (no context width enabled), so nothing would train",
                      "hypernetwork '" + hn.name + "'");
  if (hn.step >= o.steps) {
    AdapterTrainResult r;
    r.already_trained = true;
    r.final_step = hn.step;
    return r;
  }
  hn.train();
  const std::vector<at::Tensor> weights = hn.weights();
  auto optimizer = webui_detail::make_optimizer(optimizer_name, weights, 0.01);
  SidecarStatus resumed = SidecarStatus::missing;
  if (o.save_optimizer_state && !o.output.empty() && std::filesystem::exists(o.output))
    resumed = load_optim_sidecar(o.output, file_shorthash(o.output), *optimizer);
  const std::string name = hn.name;
  auto save = [&](const std::filesystem::path& file) {
    hn.name = name;
    hn.save(file);
    if (o.save_optimizer_state) save_optim_sidecar(file, file_shorthash(file), *optimizer, true);
  };
  AdapterTrainResult r;
  try {
    r = webui_detail::run(weights, *optimizer, hn.step, o, data, hooks, name, "hypernetwork",
                          "hypernetwork_loss.csv", save);
  } catch (...) {
    hn.eval();
    throw;
  }
  hn.eval();
  r.resumed_optimizer = resumed;
  return r;
}

}  // namespace difftrain::adapters
