#pragma once
// Prints, after the usual table, the ratio of each difftrain case to its baseline measured in the
// same run. Pairing is by name: a benchmark whose name contains "/difftrain" is compared with the
// one whose name has "/baseline" in that place (arguments after it must match). Timings are noisy
// on a shared machine: run with --benchmark_repetitions=5 and the medians are compared. A paired
// benchmark (paired.hpp) alternates its two sides itself and reports the ratio as a counter; those
// are printed in a table of their own, with the quartiles of the per-round ratios.

#include <benchmark/benchmark.h>

#include <cstdio>
#include <map>
#include <string>
#include <vector>

namespace difftrain::bench {

/// Whether a run errored or was skipped: Google Benchmark 1.7 has `error_occurred`, 1.8 replaced
/// it by `skipped`.
template <class Run>
bool skipped(const Run& run) {
  if constexpr (requires { run.error_occurred; })
    return run.error_occurred;
  else
    return run.skipped != decltype(run.skipped){};
}

class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& run : runs) {
      if (skipped(run)) continue;
      // A paired benchmark measured its ratio itself (paired.hpp).
      if (const auto it = run.counters.find("paired_ratio"); it != run.counters.end()) {
        paired_[run.run_name.str()] = {it->second.value, run.counters.at("ratio_q1").value,
                                       run.counters.at("ratio_q3").value};
        continue;
      }
      // With --benchmark_repetitions the median stands for the case; otherwise the single run.
      if (run.run_type == Run::RT_Iteration && run.repetitions <= 1) {
        times_[run.run_name.str()] = run.GetAdjustedRealTime();
      } else if (run.run_type == Run::RT_Aggregate && run.aggregate_name == "median") {
        times_[run.run_name.str()] = run.GetAdjustedRealTime();
      }
    }
  }

  void Finalize() override {
    ConsoleReporter::Finalize();
    std::printf("\n%-60s %12s\n", "ratio (difftrain / baseline, same run)", "ratio");
    for (const auto& [name, time] : times_) {
      const auto at = name.find("/difftrain");
      if (at == std::string::npos) continue;
      std::string baseline = name;
      baseline.replace(at, 10, "/baseline");
      const auto it = times_.find(baseline);
      if (it == times_.end() || it->second <= 0) continue;
      std::printf("%-60s %12.4g\n", name.c_str(), time / it->second);
    }
    if (paired_.empty()) return;
    std::printf("\n%-60s %12s  %s\n", "paired (median of alternating blocks, same run)", "ratio",
                "quartiles");
    for (const auto& [name, r] : paired_)
      std::printf("%-60s %12.4g  [%.4g, %.4g]\n", name.c_str(), r.ratio, r.q1, r.q3);
  }

 private:
  struct Paired {
    double ratio, q1, q3;
  };
  std::map<std::string, double> times_;
  std::map<std::string, Paired> paired_;
};

}  // namespace difftrain::bench
