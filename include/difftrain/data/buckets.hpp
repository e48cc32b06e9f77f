#pragma once
// Aspect-ratio buckets as kohya's sd-scripts (after NovelAI's scheme) define them, so that a batch
// holds images of one shape and no image is cropped to a square:
//
//   table    the square of side floor(sqrt(max area) / steps) * steps, and for each width from
//            min_size to max_size in steps, (width, height) and (height, width) with height the
//            largest multiple of steps that keeps width * height within the max area (capped at
//            max_size, dropped below min_size);
//   choice   an image whose size is a bucket takes it; otherwise the bucket whose aspect ratio is
//            nearest (the first such in the sorted table); the image is scaled to cover it and
//            rounded to whole pixels (the rest is cropped). With no_upscale the image is only
//            shrunk, to fit the max area keeping its aspect ratio, and its bucket is its size
//            rounded down to steps.
//   batches  per epoch every bucket's images are shuffled and cut into batches, and the batches
//            of all buckets shuffled together: every batch is one bucket's, the order fixed by
//            the seed and the epoch.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "difftrain/core/error.hpp"

namespace difftrain::data {

struct BucketOptions {
  std::int64_t max_width = 512, max_height = 512;  ///< kohya's --resolution (the max area)
  std::int64_t min_size = 256;                     ///< --min_bucket_reso
  std::int64_t max_size = 1024;                    ///< --max_bucket_reso
  std::int64_t steps = 64;                         ///< --bucket_reso_steps
  bool no_upscale = false;                         ///< --bucket_no_upscale

  void check(const std::string& where = "BucketOptions") const {
    if (steps < 1)
      throw ConfigError("steps must be at least 1, got " + std::to_string(steps), where);
    if (max_width < steps || max_height < steps)
      throw ConfigError("the resolution " + std::to_string(max_width) + "x" +
                            std::to_string(max_height) + " is smaller than a step of " +
                            std::to_string(steps),
                        where);
    if (min_size < 1 || min_size > max_size)
      throw ConfigError("min_size " + std::to_string(min_size) + " must be from 1 to max_size " +
                            std::to_string(max_size),
                        where);
    if (max_size < max_width || max_size < max_height)
      throw ConfigError("max_size " + std::to_string(max_size) +
                            " must be at least the resolution's sides (" +
                            std::to_string(max_width) + "x" + std::to_string(max_height) + ")",
                        where);
    if (min_size % steps != 0 || max_size % steps != 0)
      throw ConfigError(
          "min_size and max_size must be multiples of steps (" + std::to_string(steps) + ")",
          where);
  }
};

/// A bucket: width and height in pixels.
using Bucket = std::pair<std::int64_t, std::int64_t>;

/// kohya's make_bucket_resolutions, sorted by (width, height).
inline std::vector<Bucket> bucket_resolutions(const BucketOptions& o) {
  o.check();
  const std::int64_t area = o.max_width * o.max_height;
  std::set<Bucket> resos;
  const auto side = static_cast<std::int64_t>(std::floor(std::sqrt(static_cast<double>(area)) /
                                                         static_cast<double>(o.steps))) *
                    o.steps;
  resos.insert({side, side});
  for (std::int64_t w = o.min_size; w <= o.max_size; w += o.steps) {
    const std::int64_t h = std::min(o.max_size, (area / w) / o.steps * o.steps);
    if (h >= o.min_size) {
      resos.insert({w, h});
      resos.insert({h, w});
    }
  }
  return {resos.begin(), resos.end()};
}

/// Where an image goes: its bucket and the size it is resized to before the crop.
struct BucketChoice {
  Bucket bucket;
  std::int64_t resized_width = 0, resized_height = 0;
  double aspect_error = 0;  ///< bucket's aspect ratio minus the image's
};

class BucketManager {
 public:
  explicit BucketManager(BucketOptions o) : o_(o) {
    o_.check();
    if (!o_.no_upscale) {
      table_ = bucket_resolutions(o_);
      for (const auto& [w, h] : table_)
        ratios_.push_back(static_cast<double>(w) / static_cast<double>(h));
    }
  }

  [[nodiscard]] const std::vector<Bucket>& table() const { return table_; }

