#pragma once
// Images as the Python training scripts see them: `PIL.Image.open(f)`, `ImageOps.exif_transpose`,
// `.convert("RGB")`. JPEG through libjpeg-turbo's TurboJPEG API, PNG through libpng, WebP through
// libwebp (Debian's packages: the decoders PIL itself wraps, so the pixels are the same; each
// reports errors as return codes, so nothing longjmps across C++ frames).
//
// What PIL does and so this does: grey, grey + alpha and palette images become RGB by repeating
// the grey or looking up the palette; alpha is dropped, not composited; 16-bit PNG colour keeps
// the high byte, 16-bit PNG grey (without alpha) is clipped at 255 (PIL reads it as "I;16" and
// clips on conversion); an animated WebP is its first frame on its canvas (libwebpdemux's
// animation decoder, as PIL's); the gAMA, cHRM, sRGB and iCCP chunks are ignored; the EXIF
// orientation (JPEG APP1, PNG eXIf, WebP EXIF) is applied. A file larger than the pixel limit is
// refused before any pixel memory is allocated (a decompression bomb), as is anything damaged,
// truncated or of another kind: a FormatError naming the file and what is wrong.

#include <ATen/ATen.h>
#include <turbojpeg.h>
#include <webp/decode.h>
#include <webp/demux.h>

#include <csetjmp>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/io/png.hpp"
#include "difftrain/io/read_file.hpp"

