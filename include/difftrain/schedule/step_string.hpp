#pragma once
// The web UI's step strings ("0.005:100, 1e-5:1000, 1e-6"): a value until a step, the next value
// until a later step, and so on; a value without a step (or with step -1) holds to the end. Used
// for learning rates and for gradient-clipping limits by the hypernetwork and textual-inversion
// trainers. The values are absolute: the group's base LR is ignored.
//
// Parity with the reference's LearnRateScheduler, including its quirks: the schedule is consulted
// once per step and advances at most one entry per step; entries whose step is not after
// `start_step` (a resumed run) are dropped; steps past `max_steps` are clamped to it. Stricter than
// the reference: a value that is negative or not finite, or an entry with more than one ':', is a
// ConfigError rather than a silent surprise.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "difftrain/schedule/concepts.hpp"
#include "difftrain/schedule/parse.hpp"

namespace difftrain::schedule {

struct StepString {
  static constexpr std::string_view name = "step_string";
  struct Options {
    std::string text = "0.005";
    std::int64_t max_steps = std::numeric_limits<std::int64_t>::max();
    std::int64_t start_step = 0;  ///< the step a resumed run starts at
    /// How often the trainer consults the schedule per optimizer step. The web UI consults it
    /// once per micro-batch, so with gradient accumulation several entries can pass in one step.
    std::int64_t consults_per_step = 1;
  };

  explicit StepString(const Options& o) : o_(o) {
    detail::require(o.max_steps > 0, name, "max_steps", "must be > 0");
    detail::require(o.start_step >= 0, name, "start_step", "must be >= 0");
    detail::require(o.consults_per_step > 0, name, "consults_per_step", "must be > 0");
    parse();
    // The step at which entry k takes over: the first consult at a step s >= the end of entry
    // k-1, each consult advancing at most one entry.
    starts_.resize(entries_.size());
    starts_[0] = std::numeric_limits<std::int64_t>::min();
    std::int64_t at = o_.start_step;  // the step of the last advance (or the first consult)
    std::int64_t used = 0;            // consults spent on advances at that step
    for (std::size_t k = 1; k < entries_.size(); ++k) {
      std::int64_t target = std::max(entries_[k - 1].second, at);
      if (target == at && used == o_.consults_per_step) ++target;
      if (target != at) used = 0;
      starts_[k] = at = target;
      ++used;
    }
  }

  [[nodiscard]] double lr(std::int64_t step, double /*base_lr*/) const { return value_at(step); }

  /// The value in force at `step`.
  [[nodiscard]] double value_at(std::int64_t step) const {
    const auto it = std::upper_bound(starts_.begin(), starts_.end(), step);
    return entries_[static_cast<std::size_t>(it - starts_.begin()) - 1].first;
  }

  /// (value, end step) pairs after parsing, as the reference's iterator yields them.
  [[nodiscard]] const std::vector<std::pair<double, std::int64_t>>& entries() const noexcept {
    return entries_;
  }

 private:
  void parse() {
    const std::string where = "step string '" + o_.text + "'";
    const auto fail = [&](const std::string& why) {
      throw ConfigError(why +
                            ". It should be a number or, for example, like \"0.001:100, "
                            "0.00001:1000, 1e-5:10000\" to have 0.001 until step 100, 0.00001 "
                            "until 1000, and 1e-5 until 10000",
                        where);
    };
    const auto value_of = [&](std::string_view field) {
      const double v = parse_finite(field, where);
      if (v < 0) fail("value " + std::string(trim(field)) + " is negative");
      return v;
    };
    for (std::string_view pair : split(o_.text, ',')) {
      if (trim(pair).empty()) continue;
      const std::vector<std::string_view> parts = split(pair, ':');
      if (parts.size() > 2) fail("entry '" + std::string(trim(pair)) + "' has more than one ':'");
      if (parts.size() == 1) {
        entries_.emplace_back(value_of(parts[0]), o_.max_steps);
        return;
      }
      const std::int64_t step = parse_int(parts[1], where);
      if (step > o_.start_step) {
        entries_.emplace_back(value_of(parts[0]), std::min(step, o_.max_steps));
        if (step > o_.max_steps) return;
      } else if (step == -1) {
        entries_.emplace_back(value_of(parts[0]), o_.max_steps);
        return;
      } else {
        (void)value_of(parts[0]);  // still validated, though the entry is already over
      }
    }
    if (entries_.empty()) fail("no entry is in force after step " + std::to_string(o_.start_step));
  }

  Options o_;
  std::vector<std::pair<double, std::int64_t>> entries_;
  std::vector<std::int64_t> starts_;
};

}  // namespace difftrain::schedule
