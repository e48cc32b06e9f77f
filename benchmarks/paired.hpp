#pragma once
// Paired measurement for comparisons on a machine whose load changes from second to second: short
// blocks of the baseline and of difftrain alternate (the order flips every round), each block's
// time per step is measured, and each round gives the ratio of its two blocks. The median of
// those ratios is the result, with its quartiles as the spread. Two benchmarks run one after the
// other see two different machines; the two blocks of a round see nearly the same one.

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

namespace difftrain::bench {

struct PairedResult {
  double ratio = -1;     // median over rounds of difftrain's time / the baseline's
  double ratio_q1 = -1;  // the quartiles of those ratios
  double ratio_q3 = -1;
  double baseline_s = -1;  // the median seconds per step of each side
  double difftrain_s = -1;
  int rounds = 0;
};

/// Seconds per step of `steps` calls of `step`, `sync` run once at the end (a GPU's queue).
template <class Step, class Sync>
double seconds_per_step(int steps, Step&& step, Sync&& sync) {
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) step();
  sync();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / steps;
}

/// `rounds` rounds of one block of each; a block function returns its seconds per step, or a
/// negative number when it could not run (the result's ratio is then -1).
template <class Baseline, class Difftrain>
PairedResult paired(int rounds, Baseline&& baseline_block, Difftrain&& difftrain_block) {
  std::vector<double> ratios, base, diff;
  for (int r = 0; r < rounds; ++r) {
    double b = 0, d = 0;
    if (r % 2 == 0) {
      b = baseline_block();
      d = difftrain_block();
    } else {
      d = difftrain_block();
      b = baseline_block();
    }
    if (b <= 0 || d <= 0) return {};
    ratios.push_back(d / b);
    base.push_back(b);
    diff.push_back(d);
  }
  auto quantile = [](std::vector<double> v, double q) {
    std::sort(v.begin(), v.end());
    const double at = q * static_cast<double>(v.size() - 1);
    const auto lo = static_cast<std::size_t>(at);
    const std::size_t hi = std::min(lo + 1, v.size() - 1);
    return v[lo] + (v[hi] - v[lo]) * (at - static_cast<double>(lo));
  };
  if (ratios.empty()) return {};
  return {quantile(ratios, 0.5), quantile(ratios, 0.25), quantile(ratios, 0.75),
          quantile(base, 0.5),   quantile(diff, 0.5),    rounds};
}

/// Puts a paired result on the benchmark: its iterations take difftrain's median time per step,
/// and the counters carry the ratio (the reporter prints it in the ratio table) and its spread.
inline void report_paired(benchmark::State& state, const PairedResult& r,
                          const std::string& why = {}) {
  if (r.ratio <= 0) {
    state.SkipWithError(("the paired measurement did not run: " + why).c_str());
    return;
  }
  for (auto _ : state) state.SetIterationTime(r.difftrain_s);
  state.counters["paired_ratio"] = r.ratio;
  state.counters["ratio_q1"] = r.ratio_q1;
  state.counters["ratio_q3"] = r.ratio_q3;
  state.counters["baseline_us"] = r.baseline_s * 1e6;
  state.counters["difftrain_us"] = r.difftrain_s * 1e6;
}

}  // namespace difftrain::bench
