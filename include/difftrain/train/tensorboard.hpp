#pragma once
// train::TensorBoard: a callback that writes a run's TensorBoard event file (log/event_file.hpp):
// per step the loss, the learning rate of each parameter group, the gradient norm, the fp16 loss
// scale, the EMA decay, steps/s and samples/s; histograms of weights and gradients every N steps;
// the run's configuration as a table when training begins; images on request (SampleEvery hands
// it the grids it draws). Only rank 0 of a distributed run writes.
//
//   train::TensorBoard tb({.dir = out / "tensorboard", .config = settings_json});
//   then:  tensorboard --logdir out/tensorboard

#include <ATen/ATen.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/io/image_grid.hpp"
#include "difftrain/log/event_file.hpp"
#include "difftrain/log/histogram.hpp"
#include "difftrain/train/trainer.hpp"

namespace difftrain::train {

namespace tensorboard_detail {
inline void flatten(const nlohmann::json& j, const std::string& prefix,
                    std::vector<std::pair<std::string, std::string>>& out) {
  if (j.is_object() && !j.empty()) {
    for (const auto& [k, v] : j.items()) flatten(v, prefix.empty() ? k : prefix + "." + k, out);
    return;
  }
  out.emplace_back(prefix, j.is_string() ? j.get<std::string>() : j.dump());
}
inline std::string cell(std::string s) {
  std::string out;
  for (char c : s) {
    if (c == '|')
      out += "\\|";
    else if (c == '\n')
      out += "<br>";
    else
      out += c;
  }
  return out;
}
}  // namespace tensorboard_detail

/// A settings object as a two-column Markdown table (nested keys joined with dots).
inline std::string markdown_table(const nlohmann::json& settings) {
  std::vector<std::pair<std::string, std::string>> rows;
  tensorboard_detail::flatten(settings, "", rows);
  std::string md = "| setting | value |\n|---|---|\n";
  for (const auto& [k, v] : rows)
    md += "| " + tensorboard_detail::cell(k) + " | " + tensorboard_detail::cell(v) + " |\n";
  return md;
}

class TensorBoard {
 public:
  struct Tags {
    std::string loss = "train/loss";
    std::string lr = "train/lr";  ///< with several groups, one tag per group: train/lr/<label>
    std::string grad_norm = "train/grad_norm";
    std::string loss_scale = "train/loss_scale";
    std::string ema_decay = "train/ema_decay";
    std::string skipped_steps = "train/skipped_steps";  ///< non-finite and overflow, so far
    std::string steps_per_second = "perf/steps_per_second";
    std::string samples_per_second = "perf/samples_per_second";
    std::string config = "config";
    std::string weights = "weights/";      ///< histogram tag prefix, then the parameter's name
    std::string gradients = "gradients/";  ///< likewise
  };
  struct Options {
    std::filesystem::path dir = "tensorboard";  ///< empty: the callback does nothing
    std::int64_t scalars_every = 1;             ///< optimizer steps between scalar logs
    std::int64_t histograms_every = 0;          ///< 0: no histograms
    int histogram_buckets = 30;
    /// Shown as a table under tags.config when training begins (a run's settings); null: none.
    nlohmann::json config = nullptr;
    Tags tags{};
    log::EventFileOptions file{};
  };

  TensorBoard() : TensorBoard(Options()) {}
  explicit TensorBoard(Options o) : o_(std::move(o)) {
    if (o_.scalars_every < 1) throw ConfigError("scalars_every must be >= 1", "TensorBoard");
    if (o_.histograms_every < 0) throw ConfigError("histograms_every must be >= 0", "TensorBoard");
    if (o_.histogram_buckets < 1)
      throw ConfigError("histogram_buckets must be >= 1", "TensorBoard");
  }

  // ---- trainer hooks ----------------------------------------------------------------------------

  /// Opens the event file (the trainer's constructor), so a folder that cannot be written stops
  /// the run before its first step.
  template <class T>
  void on_train_begin(T& t) {
    if (!enabled()) return;
    (void)writer();
    last_step_ = t.global_step();
    last_time_ = std::chrono::steady_clock::now();
    if (!o_.config.is_null() && !config_written_) {
      writer().add_text(o_.tags.config, markdown_table(o_.config), t.global_step());
      config_written_ = true;
    }
  }
  /// A resumed run logs the steps after its checkpoint again: TensorBoard drops the earlier
  /// run's events from there on.
  template <class T>
  void on_resume(T& t) {
    if (!enabled()) return;
    writer().add_session_start(t.global_step() + 1);
    last_step_ = t.global_step();
    last_time_ = std::chrono::steady_clock::now();
  }
  template <class T>
  void on_step_end(T& t, const StepInfo& s) {
    if (!s.stepped || !enabled()) return;  // a skipped step repeats the previous step's number
    if (s.step % o_.scalars_every == 0) log_scalars(t, s);
    if (o_.histograms_every > 0 && s.step % o_.histograms_every == 0) log_histograms(t, s.step);
  }
  template <class T>
  void on_train_end(T& /*t*/) {
    if (writer_) writer_->flush();
  }

