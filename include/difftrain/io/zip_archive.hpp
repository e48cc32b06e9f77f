#pragma once
// The zip container of torch.save files, read from memory with every declared number checked
// before it is used. LibTorch's own reader inflates some records while it opens the archive (a
// 1 GB `version` record in a 1 KB file is inflated before any caller can refuse it) and never
// checks a record's CRC-32, so a flipped byte in a weight loads silently. This reader reads only
// the central directory when it opens, inflates a record only when asked and never past the size
// the directory declares (and no further than deflate's 1032:1 ratio allows), and checks every
// record's CRC-32 before handing its bytes out.

#include <zlib.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/io/inflate.hpp"

namespace difftrain::io {

/// One record as the central directory declares it.
struct ZipRecord {
  std::string name;  // without the archive's top folder
  std::uint16_t method = 0;
  std::uint32_t crc32 = 0;
  std::uint64_t compressed_size = 0;
  std::uint64_t size = 0;
  std::uint64_t data_offset = 0;  // of the record's bytes, past its local header
};

class ZipArchive {
 public:
  /// Reads the directory of the archive held in `bytes` (which must outlive this object). Records
  /// live under one top folder (torch.save names it after the file); lookups leave it out.
  ZipArchive(std::span<const char> bytes, std::string where)
      : bytes_(bytes), where_(std::move(where)) {
    read_directory();
  }

  [[nodiscard]] bool contains(const std::string& name) const { return records_.count(name) != 0; }
  [[nodiscard]] const std::map<std::string, ZipRecord>& records() const { return records_; }
  [[nodiscard]] const std::string& top_folder() const { return top_; }

  /// The record's declared (uncompressed) size.
  [[nodiscard]] std::uint64_t size_of(const std::string& name) const { return record(name).size; }

  /// Copies the record's bytes into `out` (which must hold size_of(name) bytes), inflating a
  /// deflated record, and checks its CRC-32.
  void read_into(const std::string& name, void* out) const {
    const ZipRecord& r = record(name);
    const std::string here = where_ + " record '" + top_ + "/" + name + "'";
    const auto* src = reinterpret_cast<const unsigned char*>(bytes_.data()) + r.data_offset;
    if (r.method == 0) {
      if (r.size != 0) std::memcpy(out, src, r.size);
    } else {
      const std::string data =
          inflate_capped({src, r.compressed_size}, r.size, here, Compression::raw);
      if (data.size() != r.size)
        throw FormatError("inflates to " + std::to_string(data.size()) +
                              " bytes, its directory "
                              "entry declares " +
                              std::to_string(r.size),
                          here);
      if (r.size != 0) std::memcpy(out, data.data(), r.size);
    }
    const std::uint32_t got = checksum(out, r.size);
    if (got != r.crc32)
      throw FormatError("fails its CRC-32 check (stored " + hex(r.crc32) + ", computed " +
                            hex(got) + "): the file is corrupted",
                        here);
  }

  /// The record's bytes as a string (small records: byteorder, data.pkl).
  [[nodiscard]] std::string read(const std::string& name) const {
    std::string out(static_cast<std::size_t>(size_of(name)), '\0');
    read_into(name, out.data());
    return out;
  }

  /// CRC-32 as zip computes it, in pieces zlib's 32-bit lengths can take.
  static std::uint32_t checksum(const void* data, std::uint64_t n) {
    uLong c = crc32(0L, Z_NULL, 0);
    const auto* p = static_cast<const Bytef*>(data);
    while (n > 0) {
      const auto chunk = static_cast<uInt>(std::min<std::uint64_t>(n, 1U << 30));
      c = crc32(c, p, chunk);
      p += chunk;
      n -= chunk;
    }
    return static_cast<std::uint32_t>(c);
  }

 private:
  static std::string hex(std::uint32_t v) {
    static const char* digits = "0123456789abcdef";
    std::string s = "0x";
    for (int shift = 28; shift >= 0; shift -= 4) s += digits[(v >> shift) & 0xf];
    return s;
  }

  [[noreturn]] void fail(const std::string& what, std::uint64_t at) const {
    throw FormatError("zip " + what + " (byte " + std::to_string(at) + ")", where_);
  }
  const ZipRecord& record(const std::string& name) const {
    const auto it = records_.find(name);
    if (it == records_.end()) throw FormatError("has no record '" + name + "'", where_);
    return it->second;
  }

  // Little-endian fields at `at`, refusing reads past the end.
  template <typename T>
  T le(std::uint64_t at) const {
    if (at > bytes_.size() || sizeof(T) > bytes_.size() - at) fail("structure is truncated", at);
    T v = 0;
    for (std::size_t i = 0; i < sizeof(T); ++i)
      v |= static_cast<T>(static_cast<unsigned char>(bytes_[at + i])) << (8 * i);
    return v;
  }