namespace difftrain::data {

enum class ImageFormat { jpeg, png, webp };

inline std::string_view format_name(ImageFormat f) {
  switch (f) {
    case ImageFormat::jpeg:
      return "JPEG";
    case ImageFormat::png:
      return "PNG";
    case ImageFormat::webp:
      return "WebP";
  }
  return "?";
}

struct ImageLimits {
  /// PIL's Image.MAX_IMAGE_PIXELS is 89,478,485 (it warns there and refuses at twice that);
  /// difftrain refuses at this many.
  std::uint64_t max_pixels = 89'478'485;
};

/// A decoded image: (height, width, 3) uint8, rows top to bottom, after the EXIF orientation.
struct DecodedImage {
  at::Tensor pixels;
  ImageFormat format = ImageFormat::png;
  int exif_orientation = 1;  ///< 1 to 8 as the file said (1: none), already applied
  std::int64_t stored_width = 0, stored_height = 0;  ///< before the orientation
};

namespace image_detail {

inline std::uint16_t get16(const unsigned char* p, bool little) {
  return little ? static_cast<std::uint16_t>(p[0] | (p[1] << 8))
                : static_cast<std::uint16_t>((p[0] << 8) | p[1]);
}
inline std::uint32_t get32(const unsigned char* p, bool little) {
  return little ? (std::uint32_t{p[0]} | (std::uint32_t{p[1]} << 8) | (std::uint32_t{p[2]} << 16) |
                   (std::uint32_t{p[3]} << 24))
                : ((std::uint32_t{p[0]} << 24) | (std::uint32_t{p[1]} << 16) |
                   (std::uint32_t{p[2]} << 8) | std::uint32_t{p[3]});
}

/// The Orientation tag (0x0112) of IFD0 in a TIFF-structured EXIF block; 1 when absent or out of
/// range (PIL's exif_transpose then leaves the image), never reading past the block.
inline int exif_orientation(std::span<const unsigned char> tiff) {
  if (tiff.size() < 8) return 1;
  bool little = false;
  if (tiff[0] == 'I' && tiff[1] == 'I')
    little = true;
  else if (!(tiff[0] == 'M' && tiff[1] == 'M'))
    return 1;
  if (get16(tiff.data() + 2, little) != 42) return 1;
  const std::uint64_t ifd = get32(tiff.data() + 4, little);
  if (ifd + 2 > tiff.size()) return 1;
  const std::uint16_t n = get16(tiff.data() + ifd, little);
  for (std::uint64_t i = 0; i < n; ++i) {
    const std::uint64_t at = ifd + 2 + 12 * i;
    if (at + 12 > tiff.size()) return 1;
    const unsigned char* e = tiff.data() + at;
    if (get16(e, little) != 0x0112) continue;
    const std::uint16_t type = get16(e + 2, little);
    int v = 0;
    if (type == 3)  // SHORT
      v = get16(e + 8, little);
    else if (type == 4)  // LONG
      v = static_cast<int>(get32(e + 8, little));
    return v >= 1 && v <= 8 ? v : 1;
  }
  return 1;
}

/// The EXIF block of a JPEG: the first APP1 segment starting "Exif\0\0", before the scan.
inline std::span<const unsigned char> jpeg_exif(std::span<const unsigned char> b) {
  std::size_t i = 2;
  while (i + 4 <= b.size()) {
    if (b[i] != 0xFF) return {};
    const unsigned char marker = b[i + 1];
    if (marker == 0xFF) {  // fill byte
      ++i;
      continue;
    }
    if (marker == 0xDA || marker == 0xD9) return {};  // start of scan, end of image
    if (marker == 0x01 || (marker >= 0xD0 && marker <= 0xD7)) {
      i += 2;
      continue;
    }
    const std::size_t len = get16(b.data() + i + 2, false);
    if (len < 2 || i + 2 + len > b.size()) return {};
    if (marker == 0xE1 && len >= 8 && std::memcmp(b.data() + i + 4, "Exif\0\0", 6) == 0)
      return b.subspan(i + 10, len - 8);
    i += 2 + len;
  }
  return {};
}

/// A PNG's eXIf chunk.
inline std::span<const unsigned char> png_exif(std::span<const unsigned char> b) {
  for (std::size_t i = 8; i + 12 <= b.size();) {
    const std::uint64_t len = get32(b.data() + i, false);
    if (i + 12 + len > b.size()) return {};
    if (std::memcmp(b.data() + i + 4, "eXIf", 4) == 0) return b.subspan(i + 8, len);
    if (std::memcmp(b.data() + i + 4, "IDAT", 4) == 0) return {};  // PIL reads it before IDAT
    i += 12 + len;
  }
  return {};
}

/// A WebP's EXIF chunk (extended format), without an "Exif\0\0" prefix if one was written.
inline std::span<const unsigned char> webp_exif(std::span<const unsigned char> b) {
  for (std::size_t i = 12; i + 8 <= b.size();) {
    const std::uint64_t len = get32(b.data() + i + 4, true);
    if (i + 8 + len > b.size()) return {};
    if (std::memcmp(b.data() + i, "EXIF", 4) == 0) {
      auto e = b.subspan(i + 8, len);
      if (e.size() >= 6 && std::memcmp(e.data(), "Exif\0\0", 6) == 0) e = e.subspan(6);
      return e;
    }
    i += 8 + len + (len & 1);
  }
  return {};
}

/// PNG bytes without the colour-management chunks PIL ignores (so libpng converts nothing).
inline std::vector<char> png_without_color_management(std::span<const char> bytes) {
  std::vector<char> out(bytes.begin(), bytes.begin() + std::min<std::size_t>(8, bytes.size()));
  const auto* b = reinterpret_cast<const unsigned char*>(bytes.data());
  std::size_t i = 8;
  for (; i + 12 <= bytes.size();) {
    const std::uint64_t len = get32(b + i, false);
    if (i + 12 + len > bytes.size()) break;
    const bool drop =
        std::memcmp(b + i + 4, "gAMA", 4) == 0 || std::memcmp(b + i + 4, "cHRM", 4) == 0 ||
        std::memcmp(b + i + 4, "sRGB", 4) == 0 || std::memcmp(b + i + 4, "iCCP", 4) == 0;
    if (!drop) out.insert(out.end(), bytes.begin() + i, bytes.begin() + i + 12 + len);
    i += 12 + len;
  }
  out.insert(out.end(), bytes.begin() + i, bytes.end());  // a damaged tail: libpng says what
  return out;
}

inline void check_size(std::uint64_t w, std::uint64_t h, const ImageLimits& limits,
                       const std::string& where) {
  if (w == 0 || h == 0)
    throw FormatError("has no pixels (" + std::to_string(w) + "x" + std::to_string(h) + ")", where);
  if (w * h > limits.max_pixels)
    throw FormatError("has " + std::to_string(w) + "x" + std::to_string(h) + " = " +
                          std::to_string(w * h) + " pixels, over the limit of " +
                          std::to_string(limits.max_pixels) + " (ImageLimits::max_pixels)",
                      where);
}

inline at::Tensor decode_jpeg(std::span<const char> bytes, const ImageLimits& limits,
                              const std::string& where) {
  std::unique_ptr<void, int (*)(tjhandle)> tj(tjInitDecompress(), tjDestroy);
  if (!tj) throw IoError("TurboJPEG cannot start a decompressor", where);
  int w = 0, h = 0, subsampling = 0, colorspace = 0;
  auto* data = reinterpret_cast<const unsigned char*>(bytes.data());
  const auto size = static_cast<unsigned long>(bytes.size());
  if (tjDecompressHeader3(tj.get(), data, size, &w, &h, &subsampling, &colorspace) != 0)
    throw FormatError(std::string("is not a JPEG TurboJPEG can read: ") + tjGetErrorStr2(tj.get()),
                      where);
  check_size(static_cast<std::uint64_t>(w), static_cast<std::uint64_t>(h), limits, where);
  if (colorspace == TJCS_CMYK || colorspace == TJCS_YCCK)
    throw FormatError("is a CMYK JPEG; difftrain reads greyscale and colour (YCbCr, RGB) JPEGs",
                      where);
  at::Tensor out = at::empty({h, w, 3}, at::kByte);
  // Default flags: the accurate integer IDCT and fancy upsampling, libjpeg's defaults, which PIL
  // keeps. A warning (corrupt or truncated data) is an error here, as PIL's "image file is
  // truncated".
  if (tjDecompress2(tj.get(), data, size, out.data_ptr<std::uint8_t>(), w, 0, h, TJPF_RGB,
                    TJFLAG_STOPONWARNING) != 0)
    throw FormatError(std::string("is damaged: ") + tjGetErrorStr2(tj.get()), where);
  return out;
}

/// An animated WebP's first frame as PIL opens it: libwebp's animation decoder composites it on
/// the canvas (transparent black where the frame does not reach), as RGBA; the alpha is dropped,
/// as convert("RGB") drops it. The canvas size has passed the pixel limit already (the decoder
/// allocates it).
inline at::Tensor decode_webp_first_frame(std::span<const char> bytes, const std::string& where) {
  WebPData data{reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size()};
  WebPAnimDecoderOptions options;
  if (WebPAnimDecoderOptionsInit(&options) == 0)
    throw FormatError("cannot be decoded: libwebp's animation decoder is of another version",
                      where);
  options.color_mode = MODE_RGBA;
  options.use_threads = 0;
  const std::unique_ptr<WebPAnimDecoder, void (*)(WebPAnimDecoder*)> decoder(
      WebPAnimDecoderNew(&data, &options), &WebPAnimDecoderDelete);
  WebPAnimInfo info;
  if (!decoder || WebPAnimDecoderGetInfo(decoder.get(), &info) == 0)
    throw FormatError("is an animated WebP whose frames libwebp cannot read (damaged)", where);
  std::uint8_t* rgba = nullptr;
  int timestamp = 0;
  if (WebPAnimDecoderGetNext(decoder.get(), &rgba, &timestamp) == 0 || rgba == nullptr)
    throw FormatError("is damaged or truncated (libwebp cannot decode its first frame)", where);
  const auto h = static_cast<std::int64_t>(info.canvas_height);
  const auto w = static_cast<std::int64_t>(info.canvas_width);
  at::Tensor out = at::empty({h, w, 3}, at::kByte);
  auto* o = out.data_ptr<std::uint8_t>();
  for (std::int64_t i = 0; i < h * w; ++i) std::memcpy(o + 3 * i, rgba + 4 * i, 3);
  return out;
}

inline at::Tensor decode_webp(std::span<const char> bytes, const ImageLimits& limits,
                              const std::string& where) {
  WebPBitstreamFeatures f;
  const auto* data = reinterpret_cast<const std::uint8_t*>(bytes.data());
  if (WebPGetFeatures(data, bytes.size(), &f) != VP8_STATUS_OK)
    throw FormatError("is not a WebP libwebp can read (damaged header)", where);
  check_size(static_cast<std::uint64_t>(f.width), static_cast<std::uint64_t>(f.height), limits,
             where);
  if (f.has_animation != 0) return decode_webp_first_frame(bytes, where);
  at::Tensor out = at::empty({f.height, f.width, 3}, at::kByte);
  if (WebPDecodeRGBInto(data, bytes.size(), out.data_ptr<std::uint8_t>(),
                        static_cast<std::size_t>(out.numel()), f.width * 3) == nullptr)
    throw FormatError("is damaged or truncated (libwebp cannot decode its image data)", where);
  return out;
}

struct PngSource {
  const char* data;
  std::size_t size;
  std::size_t at;
};

/// The image header the caller sized its rows for.
struct PngHeader {
  std::uint32_t width = 0, height = 0;
  int depth = 0, color_type = 0;
};

/// Reads a 16-bit PNG's rows as stored (big-endian samples, interlacing undone) with libpng's
/// full API into `rows`, sized for `expected`: a header libpng reads differently is an error, not
/// rows written past the buffers. Its errors longjmp: this frame holds only trivially
/// destructible objects, and the message is copied out before returning false.
inline bool read_png_rows(const char* data, std::size_t size, const PngHeader& expected,
                          unsigned char** rows, char (&message)[256]) {
  png_structp png = png_create_read_struct(
      PNG_LIBPNG_VER_STRING, message,
      [](png_structp p, png_const_charp msg) {
        std::snprintf(static_cast<char*>(png_get_error_ptr(p)), 256, "%s", msg);
        png_longjmp(p, 1);
      },
      [](png_structp, png_const_charp) {});
  if (png == nullptr) {
    std::snprintf(message, sizeof message, "libpng cannot start a reader");
    return false;
  }
  png_infop info = png_create_info_struct(png);
  PngSource source{data, size, 0};
  if (info == nullptr || setjmp(png_jmpbuf(png))) {
    png_destroy_read_struct(&png, info != nullptr ? &info : nullptr, nullptr);
    return false;
  }
  png_set_read_fn(png, &source, [](png_structp p, png_bytep out, png_size_t n) {
    auto* s = static_cast<PngSource*>(png_get_io_ptr(p));
    if (n > s->size - s->at) png_error(p, "the file ends inside its image data");
    std::memcpy(out, s->data + s->at, n);
    s->at += n;
  });
  png_read_info(png, info);
  if (png_get_image_width(png, info) != expected.width ||
      png_get_image_height(png, info) != expected.height ||
      png_get_bit_depth(png, info) != expected.depth ||
      png_get_color_type(png, info) != expected.color_type)
    png_error(png, "the image header libpng reads differs from the one at the file's start");
  (void)png_set_interlace_handling(png);
  png_read_update_info(png, info);
  png_read_image(png, rows);
  png_read_end(png, nullptr);
  png_destroy_read_struct(&png, &info, nullptr);
  return true;
}

inline at::Tensor decode_png(std::span<const char> bytes, const ImageLimits& limits,
                             const std::string& where) {
  if (bytes.size() < 33) throw FormatError("is truncated before its image header", where);
  // The standard puts IHDR first; its sizes decide the buffers below, so no other chunk may
  // stand in for it (a colour-management chunk before it would be dropped and the real IHDR read).
  if (std::memcmp(bytes.data() + 12, "IHDR", 4) != 0)
    throw FormatError("does not start with its image header (IHDR must be the first chunk)", where);
  const auto* ihdr = reinterpret_cast<const unsigned char*>(bytes.data()) + 16;
  const std::uint64_t w = get32(ihdr, false), h = get32(ihdr + 4, false);
  check_size(w, h, limits, where);
  const int depth = ihdr[8], color_type = ihdr[9];
  const std::vector<char> plain = png_without_color_management(bytes);
  io::PngLimits pl;
  pl.max_pixels = limits.max_pixels;
  if (depth != 16) {
    io::PngFile f = io::decode_png(plain, where, pl);
    return at::from_blob(f.image.pixels.data(),
                         {static_cast<std::int64_t>(f.image.height),
                          static_cast<std::int64_t>(f.image.width), 3},
                         at::kByte)
        .clone();
  }
  // 16 bits per sample, reduced as PIL does: colour and grey + alpha keep the high byte; grey
  // alone, read by PIL as "I;16", is clipped at 255. (libpng's simplified API would convert the
  // samples.)
  const int channels = color_type == 0 ? 1 : color_type == 4 ? 2 : color_type == 2 ? 3 : 4;
  // Its image data must hold what the header declares before the rows are allocated (a 69-byte
  // body declaring 9400x9400 16-bit pixels is a decompression bomb, refused here).
  io::check_png_chunks(plain, w, h, pl, where);
  std::vector<unsigned char> raw(static_cast<std::size_t>(w * h) * channels * 2);
  std::vector<unsigned char*> rows(static_cast<std::size_t>(h));
  for (std::uint64_t y = 0; y < h; ++y) rows[y] = raw.data() + y * w * channels * 2;
  char message[256] = {0};
  const PngHeader header{static_cast<std::uint32_t>(w), static_cast<std::uint32_t>(h), depth,
                         color_type};
  if (!read_png_rows(plain.data(), plain.size(), header, rows.data(), message))
    throw FormatError(std::string("cannot be decoded: ") + message, where);
  at::Tensor out =
      at::empty({static_cast<std::int64_t>(h), static_cast<std::int64_t>(w), 3}, at::kByte);
  auto* o = out.data_ptr<std::uint8_t>();
  const bool grey = channels == 1;  // grey + alpha PIL reads as RGBA, keeping the high byte
  for (std::uint64_t i = 0; i < w * h; ++i) {
    const unsigned char* px = raw.data() + i * channels * 2;
    if (grey) {
      const unsigned v = (unsigned{px[0]} << 8) | px[1];
      o[3 * i] = o[3 * i + 1] = o[3 * i + 2] = static_cast<std::uint8_t>(v > 255 ? 255 : v);
    } else if (channels == 2) {
      o[3 * i] = o[3 * i + 1] = o[3 * i + 2] = px[0];
    } else {
      for (int c = 0; c < 3; ++c) o[3 * i + c] = px[2 * c];
    }
  }
  return out;
}

/// PIL's ImageOps.exif_transpose for orientations 2 to 8.
inline at::Tensor orient(const at::Tensor& hwc, int orientation) {
  switch (orientation) {
    case 2:
      return hwc.flip({1});
    case 3:
      return hwc.flip({0, 1});
    case 4:
      return hwc.flip({0});
    case 5:
      return hwc.transpose(0, 1);
    case 6:
      return hwc.transpose(0, 1).flip({1});  // 90 degrees clockwise
    case 7:
      return hwc.flip({0, 1}).transpose(0, 1);
    case 8:
      return hwc.transpose(0, 1).flip({0});  // 90 degrees counter-clockwise
    default:
      return hwc;
  }
}

}  // namespace image_detail

/// The format of `bytes` from its signature, or a FormatError naming what it looks like.
inline ImageFormat detect_image_format(std::span<const char> bytes, const std::string& where) {
  const auto* b = reinterpret_cast<const unsigned char*>(bytes.data());
  if (bytes.size() >= 3 && b[0] == 0xFF && b[1] == 0xD8 && b[2] == 0xFF) return ImageFormat::jpeg;
  if (bytes.size() >= 8 && std::memcmp(b, "\x89PNG\r\n\x1a\n", 8) == 0) return ImageFormat::png;
  if (bytes.size() >= 12 && std::memcmp(b, "RIFF", 4) == 0 && std::memcmp(b + 8, "WEBP", 4) == 0)
    return ImageFormat::webp;
  std::string what = "an unknown kind of file";
  if (bytes.size() >= 6 && (std::memcmp(b, "GIF87a", 6) == 0 || std::memcmp(b, "GIF89a", 6) == 0))
    what = "a GIF";
  else if (bytes.size() >= 2 && b[0] == 'B' && b[1] == 'M')
    what = "a BMP";
  else if (bytes.size() >= 4 &&
           (std::memcmp(b, "II*\0", 4) == 0 || std::memcmp(b, "MM\0*", 4) == 0))
    what = "a TIFF";
  else if (bytes.empty())
    what = "empty";
  throw FormatError("is " + what + ", not a JPEG, PNG or WebP image (by its first bytes)", where);
}

/// Decodes an image file's bytes as PIL opens, exif-transposes and converts it to RGB.
inline DecodedImage decode_image(std::span<const char> bytes, const std::string& where,
                                 const ImageLimits& limits = {}) {
  using namespace image_detail;
  DecodedImage out;
  out.format = detect_image_format(bytes, where);
  const std::span<const unsigned char> u(reinterpret_cast<const unsigned char*>(bytes.data()),
                                         bytes.size());
  std::span<const unsigned char> exif;
  switch (out.format) {
    case ImageFormat::jpeg:
      out.pixels = decode_jpeg(bytes, limits, where);
      exif = jpeg_exif(u);
      break;
    case ImageFormat::png:
      out.pixels = decode_png(bytes, limits, where);
      exif = png_exif(u);
      break;
    case ImageFormat::webp:
      out.pixels = decode_webp(bytes, limits, where);
      exif = webp_exif(u);
      break;
  }
  out.stored_height = out.pixels.size(0);
  out.stored_width = out.pixels.size(1);
  out.exif_orientation = exif_orientation(exif);
  if (out.exif_orientation != 1) out.pixels = orient(out.pixels, out.exif_orientation).contiguous();
  return out;
}

inline DecodedImage read_image(const std::filesystem::path& path, const ImageLimits& limits = {}) {
  const std::vector<char> bytes = io::read_file(path);
  return decode_image(bytes, path.string(), limits);
}

/// An image's alpha channel as kohya's alpha_mask reads it: (height, width) uint8 after the EXIF
/// orientation `decoded` applied; 255 everywhere for a file without alpha (a JPEG, an RGB PNG or
/// WebP). `decoded` is decode_image's result for the same bytes.
inline at::Tensor decode_alpha(std::span<const char> bytes, const DecodedImage& decoded,
                               const std::string& where, const ImageLimits& limits = {}) {
  using namespace image_detail;
  const std::int64_t h = decoded.stored_height, w = decoded.stored_width;
  at::Tensor alpha;
  if (decoded.format == ImageFormat::png) {
    io::PngLimits pl;
    pl.max_pixels = limits.max_pixels;
    std::uint32_t pw = 0, ph = 0;
    const std::vector<char> plain = png_without_color_management(bytes);
    const std::vector<std::uint8_t> rgba = io::decode_png_rgba(plain, where, pl, pw, ph);
    alpha = at::from_blob(const_cast<std::uint8_t*>(rgba.data()), {ph, pw, 4}, at::kByte)
                .select(2, 3)
                .clone();
  } else if (decoded.format == ImageFormat::webp) {
    WebPBitstreamFeatures f;
    const auto* data = reinterpret_cast<const std::uint8_t*>(bytes.data());
    if (WebPGetFeatures(data, bytes.size(), &f) != VP8_STATUS_OK || f.has_alpha == 0 ||
        f.has_animation != 0) {
      alpha = at::full({h, w}, 255, at::kByte);
    } else {
      at::Tensor rgba = at::empty({f.height, f.width, 4}, at::kByte);
      if (WebPDecodeRGBAInto(data, bytes.size(), rgba.data_ptr<std::uint8_t>(),
                             static_cast<std::size_t>(rgba.numel()), f.width * 4) == nullptr)
        throw FormatError("is damaged or truncated (libwebp cannot decode its alpha)", where);
      alpha = rgba.select(2, 3).clone();
    }
  } else {
    alpha = at::full({h, w}, 255, at::kByte);
  }
  if (decoded.exif_orientation != 1)
    alpha = orient(alpha.unsqueeze(2), decoded.exif_orientation).squeeze(2).contiguous();
  return alpha;
}

}  // namespace difftrain::data
