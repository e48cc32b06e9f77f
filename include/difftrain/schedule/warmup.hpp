#pragma once
// Warm-up as pytorch-warmup does it: a factor ω(t) ∈ [0, 1] that dampens whatever LR the wrapped
// schedule gives, lr(t) = schedule(t) · ω(t). DALLE2's trainers use LinearWarmup this way over
// CosineAnnealingLR or a constant LR.

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "difftrain/schedule/concepts.hpp"

namespace difftrain::schedule {

namespace detail {
inline void check_period(std::string_view name, std::int64_t period) {
  require(period > 0, name, "warmup_period",
          "must be a positive number of steps, got " + std::to_string(period));
}
inline void check_beta2(std::string_view name, double beta2, double lowest) {
  require(beta2 > lowest && beta2 < 1, name, "beta2",
          "must be in (" + std::to_string(lowest) + ", 1), got " + std::to_string(beta2));
}
/// The untuned warm-ups' period ⌊c / (1 − β₂)⌋, with β₂ checked before it is divided by.
inline std::int64_t untuned_period(std::string_view name, double beta2, double c) {
  check_beta2(name, beta2, 0.0);
  return static_cast<std::int64_t>(c / (1.0 - beta2));
}
/// Per-group values (pytorch-warmup takes a list, one per parameter group) or, when there are
/// none, the one value for every group. A group past the list is a ConfigError.
template <class T>
const T& for_group(const std::vector<T>& per_group, const T& all, std::size_t group,
                   std::string_view name, std::string_view option) {
  if (per_group.empty()) return all;
  require(group < per_group.size(), name, option,
          "has " + std::to_string(per_group.size()) +
              " entries (one per parameter group), but the optimizer has a group " +
              std::to_string(group));
  return per_group[group];
}
}  // namespace detail

/// ω(t) = min(1, (t + 1) / τ); τ per group with `warmup_periods`.
struct LinearWarmup {
  static constexpr std::string_view name = "linear_warmup";
  struct Options {
    std::int64_t warmup_period = 1000;
    std::vector<std::int64_t> warmup_periods = {};  ///< one per parameter group, if given
  };
  explicit LinearWarmup(const Options& o) : o_(o) {
    detail::check_period(name, o.warmup_period);
    for (std::int64_t p : o.warmup_periods) detail::check_period(name, p);
  }
  [[nodiscard]] double factor(std::int64_t step) const { return at(step, o_.warmup_period); }
  [[nodiscard]] double factor(std::int64_t step, std::size_t group) const {
    return at(step, detail::for_group(o_.warmup_periods, o_.warmup_period, group, name,
                                      "warmup_periods"));
  }

 private:
  static double at(std::int64_t step, std::int64_t period) {
    return std::min(1.0, static_cast<double>(step + 1) / static_cast<double>(period));
  }
  Options o_;
};

/// ω(t) = 1 - exp(-(t + 1) / τ); τ per group with `warmup_periods`.
struct ExponentialWarmup {
  static constexpr std::string_view name = "exponential_warmup";
  struct Options {
    std::int64_t warmup_period = 1000;
    std::vector<std::int64_t> warmup_periods = {};  ///< one per parameter group, if given
  };
  explicit ExponentialWarmup(const Options& o) : o_(o) {
    detail::check_period(name, o.warmup_period);
    for (std::int64_t p : o.warmup_periods) detail::check_period(name, p);
  }
  [[nodiscard]] double factor(std::int64_t step) const { return at(step, o_.warmup_period); }
  [[nodiscard]] double factor(std::int64_t step, std::size_t group) const {
    return at(step, detail::for_group(o_.warmup_periods, o_.warmup_period, group, name,
                                      "warmup_periods"));
  }

 private:
  static double at(std::int64_t step, std::int64_t period) {
    return 1.0 - std::exp(-static_cast<double>(step + 1) / static_cast<double>(period));
  }
  Options o_;
};

namespace detail {
/// A warm-up built from a β₂, once for every group or once per group (`beta2s`, e.g. from
/// schedule::adam_beta2s(optimizer), as pytorch-warmup reads each group's betas).
template <class Self, class Inner>
class PerGroupBeta2 {
 public:
  PerGroupBeta2(double beta2, const std::vector<double>& beta2s) : all_(Self::make(beta2)) {
    for (double b : beta2s) per_group_.push_back(Self::make(b));
  }
  [[nodiscard]] double factor(std::int64_t step) const { return all_.factor(step); }
  [[nodiscard]] double factor(std::int64_t step, std::size_t group) const {
    return for_group(per_group_, all_, group, Self::name, "beta2s").factor(step);
  }

