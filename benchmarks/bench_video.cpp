// Video decoding (data/video_file.hpp) against the reader a Python user has, PyAV (what
// torchvision.io.read_video wraps), on 16 H.264 clips of 49 frames at 320×240 written by
// python_video_reader.py, every frame decoded to (T, H, W, 3) uint8 RGB:
//  - video_loader_vs_torch_dataloader: one pass over the 16 clips as a training loop is fed, by
//    difftrain's ParallelLoader with 2 worker threads against torch's DataLoader with 2 worker
//    processes reading with PyAV; difftrain's time per pass / the baseline's, goal ≤ 0.5 (twice
//    the clips a second), as the image loader's benchmark compares.
//  - video_reader_vs_pyav: clips 0-7 one after another on one thread against PyAV in one process,
//    the best of three passes on each side: the reader alone (no goal; the loader carries it).

#include <benchmark/benchmark.h>

#include <ATen/Parallel.h>
#include <difftrain/data/loader.hpp>
#include <difftrain/data/video_file.hpp>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "python_baseline.hpp"

namespace {

const std::filesystem::path& clip_folder() {
  static const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / "difftrain-bench-videos";
  return dir;
}

/// The Python side in `mode` (reader, loader); it writes the clips first when they are missing.
double pyav_seconds(const std::string& mode, std::string& why) {
  static std::map<std::string, std::pair<double, std::string>> measured;
  auto it = measured.find(mode);
  if (it == measured.end()) {
    std::string reason;
    const double s = difftrain::bench::python_seconds_per_step(
        difftrain::bench::python_script("python_video_reader.py") + " " + clip_folder().string() +
            " " + mode,
        &reason);
    it = measured.emplace(mode, std::make_pair(s, reason)).first;
  }
  why = it->second.second;
  return it->second.first;
}

/// The clips, once the Python side in `mode` has run (it writes them); none, with the case
/// skipped and the reason given, when it did not.
std::vector<std::filesystem::path> clips(benchmark::State& state, const std::string& mode) {
  std::string why;
  if (pyav_seconds(mode, why) <= 0) {
    state.SkipWithError(("no clips: the Python baseline did not run: " + why).c_str());
    return {};
  }
  std::vector<std::filesystem::path> files;
  for (const auto& e : std::filesystem::directory_iterator(clip_folder()))
    if (e.path().extension() == ".mp4") files.push_back(e.path());
  std::sort(files.begin(), files.end());
  return files;
}

void pyav_loader(benchmark::State& state) {
  std::string why;
  difftrain::bench::report_baseline(state, pyav_seconds("loader", why), why);
}

void difftrain_loader(benchmark::State& state) {
  const std::vector<std::filesystem::path> files = clips(state, "loader");
  if (files.empty()) return;
  const int threads = at::get_num_threads();
  at::set_num_threads(1);  // one core per worker, as each Python worker process has
  auto pass = [&] {
    difftrain::data::ParallelLoader<at::Tensor> loader(
        files.size(), [&](std::size_t i) { return difftrain::data::read_video(files[i]).pixels; },
        2, 4);
    while (auto clip = loader.next()) benchmark::DoNotOptimize(*clip);
  };
  pass();  // files in the page cache, as the baseline's warm pass
  double seconds = 0;
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    pass();
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    state.SetIterationTime(s);
    seconds += s;
  }
  state.counters["clips_per_s"] =
      static_cast<double>(files.size() * state.iterations()) / std::max(seconds, 1e-9);
  at::set_num_threads(threads);
}

void pyav_reader(benchmark::State& state) {
  std::string why;
  difftrain::bench::report_baseline(state, pyav_seconds("reader", why), why);
}

void difftrain_reader(benchmark::State& state) {
  std::vector<std::filesystem::path> files = clips(state, "reader");
  if (files.empty()) return;
  files.resize(std::min<std::size_t>(files.size(), 8));
  double best = std::numeric_limits<double>::infinity();
  std::int64_t frames = 0;
  for (int pass = 0; pass < 3; ++pass) {
    const auto start = std::chrono::steady_clock::now();
    frames = 0;
    for (const auto& f : files) frames += difftrain::data::read_video(f).pixels.size(0);
    best = std::min(
        best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  for (auto _ : state) state.SetIterationTime(best);
  state.counters["frames"] = static_cast<double>(frames);
  state.counters["clips_per_s"] = static_cast<double>(files.size()) / best;
}

}  // namespace

BENCHMARK(pyav_loader)->Name("video_loader_vs_torch_dataloader/baseline")->UseManualTime();
BENCHMARK(difftrain_loader)->Name("video_loader_vs_torch_dataloader/difftrain")->UseManualTime();
BENCHMARK(pyav_reader)->Name("video_reader_vs_pyav/baseline")->UseManualTime()->Iterations(1);
BENCHMARK(difftrain_reader)->Name("video_reader_vs_pyav/difftrain")->UseManualTime()->Iterations(1);
