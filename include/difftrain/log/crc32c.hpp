#pragma once
// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum TFRecord files carry, and
// its "masked" form. Slicing-by-8 tables built at compile time: 8 bytes per step, ~1.5 GB/s on
// one core, far more than an event log needs, and no dependency for 40 lines.

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

namespace difftrain::log {

namespace crc_detail {
inline constexpr std::uint32_t kPolynomial = 0x82F63B78u;

consteval std::array<std::array<std::uint32_t, 256>, 8> make_tables() {
  std::array<std::array<std::uint32_t, 256>, 8> t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1u) != 0 ? (c >> 1) ^ kPolynomial : c >> 1;
    t[0][i] = c;
  }
  for (std::size_t s = 1; s < 8; ++s)
    for (std::size_t i = 0; i < 256; ++i) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFFu];
  return t;
}
inline constexpr auto kTables = make_tables();
}  // namespace crc_detail

/// CRC-32C of `bytes`, continuing from `crc` (0 to start).
[[nodiscard]] inline std::uint32_t crc32c(std::span<const std::byte> bytes, std::uint32_t crc = 0) {
  const auto& t = crc_detail::kTables;
  std::uint32_t c = ~crc;
  const std::byte* p = bytes.data();
  std::size_t n = bytes.size();
  for (; n >= 8; n -= 8, p += 8) {
    const std::uint32_t lo =
        c ^
        (std::to_integer<std::uint32_t>(p[0]) | std::to_integer<std::uint32_t>(p[1]) << 8 |
         std::to_integer<std::uint32_t>(p[2]) << 16 | std::to_integer<std::uint32_t>(p[3]) << 24);
    c = t[7][lo & 0xFFu] ^ t[6][(lo >> 8) & 0xFFu] ^ t[5][(lo >> 16) & 0xFFu] ^ t[4][lo >> 24] ^
        t[3][std::to_integer<std::uint32_t>(p[4])] ^ t[2][std::to_integer<std::uint32_t>(p[5])] ^
        t[1][std::to_integer<std::uint32_t>(p[6])] ^ t[0][std::to_integer<std::uint32_t>(p[7])];
  }
  for (; n > 0; --n, ++p) c = (c >> 8) ^ t[0][(c ^ std::to_integer<std::uint32_t>(*p)) & 0xFFu];
  return ~c;
}
[[nodiscard]] inline std::uint32_t crc32c(std::string_view bytes, std::uint32_t crc = 0) {
  return crc32c(std::as_bytes(std::span<const char>(bytes.data(), bytes.size())), crc);
}

/// TFRecord's masked CRC: a CRC stored next to the data it covers is rotated and offset, so the
/// CRC of a string holding CRCs stays well distributed.
[[nodiscard]] constexpr std::uint32_t mask_crc(std::uint32_t crc) {
  return ((crc >> 15) | (crc << 17)) + 0xA282EAD8u;
}
[[nodiscard]] constexpr std::uint32_t unmask_crc(std::uint32_t masked) {
  const std::uint32_t rot = masked - 0xA282EAD8u;
  return (rot >> 17) | (rot << 15);
}

}  // namespace difftrain::log
