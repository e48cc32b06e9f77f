#pragma once
// VAE latents of an image folder, computed once and kept on disk (diffusers' and kohya's
// --cache_latents, made durable): each image × its bucket × (optionally) its mirror image is
// encoded once, and later epochs and later runs read the posterior from a TensorCache instead of
// decoding, resizing and encoding the image again.
//
//   key        SHA-256 of the image file's bytes, the bucket, the resized size, the center crop
//              and the flip. A changed image, a changed bucket table or a flip gets its own entry;
//              the rest stay valid.
//   producer   the VAE's weights (tensors_fingerprint) and the storage choice: another VAE opens
//              another folder, so reading never needs the VAE in memory, only its fingerprint.
//   storage    `distribution`: the posterior's mean and std, a new latent drawn each time one is
//              read (what training on pixels does); `sample`: one latent drawn when cached (half
//              the disk, as kohya's cache).
//   entry      "mean" and "std" (or "sample"), unscaled: (C, h, w) float32 as the VAE gave them;
//              "original_size" (height, width) and "crop_top_left" (top, left), SDXL's time ids.
//
// Cropping at random cannot be cached (every epoch would need another crop): the crop is the
// center, as kohya requires with cached latents. Mirror images are cached beside the originals
// when asked, and a reader draws each sample's flip from the same per-sample generator as
// ImageBatches, so the batches' images, order and flips equal the pixel loader's.

#include <ATen/ATen.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/data/buckets.hpp"
#include "difftrain/data/image_folder.hpp"
#include "difftrain/data/loader.hpp"
#include "difftrain/data/tensor_cache.hpp"
#include "difftrain/io/sha256.hpp"

namespace difftrain::data {

enum class LatentStorage { distribution, sample };

inline std::string_view to_string(LatentStorage s) {
  return s == LatentStorage::distribution ? "distribution" : "sample";
}

struct LatentCacheOptions {
  LatentStorage storage = LatentStorage::distribution;
  bool flipped = false;        ///< also cache each image's mirror image (for --random_flip)
  std::size_t batch_size = 8;  ///< images per call of the encoder (one bucket per call)
  std::size_t workers = 2;     ///< threads that hash and decode the images
  std::uint64_t seed = 0;      ///< the draws of `sample` storage
  ImageLimits limits;
  TensorCacheOptions shards;
  /// Called after each encoded batch with (entries done, entries to do) of this build.
  std::function<void(std::size_t, std::size_t)> progress;
};

/// The cache key of one image's latent: its bytes' hash and everything the transform did.
inline std::string latent_key(const std::string& content_hash, const BucketChoice& c,
                              bool flipped) {
  return io::sha256_hex("latent v1|" + content_hash + "|bucket " + std::to_string(c.bucket.first) +
                        "x" + std::to_string(c.bucket.second) + "|resized " +
                        std::to_string(c.resized_width) + "x" + std::to_string(c.resized_height) +
                        "|center crop|" + (flipped ? "flipped" : "as is"));
}

struct LatentCacheReport {
  std::size_t entries = 0;  ///< entries the folder needs
  std::size_t reused = 0;   ///< found in the cache
  std::size_t encoded = 0;  ///< computed by this build
  double seconds = 0;
};

/// One cached sample as training reads it.
struct CachedLatent {
  at::Tensor latent;  ///< (C, h, w), unscaled
  std::array<std::int64_t, 2> original_size{}, crop_top_left{};
};

class LatentCache {
 public:
  /// Hashes the folder's images and opens the cache of the VAE `vae_fingerprint` under `root`.
  LatentCache(const std::filesystem::path& root, const std::string& vae_fingerprint,
              const ImageFolder& folder, const BucketManager& buckets, LatentCacheOptions o = {})
      : folder_(folder),
        o_(std::move(o)),
        cache_(root, io::sha256_hex(vae_fingerprint + "|" + std::string(to_string(o_.storage))),
               "VAE latents (" + std::string(to_string(o_.storage)) + ") of VAE " + vae_fingerprint,
               o_.shards) {
    if (o_.batch_size == 0) throw ConfigError("batch_size must be at least 1", "latent cache");
    for (const auto& r : folder.images) choices_.push_back(buckets.select(r.width, r.height));
    ParallelLoader<std::string> hashes(
        folder.images.size(), [&](std::size_t i) { return io::sha256_file(folder.images[i].path); },
        o_.workers, 4 * std::max<std::size_t>(o_.workers, 1));
    while (auto h = hashes.next()) hashes_.push_back(std::move(*h));
  }

  [[nodiscard]] const TensorCache& store() const { return cache_; }
  [[nodiscard]] const std::vector<BucketChoice>& choices() const { return choices_; }
  [[nodiscard]] const std::vector<std::string>& content_hashes() const { return hashes_; }
  [[nodiscard]] const LatentCacheOptions& options() const { return o_; }

