#pragma once
// The LR lambdas of CogVideoX's SAT training (sgm/lr_scheduler.py, from latent diffusion). They
// return the LR itself and are meant for a base LR of 1.0; used with another base they scale by it,
// as a LambdaLR would.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <string>
#include <string_view>
#include <vector>

#include "difftrain/schedule/concepts.hpp"

namespace difftrain::schedule {

/// LambdaWarmUpCosineScheduler: linear lr_start → lr_max over the warm-up, then a half cosine to
/// lr_min at max_decay_steps, lr_min after.
struct WarmupCosine {
  static constexpr std::string_view name = "warmup_cosine";
  struct Options {
    std::int64_t warm_up_steps = 0;
    double lr_min = 0.0;
    double lr_max = 1.0;
    double lr_start = 0.0;
    std::int64_t max_decay_steps = 1000;
  };
  explicit WarmupCosine(const Options& o) : o_(o) {
    detail::require(o.warm_up_steps >= 0, name, "warm_up_steps", "must be >= 0");
    detail::require(o.max_decay_steps > o.warm_up_steps, name, "max_decay_steps",
                    "must be greater than warm_up_steps (" + std::to_string(o.warm_up_steps) + ")");
  }
  [[nodiscard]] double lr(std::int64_t n, double base_lr) const {
    if (n < o_.warm_up_steps)
      return base_lr * ((o_.lr_max - o_.lr_start) / static_cast<double>(o_.warm_up_steps) *
                            static_cast<double>(n) +
                        o_.lr_start);
    double t = static_cast<double>(n - o_.warm_up_steps) /
               static_cast<double>(o_.max_decay_steps - o_.warm_up_steps);
    t = std::min(t, 1.0);
    return base_lr *
           (o_.lr_min + 0.5 * (o_.lr_max - o_.lr_min) * (1 + std::cos(t * std::numbers::pi)));
  }

 private:
  Options o_;
};

namespace detail {

/// The per-cycle lists of LambdaWarmUpCosineScheduler2 / LambdaLinearScheduler.
struct CycleLists {
  std::vector<std::int64_t> warm_up_steps;
  std::vector<double> f_min, f_max, f_start;
  std::vector<std::int64_t> cycle_lengths;
};

inline std::vector<std::int64_t> check_cycles(std::string_view name, const CycleLists& c) {
  const std::size_t n = c.cycle_lengths.size();
  require(n > 0, name, "cycle_lengths", "needs at least one cycle");
  require(c.warm_up_steps.size() == n && c.f_min.size() == n && c.f_max.size() == n &&
              c.f_start.size() == n,
          name, "warm_up_steps",
          "warm_up_steps, f_min, f_max, f_start and cycle_lengths must have the same length");
  std::vector<std::int64_t> cum{0};
  for (std::size_t i = 0; i < n; ++i) {
    require(c.cycle_lengths[i] > 0, name, "cycle_lengths",
            "cycle " + std::to_string(i) + " has length " + std::to_string(c.cycle_lengths[i]));
    require(c.warm_up_steps[i] >= 0 && c.warm_up_steps[i] < c.cycle_lengths[i], name,
            "warm_up_steps",
            "cycle " + std::to_string(i) + ": warm-up must be >= 0 and shorter than the cycle");
    cum.push_back(cum.back() + c.cycle_lengths[i]);
  }
  return cum;
}

/// The cycle that step n is in: the first whose cumulative end is >= n. Past the last cycle the
/// reference finds none and fails; here the step belongs to the last cycle.
inline std::size_t find_in_interval(const std::vector<std::int64_t>& cum, std::int64_t n) {
  for (std::size_t i = 1; i < cum.size(); ++i)
    if (n <= cum[i]) return i - 1;
  return cum.size() - 2;
}

/// The linear warm-up of cycle c, n steps into it (n < its warm-up length).
inline double cycle_warmup(const CycleLists& o, std::size_t c, std::int64_t n) {
  return (o.f_max[c] - o.f_start[c]) / static_cast<double>(o.warm_up_steps[c]) *
             static_cast<double>(n) +
         o.f_start[c];
}

}  // namespace detail

/// LambdaWarmUpCosineScheduler2: repeated cycles, each with its own warm-up and cosine.
struct WarmupCosineCycles {
  static constexpr std::string_view name = "warmup_cosine_cycles";
  using Options = detail::CycleLists;
  explicit WarmupCosineCycles(const Options& o) : o_(o), cum_(detail::check_cycles(name, o)) {}
  [[nodiscard]] double lr(std::int64_t n, double base_lr) const {
    const std::size_t c = detail::find_in_interval(cum_, n);
    n -= cum_[c];
    if (n < o_.warm_up_steps[c]) return base_lr * detail::cycle_warmup(o_, c, n);
    double t = static_cast<double>(n - o_.warm_up_steps[c]) /
               static_cast<double>(o_.cycle_lengths[c] - o_.warm_up_steps[c]);
    t = std::min(t, 1.0);
    return base_lr *
           (o_.f_min[c] + 0.5 * (o_.f_max[c] - o_.f_min[c]) * (1 + std::cos(t * std::numbers::pi)));
  }

 private:
  Options o_;
  std::vector<std::int64_t> cum_;
};

/// LambdaLinearScheduler: repeated cycles of warm-up then linear decay towards f_min.
struct WarmupLinearCycles {
  static constexpr std::string_view name = "warmup_linear_cycles";
  using Options = detail::CycleLists;
  explicit WarmupLinearCycles(const Options& o) : o_(o), cum_(detail::check_cycles(name, o)) {}
  [[nodiscard]] double lr(std::int64_t n, double base_lr) const {
    const std::size_t c = detail::find_in_interval(cum_, n);
    n -= cum_[c];
    if (n < o_.warm_up_steps[c]) return base_lr * detail::cycle_warmup(o_, c, n);
    return base_lr * (o_.f_min[c] + (o_.f_max[c] - o_.f_min[c]) *
                                        static_cast<double>(o_.cycle_lengths[c] - n) /
                                        static_cast<double>(o_.cycle_lengths[c]));
  }

 private:
  Options o_;
  std::vector<std::int64_t> cum_;
};

}  // namespace difftrain::schedule
