#pragma once
// Video buckets, frames × height × width, as finetrainers (CogVideoX-Factory, the training code
// diffusers' CogVideoX guide points to for buckets) assigns clips to them, so clips of different
// lengths and shapes train without being cut to the shortest or squeezed to one size:
//
//   frames   among the buckets no longer than the clip, the one whose frame count is nearest to
//            min(clip frames, max_num_frames) (the first such in the list); frames 0, s, 2s, ...
//            with s = ⌊clip frames / bucket frames⌋, the first `bucket frames` of them;
//   size     the listed (height, width) nearest to the clip's in |Δh| + |Δw|, over all buckets;
//            every frame is resized to it (no crop);
//   batches  per epoch, each shape's clips shuffled and cut into batches and all batches shuffled
//            (bucket_batches), so a batch holds one shape.
//
//   auto buckets = data::parse_video_buckets({"49x480x720", "49x720x480", "17x480x720"});
//   data::VideoBucketChoice c = data::choose_video_bucket(info.frames, info.height, info.width,
//                                                         buckets, /*max_num_frames*/ 49);
//   // c.shape: (frames, height, width); c.frames: the indices to decode

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/data/buckets.hpp"

namespace difftrain::data {

struct VideoShape {
  std::int64_t frames = 1, height = 1, width = 1;
  auto operator<=>(const VideoShape&) const = default;
  [[nodiscard]] std::string str() const {
    return std::to_string(frames) + "x" + std::to_string(height) + "x" + std::to_string(width);
  }
};

/// "FxHxW" strings (finetrainers' --video_resolution_buckets) as shapes; each must be three
/// positive numbers.
inline std::vector<VideoShape> parse_video_buckets(const std::vector<std::string>& specs,
                                                   const std::string& where = "video buckets") {
  std::vector<VideoShape> out;
  for (const auto& spec : specs) {
    std::vector<std::int64_t> v;
    std::size_t start = 0;
    bool ok = !spec.empty();
    while (ok && start <= spec.size()) {
      const std::size_t x = spec.find('x', start);
      const std::string part =
          spec.substr(start, x == std::string::npos ? std::string::npos : x - start);
      char* end = nullptr;
      const long long n = part.empty() ? 0 : std::strtoll(part.c_str(), &end, 10);
      ok = !part.empty() && end != nullptr && *end == '\0' && n >= 1 && n <= 1'000'000;
      v.push_back(n);
      if (x == std::string::npos) break;
      start = x + 1;
    }
    if (!ok || v.size() != 3)
      throw ConfigError("'" + spec + "' is not FRAMESxHEIGHTxWIDTH (e.g. 49x480x720)", where);
    out.push_back({v[0], v[1], v[2]});
  }
  if (out.empty()) throw ConfigError("no buckets given", where);
  return out;
}

struct VideoBucketChoice {
  VideoShape shape;                  ///< the frames kept and the size they are resized to
  std::vector<std::int64_t> frames;  ///< the clip's frame indices, shape.frames of them
};

/// finetrainers' VideoDatasetWithResizing choice for a clip of `count` frames at height × width.
inline VideoBucketChoice choose_video_bucket(std::int64_t count, std::int64_t height,
                                             std::int64_t width,
                                             const std::vector<VideoShape>& buckets,
                                             std::int64_t max_num_frames) {
  const char* where = "choose_video_bucket";
  if (buckets.empty()) throw ConfigError("no buckets", where);
  if (count < 1 || height < 1 || width < 1)
    throw ShapeError("a clip of " + std::to_string(count) + " frames at " + std::to_string(height) +
                         "x" + std::to_string(width) + " has nothing",
                     where);
  const std::int64_t want = std::min(count, max_num_frames);
  std::int64_t frames = 1;  // no bucket fits: one frame (finetrainers' default=[1])
  std::int64_t best = -1;
  for (const auto& b : buckets) {
    if (b.frames > count) continue;
    const std::int64_t d = std::abs(b.frames - want);
    if (best < 0 || d < best) {
      best = d;
      frames = b.frames;
    }
  }
  VideoBucketChoice c;
  const std::int64_t step = count / frames;
  for (std::int64_t i = 0; i < count && static_cast<std::int64_t>(c.frames.size()) < frames;
       i += step)
    c.frames.push_back(i);
  std::int64_t nearest = -1;
  for (const auto& b : buckets) {
    const std::int64_t d = std::abs(b.height - height) + std::abs(b.width - width);
    if (nearest < 0 || d < nearest) {
      nearest = d;
      c.shape.height = b.height;
      c.shape.width = b.width;
    }
  }
  c.shape.frames = frames;
  return c;
}

/// bucket_batches over video shapes: one shape per batch, the order fixed by seed and epoch.
inline std::vector<std::vector<std::size_t>> video_bucket_batches(
    const std::vector<VideoShape>& shapes, std::size_t batch_size, std::uint64_t seed,
    std::uint64_t epoch) {
  std::map<VideoShape, std::int64_t> index;
  for (const auto& s : shapes) index.emplace(s, 0);
  std::int64_t k = 0;
  for (auto& [shape, i] : index) i = k++;
  std::vector<Bucket> keys;
  keys.reserve(shapes.size());
  for (const auto& s : shapes) keys.emplace_back(index.at(s), 0);
  return bucket_batches(keys, {}, batch_size, seed, epoch);
}

/// The shapes with their clip counts, one line each.
inline std::string describe_video_buckets(const std::vector<VideoShape>& shapes) {
  std::map<VideoShape, std::int64_t> count;
  for (const auto& s : shapes) ++count[s];
  std::string out = "number of video buckets: " + std::to_string(count.size()) + "\n";
  for (const auto& [s, n] : count) out += "  " + s.str() + ": " + std::to_string(n) + " clips\n";
  return out;
}

}  // namespace difftrain::data
