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
}  // namespace detail

/// ω(t) = min(1, (t + 1) / τ).
struct LinearWarmup {
  static constexpr std::string_view name = "linear_warmup";
  struct Options {
    std::int64_t warmup_period = 1000;
  };
  explicit LinearWarmup(const Options& o) : period_(o.warmup_period) {
    detail::check_period(name, period_);
  }
  [[nodiscard]] double factor(std::int64_t step) const {
    return std::min(1.0, static_cast<double>(step + 1) / static_cast<double>(period_));
  }

 private:
  std::int64_t period_;
};

/// ω(t) = 1 - exp(-(t + 1) / τ).
struct ExponentialWarmup {
  static constexpr std::string_view name = "exponential_warmup";
  struct Options {
    std::int64_t warmup_period = 1000;
  };
  explicit ExponentialWarmup(const Options& o) : period_(o.warmup_period) {
    detail::check_period(name, period_);
  }
  [[nodiscard]] double factor(std::int64_t step) const {
    return 1.0 - std::exp(-static_cast<double>(step + 1) / static_cast<double>(period_));
  }

 private:
  std::int64_t period_;
};

/// Linear warm-up with τ = ⌊2 / (1 - β₂)⌋ from Adam's β₂ (untuned: Ma & Yarats, 2021).
struct UntunedLinearWarmup {
  static constexpr std::string_view name = "untuned_linear_warmup";
  struct Options {
    double beta2 = 0.999;
  };
  explicit UntunedLinearWarmup(const Options& o)
      : inner_({.warmup_period = detail::untuned_period(name, o.beta2, 2.0)}) {}
  [[nodiscard]] double factor(std::int64_t step) const { return inner_.factor(step); }

 private:
  LinearWarmup inner_;
};

/// Exponential warm-up with τ = ⌊1 / (1 - β₂)⌋.
struct UntunedExponentialWarmup {
  static constexpr std::string_view name = "untuned_exponential_warmup";
  struct Options {
    double beta2 = 0.999;
  };
  explicit UntunedExponentialWarmup(const Options& o)
      : inner_({.warmup_period = detail::untuned_period(name, o.beta2, 1.0)}) {}
  [[nodiscard]] double factor(std::int64_t step) const { return inner_.factor(step); }

 private:
  ExponentialWarmup inner_;
};

/// RAdam's variance-rectification term as a warm-up factor (offset so that ρ > 4 at t = 0).
struct RAdamWarmup {
  static constexpr std::string_view name = "radam_warmup";
  struct Options {
    double beta2 = 0.999;
  };
  explicit RAdamWarmup(const Options& o) : beta2_(o.beta2), rho_inf_(2.0 / (1 - o.beta2) - 1) {
    detail::check_beta2(name, o.beta2, 0.6);
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

 private:
  W warmup_;
  S schedule_;
};

}  // namespace difftrain::schedule
