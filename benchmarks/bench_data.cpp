// Data loading:
//   image_loader_vs_torch_dataloader: one pass over 48 JPEGs of 512 to 900 pixels a side, each
//     decoded, resized to 512 on the shorter side (bilinear, antialiased), center-cropped to 512
//     and converted to [-1, 1] in batches of 4, by difftrain's ParallelLoader with 2 worker
//     threads against torch's DataLoader with 2 worker processes doing the same with PIL and
//     torchvision, as diffusers' train_text_to_image.py does; difftrain's time per pass / the
//     baseline's (goal <= 0.5, i.e. at least twice the images per second).
#include <benchmark/benchmark.h>

#include <ATen/Parallel.h>
#include <difftrain/data/image.hpp>
#include <difftrain/data/loader.hpp>
#include <difftrain/data/transforms.hpp>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include "python_baseline.hpp"

namespace {

const std::filesystem::path& folder() {
  static const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / "difftrain-bench-images";
  return dir;
}

double baseline_seconds(std::string& why) {
  static std::string reason;
  static const double seconds = difftrain::bench::python_seconds_per_step(
      difftrain::bench::python_script("python_image_loader.py") + " " + folder().string(), &reason);
  why = reason;
  return seconds;
}

void torch_dataloader(benchmark::State& state) {
  std::string why;
  difftrain::bench::report_baseline(state, baseline_seconds(why), why);
}

void difftrain_loader(benchmark::State& state) {
  namespace data = difftrain::data;
  std::string why;
  if (baseline_seconds(why) <= 0) {
    state.SkipWithError(("no images: the Python baseline did not run: " + why).c_str());
    return;
  }
  std::vector<std::filesystem::path> files;
  for (const auto& e : std::filesystem::directory_iterator(folder()))
    if (e.path().extension() == ".jpg") files.push_back(e.path());
  std::sort(files.begin(), files.end());
  const int threads = at::get_num_threads();
  at::set_num_threads(1);  // one core per worker, as each Python worker process has
  auto pass = [&] {
    const std::size_t batches = files.size() / 4;
    data::ParallelLoader<at::Tensor> loader(
        batches,
        [&](std::size_t b) {
          std::vector<at::Tensor> xs;
          for (std::size_t k = 0; k < 4; ++k) {
            const auto img = data::read_image(files[4 * b + k]);
            // (3, H, W) over the decoded rows (channels last): the uint8 resize kernel reads
            // that layout directly.
            const at::Tensor x = data::center_crop(
                data::resize(img.pixels.permute({2, 0, 1}), std::vector<std::int64_t>{512}), 512,
                512);
            xs.push_back(data::to_unit_range(x));
          }
          return at::stack(xs);
        },
        2, 4);
    while (auto batch = loader.next()) benchmark::DoNotOptimize(*batch);
  };
  pass();
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    pass();
    state.SetIterationTime(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  at::set_num_threads(threads);
}

}  // namespace

BENCHMARK(torch_dataloader)->Name("image_loader_vs_torch_dataloader/baseline")->UseManualTime();
BENCHMARK(difftrain_loader)->Name("image_loader_vs_torch_dataloader/difftrain")->UseManualTime();
