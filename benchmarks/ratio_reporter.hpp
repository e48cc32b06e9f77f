#pragma once
// Prints, after the usual table, the ratio of each difftrain case to its baseline measured in the
// same run. Pairing is by name: a benchmark whose name contains "/difftrain" is compared with the
// one whose name has "/baseline" in that place (arguments after it must match).

#include <benchmark/benchmark.h>

#include <cstdio>
#include <map>
#include <string>
#include <vector>

namespace difftrain::bench {

class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& run : runs) {
      if (run.run_type != Run::RT_Iteration || run.error_occurred) continue;
      times_[run.benchmark_name()] = run.GetAdjustedRealTime();
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
      std::printf("%-60s %12.3f\n", name.c_str(), time / it->second);
    }
  }

 private:
  std::map<std::string, double> times_;
};

}  // namespace difftrain::bench
