#pragma once
// Loading in parallel without giving up determinism: worker threads make items (decode, resize,
// crop, flip) ahead of the consumer, and the consumer receives them in index order, so the
// batches are the same whatever the number of workers. At most `prefetch` items are made ahead of
// the one consumed (the memory bound: prefetch items, each one transformed sample). An exception
// in a worker reaches the consumer when it asks for that item, with its type, and stops the
// workers; destroying the loader stops and joins them.
//
// ImageBatches builds on it: an image folder's records, their aspect-ratio buckets and an epoch's
// batches become (B, 3, H, W) float tensors in [-1, 1] with each sample's original size and crop
// corner (SDXL's add_time_ids). Each sample's random choices (crop corner, flip) come from a
// generator seeded by (seed, epoch, position), never from the worker that made it.

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/data/buckets.hpp"
#include "difftrain/data/image.hpp"
#include "difftrain/data/image_folder.hpp"
#include "difftrain/data/transforms.hpp"
#include "difftrain/io/read_file.hpp"

namespace difftrain::data {

template <class T>
class ParallelLoader {
 public:
  /// Makes items 0 .. count-1 with `make` on `workers` threads (0: on the consumer's thread).
  ParallelLoader(std::size_t count, std::function<T(std::size_t)> make, std::size_t workers = 2,
                 std::size_t prefetch = 8)
      : count_(count), make_(std::move(make)), prefetch_(std::max<std::size_t>(prefetch, 1)) {
    for (std::size_t w = 0; w < workers; ++w) threads_.emplace_back([this] { work(); });
  }
  ParallelLoader(const ParallelLoader&) = delete;
  ParallelLoader& operator=(const ParallelLoader&) = delete;
  ~ParallelLoader() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : threads_) t.join();
  }

  /// The next item in index order, or nothing after the last.
  std::optional<T> next() {
    if (consumed_ >= count_) return std::nullopt;
    if (threads_.empty()) return make_(consumed_++);
    std::unique_lock<std::mutex> lock(mutex_);
    ready_.wait(lock, [&] { return done_.contains(consumed_) || failed_.contains(consumed_); });
    if (const auto f = failed_.find(consumed_); f != failed_.end()) {
      stop_ = true;
      wake_.notify_all();
      std::rethrow_exception(f->second);
    }
    T item = std::move(done_.at(consumed_));
    done_.erase(consumed_);
    ++consumed_;
    lock.unlock();
    wake_.notify_all();  // room for one more ahead
    return item;
  }

  /// The most items that were made and not yet consumed at once (for the memory bound's test).
  [[nodiscard]] std::size_t peak_ahead() const { return peak_; }

 private:
  void work() {
    for (;;) {
      std::size_t i = 0;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock,
                   [&] { return stop_ || (next_ < count_ && next_ < consumed_ + prefetch_); });
        if (stop_ || next_ >= count_) return;
        i = next_++;
      }
      std::optional<T> item;
      std::exception_ptr error;
      try {
        item.emplace(make_(i));
      } catch (...) {
        error = std::current_exception();
      }
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (error)
          failed_[i] = error;
        else
          done_.emplace(i, std::move(*item));
        peak_ = std::max(peak_, done_.size());
      }
      ready_.notify_all();
    }
  }

  std::size_t count_;
  std::function<T(std::size_t)> make_;
  std::size_t prefetch_;
  std::mutex mutex_;
  std::condition_variable wake_, ready_;
  std::map<std::size_t, T> done_;
  std::map<std::size_t, std::exception_ptr> failed_;
  std::size_t next_ = 0, consumed_ = 0, peak_ = 0;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

