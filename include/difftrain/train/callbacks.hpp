#pragma once
// Training callbacks. A callback is any type with some of
//   void on_train_begin(Trainer&);  void on_step_end(Trainer&, const StepInfo&);
//   void on_train_end(Trainer&);  void on_resume(Trainer&)  (after a checkpoint is loaded)
// The trainer holds them in a std::tuple (Config::Callbacks) and calls only the hooks a type has,
// resolved at compile time: a run without callbacks pays nothing.

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <functional>
#include <optional>
#include <regex>
#include <set>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/io/atomic_file.hpp"
#include "difftrain/io/csv_log.hpp"
#include "difftrain/io/image_grid.hpp"
#include "difftrain/train/progress.hpp"
#include "difftrain/train/trainer.hpp"

namespace difftrain::train {

/// The learning rate a log shows for a step: the default group's. Rule groups (their own LR, see
/// GroupingOptions) come first in the optimizer, so the first group is not the one to show.
template <class T>
double shown_lr(const T& t, const StepInfo& s) {
  if constexpr (requires { t.param_groups(); }) {
    const auto& groups = t.param_groups();
    for (std::size_t i = 0; i < groups.size() && i < s.lr.size(); ++i)
      if (groups[i].label == "default" || groups[i].label == "default/no_decay") return s.lr[i];
  }
  return s.lr.empty() ? 0.0 : s.lr.front();
}

/// The web UI's loss log: step, epoch, epoch_step, loss, learn_rate, one row per optimizer step.
class CsvLossLog {
 public:
  struct Options {
    std::filesystem::path path = "loss.csv";
    std::int64_t steps_per_epoch = 0;  ///< 0: epoch columns stay 0
    std::int64_t every = 1;
  };
  explicit CsvLossLog(const Options& o) : o_(o) {}
  /// The file opens when training begins (the trainer's constructor), so a log that cannot be
  /// written stops the run before any step; only rank 0 of a distributed run opens it.
  template <class T>
  void on_train_begin(T& /*t*/) {
    (void)log();
  }
  template <class T>
  void on_step_end(T& t, const StepInfo& s) {
    if (!s.stepped || s.step % o_.every != 0) return;
    const std::int64_t epoch = o_.steps_per_epoch > 0 ? (s.step - 1) / o_.steps_per_epoch : 0;
    const std::int64_t epoch_step =
        o_.steps_per_epoch > 0 ? (s.step - 1) % o_.steps_per_epoch + 1 : s.step;
    log().row(s.step, epoch, epoch_step, s.loss, shown_lr(t, s));
  }
  template <class T>
  void on_train_end(T& /*t*/) {
    log().flush();
  }
  /// A resumed run writes the steps after its checkpoint again: their old rows go.
  template <class T>
  void on_resume(T& t) {
    log().drop_rows_after(t.global_step());
  }

 private:
  io::CsvLog& log() {
    if (!log_)
      log_.emplace(o_.path,
                   std::vector<std::string>{"step", "epoch", "epoch_step", "loss", "learn_rate"});
    return *log_;
  }
  Options o_;
  std::optional<io::CsvLog> log_;
};

/// Mean ± standard error of the loss over the last `window` steps (the web UI keeps 32).
class LossStatistics {
 public:
  struct Options {
    std::size_t window = 32;
  };
  LossStatistics() : LossStatistics(Options()) {}
  explicit LossStatistics(const Options& o) : o_(o) {
    if (o.window < 1) throw ConfigError("window must be >= 1", "LossStatistics");
  }
  template <class T>
  void on_step_end(T& /*t*/, const StepInfo& s) {
    if (!std::isfinite(s.loss)) return;
    losses_.push_back(s.loss);
    if (losses_.size() > o_.window) losses_.pop_front();
  }
  [[nodiscard]] double mean() const {
    double sum = 0;
    for (double l : losses_) sum += l;
    return losses_.empty() ? std::nan("") : sum / static_cast<double>(losses_.size());
  }
  /// Sample standard deviation / sqrt(n) (statistics.stdev, as the web UI); NaN below 2 values.
  [[nodiscard]] double standard_error() const {
    const auto n = static_cast<double>(losses_.size());
    if (losses_.size() < 2) return std::nan("");
    const double m = mean();
    double ss = 0;
    for (double l : losses_) ss += (l - m) * (l - m);
    return std::sqrt(ss / (n - 1)) / std::sqrt(n);
  }
  [[nodiscard]] std::size_t count() const { return losses_.size(); }
  [[nodiscard]] std::size_t window() const { return o_.window; }

