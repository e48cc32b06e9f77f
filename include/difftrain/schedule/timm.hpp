#pragma once
// timm's schedulers (timm/scheduler/*.py): cosine, tanh and poly with cycles (cycle_mul,
// cycle_decay, cycle_limit, k_decay), step, multistep and warmup-stable-decay. Their warm-up goes
// linearly from warmup_lr_init; with warmup_prefix the schedule starts after it. timm's LR noise
// (noise_range_t) is not part of these: it is random by design and off by default.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numbers>
#include <string>
#include <string_view>
#include <vector>

#include "difftrain/schedule/concepts.hpp"

namespace difftrain::schedule::timm {

namespace detail {

using schedule::detail::require;

/// The options every timm scheduler shares.
struct WarmupOptions {
  std::int64_t warmup_t = 0;
  double warmup_lr_init = 0.0;
};

/// Which cycle step t falls in, that cycle's length and the position inside it.
struct CyclePosition {
  double i;       // cycle index (a whole number)
  double t_i;     // cycle length
  double t_curr;  // steps into the cycle
};

inline CyclePosition cycle_position(double t, double t_initial, double cycle_mul) {
  if (cycle_mul != 1) {
    const double i =
        std::floor(std::log(1 - t / t_initial * (1 - cycle_mul)) / std::log(cycle_mul));
    const double t_i = std::pow(cycle_mul, i) * t_initial;
    const double t_curr = t - (1 - std::pow(cycle_mul, i)) / (1 - cycle_mul) * t_initial;
    return {i, t_i, t_curr};
  }
  const double i = std::floor(t / t_initial);
  return {i, t_initial, t - t_initial * i};
}

struct CycleOptions {
  std::int64_t t_initial;
  double lr_min;
  double cycle_mul;
  double cycle_decay;
  std::int64_t cycle_limit;
  std::int64_t warmup_t;
  double warmup_lr_init;
  bool warmup_prefix;
};

/// The cycle fields of a cosine, tanh or poly schedule's options.
template <class O>
CycleOptions cycle_of(const O& o) {
  return {o.t_initial,   o.lr_min,   o.cycle_mul,      o.cycle_decay,
          o.cycle_limit, o.warmup_t, o.warmup_lr_init, o.warmup_prefix};
}

inline void check_cycle(std::string_view name, const CycleOptions& o) {
  require(o.t_initial > 0, name, "t_initial", "must be > 0, got " + std::to_string(o.t_initial));
  require(o.lr_min >= 0, name, "lr_min", "must be >= 0");
  require(o.cycle_mul > 0, name, "cycle_mul", "must be > 0");
  require(o.cycle_limit >= 0, name, "cycle_limit", "must be >= 0");
  require(o.warmup_t >= 0, name, "warmup_t", "must be >= 0");
  require(o.warmup_lr_init >= 0, name, "warmup_lr_init", "must be >= 0");
}

/// The cycle scaffolding shared by cosine, tanh and poly: warm-up, then `shape(t_curr, t_i)` in
/// [0, 1] interpolating lr_min..lr_max of the cycle, lr_min after the cycle limit. `warmup_target`
/// is where the warm-up ramps to (timm's warmup_steps use the base LR, or for tanh without prefix
/// the schedule's own value at warmup_t).
template <class Shape>
double cycle_lr(const CycleOptions& o, std::int64_t step, double base_lr, double warmup_target,
                Shape shape) {
  if (step < o.warmup_t) {
    const double slope = (warmup_target - o.warmup_lr_init) / static_cast<double>(o.warmup_t);
    return o.warmup_lr_init + static_cast<double>(step) * slope;
  }
  double t = static_cast<double>(step);
  if (o.warmup_prefix) t -= static_cast<double>(o.warmup_t);
  const CyclePosition c = cycle_position(t, static_cast<double>(o.t_initial), o.cycle_mul);
  if (!(c.i < static_cast<double>(o.cycle_limit))) return o.lr_min;
  const double lr_max = base_lr * std::pow(o.cycle_decay, c.i);
  return shape(lr_max, c.t_curr, c.t_i);
}

}  // namespace detail

/// timm's CosineLRScheduler.
struct Cosine {
  static constexpr std::string_view name = "timm_cosine";
  struct Options {
    std::int64_t t_initial = 1000;
    double lr_min = 0.0;
    double cycle_mul = 1.0;
    double cycle_decay = 1.0;
    std::int64_t cycle_limit = 1;
    std::int64_t warmup_t = 0;
    double warmup_lr_init = 0.0;
    bool warmup_prefix = false;
    double k_decay = 1.0;
  };
  explicit Cosine(const Options& o) : o_(o) { detail::check_cycle(name, cycle()); }
  [[nodiscard]] double lr(std::int64_t step, double base_lr) const {
    return detail::cycle_lr(
        cycle(), step, base_lr, base_lr, [&](double lr_max, double t_curr, double t_i) {
          const double k = o_.k_decay;
          return o_.lr_min +
                 0.5 * (lr_max - o_.lr_min) *
                     (1 + std::cos(std::numbers::pi * std::pow(t_curr, k) / std::pow(t_i, k)));
        });
  }