/// An image (H, W, C uint8) resized to cover its bucket and cropped to it, at random with `gen` or
/// at the center: (C, bucket height, bucket width) uint8. `corner` gets the crop's corner.
inline at::Tensor crop_to_bucket(const at::Tensor& hwc, const BucketChoice& c, bool random,
                                 at::Generator& gen, CropCorner& corner) {
  at::Tensor x = hwc.permute({2, 0, 1});  // channels last: the resize reads it as is
  x = data::resize(x, std::vector<std::int64_t>{c.resized_height, c.resized_width});
  return random ? random_crop(x, c.bucket.second, c.bucket.first, gen, &corner)
                : center_crop(x, c.bucket.second, c.bucket.first, &corner);
}

/// Whether a sample is mirrored: one draw from `gen` when flip_p > 0 (none otherwise, so turning
/// flips off leaves every later draw as it was).
inline bool draw_flip(double flip_p, at::Generator& gen) {
  return flip_p > 0 && at::rand({1}, gen, at::kDouble).item<double>() < flip_p;
}

/// The crop `x` mirrored left to right, and its corner moved to where the crop lies in the
/// mirrored resized image (SDXL's crop_top_left of a flipped sample).
inline at::Tensor mirror(const at::Tensor& x, const BucketChoice& c, CropCorner& corner) {
  corner.left = c.resized_width - corner.left - c.bucket.first;
  return horizontal_flip(x);
}

/// The generator of one sample's random choices: seeded by the run's seed, the epoch and the
/// sample's place in the epoch, so any thread makes the same sample.
inline at::Generator sample_generator(std::uint64_t seed, std::uint64_t epoch, std::size_t batch,
                                      std::size_t k) {
  return at::make_generator<at::CPUGeneratorImpl>(seed * 1000003ULL + epoch * 7919ULL +
                                                  batch * 131ULL + k);
}

/// One batch of images of one bucket.
struct ImageBatch {
  at::Tensor pixels;                 ///< (B, 3, H, W) float32 in [-1, 1]
  std::vector<std::size_t> indices;  ///< into the folder's records
  std::vector<std::string> captions;
  std::vector<std::array<std::int64_t, 2>> original_sizes;  ///< (height, width), SDXL
  std::vector<std::array<std::int64_t, 2>> crop_top_left;   ///< (top, left), SDXL
  /// (B, H, W) float32 in [0, 1], cropped and flipped with the pixels: each image's mask, with
  /// ImageBatchOptions::alpha_mask or records that name one (undefined otherwise).
  at::Tensor masks;
};

struct ImageBatchOptions {
  std::size_t batch_size = 1;
  bool random_crop = false;  ///< diffusers' --random_crop; else the center
  double flip_p = 0.0;       ///< diffusers' --random_flip gives 0.5
  std::uint64_t seed = 0;
  std::size_t workers = 2;
  std::size_t prefetch_batches = 2;
  /// Page-locked batches (when CUDA is there), so `pixels.to(device, non_blocking)` overlaps the
  /// copy with the step.
  bool pin_memory = false;
  ImageLimits limits;
  /// kohya's alpha_mask: each image's alpha channel (opaque where it has none) as its mask; a
  /// record's own mask image takes precedence.
  bool alpha_mask = false;
};

/// An epoch of bucketed batches of an image folder, made on worker threads, delivered in order.
class ImageBatches {
 public:
  /// The batches of `epoch` from batch `start` on (a resumed run's place in the epoch; the
  /// batches before it are skipped without being made).
  ImageBatches(const ImageFolder& folder, const BucketManager& buckets, const ImageBatchOptions& o,
               std::uint64_t epoch, std::size_t start = 0)
      : folder_(folder), o_(o), epoch_(epoch), start_(start) {
    std::vector<Bucket> assigned;
    std::vector<std::int64_t> repeats;
    for (const auto& r : folder.images) {
      choices_.push_back(buckets.select(r.width, r.height));
      assigned.push_back(choices_.back().bucket);
      repeats.push_back(r.repeats);
    }
    batches_ = bucket_batches(assigned, repeats, o.batch_size, o.seed, epoch);
    if (start > batches_.size())
      throw ConfigError("start " + std::to_string(start) + " is past the epoch's " +
                            std::to_string(batches_.size()) + " batches",
                        "image batches");
    loader_.emplace(
        batches_.size() - start, [this](std::size_t b) { return make(start_ + b); }, o.workers,
        o.prefetch_batches);
  }

