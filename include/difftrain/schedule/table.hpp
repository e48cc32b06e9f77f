#pragma once
// A schedule's LR curve as an xtensor array: plotting, CSV export, and cheap lookup in hot loops.

#include <cstddef>
#include <cstdint>
#include <xtensor/xtensor.hpp>

#include "difftrain/schedule/concepts.hpp"

namespace difftrain::schedule {

/// LRs of steps 0 .. n-1 for a group whose base LR is `base_lr`.
template <class S>
requires HasLrAt<S> xt::xtensor<double, 1> table(const S& schedule, std::int64_t n,
                                                 double base_lr = 1.0) {
  if (n < 0)
    throw ConfigError("table length " + std::to_string(n) + " is negative", "schedule::table");
  xt::xtensor<double, 1> out = xt::zeros<double>({static_cast<std::size_t>(n)});
  for (std::int64_t t = 0; t < n; ++t) out(static_cast<std::size_t>(t)) = schedule.lr(t, base_lr);
  return out;
}

}  // namespace difftrain::schedule
