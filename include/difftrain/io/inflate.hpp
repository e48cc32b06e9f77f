#pragma once
// zlib and gzip decompression with a cap on the output, for every reader that inflates data from a
// file (PNG text chunks, the embeddings' image data, gzip IDX files): a hostile file cannot make it
// allocate past `cap`, and corrupt or truncated data is a FormatError naming `where`.

#include <zlib.h>

#include <array>
#include <cstdint>
#include <span>
#include <string>

#include "difftrain/core/error.hpp"

namespace difftrain::io {

/// Deflate cannot expand data by more than 1032:1: a header declaring more output than its
/// compressed bytes can give is a lie, refused before anything is inflated or allocated.
inline constexpr std::uint64_t kMaxDeflateRatio = 1032;

/// zlib (PNG), gzip (.gz files) or raw deflate (zip records).
enum class Compression { zlib, gzip, raw };

namespace inflate_detail {
// Inflates until the stream ends, or until `cap` bytes are out: then an error, or (head_only) the
// first `cap` bytes.
inline std::string run(std::span<const unsigned char> in, std::uint64_t cap,
                       const std::string& where, Compression format, bool head_only) {
  z_stream z{};
  const int window = format == Compression::gzip  ? 16 + MAX_WBITS
                     : format == Compression::raw ? -MAX_WBITS
                                                  : MAX_WBITS;
  if (inflateInit2(&z, window) != Z_OK) throw FormatError("zlib init failed", where);
  std::string out;
  std::array<unsigned char, 1 << 16> buf{};
  z.next_in = const_cast<unsigned char*>(in.data());
  z.avail_in = static_cast<uInt>(in.size());
  const char* kind = format == Compression::gzip ? "gzip" : "compressed";
  int rc = Z_OK;
  while (rc != Z_STREAM_END) {
    z.next_out = buf.data();
    z.avail_out = buf.size();
    rc = inflate(&z, Z_NO_FLUSH);
    if (rc != Z_OK && rc != Z_STREAM_END) {
      const std::string msg = z.msg ? z.msg : "error " + std::to_string(rc);
      inflateEnd(&z);
      throw FormatError(std::string(kind) + " data is corrupt (" + msg + ")", where);
    }
    out.append(reinterpret_cast<const char*>(buf.data()), buf.size() - z.avail_out);
    if (head_only && out.size() >= cap) {
      inflateEnd(&z);
      out.resize(static_cast<std::size_t>(cap));
      return out;
    }
    if (out.size() > cap) {
      inflateEnd(&z);
      throw FormatError("inflates to more than " + std::to_string(cap) + " bytes", where);
    }
    if (rc == Z_OK && z.avail_in == 0 && z.avail_out != 0) {
      inflateEnd(&z);
      throw FormatError(std::string(kind) + " data is truncated", where);
    }
  }
  inflateEnd(&z);
  return out;
}

}  // namespace inflate_detail

/// Inflates `in`; data after the end of the stream is ignored (as Python's zlib.decompress does).
/// More than `cap` bytes of output is a FormatError.
inline std::string inflate_capped(std::span<const unsigned char> in, std::uint64_t cap,
                                  const std::string& where,
                                  Compression format = Compression::zlib) {
  return inflate_detail::run(in, cap, where, format, false);
}

/// The first `n` inflated bytes of `in` (fewer when the stream is shorter): enough to read a
/// header and learn how large the whole may legally be.
inline std::string inflate_head(std::span<const unsigned char> in, std::uint64_t n,
                                const std::string& where, Compression format = Compression::zlib) {
  return inflate_detail::run(in, n, where, format, true);
}

}  // namespace difftrain::io