 private:
  [[nodiscard]] detail::CycleOptions cycle() const { return detail::cycle_of(o_); }
  Options o_;
};

/// timm's TanhLRScheduler: lr_min + (lr_max - lr_min)(1 - tanh(lb(1 - r) + ub·r)) / 2.
struct Tanh {
  static constexpr std::string_view name = "timm_tanh";
  struct Options {
    std::int64_t t_initial = 1000;
    double lb = -7.0;
    double ub = 3.0;
    double lr_min = 0.0;
    double cycle_mul = 1.0;
    double cycle_decay = 1.0;
    std::int64_t cycle_limit = 1;
    std::int64_t warmup_t = 0;
    double warmup_lr_init = 0.0;
    bool warmup_prefix = false;
  };
  explicit Tanh(const Options& o) : o_(o) {
    detail::check_cycle(name, cycle());
    detail::require(o.lb < o.ub, name, "lb", "must be < ub");
  }
  [[nodiscard]] double lr(std::int64_t step, double base_lr) const {
    // Without the prefix timm ramps towards the schedule's own value at warmup_t.
    const double target =
        (o_.warmup_t == 0 || o_.warmup_prefix) ? base_lr : after_warmup(o_.warmup_t, base_lr);
    return step < o_.warmup_t
               ? detail::cycle_lr(cycle(), step, base_lr, target,
                                  [this](double m, double c, double i) { return shape(m, c, i); })
               : after_warmup(step, base_lr);
  }

 private:
  [[nodiscard]] double after_warmup(std::int64_t step, double base_lr) const {
    return detail::cycle_lr(cycle(), step, base_lr, base_lr,
                            [this](double m, double c, double i) { return shape(m, c, i); });
  }
  [[nodiscard]] double shape(double lr_max, double t_curr, double t_i) const {
    const double tr = t_curr / t_i;
    return o_.lr_min + 0.5 * (lr_max - o_.lr_min) * (1 - std::tanh(o_.lb * (1. - tr) + o_.ub * tr));
  }
  [[nodiscard]] detail::CycleOptions cycle() const { return detail::cycle_of(o_); }
  Options o_;
};

/// timm's PolyLRScheduler: lr_min + (lr_max - lr_min)(1 - t^k / T^k)^power.
struct Poly {
  static constexpr std::string_view name = "timm_poly";
  struct Options {
    std::int64_t t_initial = 1000;
    double power = 0.5;
    double lr_min = 0.0;
    double cycle_mul = 1.0;
    double cycle_decay = 1.0;
    std::int64_t cycle_limit = 1;
    std::int64_t warmup_t = 0;
    double warmup_lr_init = 0.0;
    bool warmup_prefix = false;
    double k_decay = 1.0;
  };
  explicit Poly(const Options& o) : o_(o) { detail::check_cycle(name, cycle()); }
  [[nodiscard]] double lr(std::int64_t step, double base_lr) const {
    return detail::cycle_lr(
        cycle(), step, base_lr, base_lr, [&](double lr_max, double t_curr, double t_i) {
          const double k = o_.k_decay;
          return o_.lr_min + (lr_max - o_.lr_min) *
                                 std::pow(1 - std::pow(t_curr, k) / std::pow(t_i, k), o_.power);
        });
  }

 private:
  [[nodiscard]] detail::CycleOptions cycle() const { return detail::cycle_of(o_); }
  Options o_;
};

namespace detail {
inline double warmup_ramp(std::int64_t step, std::int64_t warmup_t, double warmup_lr_init,
                          double base_lr) {
  return warmup_lr_init +
         static_cast<double>(step) * ((base_lr - warmup_lr_init) / static_cast<double>(warmup_t));
}
}  // namespace detail

/// timm's StepLRScheduler: base · decay_rate^⌊t / decay_t⌋ (after a prefix warm-up by default).
struct Step {
  static constexpr std::string_view name = "timm_step";
  struct Options {
    double decay_t = 30;
    double decay_rate = 1.0;
    std::int64_t warmup_t = 0;
    double warmup_lr_init = 0.0;
    bool warmup_prefix = true;
  };
  explicit Step(const Options& o) : o_(o) {
    detail::require(o.decay_t > 0, name, "decay_t", "must be > 0");
    detail::require(o.warmup_t >= 0, name, "warmup_t", "must be >= 0");
  }
  [[nodiscard]] double lr(std::int64_t step, double base_lr) const {
    if (step < o_.warmup_t)
      return detail::warmup_ramp(step, o_.warmup_t, o_.warmup_lr_init, base_lr);
    double t = static_cast<double>(step);
    if (o_.warmup_prefix) t -= static_cast<double>(o_.warmup_t);
    return base_lr * std::pow(o_.decay_rate, std::floor(t / o_.decay_t));
  }

