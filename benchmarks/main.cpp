#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "python_baseline.hpp"
#include "ratio_reporter.hpp"

std::string difftrain::bench::python_script(const std::string& script) {
  const char* py = std::getenv("DIFFTRAIN_PYTHON");
  const char* dir = std::getenv("DIFFTRAIN_BENCH_DIR");
  return std::string(py != nullptr ? py : DIFFTRAIN_PYTHON) + " " +
         (dir != nullptr ? dir : DIFFTRAIN_BENCH_DIR) + "/" + script;
}

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
#ifdef DIFFTRAIN_BENCH_UNOPTIMISED
  // The ci preset (-Og) builds the benchmarks to check that they compile: their difftrain sides are
  // then slower than in a user's build, and their ratios say little.
  std::fputs("warning: built without -O2/-O3; take figures from the release preset's build\n",
             stderr);
#endif
  difftrain::bench::RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  return 0;
}