 private:
  Options o_;
  std::deque<double> losses_;
};

/// The training progress line (train/progress.hpp): step/total, a bar, it/s and ETA over the recent
/// steps, the loss with its running mean, the LR. Redrawn in place on a terminal; when stderr is
/// not one, a line every `lines_every` steps (0: quiet), unless `force` draws it in place anyway.
class ProgressBar {
 public:
  struct Options {
    std::int64_t total_steps = 0;
    std::int64_t every = 1;        ///< terminal: redraw every N steps
    std::int64_t lines_every = 0;  ///< not a terminal: a line every N steps; 0: quiet
    bool force = false;
    std::FILE* out = stderr;
    std::size_t loss_window = 32;  ///< steps in the running mean of the loss
    std::string label = "train";   ///< what the line starts with (one program, several trainings)
  };
  ProgressBar() : ProgressBar(Options()) {}
  explicit ProgressBar(const Options& o)
      : stats_(checked_window(o.loss_window)),
        line_({.label = o.label,
               .total = o.total_steps,
               .every = o.every,
               .lines_every = o.lines_every,
               .force = o.force,
               .out = o.out}) {}

  template <class T>
  void on_train_begin(T& t) {
    line_.start(t.global_step());
  }
  template <class T>
  void on_resume(T& t) {
    line_.start(t.global_step());
    stats_ = LossStatistics({.window = stats_.window()});
  }
  template <class T>
  void on_step_end(T& t, const StepInfo& s) {
    stats_.on_step_end(t, s);
    line_.update(s.step, extra(s, shown_lr(t, s)));
  }
  template <class T>
  void on_train_end(T& /*t*/) {
    line_.finish();
  }

  /// The text shown for a step (also what tests look at); `lr` defaults to the first group's.
  [[nodiscard]] std::string line(const StepInfo& s, std::optional<double> lr = {}) const {
    return line_.line(s.step, extra(s, lr.value_or(s.lr.empty() ? 0.0 : s.lr.front())));
  }
  /// The mean loss of the last `loss_window` finite losses (NaN before any).
  [[nodiscard]] double running_mean() const { return stats_.mean(); }

 private:
  static LossStatistics::Options checked_window(std::size_t window) {
    if (window < 1) throw ConfigError("loss_window must be >= 1", "ProgressBar");
    return {.window = window};
  }
  [[nodiscard]] std::string extra(const StepInfo& s, double lr) const {
    char buf[128];
    if (stats_.count() == 0)
      std::snprintf(buf, sizeof buf, "loss %.5f  lr %.3g", s.loss, lr);
    else
      std::snprintf(buf, sizeof buf, "loss %.5f (mean %.5f)  lr %.3g", s.loss, running_mean(), lr);
    return buf;
  }
  LossStatistics stats_;
  ProgressLine line_;
};

/// Saves `dir/checkpoint-<step>.pt` every N steps and keeps the last K. Non-finite weights are
/// never saved (the trainer refuses), so the last good checkpoint survives a diverged run.
class CheckpointEvery {
 public:
  struct Options {
    std::filesystem::path dir = "checkpoints";
    std::int64_t every = 1000;
    std::size_t keep_last = 3;
  };
  /// Saving is collective in a distributed run: every rank gathers its part, rank 0 writes.
  static constexpr bool every_rank = true;
  explicit CheckpointEvery(const Options& o) : o_(o) {
    if (o.every < 1 || o.keep_last < 1)
      throw ConfigError("every and keep_last must be >= 1", "CheckpointEvery");
  }
  template <class T>
  void on_step_end(T& t, const StepInfo& s) {
    if (s.stepped && s.step % o_.every == 0) save(t);
  }
  template <class T>
  void save(T& t) {
    t.save_checkpoint(path_for(t.global_step()));
    if constexpr (requires { t.is_main(); }) {
      if (!t.is_main()) return;  // rank 0 wrote it; rank 0 prunes
    }
    prune();
  }
  [[nodiscard]] std::filesystem::path path_for(std::int64_t step) const {
    return o_.dir / ("checkpoint-" + std::to_string(step) + ".pt");
  }
  /// Checkpoints in `dir`, oldest first.
  [[nodiscard]] static std::vector<std::pair<std::int64_t, std::filesystem::path>> list(
      const std::filesystem::path& dir) {
    std::vector<std::pair<std::int64_t, std::filesystem::path>> out;
    std::error_code ec;
    static const std::regex name("checkpoint-([0-9]+)\\.pt");
    for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
      std::smatch m;
      const std::string f = e.path().filename().string();
      if (!std::regex_match(f, m, name)) continue;
      std::int64_t step = 0;
      const std::string digits = m[1].str();
      const auto [end, err] = std::from_chars(digits.data(), digits.data() + digits.size(), step);
      if (err != std::errc()) continue;  // not a step this library wrote (too many digits)
      out.emplace_back(step, e.path());
    }
    std::sort(out.begin(), out.end());
    return out;
  }