 private:
  Options o_;
};

/// timm's MultiStepLRScheduler: decays once per milestone m with m <= t + 1 (timm's off-by-one,
/// kept for parity).
struct MultiStep {
  static constexpr std::string_view name = "timm_multistep";
  struct Options {
    std::vector<std::int64_t> decay_t = {};
    double decay_rate = 1.0;
    std::int64_t warmup_t = 0;
    double warmup_lr_init = 0.0;
    bool warmup_prefix = true;
  };
  explicit MultiStep(const Options& o) : o_(o) {
    detail::require(std::is_sorted(o.decay_t.begin(), o.decay_t.end()), name, "decay_t",
                    "milestones must be sorted ascending");
    detail::require(o.warmup_t >= 0, name, "warmup_t", "must be >= 0");
  }
  [[nodiscard]] double lr(std::int64_t step, double base_lr) const {
    if (step < o_.warmup_t)
      return detail::warmup_ramp(step, o_.warmup_t, o_.warmup_lr_init, base_lr);
    std::int64_t t = step;
    if (o_.warmup_prefix) t -= o_.warmup_t;
    const auto passed =
        std::upper_bound(o_.decay_t.begin(), o_.decay_t.end(), t + 1) - o_.decay_t.begin();
    return base_lr * std::pow(o_.decay_rate, static_cast<double>(passed));
  }

 private:
  Options o_;
};

/// timm's WSDLRScheduler: warm-up, a stable phase (constant, rsqrt or power decay), and a final
/// decay over the last decay_t steps (linear, 1-sqrt, cosine, power or exp).
struct WarmupStableDecay {
  static constexpr std::string_view name = "timm_wsd";
  enum class StableFn { constant, rsqrt, power };
  enum class DecayFn { linear, one_minus_sqrt, cosine, power, exp };
  struct Options {
    std::int64_t t_initial = 1000;
    std::int64_t decay_t = 100;
    double lr_min = 0.0;
    StableFn stable_fn = StableFn::constant;
    double stable_timescale = 0.0;  ///< 0: warmup_t, as in timm
    double stable_power = 0.5;
    DecayFn decay_fn = DecayFn::one_minus_sqrt;
    double decay_power = 0.5;
    double decay_ratio = 0.1;
    std::int64_t warmup_t = 0;
    double warmup_lr_init = 0.0;
  };
  explicit WarmupStableDecay(const Options& o) : o_(o) {
    detail::require(o.t_initial > 0, name, "t_initial",
                    "must be > 0, got " + std::to_string(o.t_initial));
    detail::require(o.decay_t > 0 && o.decay_t <= o.t_initial, name, "decay_t",
                    "must be in (0, t_initial], got " + std::to_string(o.decay_t));
    detail::require(o.lr_min >= 0, name, "lr_min", "must be >= 0");
    detail::require(o.decay_ratio > 0 && o.decay_ratio < 1, name, "decay_ratio",
                    "must be in (0, 1)");
    detail::require(o.decay_power > 0, name, "decay_power", "must be > 0");
    detail::require(o.stable_power > 0, name, "stable_power", "must be > 0");
    if (o.stable_fn != StableFn::constant) {
      if (o_.stable_timescale == 0) o_.stable_timescale = static_cast<double>(o.warmup_t);
      detail::require(
          o_.stable_timescale > 0, name, "stable_timescale",
          "a decaying stable phase needs a positive timescale (it defaults to warmup_t)");
    }
  }
  [[nodiscard]] double lr(std::int64_t step, double base_lr) const {
    if (step < o_.warmup_t)
      return detail::warmup_ramp(step, o_.warmup_t, o_.warmup_lr_init, base_lr);
    const auto t_s = static_cast<double>(step - o_.warmup_t);
    const double stable_lr = std::max(base_lr * stable(t_s), o_.lr_min);
    const double t_decay = t_s - static_cast<double>(o_.t_initial - o_.decay_t);
    if (t_decay <= 0) return stable_lr;
    const double d = decay(std::min(t_decay / static_cast<double>(o_.decay_t), 1.));
    return o_.lr_min + (stable_lr - o_.lr_min) * d;
  }

 private:
  [[nodiscard]] double stable(double t_s) const {
    if (o_.stable_fn == StableFn::constant) return 1.;
    const double power = o_.stable_fn == StableFn::rsqrt ? 0.5 : o_.stable_power;
    return std::pow(1. + t_s / o_.stable_timescale, -power);
  }
  [[nodiscard]] double decay(double frac) const {
    switch (o_.decay_fn) {
      case DecayFn::linear:
        return 1. - frac;
      case DecayFn::one_minus_sqrt:
        return 1. - std::sqrt(frac);
      case DecayFn::cosine:
        return 0.5 * (1. + std::cos(std::numbers::pi * frac));
      case DecayFn::power:
        return 1. - std::pow(frac, o_.decay_power);
      case DecayFn::exp:
        break;
    }
    const double r = o_.decay_ratio;
    return (std::pow(r, frac) - r) / (1. - r);
  }
  Options o_;
};

}  // namespace difftrain::schedule::timm