  // ---- for the run's own code -----------------------------------------------------------------

  void add_image(std::string_view tag, const io::RgbImage& image, std::int64_t step) {
    if (!enabled()) return;
    writer().add_image(tag, image, step);
  }
  /// (N, C, H, W) images in [-1, 1] as one grid.
  void add_images(std::string_view tag, const at::Tensor& images, std::int64_t step,
                  const io::GridOptions& grid = {}) {
    if (!enabled()) return;
    add_image(tag, io::image_grid(images, grid), step);
  }
  void add_scalar(std::string_view tag, double value, std::int64_t step) {
    if (!enabled()) return;
    writer().add_scalar(tag, value, step);
  }
  void add_text(std::string_view tag, std::string_view markdown, std::int64_t step) {
    if (!enabled()) return;
    writer().add_text(tag, markdown, step);
  }
  void flush() {
    if (writer_) writer_->flush();
  }
  /// Closes the event file (reporting a write that failed); later calls open a new one.
  void close() {
    if (writer_) writer_->close();
    writer_.reset();
  }
  /// Whether it writes (a folder was named).
  [[nodiscard]] bool enabled() const noexcept { return !o_.dir.empty(); }
  [[nodiscard]] log::EventFileWriter& writer() {
    if (!enabled()) throw ConfigError("has no folder: this callback writes nothing", "TensorBoard");
    if (!writer_) writer_ = std::make_unique<log::EventFileWriter>(o_.dir, o_.file);
    return *writer_;
  }
  [[nodiscard]] const Options& options() const noexcept { return o_; }

 private:
  template <class T>
  void log_scalars(T& t, const StepInfo& s) {
    std::vector<std::pair<std::string, double>> v;
    v.emplace_back(o_.tags.loss, s.loss);
    if constexpr (requires { t.param_groups(); }) {
      const auto& groups = t.param_groups();
      if (groups.size() == 1 || s.lr.size() == 1) {
        if (!s.lr.empty()) v.emplace_back(o_.tags.lr, s.lr.front());
      } else {
        for (std::size_t i = 0; i < groups.size() && i < s.lr.size(); ++i)
          v.emplace_back(o_.tags.lr + "/" + groups[i].label, s.lr[i]);
      }
    } else if (!s.lr.empty()) {
      v.emplace_back(o_.tags.lr, s.lr.front());
    }
    if (std::isfinite(s.grad_norm)) v.emplace_back(o_.tags.grad_norm, s.grad_norm);
    if constexpr (requires { t.scaler().enabled(); }) {
      if (t.scaler().enabled()) v.emplace_back(o_.tags.loss_scale, t.scaler().current_scale());
    }
    if constexpr (requires { t.ema().last_decay(); }) {  // ema() exists only with an EMA
      if (std::isfinite(t.ema().last_decay()))
        v.emplace_back(o_.tags.ema_decay, t.ema().last_decay());
    }
    if constexpr (requires { t.skipped_nonfinite() + t.skipped_overflow(); })
      v.emplace_back(o_.tags.skipped_steps,
                     static_cast<double>(t.skipped_nonfinite() + t.skipped_overflow()));
    const auto now = std::chrono::steady_clock::now();
    const double dt = std::chrono::duration<double>(now - last_time_).count();
    if (s.step > last_step_ && dt > 0) {
      const double steps_per_second = static_cast<double>(s.step - last_step_) / dt;
      v.emplace_back(o_.tags.steps_per_second, steps_per_second);
      if (s.samples > 0)
        v.emplace_back(o_.tags.samples_per_second,
                       steps_per_second * static_cast<double>(s.samples));
    }
    last_step_ = s.step;
    last_time_ = now;
    writer().add_scalars(v, s.step);
  }
  template <class T>
  void log_histograms(T& t, std::int64_t step) {
    // An fp16 step skipped before the fused optimizer could unscale them leaves them scaled.
    std::optional<at::Tensor> scale;
    if constexpr (requires { t.scaler().scale_left_in_grads(); })
      scale = t.scaler().scale_left_in_grads();
    for (const auto& item : t.model().named_parameters(/*recurse=*/true)) {
      writer().add_histogram(o_.tags.weights + item.key(),
                             log::histogram_of(item.value(), o_.histogram_buckets), step);
      const at::Tensor& grad = item.value().grad();
      if (grad.defined())
        writer().add_histogram(
            o_.tags.gradients + item.key(),
            log::histogram_of(scale ? grad / scale->to(grad.device()) : grad, o_.histogram_buckets),
            step);
    }
  }

  Options o_;
  std::unique_ptr<log::EventFileWriter> writer_;
  std::int64_t last_step_ = 0;
  std::chrono::steady_clock::time_point last_time_ = std::chrono::steady_clock::now();
  bool config_written_ = false;
};

}  // namespace difftrain::train