  /// Batches in the whole epoch.
  [[nodiscard]] std::size_t size() const { return batches_.size(); }
  /// The next batch's place in the epoch (what a checkpoint keeps to resume there).
  [[nodiscard]] std::size_t position() const { return start_ + consumed_; }
  std::optional<ImageBatch> next() {
    auto b = loader_->next();
    if (b) ++consumed_;
    return b;
  }

 private:
  ImageBatch make(std::size_t b) const {
    ImageBatch out;
    std::vector<at::Tensor> pixels, masks;
    for (std::size_t k = 0; k < batches_[b].size(); ++k) {
      const std::size_t i = batches_[b][k];
      const ImageRecord& r = folder_.images[i];
      const BucketChoice& c = choices_[i];
      // This sample's draws, whatever thread makes it.
      at::Generator gen = sample_generator(o_.seed, epoch_, b, k);
      const std::vector<char> bytes = io::read_file(r.path);
      const DecodedImage img = decode_image(bytes, r.path.string(), o_.limits);
      // A mask travels as a fourth channel through the same resize, crop and flip.
      at::Tensor mask = image_mask(r, bytes, img);
      const at::Tensor hwc =
          mask.defined() ? at::cat({img.pixels, mask.unsqueeze(2)}, 2) : img.pixels;
      CropCorner corner;
      at::Tensor x = crop_to_bucket(hwc, c, o_.random_crop, gen, corner);
      if (draw_flip(o_.flip_p, gen)) x = mirror(x, c, corner);
      if (mask.defined()) {
        masks.push_back(x.select(0, 3).to(at::kFloat) / 255.0);
        x = x.narrow(0, 0, 3);
      }
      pixels.push_back(to_unit_range(x.contiguous()));
      out.indices.push_back(i);
      out.captions.push_back(r.caption);
      out.original_sizes.push_back({img.pixels.size(0), img.pixels.size(1)});
      out.crop_top_left.push_back({corner.top, corner.left});
    }
    out.pixels = at::stack(pixels);
    if (!masks.empty()) {
      if (masks.size() != pixels.size())
        throw ConfigError("some images of a batch have a mask and some none",
                          folder_.images[batches_[b].front()].path.string());
      out.masks = at::stack(masks);
    }
    if (o_.pin_memory && at::hasCUDA()) out.pixels = out.pixels.pin_memory();
    return out;
  }

  /// The record's mask (its mask image's red channel, or the alpha channel with alpha_mask) as
  /// (H, W) uint8 in the image's orientation, or undefined.
  at::Tensor image_mask(const ImageRecord& r, std::span<const char> bytes,
                        const DecodedImage& img) const {
    if (!r.mask.empty()) {
      const DecodedImage m = read_image(r.mask, o_.limits);
      if (m.pixels.size(0) != img.pixels.size(0) || m.pixels.size(1) != img.pixels.size(1))
        throw FormatError("is " + std::to_string(m.pixels.size(1)) + "x" +
                              std::to_string(m.pixels.size(0)) + ", its image " + r.path.string() +
                              " " + std::to_string(img.pixels.size(1)) + "x" +
                              std::to_string(img.pixels.size(0)) + " (a mask has its image's size)",
                          r.mask.string());
      return m.pixels.select(2, 0).contiguous();
    }
    if (o_.alpha_mask) return decode_alpha(bytes, img, r.path.string(), o_.limits);
    return {};
  }

  const ImageFolder& folder_;
  ImageBatchOptions o_;
  std::uint64_t epoch_;
  std::size_t start_ = 0, consumed_ = 0;
  std::vector<BucketChoice> choices_;
  std::vector<std::vector<std::size_t>> batches_;
  std::optional<ParallelLoader<ImageBatch>> loader_;
};

}  // namespace difftrain::data
