#pragma once
// Binding a schedule to a torch optimizer. Each parameter group keeps its own base LR (captured
// from the group when bound, like torch's `initial_lr`), and the schedule sets every group's LR
// from it. Like torch's schedulers: binding sets the LR of step 0, each `step()` moves to the next.

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/schedule/concepts.hpp"

namespace difftrain::schedule {

/// A schedule chosen at run time (by name, from a config file): type-erased, same interface.
class AnySchedule {
 public:
  AnySchedule(std::string name, std::function<double(std::int64_t, double)> lr)
      : name_(std::move(name)),
        lr_([f = std::move(lr)](std::int64_t t, double b, std::size_t /*group*/) {
          return f(t, b);
        }) {}
  template <class S>
  requires LrSchedule<S>
  explicit AnySchedule(S schedule)
      : name_(S::name), lr_([s = std::move(schedule)](std::int64_t t, double b, std::size_t g) {
          if constexpr (HasGroupLrAt<S>) {
            return s.lr(t, b, g);
          } else {
            (void)g;
            return s.lr(t, b);
          }
        }) {}

  [[nodiscard]] double lr(std::int64_t step, double base_lr) const { return lr_(step, base_lr, 0); }
  [[nodiscard]] double lr(std::int64_t step, double base_lr, std::size_t group) const {
    return lr_(step, base_lr, group);
  }
  [[nodiscard]] const std::string& name() const noexcept { return name_; }

 private:
  std::string name_;
  std::function<double(std::int64_t, double, std::size_t)> lr_;
};

namespace detail {
template <class S>
std::string schedule_name(const S& s) {
  if constexpr (NamedPolicy<S>) {
    (void)s;
    return std::string(S::name);
  } else {
    return s.name();
  }
}
}  // namespace detail

template <class S>
class LrScheduler {
  static_assert(HasLrAt<S>,
                "difftrain: LrScheduler needs a schedule with `double lr(std::int64_t step, double "
                "base_lr) const`");

 public:
  /// Binds `schedule` to `optimizer` and sets the LR for step `last_step + 1` (0 for a new run).
  LrScheduler(torch::optim::Optimizer& optimizer, S schedule, std::int64_t last_step = -1)
      : optimizer_(&optimizer), schedule_(std::move(schedule)), last_step_(last_step) {
    for (auto& group : optimizer.param_groups()) base_lrs_.push_back(group.options().get_lr());
    step();
  }

  /// Moves to the next step and sets every group's LR for it.
  void step() { set_step(last_step_ + 1); }

  /// Jumps to `step` (a resumed run) and sets every group's LR for it.
  void set_step(std::int64_t step) {
    auto& groups = optimizer_->param_groups();
    if (groups.size() != base_lrs_.size())
      throw ConfigError("the optimizer has " + std::to_string(groups.size()) +
                            " parameter groups, the scheduler was bound to " +
                            std::to_string(base_lrs_.size()),
                        "lr scheduler '" + detail::schedule_name(schedule_) + "'");
    for (std::size_t i = 0; i < groups.size(); ++i) {
      double lr = 0;
      if constexpr (HasGroupLrAt<S>) {
        lr = schedule_.lr(step, base_lrs_[i], i);
      } else {
        lr = schedule_.lr(step, base_lrs_[i]);
      }
      if (!std::isfinite(lr))
        throw NumericError(
            "learning rate is " + std::to_string(lr) + " for group " + std::to_string(i),
            "lr scheduler '" + detail::schedule_name(schedule_) + "' at step " +
                std::to_string(step));
      groups[i].options().set_lr(lr);
    }
    last_step_ = step;
  }

  /// Replaces each group's base LR (a resumed run that trains on with new LRs) and sets the LRs of
  /// the current step from them.
  void rebase(std::vector<double> base_lrs) {
    if (base_lrs.size() != base_lrs_.size())
      throw ConfigError("got " + std::to_string(base_lrs.size()) + " base LRs for " +
                            std::to_string(base_lrs_.size()) + " parameter groups",
                        "lr scheduler '" + detail::schedule_name(schedule_) + "'");
    base_lrs_ = std::move(base_lrs);
    set_step(last_step_);
  }