 private:
  Inner all_;
  std::vector<Inner> per_group_;
};
}  // namespace detail

/// Linear warm-up with τ = ⌊2 / (1 - β₂)⌋ from Adam's β₂ (untuned: Ma & Yarats, 2021).
struct UntunedLinearWarmup : detail::PerGroupBeta2<UntunedLinearWarmup, LinearWarmup> {
  static constexpr std::string_view name = "untuned_linear_warmup";
  struct Options {
    double beta2 = 0.999;
    std::vector<double> beta2s = {};  ///< one per parameter group, if given
  };
  explicit UntunedLinearWarmup(const Options& o) : PerGroupBeta2(o.beta2, o.beta2s) {}
  static LinearWarmup make(double beta2) {
    return LinearWarmup({.warmup_period = detail::untuned_period(name, beta2, 2.0)});
  }
};

/// Exponential warm-up with τ = ⌊1 / (1 - β₂)⌋.
struct UntunedExponentialWarmup
    : detail::PerGroupBeta2<UntunedExponentialWarmup, ExponentialWarmup> {
  static constexpr std::string_view name = "untuned_exponential_warmup";
  struct Options {
    double beta2 = 0.999;
    std::vector<double> beta2s = {};  ///< one per parameter group, if given
  };
  explicit UntunedExponentialWarmup(const Options& o) : PerGroupBeta2(o.beta2, o.beta2s) {}
  static ExponentialWarmup make(double beta2) {
    return ExponentialWarmup({.warmup_period = detail::untuned_period(name, beta2, 1.0)});
  }
};

namespace detail {
/// RAdam's variance-rectification term for one β₂, offset so that ρ > 4 at t = 0.
class RAdamFactor {
 public:
  explicit RAdamFactor(double beta2) : beta2_(beta2), rho_inf_(2.0 / (1 - beta2) - 1) {
    while (!(rho(static_cast<double>(offset_)) > 4)) ++offset_;
  }
  [[nodiscard]] double factor(std::int64_t step) const {
    const double r = rho(static_cast<double>(step + offset_));
    const double numerator = (r - 4) * (r - 2) * rho_inf_;
    const double denominator = (rho_inf_ - 4) * (rho_inf_ - 2) * r;
    return std::sqrt(numerator / denominator);
  }

 private:
  [[nodiscard]] double rho(double t) const {
    const double b2t = std::pow(beta2_, t);
    return rho_inf_ - 2 * t * b2t / (1 - b2t);
  }
  double beta2_;
  double rho_inf_;
  std::int64_t offset_ = 1;
};
}  // namespace detail

/// RAdam's variance-rectification term as a warm-up factor; β₂ per group with `beta2s`.
struct RAdamWarmup : detail::PerGroupBeta2<RAdamWarmup, detail::RAdamFactor> {
  static constexpr std::string_view name = "radam_warmup";
  struct Options {
    double beta2 = 0.999;
    std::vector<double> beta2s = {};  ///< one per parameter group, if given
  };
  explicit RAdamWarmup(const Options& o) : PerGroupBeta2(o.beta2, o.beta2s) {}
  static detail::RAdamFactor make(double beta2) {
    detail::check_beta2(name, beta2, 0.6);
    return detail::RAdamFactor(beta2);
  }
};

namespace detail {
/// "<a>+<b>" as a compile-time string, so a composite has a name that says what it is.
template <const std::string_view& A, const std::string_view& B>
struct joined_name {
  static constexpr auto chars = [] {
    std::array<char, A.size() + 1 + B.size()> out{};
    std::size_t i = 0;
    for (char c : A) out[i++] = c;
    out[i++] = '+';
    for (char c : B) out[i++] = c;
    return out;
  }();
  static constexpr std::string_view value{chars.data(), chars.size()};
};
}  // namespace detail

/// A schedule dampened by a warm-up: lr(t) = S(t) · W(t). Named "<warm-up>+<schedule>".
template <class W, class S>
class WithWarmup {
  static_assert(diagnose_warmup<W>());
  static_assert(diagnose_lr_schedule<S>());

 public:
  static constexpr std::string_view name = detail::joined_name<W::name, S::name>::value;
  struct Options {
    typename W::Options warmup{};
    typename S::Options schedule{};
  };
  explicit WithWarmup(const Options& o) : warmup_(o.warmup), schedule_(o.schedule) {}
  [[nodiscard]] double lr(std::int64_t step, double base_lr) const {
    return schedule_.lr(step, base_lr) * warmup_.factor(step);
  }
  /// Per group, for warm-ups (or schedules) with per-group options.
  [[nodiscard]] double lr(std::int64_t step, double base_lr, std::size_t group) const {
    double lr = 0;
    if constexpr (HasGroupLrAt<S>) {
      lr = schedule_.lr(step, base_lr, group);
    } else {
      lr = schedule_.lr(step, base_lr);
    }
    if constexpr (HasGroupFactor<W>) return lr * warmup_.factor(step, group);
    return lr * warmup_.factor(step);
  }

 private:
  W warmup_;
  S schedule_;
};

}  // namespace difftrain::schedule
