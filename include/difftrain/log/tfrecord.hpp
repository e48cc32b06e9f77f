#pragma once
// TFRecord framing, the container of TensorBoard's event files:
//   uint64 length | uint32 masked CRC-32C of length | data | uint32 masked CRC-32C of data
// all little-endian. A writer appends whole records; the reader here behaves as TensorBoard's:
// a record cut short at the end of the file (a run still writing, or killed mid-write) ends the
// records without an error, a record whose checksum does not match is a FormatError naming the
// file and the byte offset.

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/io/read_file.hpp"
#include "difftrain/log/crc32c.hpp"

namespace difftrain::log {

namespace tfrecord_detail {
inline void put_le(std::string& out, std::uint64_t v, int n) {
  for (int i = 0; i < n; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}
inline std::uint64_t get_le(const char* p, int n) {
  std::uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}
}  // namespace tfrecord_detail

/// Appends one framed record holding `data` to `out`.
inline void append_record(std::string& out, std::string_view data) {
  using tfrecord_detail::put_le;
  std::string header;
  put_le(header, data.size(), 8);
  out += header;
  put_le(out, mask_crc(crc32c(header)), 4);
  out.append(data);
  put_le(out, mask_crc(crc32c(data)), 4);
}

/// Reads the records of a TFRecord file from memory, in order.
class TfRecordReader {
 public:
  TfRecordReader(std::string bytes, std::string where)
      : bytes_(std::move(bytes)), where_(std::move(where)) {}
  static TfRecordReader open(const std::filesystem::path& path) {
    const std::vector<char> b = io::read_file(path);
    return {std::string(b.begin(), b.end()), path.string()};
  }

  /// The next record; nothing at the end of the file or at a record cut short there (then
  /// truncated() is true). A checksum that does not match is a FormatError.
  std::optional<std::string> next() {
    using tfrecord_detail::get_le;
    const std::size_t left = bytes_.size() - offset_;
    if (left == 0) return std::nullopt;
    if (left < 12) return cut();
    const char* p = bytes_.data() + offset_;
    if (unmask_crc(static_cast<std::uint32_t>(get_le(p + 8, 4))) != crc32c(std::string_view(p, 8)))
      throw FormatError("corrupted record at byte " + std::to_string(offset_) +
                            ": the length's checksum does not match",
                        where_);
    const std::uint64_t n = get_le(p, 8);
    if (n > left - 12 || left - 12 - n < 4) return cut();
    const std::string_view data(p + 12, n);
    if (unmask_crc(static_cast<std::uint32_t>(get_le(p + 12 + n, 4))) != crc32c(data))
      throw FormatError("corrupted record at byte " + std::to_string(offset_) +
                            ": the data's checksum does not match",
                        where_);
    offset_ += 16 + n;
    return std::string(data);
  }
  /// Every record up to the end (or the cut).
  std::vector<std::string> all() {
    std::vector<std::string> out;
    while (auto r = next()) out.push_back(std::move(*r));
    return out;
  }
  [[nodiscard]] bool truncated() const noexcept { return truncated_; }
  [[nodiscard]] std::size_t offset() const noexcept { return offset_; }

 private:
  std::optional<std::string> cut() {
    truncated_ = true;
    return std::nullopt;
  }
  std::string bytes_;
  std::string where_;
  std::size_t offset_ = 0;
  bool truncated_ = false;
};

}  // namespace difftrain::log
