#pragma once
// A baseline measured by a Python script in the same run: the script prints
// {"seconds_per_step": ...} and this returns that number (or -1 when it did not run).

#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace difftrain::bench {

/// `python script` for a script in benchmarks/: the interpreter and folder the build saw, or
/// DIFFTRAIN_PYTHON / DIFFTRAIN_BENCH_DIR from the environment (a binary run on another machine).
inline std::string python_script(const std::string& script) {
  const char* py = std::getenv("DIFFTRAIN_PYTHON");
  const char* dir = std::getenv("DIFFTRAIN_BENCH_DIR");
  return std::string(py != nullptr ? py : DIFFTRAIN_PYTHON) + " " +
         (dir != nullptr ? dir : DIFFTRAIN_BENCH_DIR) + "/" + script;
}

/// The seconds per step a baseline script printed, or -1 with the end of what it wrote (stdout
/// and stderr) in `why`.
inline double python_seconds_per_step(const std::string& command, std::string* why = nullptr) {
  std::FILE* p = ::popen((command + " 2>&1").c_str(), "r");
  if (p == nullptr) return -1.0;
  std::string out;
  char buf[4096];
  for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
  const int status = ::pclose(p);
  const auto at = out.find("\"seconds_per_step\": ");
  if (status == 0 && at != std::string::npos) return std::stod(out.substr(at + 20));
  if (why != nullptr) *why = out.size() > 600 ? out.substr(out.size() - 600) : out;
  return -1.0;
}

/// Reports a baseline's measured seconds as every iteration's time (UseManualTime), or marks the
/// benchmark as not run with the script's last words.
inline void report_baseline(benchmark::State& state, double seconds, const std::string& why) {
  if (seconds <= 0) {
    state.SkipWithError(("the Python baseline did not run: " + why).c_str());
    return;
  }
  for (auto _ : state) state.SetIterationTime(seconds);
}

}  // namespace difftrain::bench
