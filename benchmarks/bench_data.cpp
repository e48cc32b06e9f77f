// Data loading:
//   image_loader_vs_torch_dataloader: one pass over 48 JPEGs of 512 to 900 pixels a side, each
//     decoded, resized to 512 on the shorter side (bilinear, antialiased), center-cropped to 512
//     and converted to [-1, 1] in batches of 4, by difftrain's ParallelLoader with 2 worker
//     threads against torch's DataLoader with 2 worker processes doing the same with PIL and
//     torchvision, as diffusers' train_text_to_image.py does; difftrain's time per pass / the
//     baseline's (goal <= 0.5, i.e. at least twice the images per second).
//   cached_latents_vs_vae_encode: a batch of 4 latents for training at 256 px, read from the
//     latent cache (mapped shards, one posterior draw each) against encoding the batch's pixels
//     with a VAE of Stable Diffusion's shape at a quarter of its width (four levels, 8x down),
//     which is what a run without --cache_latents does every step; the ratio is the share of the
//     encoding a cached run still pays.
#include <benchmark/benchmark.h>

#include <ATen/Parallel.h>
#include <difftrain/data/image.hpp>
#include <difftrain/data/image_folder.hpp>
#include <difftrain/data/latent_cache.hpp>
#include <difftrain/data/loader.hpp>
#include <difftrain/data/transforms.hpp>
#include <difftrain/io/png.hpp>
#include <difftrain/io/remove_tree.hpp>
#include <difftrain/models/autoencoder_kl.hpp>

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

/// 16 images, a VAE of SD's shape at a quarter of its width, and the latent cache of the images.
struct LatentScene {
  std::filesystem::path dir = std::filesystem::temp_directory_path() / "difftrain-bench-latents";
  difftrain::data::ImageFolder folder;
  difftrain::data::BucketManager buckets{[] {
    difftrain::data::BucketOptions o;
    o.max_width = o.max_height = o.min_size = o.max_size = 256;
    o.steps = 8;
    return o;
  }()};
  difftrain::models::AutoencoderKL<> vae{nullptr};
  std::optional<difftrain::data::LatentCache> cache;
  LatentScene() {
    namespace data = difftrain::data;
    difftrain::io::remove_tree(dir);
    std::filesystem::create_directories(dir / "images");
    auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
    for (int i = 0; i < 16; ++i) {
      difftrain::io::RgbImage img;
      img.width = img.height = 256;
      const at::Tensor px = at::randint(256, {256 * 256 * 3}, gen, at::kByte);
      img.pixels.assign(px.data_ptr<std::uint8_t>(), px.data_ptr<std::uint8_t>() + px.numel());
      difftrain::io::write_png(dir / "images" / ("img" + std::to_string(i) + ".png"), img);
    }
    folder = data::scan_image_folder(dir / "images");
    difftrain::models::AutoencoderKLConfig c;
    c.block_out_channels = {32, 64, 128, 128};
    c.down_block_types = std::vector<std::string>(4, "DownEncoderBlock2D");
    c.up_block_types = std::vector<std::string>(4, "UpDecoderBlock2D");
    c.layers_per_block = 2;
    vae = difftrain::models::AutoencoderKL<>(c);
    vae->eval();
    cache.emplace(dir / "cache", "bench-vae-0123456789abcdef", folder, buckets);
    (void)cache->build([&](const at::Tensor& px) {
      at::NoGradGuard no_grad;
      const auto posterior = vae->encode(px);
      return std::make_pair(posterior.mean, posterior.std);
    });
  }
  ~LatentScene() { difftrain::io::remove_tree(dir); }
};

LatentScene& latent_scene() {
  static LatentScene scene;
  return scene;
}

void vae_encode(benchmark::State& state) {
  LatentScene& s = latent_scene();
  difftrain::data::ImageBatchOptions o;
  o.batch_size = 4;
  o.workers = 0;
  difftrain::data::ImageBatches batches(s.folder, s.buckets, o, 0);
  const at::Tensor pixels = batches.next()->pixels;
  at::NoGradGuard no_grad;
  for (auto _ : state) benchmark::DoNotOptimize(s.vae->encode_latents(pixels));
}

void cached_latents(benchmark::State& state) {
  LatentScene& s = latent_scene();
  std::uint64_t epoch = 0;
  for (auto _ : state) {
    difftrain::data::CachedLatentBatches batches(*s.cache, s.folder, 4, 0.0, 0, epoch++);
    benchmark::DoNotOptimize(batches.next()->latents);
  }
}

}  // namespace

BENCHMARK(vae_encode)->Name("cached_latents_vs_vae_encode/baseline")->Unit(benchmark::kMillisecond);
BENCHMARK(cached_latents)
    ->Name("cached_latents_vs_vae_encode/difftrain")
    ->Unit(benchmark::kMillisecond);
BENCHMARK(torch_dataloader)->Name("image_loader_vs_torch_dataloader/baseline")->UseManualTime();
BENCHMARK(difftrain_loader)->Name("image_loader_vs_torch_dataloader/difftrain")->UseManualTime();
