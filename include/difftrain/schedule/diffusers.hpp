#pragma once
// diffusers' `get_scheduler` family (diffusers/optimization.py), as multipliers of the group's base
// LR (LambdaLR). The expressions are the reference's, in the same order, so values agree to the
// last bits.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <numbers>
#include <string>
#include <string_view>
#include <vector>

#include "difftrain/schedule/concepts.hpp"
#include "difftrain/schedule/parse.hpp"

namespace difftrain::schedule {

namespace detail {
inline double warmup_ramp(std::int64_t step, std::int64_t warmup) {
  return static_cast<double>(step) / static_cast<double>(std::max<std::int64_t>(1, warmup));
}
/// Fraction of the post-warm-up steps done at `step`.
inline double progress(std::int64_t step, std::int64_t warmup, std::int64_t training) {
  return static_cast<double>(step - warmup) /
         static_cast<double>(std::max<std::int64_t>(1, training - warmup));
}
inline void check_steps(std::string_view name, std::int64_t warmup, std::int64_t training) {
  require(warmup >= 0, name, "num_warmup_steps", "must be >= 0, got " + std::to_string(warmup));
  require(training > 0, name, "num_training_steps", "must be > 0, got " + std::to_string(training));
  require(warmup <= training, name, "num_warmup_steps",
          "warm-up (" + std::to_string(warmup) + " steps) is longer than training (" +
              std::to_string(training) + " steps)");
}
}  // namespace detail

/// "constant": the base LR throughout.
struct Constant {
  static constexpr std::string_view name = "constant";
  struct Options {};
  explicit Constant(const Options& /*unused*/ = {}) {}
  [[nodiscard]] double lr(std::int64_t /*step*/, double base_lr) const { return base_lr; }
};

/// "constant_with_warmup": linear 0 → base over the warm-up, then constant.
struct ConstantWithWarmup {
  static constexpr std::string_view name = "constant_with_warmup";
  struct Options {
    std::int64_t num_warmup_steps = 0;
  };
  explicit ConstantWithWarmup(const Options& o) : o_(o) {
    detail::require(o.num_warmup_steps >= 0, name, "num_warmup_steps",
                    "must be >= 0, got " + std::to_string(o.num_warmup_steps));
  }
  [[nodiscard]] double lr(std::int64_t step, double base_lr) const {
    if (step < o_.num_warmup_steps) return base_lr * detail::warmup_ramp(step, o_.num_warmup_steps);
    return base_lr * 1.0;
  }

 private:
  Options o_;
};

/// "linear": warm-up, then linear decay from f_max to f_min (multiples of the base LR).
struct Linear {
  static constexpr std::string_view name = "linear";
  struct Options {
    std::int64_t num_warmup_steps = 0;
    std::int64_t num_training_steps = 1000;
    double f_min = 0.0;
    double f_max = 1.0;
  };
  explicit Linear(const Options& o) : o_(o) {
    detail::check_steps(name, o.num_warmup_steps, o.num_training_steps);
    detail::require(o.f_min <= o.f_max, name, "f_min", "must not exceed f_max");
  }
  [[nodiscard]] double lr(std::int64_t step, double base_lr) const {
    if (step < o_.num_warmup_steps)
      return base_lr * (o_.f_max * static_cast<double>(step) /
                        static_cast<double>(std::max<std::int64_t>(1, o_.num_warmup_steps)));
    const double progress =
        static_cast<double>(o_.num_training_steps - step) /
        static_cast<double>(std::max<std::int64_t>(1, o_.num_training_steps - o_.num_warmup_steps));
    return base_lr * (o_.f_min + (o_.f_max - o_.f_min) * std::max(0.0, progress));
  }

 private:
  Options o_;
};

/// "cosine": warm-up, then a cosine from the base LR to 0 over `num_cycles` periods (0.5 = half a
/// cosine, the usual decay).
struct Cosine {
  static constexpr std::string_view name = "cosine";
  struct Options {
    std::int64_t num_warmup_steps = 0;
    std::int64_t num_training_steps = 1000;
    double num_cycles = 0.5;
  };
  explicit Cosine(const Options& o) : o_(o) {
    detail::check_steps(name, o.num_warmup_steps, o.num_training_steps);
    detail::require(o.num_cycles > 0, name, "num_cycles", "must be > 0");
  }
  [[nodiscard]] double lr(std::int64_t step, double base_lr) const {
    if (step < o_.num_warmup_steps) return base_lr * detail::warmup_ramp(step, o_.num_warmup_steps);
    const double progress = detail::progress(step, o_.num_warmup_steps, o_.num_training_steps);
    return base_lr *
           std::max(0.0, 0.5 * (1.0 + std::cos(std::numbers::pi * o_.num_cycles * 2.0 * progress)));
  }

