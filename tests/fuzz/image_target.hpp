#pragma once
// The image readers' fuzz target: what the data layer does with an untrusted file, detecting its
// kind, reading its size from the header (as scanning a folder does) and decoding it (as the loader
// does), under a small pixel limit so a bomb is refused rather than allocated. Shared by the
// libFuzzer binary and the unit test that replays the kept corpus. A typed difftrain::Error is the
// expected way to reject input.

#include <difftrain/data/image.hpp>
#include <difftrain/data/image_folder.hpp>

#include <cstddef>
#include <cstdint>
#include <span>

namespace difftrain::fuzz {

inline void image_input(const std::uint8_t* data, std::size_t size) {
  const std::span<const char> bytes(reinterpret_cast<const char*>(data), size);
  data::ImageLimits limits;
  limits.max_pixels = 1 << 22;
  try {
    const data::ImageFormat format = data::detect_image_format(bytes, "fuzz");
    try {
      (void)data::folder_detail::probe_size(bytes, format, limits, "fuzz");
    } catch (const Error&) {
    }
    const data::DecodedImage img = data::decode_image(bytes, "fuzz", limits);
    if (img.pixels.numel() > 0) (void)img.pixels.sum().item<std::int64_t>();
  } catch (const Error&) {
  }
}

}  // namespace difftrain::fuzz
