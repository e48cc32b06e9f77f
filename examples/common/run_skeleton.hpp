#pragma once
// What every training program of the examples shares, so that each program holds only what is its
// own: the flags of a run (data, output folder, seed, device, image limit, TensorBoard, threads)
// and of the judging classifier, where the TensorBoard files go, the intra-op threads on a shared
// machine, and timing. A program's Settings derive from RunFlags (and JudgeFlags when it scores
// with the classifier) and add its own fields; its main adds the shared groups with
// add_run_flags / add_judge_flags before its own.

#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <difftrain/core/error.hpp>
#include <difftrain/io/atomic_file.hpp>
#include <difftrain/io/remove_tree.hpp>
#include <difftrain/train/threads.hpp>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "cli_checks.hpp"

namespace examples {

/// The output folder, made (and proven writable) when the run starts; when the run ends without
/// having written a file into it (a mistake found after start-up: a pipeline folder without
/// tokenizer/, an unknown scheduler name), the folders this run made are removed again, so a
/// refused run leaves no empty output folder behind. A folder that existed before is left as it
/// was; once anything is written, everything stays. Under torchrun only rank 0 (`owner`) removes:
/// the others may end first while it still writes.
class OutputFolder {
 public:
  explicit OutputFolder(const std::filesystem::path& dir, bool owner = true) {
    namespace fs = std::filesystem;
    std::error_code ec;
    fs::path p = fs::absolute(dir, ec).lexically_normal();
    if (!p.empty() && !p.has_filename()) p = p.parent_path();  // "out/" names "out"
    // The outermost folder of `dir` that does not exist yet: what this run makes.
    while (!p.empty() && !fs::exists(p, ec) && p.has_parent_path() && p != p.parent_path()) {
      made_ = p;
      p = p.parent_path();
    }
    difftrain::io::ensure_writable_folder(dir);
    if (!owner) made_.clear();
  }
  OutputFolder(const OutputFolder&) = delete;
  OutputFolder& operator=(const OutputFolder&) = delete;
  ~OutputFolder() {
    namespace fs = std::filesystem;
    if (made_.empty()) return;
    std::error_code ec;
    for (auto it = fs::recursive_directory_iterator(made_, ec);
         !ec && it != fs::recursive_directory_iterator(); it.increment(ec))
      if (!it->is_directory(ec)) return;  // something was written: the run's, kept
    if (!ec) {
      try {
        (void)difftrain::io::remove_tree(made_);
      } catch (...) {  // a destructor must not throw; an empty folder left is no harm
      }
    }
  }

 private:
  std::filesystem::path made_;
};

/// Set by Ctrl-C (on_sigint, installed by the program while it trains).
inline std::atomic<bool> g_interrupted{false};

extern "C" inline void on_sigint(int /*sig*/) {
  g_interrupted.store(true);
  std::signal(SIGINT, SIG_DFL);  // a second Ctrl-C ends the program at once
}

/// A trainer callback: asks the trainer to stop after the step in which Ctrl-C arrived, or at
/// `stop_at` (0: never); the program then saves a checkpoint.
struct StopOnInterrupt {
  std::int64_t stop_at = 0;
  template <class Trainer, class StepInfo>
  void on_step_end(Trainer& t, const StepInfo& s) {
    if (g_interrupted.load() || (stop_at > 0 && s.step >= stop_at)) t.request_stop();
  }
};

/// Seconds since `t`.
inline double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

/// The flags of any run: where the data and the outputs are, the seed, the device, how much data,
/// TensorBoard, and the intra-op threads.
struct RunFlags {
  std::string data_dir;
  std::string out;
  std::string device = "cpu";
  std::uint64_t seed = 0;
  std::int64_t limit = 0;
  std::string tensorboard;  // the event files' folder (default OUT/tensorboard)
  bool no_tensorboard = false;
  std::int64_t threads = 0;  // intra-op threads; 0: the cores other processes leave free