  [[nodiscard]] std::string key(std::size_t image, bool flipped) const {
    return latent_key(hashes_.at(image), choices_.at(image), flipped);
  }

  /// The (image, flipped) entries the cache lacks.
  [[nodiscard]] std::vector<std::pair<std::size_t, bool>> missing() const {
    std::vector<std::pair<std::size_t, bool>> out;
    for (std::size_t i = 0; i < hashes_.size(); ++i)
      for (const bool f : {false, true}) {
        if (f && !o_.flipped) continue;
        if (!cache_.contains(key(i, f))) out.emplace_back(i, f);
      }
    return out;
  }

  /// Encodes what is missing with `encode(pixels) -> (mean, std)`: pixels (B, 3, H, W) float32 in
  /// [-1, 1] of one bucket, mean and std (B, C, h, w). Each batch's entries are written as their
  /// shard fills; an interrupted build resumes where its last shard ended.
  LatentCacheReport build(
      const std::function<std::pair<at::Tensor, at::Tensor>(const at::Tensor&)>& encode) {
    const auto t0 = std::chrono::steady_clock::now();
    LatentCacheReport report;
    const auto todo = missing();
    report.entries = hashes_.size() * (o_.flipped ? 2 : 1);
    report.reused = report.entries - todo.size();
    // Work batches: one bucket each, in the folder's order.
    std::map<Bucket, std::vector<std::pair<std::size_t, bool>>> by_bucket;
    for (const auto& item : todo) by_bucket[choices_[item.first].bucket].push_back(item);
    std::vector<std::vector<std::pair<std::size_t, bool>>> work;
    for (auto& [bucket, items] : by_bucket)
      for (std::size_t i = 0; i < items.size(); i += o_.batch_size)
        work.emplace_back(
            items.begin() + static_cast<std::ptrdiff_t>(i),
            items.begin() + static_cast<std::ptrdiff_t>(std::min(items.size(), i + o_.batch_size)));
    struct Prepared {
      at::Tensor pixels;
      std::vector<CropCorner> corners;
    };
    ParallelLoader<Prepared> prepared(
        work.size(),
        [&](std::size_t w) {
          Prepared p;
          std::vector<at::Tensor> pixels;
          for (const auto& [i, flipped] : work[w]) {
            const DecodedImage img = read_image(folder_.images[i].path, o_.limits);
            at::Generator unused = sample_generator(0, 0, 0, 0);  // the center crop draws nothing
            CropCorner corner;
            at::Tensor x = crop_to_bucket(img.pixels, choices_[i], false, unused, corner);
            if (flipped) x = mirror(x, choices_[i], corner);
            pixels.push_back(to_unit_range(x.contiguous()));
            p.corners.push_back(corner);
          }
          p.pixels = at::stack(pixels);
          return p;
        },
        o_.workers, 2);
    for (std::size_t w = 0; w < work.size(); ++w) {
      const Prepared p = *prepared.next();
      const auto [mean, std] = encode(p.pixels);
      const auto n = static_cast<std::int64_t>(work[w].size());
      if (!mean.defined() || !std.defined() || mean.dim() != 4 || mean.size(0) != n ||
          !mean.sizes().equals(std.sizes()))
        throw ShapeError("the encoder returned mean " +
                             (mean.defined() ? c10::str(mean.sizes()) : std::string("undefined")) +
                             " and std " +
                             (std.defined() ? c10::str(std.sizes()) : std::string("undefined")) +
                             " for " + std::to_string(n) + " images; expected (B, C, h, w) each",
                         "latent cache build");
      for (std::int64_t k = 0; k < n; ++k) {
        const auto [i, flipped] = work[w][static_cast<std::size_t>(k)];
        const ImageRecord& r = folder_.images[i];
        TensorCache::Entry e;
        if (o_.storage == LatentStorage::distribution) {
          e.emplace("mean", mean[k].to(at::kFloat));
          e.emplace("std", std[k].to(at::kFloat));
        } else {
          at::Generator gen = entry_generator(key(i, flipped));
          const at::Tensor m = mean[k].to(at::kCPU, at::kFloat),
                           s = std[k].to(at::kCPU, at::kFloat);
          e.emplace("sample", m + s * at::randn(m.sizes(), gen, m.options()));
        }
        e.emplace("original_size", at::tensor({r.height, r.width}, at::kLong));
        const CropCorner& c = p.corners[static_cast<std::size_t>(k)];
        e.emplace("crop_top_left", at::tensor({c.top, c.left}, at::kLong));
        cache_.put(key(i, flipped), e);
      }
      report.encoded += work[w].size();
      if (o_.progress) o_.progress(report.encoded, todo.size());
    }
    cache_.flush();
    report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return report;
  }