  /// kohya's select_bucket for an image of width x height.
  [[nodiscard]] BucketChoice select(std::int64_t width, std::int64_t height) const {
    if (width < 1 || height < 1)
      throw ShapeError(
          "an image of " + std::to_string(width) + "x" + std::to_string(height) + " has no pixels",
          "BucketManager");
    const double w = static_cast<double>(width), h = static_cast<double>(height);
    const double ar = w / h;
    BucketChoice c;
    if (!o_.no_upscale) {
      Bucket reso{width, height};
      if (!std::binary_search(table_.begin(), table_.end(), reso)) {
        std::size_t best = 0;
        for (std::size_t i = 1; i < ratios_.size(); ++i)
          if (std::abs(ratios_[i] - ar) < std::abs(ratios_[best] - ar)) best = i;
        reso = table_[best];
      }
      const double reso_ar = static_cast<double>(reso.first) / static_cast<double>(reso.second);
      const double scale =
          ar > reso_ar ? static_cast<double>(reso.second) / h : static_cast<double>(reso.first) / w;
      c.bucket = reso;
      c.resized_width = static_cast<std::int64_t>(w * scale + 0.5);
      c.resized_height = static_cast<std::int64_t>(h * scale + 0.5);
    } else {
      const double max_area = static_cast<double>(o_.max_width * o_.max_height);
      if (w * h > max_area) {
        const double rw = std::sqrt(max_area * ar), rh = max_area / rw;
        const std::int64_t bw = round_to_steps(rw);
        const std::int64_t bh_in_w = round_to_steps(static_cast<double>(bw) / ar);
        const std::int64_t bh = round_to_steps(rh);
        const std::int64_t bw_in_h = round_to_steps(static_cast<double>(bh) * ar);
        if (bw < 1 || bh < 1 || bh_in_w < 1)
          throw ConfigError("an image of " + std::to_string(width) + "x" + std::to_string(height) +
                                " is too narrow for buckets of " + std::to_string(o_.steps) +
                                " pixel steps",
                            "BucketManager");
        const double ar_w = static_cast<double>(bw) / static_cast<double>(bh_in_w);
        const double ar_h = static_cast<double>(bw_in_h) / static_cast<double>(bh);
        if (std::abs(ar_w - ar) < std::abs(ar_h - ar)) {
          c.resized_width = bw;
          c.resized_height = static_cast<std::int64_t>(static_cast<double>(bw) / ar + 0.5);
        } else {
          c.resized_width = static_cast<std::int64_t>(static_cast<double>(bh) * ar + 0.5);
          c.resized_height = bh;
        }
      } else {
        c.resized_width = width;
        c.resized_height = height;
      }
      c.bucket = {c.resized_width - c.resized_width % o_.steps,
                  c.resized_height - c.resized_height % o_.steps};
      if (c.bucket.first < 1 || c.bucket.second < 1)
        throw ConfigError("an image of " + std::to_string(width) + "x" + std::to_string(height) +
                              " is smaller than a bucket step of " + std::to_string(o_.steps) +
                              " pixels",
                          "BucketManager");
    }
    c.aspect_error =
        static_cast<double>(c.bucket.first) / static_cast<double>(c.bucket.second) - ar;
    return c;
  }

 private:
  [[nodiscard]] std::int64_t round_to_steps(double x) const {
    const auto i = static_cast<std::int64_t>(x + 0.5);
    return i - i % o_.steps;
  }

  BucketOptions o_;
  std::vector<Bucket> table_;
  std::vector<double> ratios_;
};

/// One epoch's batches: the indices of `buckets` (one bucket per item, each item `repeats`
/// times) grouped by bucket, shuffled within each bucket, cut into batches of `batch_size` (the
/// last of a bucket may be smaller), and all batches shuffled; the same for the same seed and
/// epoch.
inline std::vector<std::vector<std::size_t>> bucket_batches(
    const std::vector<Bucket>& buckets, const std::vector<std::int64_t>& repeats,
    std::size_t batch_size, std::uint64_t seed, std::uint64_t epoch) {
  if (batch_size == 0) throw ConfigError("batch_size must be at least 1", "bucket_batches");
  if (!repeats.empty() && repeats.size() != buckets.size())
    throw ShapeError("repeats has " + std::to_string(repeats.size()) + " entries for " +
                         std::to_string(buckets.size()) + " images",
                     "bucket_batches");
  std::map<Bucket, std::vector<std::size_t>> by_bucket;
  for (std::size_t i = 0; i < buckets.size(); ++i)
    for (std::int64_t r = 0; r < (repeats.empty() ? 1 : repeats[i]); ++r)
      by_bucket[buckets[i]].push_back(i);
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ULL + epoch);
  std::vector<std::vector<std::size_t>> batches;
  for (auto& [bucket, items] : by_bucket) {
    std::shuffle(items.begin(), items.end(), rng);
    for (std::size_t i = 0; i < items.size(); i += batch_size)
      batches.emplace_back(
          items.begin() + static_cast<std::ptrdiff_t>(i),
          items.begin() + static_cast<std::ptrdiff_t>(std::min(items.size(), i + batch_size)));
  }
  std::shuffle(batches.begin(), batches.end(), rng);
  return batches;
}

/// The bucket table with each bucket's image count (and repeats), as kohya prints it.
inline std::string describe_buckets(const std::vector<Bucket>& buckets,
                                    const std::vector<std::int64_t>& repeats = {}) {
  std::map<Bucket, std::int64_t> count;
  for (std::size_t i = 0; i < buckets.size(); ++i)
    count[buckets[i]] += repeats.empty() ? 1 : repeats[i];
  std::ostringstream s;
  s << "number of buckets: " << count.size() << "\n";
  std::size_t i = 0;
  for (const auto& [b, n] : count)
    s << "bucket " << i++ << ": resolution (" << b.first << ", " << b.second << "), count: " << n
      << "\n";
  return s.str();
}

}  // namespace difftrain::data
