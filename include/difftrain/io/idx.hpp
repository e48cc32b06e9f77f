#pragma once
// IDX files (the MNIST / Fashion-MNIST format), plain or gzip-compressed: a magic of two zero
// bytes, a type code and a dimension count, the big-endian dimensions, then the values in row-major
// order. The declared size must match the data exactly; anything else is a FormatError naming the
// file.

#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/io/inflate.hpp"
#include "difftrain/io/read_file.hpp"

namespace difftrain::io {

/// What an IDX header declares: the stored type, the shape, and so the file's exact size.
struct IdxHeader {
  at::ScalarType type = at::kByte;
  std::size_t item = 1;
  std::vector<std::int64_t> shape;
  std::uint64_t count = 1;
  std::size_t header_bytes = 0;
  [[nodiscard]] std::uint64_t file_bytes() const { return header_bytes + count * item; }
};

/// Reads the header at the start of `p` (n bytes of it are available).
inline IdxHeader parse_idx_header(const unsigned char* p, std::size_t n, const std::string& where) {
  if (n < 4 || p[0] != 0 || p[1] != 0)
    throw FormatError("is not an IDX file (the first two bytes must be zero)", where);
  IdxHeader h;
  switch (p[2]) {
    case 0x08:
      h.type = at::kByte, h.item = 1;
      break;
    case 0x09:
      h.type = at::kChar, h.item = 1;
      break;
    case 0x0B:
      h.type = at::kShort, h.item = 2;
      break;
    case 0x0C:
      h.type = at::kInt, h.item = 4;
      break;
    case 0x0D:
      h.type = at::kFloat, h.item = 4;
      break;
    case 0x0E:
      h.type = at::kDouble, h.item = 8;
      break;
    default:
      throw FormatError("has unknown type code " + std::to_string(int{p[2]}), where);
  }
  const std::size_t dims = p[3];
  if (dims == 0 || n < 4 + 4 * dims) throw FormatError("has a truncated header", where);
  for (std::size_t d = 0; d < dims; ++d) {
    const unsigned char* q = p + 4 + 4 * d;
    const std::uint32_t s = (std::uint32_t{q[0]} << 24) | (std::uint32_t{q[1]} << 16) |
                            (std::uint32_t{q[2]} << 8) | q[3];
    h.shape.push_back(s);
    if (s != 0 && h.count > (std::uint64_t{1} << 40) / s)
      throw FormatError("declares a size that overflows", where);
    h.count *= s;
  }
  h.header_bytes = 4 + 4 * dims;
  return h;
}

/// Parses IDX bytes (already decompressed) into a tensor of the stored type and shape.
inline at::Tensor parse_idx(const unsigned char* p, std::size_t n, const std::string& where) {
  const IdxHeader h = parse_idx_header(p, n, where);
  const at::ScalarType type = h.type;
  const std::size_t item = h.item;
  const std::vector<std::int64_t>& shape = h.shape;
  const std::uint64_t count = h.count;
  const std::size_t header = h.header_bytes;
  if (count * item != n - header)
    throw FormatError("declares " + std::to_string(count) + " values (" +
                          c10::str(at::IntArrayRef(shape)) + ") but holds " +
                          std::to_string((n - header) / item),
                      where);
  at::Tensor out = at::empty(shape, at::TensorOptions().dtype(type));
  auto* dst = static_cast<unsigned char*>(out.data_ptr());
  std::memcpy(dst, p + header, count * item);
  // Values are big-endian: swap multi-byte ones in place.
  if (item > 1)
    for (std::uint64_t i = 0; i < count; ++i)
      for (std::size_t a = 0, b = item - 1; a < b; ++a, --b)
        std::swap(dst[i * item + a], dst[i * item + b]);
  return out;
}

/// Reads an IDX file, gunzipping it when it starts with the gzip magic.
inline at::Tensor read_idx(const std::filesystem::path& path) {
  const std::vector<char> raw = read_file(path);
  const std::string where = path.string();
  if (raw.size() >= 2 && static_cast<unsigned char>(raw[0]) == 0x1f &&
      static_cast<unsigned char>(raw[1]) == 0x8b) {
    // Inflate the header first: it says how many bytes the whole may hold, and no more are
    // inflated (a gzip bomb stops there instead of filling memory).
    const std::span<const unsigned char> gz(reinterpret_cast<const unsigned char*>(raw.data()),
                                            raw.size());
    const std::string head = inflate_head(gz, 4 + 4 * 255, where, Compression::gzip);
    const IdxHeader h =
        parse_idx_header(reinterpret_cast<const unsigned char*>(head.data()), head.size(), where);
    if (h.file_bytes() > raw.size() * kMaxDeflateRatio + 1024)
      throw FormatError("declares " + std::to_string(h.file_bytes()) + " bytes, more than its " +
                            std::to_string(raw.size()) + " gzip bytes can hold",
                        where);
    const std::string bytes = inflate_capped(gz, h.file_bytes(), where, Compression::gzip);
    return parse_idx(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), where);
  }
  return parse_idx(reinterpret_cast<const unsigned char*>(raw.data()), raw.size(), where);
}

}  // namespace difftrain::io