  /// Image `image` (mirrored when `flipped`) as training reads it: a latent drawn from the cached
  /// posterior with `gen` (distribution storage) or the cached sample.
  [[nodiscard]] CachedLatent read(std::size_t image, bool flipped, at::Generator& gen) const {
    const std::string k = key(image, flipped);
    if (!cache_.contains(k))
      throw ConfigError(std::string("has no latent of ") + folder_.images.at(image).path.string() +
                            (flipped ? " (mirrored)" : "") + "; build the cache first",
                        "latent cache " + cache_.folder().string());
    const auto e = cache_.get(k);
    CachedLatent out;
    if (o_.storage == LatentStorage::distribution) {
      const at::Tensor& m = e.at("mean");
      out.latent = m + e.at("std") * at::randn(m.sizes(), gen, m.options());
    } else {
      out.latent = e.at("sample");
    }
    const auto* size = e.at("original_size").data_ptr<std::int64_t>();
    const auto* corner = e.at("crop_top_left").data_ptr<std::int64_t>();
    out.original_size = {size[0], size[1]};
    out.crop_top_left = {corner[0], corner[1]};
    return out;
  }

 private:
  /// The generator of `sample` storage's draw for entry `k`: the run's seed and the key.
  at::Generator entry_generator(const std::string& k) const {
    return at::make_generator<at::CPUGeneratorImpl>(std::stoull(k.substr(0, 15), nullptr, 16) ^
                                                    (o_.seed * 0x9E3779B97F4A7C15ULL));
  }

  const ImageFolder& folder_;
  LatentCacheOptions o_;
  TensorCache cache_;
  std::vector<BucketChoice> choices_;
  std::vector<std::string> hashes_;
};

/// One batch of cached latents of one bucket.
struct LatentBatch {
  at::Tensor latents;  ///< (B, C, h, w), unscaled
  std::vector<std::size_t> indices;
  std::vector<std::string> captions;
  std::vector<std::array<std::int64_t, 2>> original_sizes, crop_top_left;
  std::vector<bool> flipped;
};

/// An epoch of bucketed batches read from a LatentCache: the batches, their order and each
/// sample's flip equal ImageBatches' with a center crop and the same seed; each latent is drawn
/// from the sample's generator after its flip.
class CachedLatentBatches {
 public:
  CachedLatentBatches(const LatentCache& cache, const ImageFolder& folder, std::size_t batch_size,
                      double flip_p, std::uint64_t seed, std::uint64_t epoch)
      : cache_(cache), folder_(folder), flip_p_(flip_p), seed_(seed), epoch_(epoch) {
    if (flip_p > 0 && !cache.options().flipped)
      throw ConfigError("flips are asked for (p = " + std::to_string(flip_p) +
                            ") but the cache holds no mirror images (LatentCacheOptions::flipped)",
                        "cached latent batches");
    std::vector<Bucket> assigned;
    std::vector<std::int64_t> repeats;
    for (std::size_t i = 0; i < folder.images.size(); ++i) {
      assigned.push_back(cache.choices().at(i).bucket);
      repeats.push_back(folder.images[i].repeats);
    }
    batches_ = bucket_batches(assigned, repeats, batch_size, seed, epoch);
  }

  [[nodiscard]] std::size_t size() const { return batches_.size(); }
  [[nodiscard]] std::size_t position() const { return next_; }
  /// Continues the epoch from batch `position` (a resumed run's place in it).
  void seek(std::size_t position) {
    if (position > batches_.size())
      throw ConfigError("position " + std::to_string(position) + " is past the epoch's " +
                            std::to_string(batches_.size()) + " batches",
                        "cached latent batches");
    next_ = position;
  }

  std::optional<LatentBatch> next() {
    if (next_ >= batches_.size()) return std::nullopt;
    const std::size_t b = next_++;
    LatentBatch out;
    std::vector<at::Tensor> latents;
    for (std::size_t k = 0; k < batches_[b].size(); ++k) {
      const std::size_t i = batches_[b][k];
      at::Generator gen = sample_generator(seed_, epoch_, b, k);
      const bool flipped = draw_flip(flip_p_, gen);
      CachedLatent c = cache_.read(i, flipped, gen);
      latents.push_back(std::move(c.latent));
      out.indices.push_back(i);
      out.captions.push_back(folder_.images[i].caption);
      out.original_sizes.push_back(c.original_size);
      out.crop_top_left.push_back(c.crop_top_left);
      out.flipped.push_back(flipped);
    }
    out.latents = at::stack(latents);
    return out;
  }

 private:
  const LatentCache& cache_;
  const ImageFolder& folder_;
  double flip_p_;
  std::uint64_t seed_, epoch_;
  std::vector<std::vector<std::size_t>> batches_;
  std::size_t next_ = 0;
};

}  // namespace difftrain::data