  void read_directory() {
    const std::uint64_t n = bytes_.size();
    // End-of-central-directory record: 22 bytes plus a comment of at most 65535.
    if (n < 22) fail("archive is too short to have a directory", 0);
    std::uint64_t eocd = n;
    for (std::uint64_t at = n - 22 + 1; at-- > 0 && n - at <= 22 + 65535;) {
      if (le<std::uint32_t>(at) == 0x06054b50 && at + 22 + le<std::uint16_t>(at + 20) == n) {
        eocd = at;
        break;
      }
    }
    if (eocd == n) fail("archive has no end-of-directory record", n);
    if (le<std::uint16_t>(eocd + 4) != 0 || le<std::uint16_t>(eocd + 6) != 0)
      fail("archive spans several disks", eocd);
    std::uint64_t entries = le<std::uint16_t>(eocd + 10);
    std::uint64_t dir_size = le<std::uint32_t>(eocd + 12);
    std::uint64_t dir_offset = le<std::uint32_t>(eocd + 16);
    if (entries == 0xffff || dir_size == 0xffffffff || dir_offset == 0xffffffff) {
      // Zip64: a locator just before the record points at the zip64 end-of-directory record.
      if (eocd < 20 || le<std::uint32_t>(eocd - 20) != 0x07064b50)
        fail("archive needs a zip64 directory but has no locator", eocd);
      const std::uint64_t z = le<std::uint64_t>(eocd - 12);
      if (le<std::uint32_t>(z) != 0x06064b50) fail("zip64 end-of-directory record is missing", z);
      entries = le<std::uint64_t>(z + 32);
      dir_size = le<std::uint64_t>(z + 40);
      dir_offset = le<std::uint64_t>(z + 48);
    }
    if (dir_offset > n || dir_size > n - dir_offset) fail("directory lies outside the file", eocd);
    if (entries > dir_size / 46) fail("directory declares more records than it can hold", eocd);
    std::uint64_t at = dir_offset;
    for (std::uint64_t i = 0; i < entries; ++i) at = read_entry(at, dir_offset + dir_size);
    if (records_.empty()) fail("archive holds no records", eocd);
  }

  // One central-directory entry at `at`; returns where the next one starts.
  std::uint64_t read_entry(std::uint64_t at, std::uint64_t dir_end) {
    if (le<std::uint32_t>(at) != 0x02014b50) fail("directory entry has a wrong signature", at);
    const auto flags = le<std::uint16_t>(at + 8);
    ZipRecord r;
    r.method = le<std::uint16_t>(at + 10);
    r.crc32 = le<std::uint32_t>(at + 16);
    r.compressed_size = le<std::uint32_t>(at + 20);
    r.size = le<std::uint32_t>(at + 24);
    const std::uint64_t name_len = le<std::uint16_t>(at + 28);
    const std::uint64_t extra_len = le<std::uint16_t>(at + 30);
    const std::uint64_t comment_len = le<std::uint16_t>(at + 32);
    std::uint64_t local = le<std::uint32_t>(at + 42);
    const std::uint64_t next = at + 46 + name_len + extra_len + comment_len;
    if (next > dir_end) fail("directory entry runs past the directory", at);
    std::string full(bytes_.data() + at + 46, name_len);
    // Zip64 extra field: the 64-bit values of whichever 32-bit fields are saturated, in order.
    for (std::uint64_t e = at + 46 + name_len; e + 4 <= at + 46 + name_len + extra_len;) {
      const auto id = le<std::uint16_t>(e);
      const std::uint64_t len = le<std::uint16_t>(e + 2);
      if (e + 4 + len > at + 46 + name_len + extra_len) fail("extra field is truncated", e);
      if (id == 0x0001) {
        std::uint64_t f = e + 4;
        auto take = [&](std::uint64_t& field) {
          if (field != 0xffffffff) return;
          if (f + 8 > e + 4 + len) fail("zip64 extra field is truncated", e);
          field = le<std::uint64_t>(f);
          f += 8;
        };
        take(r.size);
        take(r.compressed_size);
        take(local);
      }
      e += 4 + len;
    }
    if (flags & 1U) fail("record '" + full + "' is encrypted", at);
    if (r.method != 0 && r.method != 8)
      fail("record '" + full + "' uses compression method " + std::to_string(r.method) +
               " (only stored and deflate are read)",
           at);
    if (r.method == 0 && r.compressed_size != r.size)
      fail("stored record '" + full + "' declares different sizes", at);
    if (r.method == 8 && r.size > r.compressed_size * kMaxDeflateRatio + 64)
      fail("record '" + full + "' declares " + std::to_string(r.size) + " bytes from " +
               std::to_string(r.compressed_size) + " compressed, more than deflate can expand",
           at);
    // The local header repeats the name; its own extra field may differ in length.
    if (le<std::uint32_t>(local) != 0x04034b50)
      fail("record '" + full + "' has no local header", local);
    const std::uint64_t local_name = le<std::uint16_t>(local + 26);
    const std::uint64_t local_extra = le<std::uint16_t>(local + 28);
    r.data_offset = local + 30 + local_name + local_extra;
    if (r.data_offset > bytes_.size() || r.compressed_size > bytes_.size() - r.data_offset)
      fail("record '" + full + "' runs past the end of the file", local);
    if (local_name != name_len ||
        std::memcmp(bytes_.data() + local + 30, full.data(), name_len) != 0)
      fail("record '" + full + "' has a local header naming another record", local);
    // torch.save puts every record under one top folder.
    const auto slash = full.find('/');
    if (slash == std::string::npos || slash == 0)
      fail("record '" + full + "' is not inside the archive's top folder", at);
    const std::string top = full.substr(0, slash);
    if (top_.empty()) top_ = top;
    if (top != top_) fail("record '" + full + "' lies outside the top folder '" + top_ + "'", at);
    r.name = full.substr(slash + 1);
    if (!records_.emplace(r.name, r).second) fail("archive holds record '" + full + "' twice", at);
    return next;
  }

  std::span<const char> bytes_;
  std::string where_;
  std::string top_;
  std::map<std::string, ZipRecord> records_;
};

}  // namespace difftrain::io