 private:
  Options o_;
};

/// "cosine_with_restarts": warm-up, then `num_cycles` hard restarts of a cosine to 0; 0 after the
/// last step.
struct CosineWithRestarts {
  static constexpr std::string_view name = "cosine_with_restarts";
  struct Options {
    std::int64_t num_warmup_steps = 0;
    std::int64_t num_training_steps = 1000;
    std::int64_t num_cycles = 1;
  };
  explicit CosineWithRestarts(const Options& o) : o_(o) {
    detail::check_steps(name, o.num_warmup_steps, o.num_training_steps);
    detail::require(o.num_cycles > 0, name, "num_cycles", "must be > 0");
  }
  [[nodiscard]] double lr(std::int64_t step, double base_lr) const {
    if (step < o_.num_warmup_steps) return base_lr * detail::warmup_ramp(step, o_.num_warmup_steps);
    const double progress = detail::progress(step, o_.num_warmup_steps, o_.num_training_steps);
    if (progress >= 1.0) return base_lr * 0.0;
    return base_lr *
           std::max(0.0,
                    0.5 * (1.0 + std::cos(std::numbers::pi *
                                          python_mod(static_cast<double>(o_.num_cycles) * progress,
                                                     1.0))));
  }

 private:
  Options o_;
};

/// "polynomial": warm-up, then (lr_init - lr_end)·(1 - progress)^power + lr_end, lr_end after the
/// last step. `lr_init` is the optimizer's default LR in diffusers; 0 here means the group's base.
struct Polynomial {
  static constexpr std::string_view name = "polynomial";
  struct Options {
    std::int64_t num_warmup_steps = 0;
    std::int64_t num_training_steps = 1000;
    double lr_end = 1e-7;
    double power = 1.0;
    double lr_init = 0.0;
  };
  explicit Polynomial(const Options& o) : o_(o) {
    detail::check_steps(name, o.num_warmup_steps, o.num_training_steps);
    detail::require(o.lr_init == 0.0 || o.lr_init > o.lr_end, name, "lr_end",
                    "must be smaller than the initial lr");
  }
  [[nodiscard]] double lr(std::int64_t step, double base_lr) const {
    const double lr_init = o_.lr_init > 0 ? o_.lr_init : base_lr;
    if (!(lr_init > o_.lr_end))
      throw ConfigError("lr_end (" + std::to_string(o_.lr_end) +
                            ") must be smaller than initial lr (" + std::to_string(lr_init) + ")",
                        "lr schedule 'polynomial' option lr_end");
    double factor = 0;
    if (step < o_.num_warmup_steps) {
      factor = detail::warmup_ramp(step, o_.num_warmup_steps);
    } else if (step > o_.num_training_steps) {
      factor = o_.lr_end / lr_init;
    } else {
      const double lr_range = lr_init - o_.lr_end;
      const auto decay_steps = static_cast<double>(o_.num_training_steps - o_.num_warmup_steps);
      const double pct_remaining =
          1 - static_cast<double>(step - o_.num_warmup_steps) / decay_steps;
      const double decay = lr_range * std::pow(pct_remaining, o_.power) + o_.lr_end;
      factor = decay / lr_init;
    }
    return base_lr * factor;
  }

 private:
  Options o_;
};

/// "piecewise_constant": rules like "1:10,0.1:20,0.01:30,0.005": multiple 1 before step 10, 0.1
/// before step 20, 0.01 before 30, then 0.005.
struct PiecewiseConstant {
  static constexpr std::string_view name = "piecewise_constant";
  struct Options {
    std::string step_rules = "1";
  };
  explicit PiecewiseConstant(const Options& o) {
    const std::string where = "lr schedule 'piecewise_constant' option step_rules";
    const std::vector<std::string_view> rules = split(o.step_rules, ',');
    for (std::size_t i = 0; i + 1 < rules.size(); ++i) {
      const std::vector<std::string_view> parts = split(rules[i], ':');
      if (parts.size() != 2)
        throw ConfigError("rule " + std::to_string(i + 1) + " '" + std::string(rules[i]) +
                              "' is not 'multiple:step'",
                          where);
      rules_[parse_int(parts[1], where)] = parse_finite(parts[0], where);
    }
    last_ = parse_finite(rules.back(), where);
  }
  [[nodiscard]] double lr(std::int64_t step, double base_lr) const {
    const auto it = rules_.upper_bound(step);  // first rule step > current step
    return base_lr * (it == rules_.end() ? last_ : it->second);
  }

 private:
  std::map<std::int64_t, double> rules_;
  double last_ = 1.0;
};

}  // namespace difftrain::schedule