  /// The TensorBoard folder, or empty when TensorBoard is off.
  [[nodiscard]] std::filesystem::path tensorboard_folder() const {
    if (no_tensorboard) return {};
    return tensorboard.empty() ? std::filesystem::path(out) / "tensorboard"
                               : std::filesystem::path(tensorboard);
  }
};

/// Adds RunFlags' options to `g` (the program's "data and run" group). `data_help` and
/// `tensorboard_help` say what the data and the event files are for this program.
inline void add_run_flags(CLI::Option_group* g, RunFlags& f, const std::string& data_help,
                          const std::string& tensorboard_help) {
  g->add_option("--data-dir", f.data_dir, data_help)->capture_default_str();
  g->add_option("--out,--output_dir", f.out, "output directory")->capture_default_str();
  g->add_option("--device", f.device, "cpu, cuda or cuda:N")->capture_default_str();
  g->add_option("--seed", f.seed, "seeds weights, batches, noise and samples")
      ->capture_default_str();
  g->add_option("--limit", f.limit, "use only the first N images of each split (0: all)")
      ->check(count_in(0, 100'000'000));
  g->add_option("--tensorboard", f.tensorboard, tensorboard_help);
  g->add_flag("--no-tensorboard", f.no_tensorboard, "write no TensorBoard event files");
  g->add_option("--threads", f.threads,
                "intra-op CPU threads (0: OMP_NUM_THREADS if set, else the cores other "
                "processes leave free at start; docs/train.md, \"A shared machine\")")
      ->check(count_in(0, 4096))
      ->capture_default_str();
}

/// The flags of the classifier that judges samples.
struct JudgeFlags {
  std::string classifier;  // its cache file (default OUT/classifier.safetensors)
  std::int64_t classifier_epochs = 4;
  double min_classifier_accuracy = 0.9;

  [[nodiscard]] std::filesystem::path classifier_file(const std::string& out) const {
    return classifier.empty() ? std::filesystem::path(out) / "classifier.safetensors"
                              : std::filesystem::path(classifier);
  }
};

inline void add_judge_flags(CLI::Option_group* g, JudgeFlags& f) {
  g->add_option("--classifier", f.classifier,
                "classifier cache file (default OUT/classifier.safetensors; another program's "
                "file can be shared)");
  g->add_option("--classifier-epochs", f.classifier_epochs, "classifier training epochs")
      ->check(count_in(1, 10'000))
      ->capture_default_str();
  g->add_option("--min-classifier-accuracy", f.min_classifier_accuracy,
                "refuse to score with a weaker classifier")
      ->check(number_in(0, 1))
      ->capture_default_str();
}

/// Sets LibTorch's intra-op threads: `f.threads`; with 0, OMP_NUM_THREADS when it is set (torchrun
/// sets it), else the cores that other processes leave free at start (measured for a quarter of a
/// second; on a quiet machine every core). Says what it chose on stderr.
inline int apply_threads(const RunFlags& f) {
  int threads = static_cast<int>(f.threads);
  std::string why = "--threads";
  const char* env = std::getenv("OMP_NUM_THREADS");
  if (threads == 0 && env != nullptr && *env != '\0') {
    threads = at::get_num_threads();  // LibTorch read it at start; a launcher's choice stands
    why = std::string("OMP_NUM_THREADS=") + env;
  } else if (threads == 0) {
    const difftrain::train::CpuLoad load = difftrain::train::cpu_load();
    threads = difftrain::train::threads_for(load);
    char buf[96];
    std::snprintf(buf, sizeof buf, "%d cores, %.1f kept busy by other processes", load.cores,
                  load.busy_elsewhere);
    why = buf;
  }
  at::set_num_threads(threads);
  std::fprintf(stderr, "threads: %d (%s)\n", threads, why.c_str());
  return threads;
}

}  // namespace examples
