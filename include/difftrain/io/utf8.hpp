#pragma once
// Whether bytes are UTF-8 text, as Python's strict decoder judges it: no overlong forms, no
// surrogates, nothing past U+10FFFF, no sequence cut short. Captions from files and file names are
// checked with it where they are found, so a Latin-1 caption is reported at its file instead of
// stopping training at the batch that tokenizes it.

#include <cstddef>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>

namespace difftrain::io {

/// The offset of the first byte that does not begin or continue a valid UTF-8 sequence, or
/// nothing when all of `s` is UTF-8.
[[nodiscard]] inline std::optional<std::size_t> first_invalid_utf8(std::string_view s) {
  const auto* b = reinterpret_cast<const unsigned char*>(s.data());
  const std::size_t n = s.size();
  std::size_t i = 0;
  while (i < n) {
    const unsigned char c = b[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    std::size_t len = 0;
    unsigned char lo = 0x80, hi = 0xBF;  // the range of the second byte
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      if (c == 0xE0) lo = 0xA0;  // overlong
      if (c == 0xED) hi = 0x9F;  // surrogates
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      if (c == 0xF0) lo = 0x90;  // overlong
      if (c == 0xF4) hi = 0x8F;  // past U+10FFFF
    } else {
      return i;
    }
    if (i + len > n) return i;
    if (b[i + 1] < lo || b[i + 1] > hi) return i;
    for (std::size_t k = 2; k < len; ++k)
      if (b[i + k] < 0x80 || b[i + k] > 0xBF) return i;
    i += len;
  }
  return std::nullopt;
}

/// Why `s` is not UTF-8 in a few words ("byte 12 is 0xE9"), or an empty string when it is.
[[nodiscard]] inline std::string utf8_problem(std::string_view s) {
  const auto at = first_invalid_utf8(s);
  if (!at) return {};
  char hex[8];
  std::snprintf(hex, sizeof hex, "0x%02X",
                static_cast<unsigned>(static_cast<unsigned char>(s[*at])));
  return "byte " + std::to_string(*at) + " is " + hex;
}

}  // namespace difftrain::io