  /// Removes every checkpoint in `dir` with the files of its set (optimizer shards and weights
  /// files beside it, those a stopped save left too): a run that starts again leaves nothing of
  /// the old one that a later resume could mix in. Returns how many files went.
  static std::size_t remove_all(const std::filesystem::path& dir) {
    static const std::regex mine(
        "checkpoint-[0-9]+\\.pt(\\.shard-[0-9]+-of-[0-9]+(\\.safetensors)?)?");
    std::error_code ec;
    std::vector<std::filesystem::path> files;
    for (const auto& e : std::filesystem::directory_iterator(dir, ec))
      if (std::regex_match(e.path().filename().string(), mine)) files.push_back(e.path());
    for (const auto& f : files)
      if (!std::filesystem::remove(f, ec) && ec)
        throw IoError("cannot remove: " + ec.message(), f.string());
    return files.size();
  }

 private:
  void prune() const {
    auto all = list(o_.dir);
    while (all.size() > o_.keep_last) {
      std::filesystem::remove(all.front().second);
      all.erase(all.begin());
    }
    // A sharded checkpoint's optimizer shards go with it, and so do shards a stopped save left
    // without their checkpoint (older than the newest kept one).
    if (all.empty()) return;
    std::set<std::int64_t> kept;
    for (const auto& [step, path] : all) kept.insert(step);
    static const std::regex shard(
        "checkpoint-([0-9]+)\\.pt\\.shard-[0-9]+-of-[0-9]+(\\.safetensors)?");
    std::error_code ec;
    std::vector<std::filesystem::path> stale;
    for (const auto& e : std::filesystem::directory_iterator(o_.dir, ec)) {
      std::smatch m;
      const std::string f = e.path().filename().string();
      if (!std::regex_match(f, m, shard)) continue;
      std::int64_t step = 0;
      const std::string digits = m[1].str();
      const auto [end, err] = std::from_chars(digits.data(), digits.data() + digits.size(), step);
      if (err == std::errc() && kept.count(step) == 0 && step < *kept.rbegin())
        stale.push_back(e.path());
    }
    for (const auto& f : stale) std::filesystem::remove(f, ec);
  }
  Options o_;
};

/// Resumes `trainer` from the newest checkpoint in `dir` that loads; a damaged newest one is
/// reported in `skipped` and the previous is used. Returns the path used, or nothing.
template <class T>
std::optional<std::filesystem::path> resume_latest(T& trainer, const std::filesystem::path& dir,
                                                   std::vector<std::string>* skipped = nullptr) {
  auto all = CheckpointEvery::list(dir);
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    try {
      trainer.load_checkpoint(it->second);
      return it->second;
    } catch (const FormatError& e) {  // damaged: truncated, bit-flipped, a key missing
      if (skipped != nullptr) skipped->push_back(e.what());
    } catch (const IoError& e) {  // unreadable: a folder in its place, no permission
      if (skipped != nullptr) skipped->push_back(e.what());
    }
  }
  return std::nullopt;
}

