#pragma once
// PNG images with text chunks: sample grids, and the images the web UI hides embeddings in.
// Pixels go through libpng's simplified API (it reports errors as return codes, so no longjmp
// crosses C++ frames); text chunks (tEXt, zTXt, iTXt) are read and written by a small chunk walker
// here that checks every length and CRC. Limits on size and inflated text bound what a hostile file
// can make us allocate.

#include <png.h>
#include <zlib.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/io/atomic_file.hpp"
#include "difftrain/io/inflate.hpp"
#include "difftrain/io/read_file.hpp"

namespace difftrain::io {

/// An 8-bit RGB image, rows top to bottom, pixels left to right.
struct RgbImage {
  std::uint32_t width = 0;
  std::uint32_t height = 0;
  std::vector<std::uint8_t> pixels;  // width * height * 3

  RgbImage() = default;
  RgbImage(std::uint32_t w, std::uint32_t h, std::uint8_t fill = 0)
      : width(w), height(h), pixels(std::size_t{w} * h * 3, fill) {}
  [[nodiscard]] std::uint8_t* at(std::uint32_t x, std::uint32_t y) {
    return pixels.data() + (std::size_t{y} * width + x) * 3;
  }
  [[nodiscard]] const std::uint8_t* at(std::uint32_t x, std::uint32_t y) const {
    return pixels.data() + (std::size_t{y} * width + x) * 3;
  }
};

struct PngLimits {
  std::uint64_t max_pixels = std::uint64_t{1} << 26;      // 67 M pixels (8192 x 8192)
  std::uint64_t max_text_bytes = std::uint64_t{1} << 26;  // all text chunks together, inflated
};

/// A decoded PNG: its pixels as RGB (alpha dropped, grey and palette expanded, as PIL's
/// convert('RGB')) and its text chunks by keyword.
struct PngFile {
  RgbImage image;
  std::map<std::string, std::string> text;
};

namespace png_detail {
inline constexpr std::array<unsigned char, 8> kSignature = {0x89, 'P',  'N',  'G',
                                                            '\r', '\n', 0x1a, '\n'};

inline std::uint32_t be32(const unsigned char* p) {
  return (std::uint32_t{p[0]} << 24) | (std::uint32_t{p[1]} << 16) | (std::uint32_t{p[2]} << 8) |
         std::uint32_t{p[3]};
}
inline void put_be32(std::vector<char>& out, std::uint32_t v) {
  for (int s = 24; s >= 0; s -= 8) out.push_back(static_cast<char>((v >> s) & 0xff));
}

inline std::vector<unsigned char> deflate_bytes(std::span<const char> in, int level) {
  uLongf n = compressBound(static_cast<uLong>(in.size()));
  std::vector<unsigned char> out(n);
  if (compress2(out.data(), &n, reinterpret_cast<const Bytef*>(in.data()),
                static_cast<uLong>(in.size()), level) != Z_OK)
    throw FormatError("zlib compression failed", "deflate");
  out.resize(n);
  return out;
}

// Text chunks, with CRC and length checks on every chunk up to IEND; `idat` receives the total
// size of the image data, which bounds how many pixels the file can really hold.
inline std::map<std::string, std::string> read_text_chunks(std::span<const char> bytes,
                                                           const PngLimits& limits,
                                                           const std::string& where,
                                                           std::uint64_t* idat = nullptr) {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  std::map<std::string, std::string> text;
  std::uint64_t text_bytes = 0;  // inflated so far, over all chunks
  if (idat != nullptr) *idat = 0;
  std::size_t at = 8;
  bool ended = false;
  while (!ended) {
    const std::string here = where + " chunk at byte " + std::to_string(at);
    if (bytes.size() - at < 12) throw FormatError("is truncated (no IEND chunk)", here);
    const std::uint32_t len = be32(p + at);
    if (len > bytes.size() - at - 12)
      throw FormatError("declares " + std::to_string(len) + " bytes, past the end of the file",
                        here);
    const std::string type(reinterpret_cast<const char*>(p + at + 4), 4);
    const unsigned char* data = p + at + 8;
    const std::uint32_t crc = be32(data + len);
    if (static_cast<std::uint32_t>(crc32(crc32(0, p + at + 4, 4), data, len)) != crc)
      throw FormatError("'" + type + "' has a wrong CRC", here);
    const auto nul = static_cast<const unsigned char*>(std::memchr(data, 0, len));
    if (type == "tEXt" || type == "zTXt" || type == "iTXt") {
      if (nul == nullptr) throw FormatError("'" + type + "' has no keyword terminator", here);
      const std::string key(reinterpret_cast<const char*>(data),
                            static_cast<std::size_t>(nul - data));
      const std::size_t rest = len - key.size() - 1;
      const unsigned char* body = nul + 1;
      if (type == "tEXt") {
        text[key].assign(reinterpret_cast<const char*>(body), rest);
      } else if (type == "zTXt") {
        if (rest < 1 || body[0] != 0) throw FormatError("'zTXt' has an unknown compression", here);
        text[key] = inflate_capped({body + 1, rest - 1}, limits.max_text_bytes - text_bytes, here);
      } else {  // iTXt: flag, method, language\0, translated keyword\0, text
        if (rest < 2) throw FormatError("'iTXt' is truncated", here);
        const bool compressed = body[0] != 0;
        const unsigned char* q = body + 2;
        const unsigned char* end = body + rest;
        for (int field = 0; field < 2; ++field) {
          const auto z = static_cast<const unsigned char*>(std::memchr(q, 0, end - q));
          if (z == nullptr) throw FormatError("'iTXt' is truncated", here);
          q = z + 1;
        }
        const std::span<const unsigned char> payload(q, static_cast<std::size_t>(end - q));
        text[key] = compressed ? inflate_capped(payload, limits.max_text_bytes - text_bytes, here)
                               : std::string(reinterpret_cast<const char*>(q), payload.size());
      }
      text_bytes += text[key].size();
      if (text_bytes > limits.max_text_bytes)
        throw FormatError("has more than " + std::to_string(limits.max_text_bytes) +
                              " bytes of text in its chunks",
                          here);
    }
    if (type == "IDAT" && idat != nullptr) *idat += len;
    ended = type == "IEND";
    at += std::size_t{len} + 12;
  }
  return text;
}

inline void append_chunk(std::vector<char>& out, const char* type, std::span<const char> data) {
  put_be32(out, static_cast<std::uint32_t>(data.size()));
  const std::size_t type_at = out.size();
  out.insert(out.end(), type, type + 4);
  out.insert(out.end(), data.begin(), data.end());
  const auto* crc_from = reinterpret_cast<const Bytef*>(out.data() + type_at);
  put_be32(out,
           static_cast<std::uint32_t>(crc32(0, crc_from, static_cast<uInt>(out.size() - type_at))));
}
}  // namespace png_detail

/// Deflate expands at most kMaxDeflateRatio:1, so the image data (`idat` bytes of IDAT chunks)
/// bounds the rows a PNG can really hold: a few bytes declaring a huge image are refused before
/// any pixel memory is allocated. Bits per pixel from IHDR (depth times channels; 16-bit images
/// too).
inline void check_image_data_holds(std::span<const char> bytes, std::uint64_t width,
                                   std::uint64_t height, std::uint64_t idat,
                                   const std::string& where) {
  if (bytes.size() < 33) throw FormatError("is truncated before its image header", where);
  const auto* ihdr = reinterpret_cast<const unsigned char*>(bytes.data()) + 16;
  const std::uint64_t channels = ihdr[9] == 2 ? 3 : ihdr[9] == 4 ? 2 : ihdr[9] == 6 ? 4 : 1;
  const std::uint64_t bits = std::uint64_t{ihdr[8]} * channels;
  const std::uint64_t raw_rows = height * (1 + (width * bits + 7) / 8);
  if (raw_rows > idat * kMaxDeflateRatio + 1024)
    throw FormatError("declares " + std::to_string(width) + "x" + std::to_string(height) +
                          " pixels, more than its " + std::to_string(idat) +
                          " bytes of image data can hold",
                      where);
}

/// Checks a PNG's chunks (lengths, CRCs, text within `limits`) and that its image data can hold
/// the `width` x `height` pixels its header declares, before anything is allocated for them.
inline void check_png_chunks(std::span<const char> bytes, std::uint64_t width, std::uint64_t height,
                             const PngLimits& limits, const std::string& where) {
  std::uint64_t idat = 0;
  (void)png_detail::read_text_chunks(bytes, limits, where, &idat);
  check_image_data_holds(bytes, width, height, idat, where);
}

/// Decodes PNG bytes (named `where` in errors).
/// A PNG's pixels as 8-bit RGBA (libpng's simplified reader: grey and palette expanded, an
/// image without alpha opaque), its size into `width` / `height`; `text` gets its text chunks.
inline std::vector<std::uint8_t> decode_png_rgba(
    std::span<const char> bytes, const std::string& where, const PngLimits& limits,
    std::uint32_t& width, std::uint32_t& height,
    std::map<std::string, std::string>* text = nullptr) {
  using namespace png_detail;
  if (bytes.size() < 8 || std::memcmp(bytes.data(), kSignature.data(), 8) != 0)
    throw FormatError("is not a PNG file (wrong signature)", where);
  std::uint64_t idat = 0;
  auto chunks = read_text_chunks(bytes, limits, where, &idat);
  if (text != nullptr) *text = std::move(chunks);
  png_image img{};
  img.version = PNG_IMAGE_VERSION;
  if (png_image_begin_read_from_memory(&img, bytes.data(), bytes.size()) == 0)
    throw FormatError(std::string("cannot be decoded: ") + img.message, where);
  const std::uint64_t pixels = std::uint64_t{img.width} * img.height;
  if (pixels > limits.max_pixels) {
    png_image_free(&img);
    throw FormatError("has " + std::to_string(img.width) + "x" + std::to_string(img.height) +
                          " pixels, over the limit of " + std::to_string(limits.max_pixels),
                      where);
  }
  try {
    check_image_data_holds(bytes, img.width, img.height, idat, where);
  } catch (...) {
    png_image_free(&img);
    throw;
  }
  img.format = PNG_FORMAT_RGBA;
  std::vector<std::uint8_t> rgba(pixels * 4);
  if (png_image_finish_read(&img, nullptr, rgba.data(), 0, nullptr) == 0)
    throw FormatError(std::string("cannot be decoded: ") + img.message, where);
  width = img.width;
  height = img.height;
  return rgba;
}

inline PngFile decode_png(std::span<const char> bytes, const std::string& where,
                          const PngLimits& limits = {}) {
  PngFile out;
  std::uint32_t w = 0, h = 0;
  // Read as RGBA and drop alpha rather than composite it: PIL's convert('RGB') keeps the stored
  // RGB values, and the web UI's embedding images are decoded from exactly those values.
  const std::vector<std::uint8_t> rgba = decode_png_rgba(bytes, where, limits, w, h, &out.text);
  const std::uint64_t pixels = std::uint64_t{w} * h;
  out.image = RgbImage(w, h);
  for (std::uint64_t i = 0; i < pixels; ++i)
    std::memcpy(out.image.pixels.data() + i * 3, rgba.data() + i * 4, 3);
  return out;
}

inline PngFile read_png(const std::filesystem::path& path, const PngLimits& limits = {}) {
  const std::vector<char> bytes = read_file(path);
  return decode_png(bytes, path.string(), limits);
}

/// Encodes an RGB image with text chunks (tEXt for Latin-1 text, as PIL writes them).
inline std::vector<char> encode_png(const RgbImage& image,
                                    const std::map<std::string, std::string>& text = {}) {
  using namespace png_detail;
  if (image.width == 0 || image.height == 0 ||
      image.pixels.size() != std::size_t{image.width} * image.height * 3)
    throw ShapeError("an image of " + std::to_string(image.width) + "x" +
                         std::to_string(image.height) + " needs " +
                         std::to_string(std::size_t{image.width} * image.height * 3) +
                         " bytes of RGB, has " + std::to_string(image.pixels.size()),
                     "encode_png");
  png_image img{};
  img.version = PNG_IMAGE_VERSION;
  img.width = image.width;
  img.height = image.height;
  img.format = PNG_FORMAT_RGB;
  png_alloc_size_t size = 0;
  if (png_image_write_get_memory_size(img, size, 0, image.pixels.data(), 0, nullptr) == 0)
    throw FormatError(std::string("cannot be encoded: ") + img.message, "encode_png");
  std::vector<char> raw(size);
  if (png_image_write_to_memory(&img, raw.data(), &size, 0, image.pixels.data(), 0, nullptr) == 0)
    throw FormatError(std::string("cannot be encoded: ") + img.message, "encode_png");
  raw.resize(size);
  // Text chunks go right after IHDR (signature 8 bytes + IHDR 25 bytes).
  std::vector<char> out(raw.begin(), raw.begin() + 33);
  for (const auto& [key, value] : text) {
    if (key.empty() || key.size() > 79 || key.find('\0') != std::string::npos)
      throw ConfigError("a PNG text keyword has 1 to 79 characters and no NUL: '" + key + "'",
                        "encode_png");
    std::vector<char> body(key.begin(), key.end());
    body.push_back('\0');
    body.insert(body.end(), value.begin(), value.end());
    append_chunk(out, "tEXt", body);
  }
  out.insert(out.end(), raw.begin() + 33, raw.end());
  return out;
}

/// Writes a PNG atomically.
inline void write_png(const std::filesystem::path& path, const RgbImage& image,
                      const std::map<std::string, std::string>& text = {}) {
  write_file_atomic(path, encode_png(image, text));
}

}  // namespace difftrain::io
