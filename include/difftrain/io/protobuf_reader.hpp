#pragma once
// Reading protocol-buffer messages field by field (the wire format only, no schema compiler):
// enough for the few files difftrain reads that are protobufs, such as SentencePiece's
// `spiece.model`. Every length and varint is bounds-checked; a damaged message is a FormatError
// naming the byte offset.

#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>

#include "difftrain/core/error.hpp"

namespace difftrain::io {

class ProtoReader {
 public:
  enum class Wire : std::uint8_t { varint = 0, fixed64 = 1, bytes = 2, fixed32 = 5 };

  struct Field {
    std::uint32_t number = 0;
    Wire wire = Wire::varint;
    std::uint64_t varint = 0;  ///< the value of a varint field
    std::uint64_t fixed = 0;   ///< the bits of a fixed32 / fixed64 field
    std::string_view bytes;    ///< the payload of a length-delimited field
    std::size_t offset = 0;    ///< where the field starts, for messages
  };

  /// `where` names the message in errors; `base` is its offset in the enclosing file.
  ProtoReader(std::string_view data, std::string where, std::size_t base = 0)
      : data_(data), where_(std::move(where)), base_(base) {}

  [[nodiscard]] bool done() const noexcept { return pos_ >= data_.size(); }

  /// The next field; call only while !done().
  Field next() {
    Field f;
    f.offset = base_ + pos_;
    const std::uint64_t key = varint();
    if ((key >> 3) == 0 || (key >> 3) > 0x1FFFFFFF) fail("a field number of 0 or out of range");
    f.number = static_cast<std::uint32_t>(key >> 3);
    switch (key & 7) {
      case 0:
        f.wire = Wire::varint;
        f.varint = varint();
        break;
      case 1:
        f.wire = Wire::fixed64;
        f.fixed = fixed(8);
        break;
      case 2: {
        f.wire = Wire::bytes;
        const std::uint64_t n = varint();
        if (n > data_.size() - pos_)
          fail("a length of " + std::to_string(n) + " bytes past the end of the message");
        f.bytes = data_.substr(pos_, static_cast<std::size_t>(n));
        pos_ += static_cast<std::size_t>(n);
        break;
      }
      case 5:
        f.wire = Wire::fixed32;
        f.fixed = fixed(4);
        break;
      default:
        fail("wire type " + std::to_string(key & 7) + ", which this reader does not know");
    }
    return f;
  }

  /// A nested message's reader, with offsets that stay those of the file.
  [[nodiscard]] ProtoReader message(const Field& f, const std::string& name) const {
    expect(f, Wire::bytes, name);
    const auto at = static_cast<std::size_t>(f.bytes.data() - data_.data());
    return ProtoReader(f.bytes, where_ + " " + name, base_ + at);
  }

  [[nodiscard]] float as_float(const Field& f, const std::string& name) const {
    expect(f, Wire::fixed32, name);
    const auto bits = static_cast<std::uint32_t>(f.fixed);
    float v = 0;
    std::memcpy(&v, &bits, sizeof v);
    return v;
  }
  [[nodiscard]] std::int64_t as_int(const Field& f, const std::string& name) const {
    expect(f, Wire::varint, name);
    return static_cast<std::int64_t>(f.varint);  // int32 negatives are ten-byte varints
  }
  [[nodiscard]] std::string_view as_bytes(const Field& f, const std::string& name) const {
    expect(f, Wire::bytes, name);
    return f.bytes;
  }

  [[nodiscard]] const std::string& where() const noexcept { return where_; }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw FormatError("damaged protobuf: " + what + " at byte " + std::to_string(base_ + pos_),
                      where_);
  }
  void expect(const Field& f, Wire w, const std::string& name) const {
    if (f.wire != w)
      throw FormatError("field " + std::to_string(f.number) + " (" + name +
                            ") has the wrong wire type at byte " + std::to_string(f.offset),
                        where_);
  }
  std::uint64_t varint() {
    std::uint64_t v = 0;
    for (int shift = 0; shift < 70; shift += 7) {
      if (pos_ >= data_.size()) fail("a varint cut off by the end of the message");
      const auto b = static_cast<std::uint8_t>(data_[pos_++]);
      if (shift == 63 && b > 1) fail("a varint longer than 64 bits");
      v |= static_cast<std::uint64_t>(b & 0x7F) << shift;
      if ((b & 0x80) == 0) return v;
    }
    fail("a varint longer than ten bytes");
  }
  std::uint64_t fixed(std::size_t n) {
    if (data_.size() - pos_ < n) fail("a fixed-width value cut off by the end of the message");
    std::uint64_t v = 0;
    for (std::size_t i = 0; i < n; ++i)
      v |= static_cast<std::uint64_t>(static_cast<std::uint8_t>(data_[pos_ + i])) << (8 * i);
    pos_ += n;
    return v;
  }

  std::string_view data_;
  std::string where_;
  std::size_t base_ = 0;
  std::size_t pos_ = 0;
};

}  // namespace difftrain::io
