#pragma once
// Which frames of a video train, as the two CogVideoX training codes choose them, and the SAT
// dataset's resize-and-crop. Both work on frame counts and indices, so they serve video files
// (data/video_file.hpp) and folders of frames alike, and need no FFmpeg.
//
//   diffusers_frame_indices  train_cogvideox_lora.py: skip frames at both ends, every k-th frame
//                            when more than max_num_frames remain, cut to 4k + 1;
//   sat_frame_indices        the SAT fine-tuning code's SFTDataset: a window of max_num_frames at
//                            the target fps (a stride of actual / target fps), spread uniformly,
//                            padded with the last frame to exactly max_num_frames;
//   sat_resize_crop          its resize_for_rectangle_crop (bicubic to cover, centre crop).
//
//   auto idx = data::sat_frame_indices(info.frames, info.fps, {.max_num_frames = 49, .fps = 8});
//   auto clip = data::read_video(path, {.frames = idx}).pixels;  // (49, H, W, 3)

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/data/file_names.hpp"  // is_video_name, for the programs' scans

namespace difftrain::data {

/// The window of a clip that trains.
struct FrameWindow {
  std::int64_t max_num_frames = 49;
  std::int64_t skip_start = 0;  ///< frames dropped at the start (SAT's skip_frms_num)
  std::int64_t skip_end = 0;    ///< and at the end
};

namespace video_sampling_detail {
inline void check_window(std::int64_t count, const FrameWindow& w, const char* where) {
  if (count < 1)
    throw ShapeError("a clip of " + std::to_string(count) + " frames has none to choose", where);
  if (w.max_num_frames < 1)
    throw ConfigError("max_num_frames " + std::to_string(w.max_num_frames) + " must be at least 1",
                      where);
  if (w.skip_start < 0 || w.skip_end < 0)
    throw ConfigError("frames to skip cannot be negative", where);
}
}  // namespace video_sampling_detail

/// train_cogvideox_lora.py's choice: frames [skip_start, count − skip_end), every
/// ⌊remaining / max⌋-th of them when more than max remain, at most max, then cut to the largest
/// 4k + 1 the 3-D VAE compresses. A window emptied by the skips keeps one frame.
inline std::vector<std::int64_t> diffusers_frame_indices(std::int64_t count, const FrameWindow& w) {
  video_sampling_detail::check_window(count, w, "diffusers_frame_indices");
  const std::int64_t start = std::min(w.skip_start, count);
  const std::int64_t end = std::max<std::int64_t>(count - w.skip_end, 0);
  std::vector<std::int64_t> idx;
  if (end <= start) {
    idx.push_back(std::min(start, count - 1));
  } else if (end - start <= w.max_num_frames) {
    for (std::int64_t i = start; i < end; ++i) idx.push_back(i);
  } else {
    const std::int64_t step = (end - start) / w.max_num_frames;
    for (std::int64_t i = start; i < end; i += step) idx.push_back(i);
  }
  if (static_cast<std::int64_t>(idx.size()) > w.max_num_frames)
    idx.resize(static_cast<std::size_t>(w.max_num_frames));
  const std::size_t remainder = (3 + idx.size() % 4) % 4;
  idx.resize(idx.size() - remainder);
  return idx;
}

/// What the SAT loader takes besides the window: the fps it trains at.
struct SatSampling {
  std::int64_t max_num_frames = 49;
  double fps = 8;         ///< the training fps (SAT's data config: 8)
  std::int64_t skip = 3;  ///< SAT's skip_frms_num, dropped at both ends
};

/// SFTDataset.__getitem__'s frame choice for a clip of `count` frames at `actual_fps`:
///  * longer than max_num_frames at the training fps: the window [skip, skip + max·actual/fps)
///    taken every ⌊window / max⌋-th frame (a stride of about actual / target fps);
///  * else, more than max frames: [skip, count − skip) every ⌊span / max⌋-th frame;
///  * else: the first 4k + 1 frames of [skip, count − skip);
/// then pad_last_frame: cut to max_num_frames, or padded by repeating the last frame. Where
/// SAT's loader would fail (a stride of 0 from a source slower than the training fps, an index
/// past the clip's end, an empty span) this one clamps: stride 1, the last frame, the frame at
/// the skip.
inline std::vector<std::int64_t> sat_frame_indices(std::int64_t count, double actual_fps,
                                                   const SatSampling& s) {
  const char* where = "sat_frame_indices";
  video_sampling_detail::check_window(count, {s.max_num_frames, s.skip, s.skip}, where);
  if (!(s.fps > 0) || !std::isfinite(s.fps))
    throw ConfigError("the training fps must be positive, got " + std::to_string(s.fps), where);
  if (!(actual_fps > 0) || !std::isfinite(actual_fps))
    throw ShapeError("the clip's frame rate is unknown (" + std::to_string(actual_fps) +
                         "); SAT's sampling needs it",
                     where);
  const std::int64_t max = s.max_num_frames, start = s.skip;
  std::vector<std::int64_t> idx;
  auto spread = [&](std::int64_t from, std::int64_t to) {
    const std::int64_t step = std::max<std::int64_t>((to - from) / max, 1);
    for (std::int64_t i = from; i < to; i += step) idx.push_back(std::min(i, count - 1));
  };
  if (static_cast<double>(count) / actual_fps * s.fps > static_cast<double>(max)) {
    spread(start, static_cast<std::int64_t>(static_cast<double>(start) +
                                            static_cast<double>(max) / s.fps * actual_fps));
  } else if (count > max) {
    spread(start, count - s.skip);
  } else {
    const std::int64_t n = count - 2 * s.skip;
    const std::int64_t kept = n < 1 ? 0 : n - (n % 4 == 0 ? 3 : n % 4 - 1);
    for (std::int64_t i = start; i < start + kept; ++i) idx.push_back(i);
  }
  if (idx.empty()) idx.push_back(std::min(start, count - 1));
  if (static_cast<std::int64_t>(idx.size()) > max) idx.resize(static_cast<std::size_t>(max));
  while (static_cast<std::int64_t>(idx.size()) < max) idx.push_back(idx.back());
  return idx;
}

/// SAT's resize_for_rectangle_crop(reshape_mode="center") on uint8 frames (T, C, H, W): bicubic
/// so the frames cover height × width with the other side truncated, then the crop at ⌊Δ / 2⌋.
/// The resize is torchvision.transforms.functional.resize's (the v1 API SAT calls): antialiased
/// bicubic in float32, clamped and rounded, which differs by a level or so from the v2 API's
/// native uint8 kernel that data::resize follows.
inline at::Tensor sat_resize_crop(const at::Tensor& frames, std::int64_t height,
                                  std::int64_t width) {
  if (frames.dim() != 4)
    throw ShapeError("expects frames (T, C, H, W), got " + c10::str(frames.sizes()),
                     "sat_resize_crop");
  if (height < 1 || width < 1)
    throw ConfigError(
        "a size of " + std::to_string(height) + "x" + std::to_string(width) + " is empty",
        "sat_resize_crop");
  const std::int64_t h = frames.size(2), w = frames.size(3);
  std::vector<std::int64_t> size;
  if (static_cast<double>(w) / static_cast<double>(h) >
      static_cast<double>(width) / static_cast<double>(height))
    size = {height, static_cast<std::int64_t>(static_cast<double>(w) * static_cast<double>(height) /
                                              static_cast<double>(h))};
  else
    size = {static_cast<std::int64_t>(static_cast<double>(h) * static_cast<double>(width) /
                                      static_cast<double>(w)),
            width};
  at::Tensor x = frames;
  if (size[0] != h || size[1] != w) {
    if (frames.scalar_type() != at::kByte)
      throw ShapeError("expects uint8 frames", "sat_resize_crop");
    x = at::_upsample_bicubic2d_aa(frames.to(at::kFloat), size, false)
            .clamp(0, 255)
            .round()
            .to(at::kByte);
  }
  const std::int64_t top = (x.size(2) - height) / 2, left = (x.size(3) - width) / 2;
  if (top < 0 || left < 0)
    throw ShapeError("the resized frames " + c10::str(x.sizes()) + " do not cover " +
                         std::to_string(height) + "x" + std::to_string(width),
                     "sat_resize_crop");
  return x.slice(2, top, top + height).slice(3, left, left + width);
}

}  // namespace difftrain::data
