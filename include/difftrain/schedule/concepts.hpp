#pragma once
// The learning-rate schedule family. A schedule is a pure function of the step: given the step
// index (0 = the first optimizer step) and a parameter group's base LR it returns that group's LR.
// It holds only its options (validated on construction), so it can be evaluated anywhere, in any
// order, and a resumed run needs nothing but the step to continue exactly.
//
//   struct MySchedule {
//     static constexpr std::string_view name = "my_schedule";
//     struct Options { ... };
//     explicit MySchedule(const Options&);               // throws ConfigError on bad options
//     double lr(std::int64_t step, double base_lr) const;
//   };
//
// Metric-driven schedules (ReduceLROnPlateau) have state and their own interface (plateau.hpp).

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "difftrain/core/concepts.hpp"
#include "difftrain/core/error.hpp"

namespace difftrain::schedule {

template <class S>
concept ConstructibleFromOptions =
    HasOptions<S> && std::constructible_from<S, const typename S::Options&>;

template <class S>
concept HasLrAt = requires(const S& s, std::int64_t step, double base_lr) {
  { s.lr(step, base_lr) } -> std::convertible_to<double>;
};

/// A schedule whose LR also depends on the parameter group (per-group warm-up periods, say):
/// `lr(step, base_lr, group)`. LrScheduler passes each group's index when a schedule has it.
template <class S>
concept HasGroupLrAt = requires(const S& s, std::int64_t step, double base_lr, std::size_t group) {
  { s.lr(step, base_lr, group) } -> std::convertible_to<double>;
};

/// A warm-up whose factor depends on the parameter group.
template <class W>
concept HasGroupFactor = requires(const W& w, std::int64_t step, std::size_t group) {
  { w.factor(step, group) } -> std::convertible_to<double>;
};

template <class S>
concept LrSchedule = NamedPolicy<S> && HasOptions<S> && ConstructibleFromOptions<S> && HasLrAt<S>;

template <class S>
consteval bool diagnose_lr_schedule() {
  static_assert(diagnose_named_policy<S>());
  static_assert(
      HasOptions<S>,
      "difftrain: an LR schedule needs a nested, default-constructible `struct Options {}`");
  static_assert(ConstructibleFromOptions<S>,
                "difftrain: an LR schedule needs a constructor from `const Options&`");
  static_assert(
      HasLrAt<S>,
      "difftrain: an LR schedule needs `double lr(std::int64_t step, double base_lr) const`");
  return LrSchedule<S>;
}

/// A warm-up factor ω(step) ∈ [0, 1] that multiplies a schedule's LR (pytorch-warmup's model).
template <class W>
concept WarmupFactor = NamedPolicy<W> && ConstructibleFromOptions<W> &&
    requires(const W& w, std::int64_t step) {
  { w.factor(step) } -> std::convertible_to<double>;
};

template <class W>
consteval bool diagnose_warmup() {
  static_assert(diagnose_named_policy<W>());
  static_assert(
      ConstructibleFromOptions<W>,
      "difftrain: a warm-up needs a nested `struct Options {}` and a constructor from it");
  static_assert(WarmupFactor<W>,
                "difftrain: a warm-up needs `double factor(std::int64_t step) const`");
  return WarmupFactor<W>;
}

namespace detail {

/// Throws ConfigError naming the schedule and the option when `ok` is false.
inline void require(bool ok, std::string_view schedule, std::string_view option,
                    const std::string& why) {
  if (!ok)
    throw ConfigError(why,
                      "lr schedule '" + std::string(schedule) + "' option " + std::string(option));
}

}  // namespace detail

}  // namespace difftrain::schedule
