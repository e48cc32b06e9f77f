#pragma once
// The video reader's fuzz target: what the data layer does with an untrusted video file, probing
// it (frame count, size, rate) and decoding some frames and then every frame, under small limits
// (64 frames, 2^20 pixels a frame) so a long or huge file is refused rather than allocated. FFmpeg
// reads files by name, so each input is written to one scratch file per process first. Shared by
// the libFuzzer binary and the unit test that replays the kept corpus. A typed difftrain::Error is
// the expected way to reject input.

#include <difftrain/data/video_file.hpp>

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

namespace difftrain::fuzz {

inline data::VideoLimits video_limits() {
  data::VideoLimits limits;
  limits.max_frames = 64;
  limits.max_pixels = 1 << 20;
  return limits;
}

inline void video_input(const std::uint8_t* data, std::size_t size) {
  static const std::filesystem::path file =
      std::filesystem::temp_directory_path() /
      ("difftrain-fuzz-video-" + std::to_string(::getpid()) + ".bin");
  {
    std::ofstream out(file, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  const data::VideoLimits limits = video_limits();
  try {
    const data::VideoInfo info = data::probe_video(file, limits);
    if (info.frames > 0) {
      const data::VideoFrames some =
          data::read_video(file, {.frames = {info.frames - 1, 0, 0}, .limits = limits});
      (void)some.pixels.sum().item<std::int64_t>();
    }
    const data::VideoFrames all = data::read_video(file, {.limits = limits});
    (void)all.pixels.sum().item<std::int64_t>();
  } catch (const Error&) {
  }
}

}  // namespace difftrain::fuzz
