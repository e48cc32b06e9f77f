#pragma once
// A baseline measured by a Python script in the same run: the script prints
// {"seconds_per_step": ...} and this returns that number (or -1 when it did not run).

#include <benchmark/benchmark.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace difftrain::bench {

/// `python script` for a script in benchmarks/: the interpreter and folder the build saw, or
/// DIFFTRAIN_PYTHON / DIFFTRAIN_BENCH_DIR from the environment (a binary run on another machine).
/// Defined in main.cpp, the one unit compiled with the build's paths, so that the other units'
/// objects are the same in every checkout and a compiler cache shares them.
std::string python_script(const std::string& script);

/// The number after "seconds_per_step": in what a baseline script printed, or -1 without one.
inline double seconds_in(const std::string& text) {
  const std::string key = "\"seconds_per_step\": ";
  const auto at = text.find(key);
  return at == std::string::npos ? -1.0 : std::stod(text.substr(at + key.size()));
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
  if (const double seconds = seconds_in(out); status == 0 && seconds >= 0) return seconds;
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

/// A baseline script kept running beside the benchmark (its `serve` mode): each line written to
/// it is a step count, and it answers with {"seconds_per_step": ...} for that block of steps.
/// The paired benchmarks alternate its blocks with their own (see paired.hpp).
class PythonServer {
 public:
  explicit PythonServer(const std::string& command) {
    int to[2], from[2];
    if (::pipe(to) != 0) return;
    if (::pipe(from) != 0) {
      ::close(to[0]);
      ::close(to[1]);
      return;
    }
    pid_ = ::fork();
    if (pid_ == 0) {  // the child: the script, its stdin and stdout on the pipes
      ::dup2(to[0], 0);
      ::dup2(from[1], 1);
      ::dup2(from[1], 2);
      ::close(to[0]);
      ::close(to[1]);
      ::close(from[0]);
      ::close(from[1]);
      ::execl("/bin/sh", "sh", "-c", command.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
    ::close(to[0]);
    ::close(from[1]);
    in_ = ::fdopen(to[1], "w");
    out_ = ::fdopen(from[0], "r");
    // The script answers once its model is built and warmed up.
    ready_ = line().find("\"ready\"") != std::string::npos;
  }
  PythonServer(const PythonServer&) = delete;
  PythonServer& operator=(const PythonServer&) = delete;
  ~PythonServer() {
    if (in_ != nullptr) std::fclose(in_);  // end of input: the script returns
    if (out_ != nullptr) std::fclose(out_);
    if (pid_ > 0) ::waitpid(pid_, nullptr, 0);
  }

  [[nodiscard]] bool ready() const { return ready_; }
  /// What the script wrote last (its error, when it stopped).
  [[nodiscard]] const std::string& why() const { return last_; }

  /// Seconds per step over a block of `steps`, or -1 when the script did not answer.
  double run(int steps) {
    if (!ready_) return -1.0;
    std::fprintf(in_, "%d\n", steps);
    std::fflush(in_);
    const double seconds = seconds_in(line());
    if (seconds < 0) ready_ = false;  // the script stopped: no further blocks
    return seconds;
  }

 private:
  // The next line that starts a JSON object; whatever else the script printed (warnings) is kept
  // as the reason to show if no answer comes.
  std::string line() {
    char buf[4096];
    while (out_ != nullptr && std::fgets(buf, sizeof buf, out_) != nullptr) {
      if (buf[0] == '{') return last_ = buf;
      last_ += buf;
      if (last_.size() > 600) last_.erase(0, last_.size() - 600);
    }
    return {};
  }

  pid_t pid_ = -1;
  std::FILE* in_ = nullptr;
  std::FILE* out_ = nullptr;
  bool ready_ = false;
  std::string last_;
};

}  // namespace difftrain::bench