/// Calls `sample(trainer)` every N steps with the EMA weights swapped in when the trainer has EMA.
/// When it returns images (an (N, C, H, W) tensor in [-1, 1], or an io::RgbImage), every callback
/// of the trainer that takes images (train::TensorBoard) gets them as one grid under `tag`.
/// `sample` runs on rank 0; where reading the model needs every rank (the EMA or the parameters
/// are shared out by a sharding policy), every rank gathers them with it first.
template <class Fn>
class SampleEvery {
 public:
  static constexpr bool every_rank = true;
  SampleEvery(std::int64_t every, Fn fn, std::string tag = "samples", io::GridOptions grid = {})
      : every_(every), fn_(std::move(fn)), tag_(std::move(tag)), grid_(grid) {
    if (every < 1) throw ConfigError("every must be >= 1", "SampleEvery");
  }
  template <class T>
  void on_step_end(T& t, const StepInfo& s) {
    if (!s.stepped || s.step % every_ != 0) return;
    // A schedule-free optimizer's evaluation weights (every rank: it may be a collective); the
    // next step takes the training weights back.
    if constexpr (requires { t.use_evaluation_weights(); }) t.use_evaluation_weights();
    const bool main = t.rank() == 0;
    bool gather = false;
    if constexpr (requires { t.reading_needs_every_rank(); }) gather = t.reading_needs_every_rank();
    if (!main && !gather) return;
    at::NoGradGuard no_grad;
    using Result = std::invoke_result_t<Fn&, T&>;
    // The model as it is to be read (the EMA's weights when kept, every parameter whole) for
    // the duration of `read` on rank 0; the other ranks only take part in gathering it.
    auto with_model = [&](auto&& read) {
      if constexpr (requires { t.ema_weights(); }) {
        const auto scope = t.ema_weights();
        if (main) read();
      } else if constexpr (T::has_ema) {
        ema::EmaScope scope(t.ema());
        read();
      } else if constexpr (requires { t.whole_parameters(); }) {
        const auto whole = t.whole_parameters();
        if (main) read();
      } else {
        read();
      }
    };
    if constexpr (std::is_void_v<Result>) {
      with_model([&] { fn_(t); });
    } else {
      static_assert(
          std::is_convertible_v<Result, at::Tensor> || std::is_convertible_v<Result, io::RgbImage>,
          "difftrain: SampleEvery's function returns nothing, images as an (N, C, H, W) "
          "at::Tensor, or an io::RgbImage");
      std::optional<Result> made;
      with_model([&] { made.emplace(fn_(t)); });
      if (!main) return;
      const Result& r = *made;
      if constexpr (std::is_convertible_v<Result, at::Tensor>)
        publish(t, io::image_grid(r, grid_), s.step);
      else
        publish(t, r, s.step);
    }
  }

 private:
  template <class T>
  void publish(T& t, const io::RgbImage& image, std::int64_t step) {
    std::apply(
        [&](auto&... cb) {
          (
              [&](auto& c) {
                if constexpr (requires { c.add_image(std::string_view{}, image, step); })
                  c.add_image(tag_, image, step);
              }(cb),
              ...);
        },
        t.callbacks());
  }
  std::int64_t every_;
  Fn fn_;
  std::string tag_;
  io::GridOptions grid_;
};

/// Stops when the loss has not improved by `min_delta` for `patience` steps.
class EarlyStop {
 public:
  struct Options {
    std::int64_t patience = 100;
    double min_delta = 0.0;
  };
  /// Sees the loss averaged over ranks, so every rank stops at the same step.
  static constexpr bool every_rank = true;
  explicit EarlyStop(const Options& o) : o_(o) {}
  template <class T>
  void on_step_end(T& t, const StepInfo& s) {
    if (!s.stepped) return;
    if (s.loss < best_ - o_.min_delta) {
      best_ = s.loss;
      since_ = 0;
    } else if (++since_ >= o_.patience) {
      stopped_at_ = s.step;
      t.request_stop();
    }
  }
  [[nodiscard]] std::optional<std::int64_t> stopped_at() const { return stopped_at_; }

 private:
  Options o_;
  double best_ = std::numeric_limits<double>::infinity();
  std::int64_t since_ = 0;
  std::optional<std::int64_t> stopped_at_;
};

}  // namespace difftrain::train
