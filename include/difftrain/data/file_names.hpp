#pragma once
// Which files the readers and the programs' folder scans take, by extension in any case. Free of
// any codec library, so that a build without libjpeg-turbo or FFmpeg still tells an image or a
// video it cannot read from a file it does not know.

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <string>

namespace difftrain::data {

/// `p`'s extension with its dot, lowercased ("clip.MP4" → ".mp4").
inline std::string lower_extension(const std::filesystem::path& p) {
  std::string e = p.extension().string();
  std::transform(e.begin(), e.end(), e.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return e;
}

/// JPEG, PNG and WebP: .jpg, .jpeg, .png or .webp.
inline bool is_image_name(const std::filesystem::path& p) {
  const std::string e = lower_extension(p);
  return e == ".jpg" || e == ".jpeg" || e == ".png" || e == ".webp";
}

/// MP4, MOV, M4V, WebM, MKV, AVI and GIF.
inline bool is_video_name(const std::filesystem::path& p) {
  const std::string e = lower_extension(p);
  return e == ".mp4" || e == ".mov" || e == ".m4v" || e == ".webm" || e == ".mkv" || e == ".avi" ||
         e == ".gif";
}

}  // namespace difftrain::data
