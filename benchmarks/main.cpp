#include <benchmark/benchmark.h>

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
  difftrain::bench::RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  return 0;
}
