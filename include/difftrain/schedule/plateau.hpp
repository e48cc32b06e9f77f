#pragma once
// torch's ReduceLROnPlateau: metric-driven, so unlike the step schedules it has state (best
// metric, bad-epoch and cool-down counters), which `state()` / `load_state()` keep by name.

#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/schedule/concepts.hpp"

namespace difftrain::schedule {

class ReduceLROnPlateau {
 public:
  static constexpr std::string_view name = "reduce_on_plateau";
  enum class Mode { min, max };
  enum class ThresholdMode { rel, abs };
  struct Options {
    Mode mode = Mode::min;
    double factor = 0.1;
    std::int64_t patience = 10;
    double threshold = 1e-4;
    ThresholdMode threshold_mode = ThresholdMode::rel;
    std::int64_t cooldown = 0;
    std::vector<double> min_lr = {0.0};  ///< one per group, or one for all
    double eps = 1e-8;
  };

  ReduceLROnPlateau(torch::optim::Optimizer& optimizer, const Options& o)
      : optimizer_(&optimizer), o_(o) {
    detail::require(o.factor < 1.0 && o.factor >= 0, name, "factor", "must be in [0, 1)");
    detail::require(o.patience >= 0, name, "patience", "must be >= 0");
    detail::require(o.cooldown >= 0, name, "cooldown", "must be >= 0");
    const std::size_t groups = optimizer.param_groups().size();
    if (o_.min_lr.size() == 1) o_.min_lr.assign(groups, o_.min_lr[0]);
    detail::require(o_.min_lr.size() == groups, name, "min_lr",
                    "has " + std::to_string(o.min_lr.size()) + " values for " +
                        std::to_string(groups) + " parameter groups");
    best_ = worse();
  }

  /// Feeds one metric value (after an epoch or an evaluation); a NaN metric is a NumericError.
  void step(double metric) {
    if (std::isnan(metric))
      throw NumericError("metric is NaN", "lr schedule 'reduce_on_plateau' at epoch " +
                                              std::to_string(last_epoch_ + 1));
    ++last_epoch_;
    if (is_better(metric)) {
      best_ = metric;
      num_bad_epochs_ = 0;
    } else {
      ++num_bad_epochs_;
    }
    if (cooldown_counter_ > 0) {
      --cooldown_counter_;
      num_bad_epochs_ = 0;
    }
    if (num_bad_epochs_ > o_.patience) {
      reduce_lr();
      cooldown_counter_ = o_.cooldown;
      num_bad_epochs_ = 0;
    }
  }

  [[nodiscard]] std::vector<double> last_lr() const {
    std::vector<double> out;
    for (auto& g : optimizer_->param_groups()) out.push_back(g.options().get_lr());
    return out;
  }
  [[nodiscard]] double best() const noexcept { return best_; }

  [[nodiscard]] nlohmann::json state() const {
    return {{"name", name},
            {"best", best_},
            {"num_bad_epochs", num_bad_epochs_},
            {"cooldown_counter", cooldown_counter_},
            {"last_epoch", last_epoch_}};
  }
  void load_state(const nlohmann::json& s) {
    const std::string where = "lr schedule 'reduce_on_plateau' state";
    try {
      if (s.at("name").get<std::string>() != name)
        throw FormatError("state is of schedule '" + s.at("name").get<std::string>() + "'", where);
      best_ = s.at("best").get<double>();
      num_bad_epochs_ = s.at("num_bad_epochs").get<std::int64_t>();
      cooldown_counter_ = s.at("cooldown_counter").get<std::int64_t>();
      last_epoch_ = s.at("last_epoch").get<std::int64_t>();
    } catch (const nlohmann::json::exception& e) {
      throw FormatError(e.what(), where);
    }
  }

 private:
  [[nodiscard]] double worse() const {
    return o_.mode == Mode::min ? std::numeric_limits<double>::infinity()
                                : -std::numeric_limits<double>::infinity();
  }
  [[nodiscard]] bool is_better(double a) const {
    if (o_.mode == Mode::min && o_.threshold_mode == ThresholdMode::rel)
      return a < best_ * (1. - o_.threshold);
    if (o_.mode == Mode::min) return a < best_ - o_.threshold;
    if (o_.threshold_mode == ThresholdMode::rel) return a > best_ * (o_.threshold + 1.);
    return a > best_ + o_.threshold;
  }
  void reduce_lr() {
    auto& groups = optimizer_->param_groups();
    for (std::size_t i = 0; i < groups.size(); ++i) {
      const double old_lr = groups[i].options().get_lr();
      const double new_lr = std::max(old_lr * o_.factor, o_.min_lr[i]);
      if (old_lr - new_lr > o_.eps) groups[i].options().set_lr(new_lr);
    }
  }

  torch::optim::Optimizer* optimizer_;
  Options o_;
  double best_ = 0;
  std::int64_t num_bad_epochs_ = 0;
  std::int64_t cooldown_counter_ = 0;
  std::int64_t last_epoch_ = 0;
};

}  // namespace difftrain::schedule