  [[nodiscard]] std::int64_t last_step() const noexcept { return last_step_; }
  [[nodiscard]] const std::vector<double>& base_lrs() const noexcept { return base_lrs_; }
  [[nodiscard]] std::vector<double> last_lr() const {
    std::vector<double> out;
    for (auto& g : optimizer_->param_groups()) out.push_back(g.options().get_lr());
    return out;
  }
  [[nodiscard]] const S& schedule() const noexcept { return schedule_; }

  /// The scheduler's state, keyed as torch's `state_dict()` keys it.
  [[nodiscard]] nlohmann::json state() const {
    return {{"name", detail::schedule_name(schedule_)},
            {"last_epoch", last_step_},
            {"base_lrs", base_lrs_},
            {"_last_lr", last_lr()}};
  }

  /// Restores a state written by `state()`; validates it against this schedule and optimizer
  /// before changing anything.
  void load_state(const nlohmann::json& s) {
    auto [last, bases] = checked_state(s);
    base_lrs_ = std::move(bases);
    set_step(last);
  }

  /// Validates a state written by `state()` without applying it: what load_state would refuse.
  void check_state(const nlohmann::json& s) const { (void)checked_state(s); }

 private:
  [[nodiscard]] std::pair<std::int64_t, std::vector<double>> checked_state(
      const nlohmann::json& s) const {
    const std::string where = "lr scheduler '" + detail::schedule_name(schedule_) + "' state";
    std::string saved_name;
    std::int64_t last = 0;
    std::vector<double> bases;
    try {
      saved_name = s.at("name").get<std::string>();
      last = s.at("last_epoch").get<std::int64_t>();
      bases = s.at("base_lrs").get<std::vector<double>>();
    } catch (const nlohmann::json::exception& e) {
      throw FormatError(e.what(), where);
    }
    if (saved_name != detail::schedule_name(schedule_))
      throw ConfigError("saved by schedule '" + saved_name + "'", where);
    if (bases.size() != optimizer_->param_groups().size())
      throw ConfigError("has " + std::to_string(bases.size()) + " base LRs for " +
                            std::to_string(optimizer_->param_groups().size()) + " parameter groups",
                        where);
    for (double b : bases)
      if (!std::isfinite(b) || b < 0)
        throw FormatError("base LR " + std::to_string(b) + " is invalid", where);
    if (last < -1) throw FormatError("last_epoch " + std::to_string(last) + " is below -1", where);
    return {last, std::move(bases)};
  }

  torch::optim::Optimizer* optimizer_;
  S schedule_;
  std::int64_t last_step_;
  std::vector<double> base_lrs_;
};

/// Each group's Adam β₂ (AdamW's or Adam's options), in group order: the per-group β₂ of the
/// untuned and RAdam warm-ups, as pytorch-warmup reads them from `group["betas"][1]`. A group of
/// another optimizer is a ConfigError.
inline std::vector<double> adam_beta2s(torch::optim::Optimizer& optimizer) {
  std::vector<double> out;
  for (std::size_t i = 0; i < optimizer.param_groups().size(); ++i) {
    auto& options = optimizer.param_groups()[i].options();
    if (const auto* w = dynamic_cast<const torch::optim::AdamWOptions*>(&options)) {
      out.push_back(std::get<1>(w->betas()));
    } else if (const auto* a = dynamic_cast<const torch::optim::AdamOptions*>(&options)) {
      out.push_back(std::get<1>(a->betas()));
    } else {
      throw ConfigError("group " + std::to_string(i) + " has no Adam betas",
                        "schedule::adam_beta2s");
    }
  }
  return out;
}

}  // namespace difftrain::schedule
