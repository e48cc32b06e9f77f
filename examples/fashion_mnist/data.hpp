#pragma once
// Fashion-MNIST from the IDX files of Debian's `dataset-fashion-mnist` package (gzip or plain):
// images as float tensors in [-1, 1], shaped (N, 1, 28, 28), labels as int64.

#include <ATen/CPUGeneratorImpl.h>
#include <difftrain/core/error.hpp>
#include <difftrain/io/idx.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <filesystem>
#include <string>

namespace fmnist {

namespace dt = difftrain;

inline constexpr const char* kDefaultDataDir = "/usr/share/datasets/fashion-mnist";
inline constexpr std::int64_t kClasses = 10;
inline constexpr std::array<const char*, kClasses> kClassNames = {
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal",      "Shirt",   "Sneaker",  "Bag",   "Ankle boot"};

struct Split {
  at::Tensor images;  ///< (N, 1, 28, 28) float32 in [-1, 1]
  at::Tensor labels;  ///< (N,) int64 in [0, 10)
  [[nodiscard]] std::int64_t size() const { return labels.size(0); }
};

struct Dataset {
  Split train, test;
};

/// `stem` or `stem.gz` in `dir`; a missing file says which package provides it.
inline std::filesystem::path find_idx(const std::filesystem::path& dir, const std::string& stem) {
  for (const auto& name : {stem + ".gz", stem})
    if (std::filesystem::exists(dir / name)) return dir / name;
  throw dt::ConfigError(
      "Fashion-MNIST file '" + stem +
          "(.gz)' not found; install Debian's dataset-fashion-mnist "
          "package (sudo apt-get install dataset-fashion-mnist) or pass --data-dir",
      dir.string());
}

inline Split load_split(const std::filesystem::path& dir, const std::string& prefix,
                        std::int64_t limit) {
  const auto image_path = find_idx(dir, prefix + "-images-idx3-ubyte");
  const auto label_path = find_idx(dir, prefix + "-labels-idx1-ubyte");
  at::Tensor images = dt::io::read_idx(image_path);
  at::Tensor labels = dt::io::read_idx(label_path);
  if (images.scalar_type() != at::kByte || images.dim() != 3 || images.size(1) != 28 ||
      images.size(2) != 28)
    throw dt::FormatError("holds " + std::string(c10::toString(images.scalar_type())) + " " +
                              c10::str(images.sizes()) + ", not uint8 (N, 28, 28) images",
                          image_path.string());
  if (labels.scalar_type() != at::kByte || labels.dim() != 1 || labels.size(0) != images.size(0))
    throw dt::FormatError("holds " + c10::str(labels.sizes()) + " labels for " +
                              std::to_string(images.size(0)) + " images",
                          label_path.string());
  if (labels.max().item<int>() >= kClasses)
    throw dt::FormatError("holds a label >= 10", label_path.string());
  if (limit > 0 && limit < images.size(0)) {
    images = images.slice(0, 0, limit);
    labels = labels.slice(0, 0, limit);
  }
  return {images.unsqueeze(1).to(at::kFloat).div_(127.5).sub_(1.0).contiguous(),
          labels.to(at::kLong)};
}

/// Both splits; `limit` > 0 keeps only the first `limit` examples of each (for quick runs).
inline Dataset load(const std::filesystem::path& dir, std::int64_t limit = 0) {
  if (!std::filesystem::is_directory(dir))
    throw dt::ConfigError(
        "no Fashion-MNIST directory; install Debian's dataset-fashion-mnist package (sudo "
        "apt-get install dataset-fashion-mnist) or pass --data-dir",
        dir.string());
  return {load_split(dir, "train", limit), load_split(dir, "t10k", limit)};
}

/// Batches that are a function of the step alone: epoch e visits the n examples in a permutation
/// drawn from a generator seeded with seed·1000003 + e, so a resumed run sees exactly the batches
/// an uninterrupted one would. A batch larger than n is the whole permutation.
class EpochBatches {
 public:
  EpochBatches(std::int64_t n, std::int64_t batch, std::uint64_t seed, at::Device device = at::kCPU)
      : n_(n),
        batch_(std::min(batch, n)),
        per_epoch_(std::max<std::int64_t>(1, n / batch)),
        seed_(seed),
        device_(device) {}
  [[nodiscard]] std::int64_t per_epoch() const { return per_epoch_; }
  /// The example indices of optimizer step `step` (on the device).
  at::Tensor indices(std::int64_t step) {
    const std::int64_t epoch = step / per_epoch_;
    if (epoch != perm_epoch_) {
      at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed_ * 1000003 + epoch);
      perm_ = at::randperm(n_, gen, at::TensorOptions().dtype(at::kLong)).to(device_);
      perm_epoch_ = epoch;
    }
    return perm_.narrow(0, (step % per_epoch_) * batch_, batch_);
  }

 private:
  std::int64_t n_, batch_, per_epoch_;
  std::uint64_t seed_;
  at::Device device_;
  at::Tensor perm_;
  std::int64_t perm_epoch_ = -1;
};

}  // namespace fmnist
