// Video decoding (data/video_file.hpp) against the reader a Python user has:
//  - video_reader_vs_pyav: 8 H.264 clips of 49 frames at 320×240 (written by
//    python_video_reader.py with PyAV), every frame decoded to (T, H, W, 3) uint8 RGB, the clips
//    one after another; the baseline is PyAV (torchvision.io's backend) decoding the same files to
//    RGB arrays in the same way, the best of three passes on each side; goal ratio ≤ 0.5 (twice
//    the clips a second).

#include <benchmark/benchmark.h>

#include <difftrain/data/video_file.hpp>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "python_baseline.hpp"

namespace {

const std::filesystem::path& clip_folder() {
  static const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / "difftrain-bench-videos";
  return dir;
}

double pyav_seconds(std::string& why) {
  static std::string reason;
  static const double seconds = difftrain::bench::python_seconds_per_step(
      difftrain::bench::python_script("python_video_reader.py") + " " + clip_folder().string(),
      &reason);
  why = reason;
  return seconds;
}

void pyav_reader(benchmark::State& state) {
  std::string why;
  difftrain::bench::report_baseline(state, pyav_seconds(why), why);
}

void difftrain_reader(benchmark::State& state) {
  std::string why;
  if (pyav_seconds(why) <= 0) {
    state.SkipWithError(("no clips: the Python baseline did not run: " + why).c_str());
    return;
  }
  std::vector<std::filesystem::path> files;
  for (const auto& e : std::filesystem::directory_iterator(clip_folder()))
    if (e.path().extension() == ".mp4") files.push_back(e.path());
  std::sort(files.begin(), files.end());
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

BENCHMARK(pyav_reader)->Name("video_reader_vs_pyav/baseline")->UseManualTime()->Iterations(1);
BENCHMARK(difftrain_reader)->Name("video_reader_vs_pyav/difftrain")->UseManualTime()->Iterations(1);
