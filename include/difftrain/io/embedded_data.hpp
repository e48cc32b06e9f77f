#pragma once
// Data hidden in a PNG the way the web UI shares textual-inversion embeddings. The data (a dict
// with tensors) is JSON, tensors written as {"TORCHTENSOR": nested lists}. Two carriers, usually
// both in the same file:
//   * a tEXt chunk `sd-ti-embedding` holding base64(JSON);
//   * the image-data variant: zlib(JSON) split into low and high nibbles, laid out as two RGB
//     blocks to the left and right of the picture, each separated from it by one black column and
//     XOR-ed with a fixed LCG sequence. The reader crops black borders, finds the separators as the
//     outermost all-black columns (after masking to the low nibble) and reverses the steps.
// Decoded tensors are float64 (or int64/bool), as numpy makes them from JSON lists.

#include <ATen/ATen.h>
#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/io/json_parse.hpp"
#include "difftrain/io/png.hpp"
#include "difftrain/io/torch_file.hpp"

namespace difftrain::io {

inline constexpr const char* kEmbeddingTextKey = "sd-ti-embedding";

namespace embedded_detail {
inline constexpr int kMaxDepth = 64;

// The web UI's sequence: seed = (1664525 * seed + 1013904223) mod 2^32, yielding seed % 255.
class Lcg {
 public:
  std::uint8_t next() {
    seed_ = 1664525u * seed_ + 1013904223u;
    return static_cast<std::uint8_t>(seed_ % 255u);
  }

 private:
  std::uint32_t seed_ = 0;
};

inline std::string base64_encode(std::string_view in) {
  static constexpr char kAlphabet[] =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  std::size_t i = 0;
  for (; i + 2 < in.size(); i += 3) {
    const std::uint32_t v = (std::uint32_t{static_cast<unsigned char>(in[i])} << 16) |
                            (std::uint32_t{static_cast<unsigned char>(in[i + 1])} << 8) |
                            static_cast<unsigned char>(in[i + 2]);
    for (int s = 18; s >= 0; s -= 6) out += kAlphabet[(v >> s) & 63];
  }
  if (i < in.size()) {
    std::uint32_t v = std::uint32_t{static_cast<unsigned char>(in[i])} << 16;
    if (i + 1 < in.size()) v |= std::uint32_t{static_cast<unsigned char>(in[i + 1])} << 8;
    out += kAlphabet[(v >> 18) & 63];
    out += kAlphabet[(v >> 12) & 63];
    out += i + 1 < in.size() ? kAlphabet[(v >> 6) & 63] : '=';
    out += '=';
  }
  return out;
}

inline std::string base64_decode(std::string_view in, const std::string& where) {
  auto value = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  std::string out;
  std::uint32_t acc = 0;
  int bits = 0;
  std::size_t pad = 0, digits = 0;
  for (std::size_t i = 0; i < in.size(); ++i) {
    const char c = in[i];
    if (c == ' ' || c == '\n' || c == '\r' || c == '\t') continue;
    if (c == '=') {
      ++pad;
      continue;
    }
    const int v = value(c);
    if (v < 0 || pad != 0)
      throw FormatError("has a character that is not base64 at offset " + std::to_string(i), where);
    ++digits;
    acc = (acc << 6) | static_cast<std::uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += static_cast<char>((acc >> bits) & 0xff);
    }
  }
  if ((digits + pad) % 4 != 0 || pad > 2)
    throw FormatError("has a wrong base64 length or padding", where);
  return out;
}

// JSON → IValue, with {"TORCHTENSOR": [...]} becoming a tensor.
inline void tensor_shape(const nlohmann::ordered_json& j, std::vector<std::int64_t>& shape,
                         std::size_t dim, const std::string& where) {
  if (dim > static_cast<std::size_t>(kMaxDepth))
    throw FormatError("TORCHTENSOR is nested too deeply", where);
  if (!j.is_array()) return;
  if (dim == shape.size())
    shape.push_back(static_cast<std::int64_t>(j.size()));
  else if (shape[dim] != static_cast<std::int64_t>(j.size()))
    throw ShapeError("TORCHTENSOR is ragged (lists of different lengths)", where);
  for (const auto& e : j) tensor_shape(e, shape, dim + 1, where);
}

inline at::Tensor tensor_from_json(const nlohmann::ordered_json& j, const std::string& where) {
  std::vector<std::int64_t> shape;
  tensor_shape(j, shape, 0, where);
  std::vector<const nlohmann::ordered_json*> leaves;
  std::vector<const nlohmann::ordered_json*> stack{&j};
  // Depth-first, in order: push children reversed.
  while (!stack.empty()) {
    const auto* n = stack.back();
    stack.pop_back();
    if (n->is_array()) {
      for (auto it = n->rbegin(); it != n->rend(); ++it) stack.push_back(&*it);
    } else {
      leaves.push_back(n);
    }
  }
  std::int64_t numel = 1;
  for (auto s : shape) numel *= s;
  if (static_cast<std::int64_t>(leaves.size()) != numel)
    throw ShapeError("TORCHTENSOR mixes lists and numbers at the same depth", where);
  bool all_bool = !leaves.empty(), all_int = !leaves.empty();
  for (const auto* l : leaves) {
    if (!l->is_number() && !l->is_boolean())
      throw FormatError("TORCHTENSOR holds a " + std::string(l->type_name()) + ", not a number",
                        where);
    if (l->is_number_unsigned() && l->get<std::uint64_t>() > std::uint64_t(INT64_MAX))
      throw FormatError("TORCHTENSOR holds " + l->dump() + ", too large for int64", where);
    all_bool = all_bool && l->is_boolean();
    all_int = all_int && l->is_number_integer();
  }
  const at::ScalarType type = all_bool ? at::kBool : all_int ? at::kLong : at::kDouble;
  at::Tensor out = at::empty(shape, at::TensorOptions().dtype(type));
  for (std::int64_t i = 0; i < numel; ++i) {
    const auto& l = *leaves[static_cast<std::size_t>(i)];
    if (type == at::kBool)
      out.data_ptr<bool>()[i] = l.get<bool>();
    else if (type == at::kLong)
      out.data_ptr<std::int64_t>()[i] = l.get<std::int64_t>();
    else
      out.data_ptr<double>()[i] = l.is_boolean() ? double(l.get<bool>()) : l.get<double>();
  }
  return out;
}

inline c10::IValue from_json(const nlohmann::ordered_json& j, const std::string& where, int depth) {
  if (depth > kMaxDepth) throw FormatError("is nested too deeply", where);
  switch (j.type()) {
    case nlohmann::json::value_t::null:
      return {};
    case nlohmann::json::value_t::boolean:
      return j.get<bool>();
    case nlohmann::json::value_t::number_integer:
    case nlohmann::json::value_t::number_unsigned:
      if (j.is_number_unsigned() && j.get<std::uint64_t>() > std::uint64_t(INT64_MAX))
        throw FormatError("holds an integer too large for int64", where);
      return j.get<std::int64_t>();
    case nlohmann::json::value_t::number_float:
      return j.get<double>();
    case nlohmann::json::value_t::string:
      return j.get<std::string>();
    case nlohmann::json::value_t::array: {
      auto list = torch_list();
      std::size_t i = 0;
      for (const auto& e : j)
        list.push_back(from_json(e, where + "[" + std::to_string(i++) + "]", depth + 1));
      return list;
    }
    case nlohmann::json::value_t::object: {
      if (j.size() == 1 && j.contains("TORCHTENSOR"))
        return tensor_from_json(j.at("TORCHTENSOR"), where);
      auto dict = torch_dict();
      for (const auto& [k, v] : j.items())
        dict.insert(k, from_json(v, where + "['" + k + "']", depth + 1));
      return dict;
    }
    default:
      throw FormatError("holds a value JSON cannot carry", where);
  }
}

// IValue → JSON; tensors as nested lists of their values (float64 as Python's json writes them).
inline nlohmann::ordered_json tensor_to_json(const at::Tensor& t) {
  const at::Tensor c = t.detach().to(at::kCPU);
  if (c.dim() == 0) {
    if (c.scalar_type() == at::kBool) return c.item<bool>();
    if (at::isIntegralType(c.scalar_type(), false)) return c.item<std::int64_t>();
    return c.item<double>();
  }
  nlohmann::ordered_json out = nlohmann::ordered_json::array();
  for (std::int64_t i = 0; i < c.size(0); ++i) out.push_back(tensor_to_json(c[i]));
  return out;
}

inline nlohmann::ordered_json to_json_with_tensors(const c10::IValue& v, const std::string& where,
                                                   int depth) {
  if (depth > kMaxDepth) throw FormatError("is nested too deeply", where);
  if (v.isTensor()) return {{"TORCHTENSOR", tensor_to_json(v.toTensor())}};
  if (v.isNone()) return nullptr;
  if (v.isBool()) return v.toBool();
  if (v.isInt()) return v.toInt();
  if (v.isDouble()) {
    if (!std::isfinite(v.toDouble()))
      throw NumericError("is not finite; JSON cannot hold it", where);
    return v.toDouble();
  }
  if (v.isString()) return v.toStringRef();
  if (v.isList() || v.isTuple()) {
    const auto& ref = v.isList() ? v.toListRef() : v.toTupleRef().elements();
    nlohmann::ordered_json out = nlohmann::ordered_json::array();
    for (std::size_t i = 0; i < ref.size(); ++i)
      out.push_back(to_json_with_tensors(ref[i], where + "[" + std::to_string(i) + "]", depth + 1));
    return out;
  }
  if (v.isGenericDict()) {
    nlohmann::ordered_json out = nlohmann::ordered_json::object();
    for (const auto& item : v.toGenericDict()) {
      const auto& k = item.key();
      // Python's json writes int keys as their decimal text.
      const std::string key = k.isString() ? k.toStringRef()
                              : k.isInt()  ? std::to_string(k.toInt())
                                          : throw FormatError("has a key JSON cannot carry", where);
      out[key] = to_json_with_tensors(item.value(), where + "['" + key + "']", depth + 1);
    }
    return out;
  }
  throw FormatError("holds a " + TorchValue::kind_of(v) + ", which JSON cannot carry", where);
}

inline TorchValue parse_json_data(std::string_view text, const std::string& where) {
  const auto j = parse_json<nlohmann::ordered_json>(text, where);
  return TorchValue(from_json(j, where, 0), where);
}

// First row of the first tensor found, as shades for the blocks' high nibbles (the web UI draws
// its pattern from the same numbers); decorative only, the reader never looks at high nibbles.
inline std::vector<std::uint8_t> shades_of(const c10::IValue& data) {
  std::vector<const c10::IValue*> stack{&data};
  while (!stack.empty()) {
    const c10::IValue* v = stack.back();
    stack.pop_back();
    if (v->isTensor() && v->toTensor().numel() > 0) {
      at::Tensor row = v->toTensor().detach().to(at::kCPU, at::kDouble).flatten().slice(0, 0, 1024);
      row = row.abs().nan_to_num(0.0, 0.0, 0.0);
      const double peak = row.max().item<double>();
      if (peak > 0) row = row / peak;
      std::vector<std::uint8_t> out;
      for (std::int64_t i = 0; i < row.numel(); ++i)
        out.push_back(static_cast<std::uint8_t>(row[i].item<double>() * 255.0));
      return out;
    }
    if (v->isGenericDict())
      for (const auto& item : v->toGenericDict()) stack.push_back(&item.value());
    if (v->isList())
      for (const auto& e : v->toListRef()) stack.push_back(&e);
  }
  return {128};
}
}  // namespace embedded_detail

/// Where `write_embedded_data` puts the data. The web UI writes and reads both.
enum class EmbedCarrier { text_chunk, image_data, both };

/// The JSON text the web UI would write for `data` (tensors as TORCHTENSOR lists).
inline std::string embedded_json(const c10::IValue& data) {
  return embedded_detail::to_json_with_tensors(data, "embedded data", 0).dump();
}

/// The picture `cover` with `data` laid out around it as the web UI's image-data variant.
inline RgbImage insert_image_data(const RgbImage& cover, const c10::IValue& data) {
  using embedded_detail::Lcg;
  if (cover.height == 0 || cover.width == 0)
    throw ShapeError("the cover image is empty", "insert_image_data");
  const std::string json = embedded_json(data);
  const std::vector<unsigned char> packed = png_detail::deflate_bytes(json, 9);
  const std::size_t h = cover.height, d = 3;
  // Cyclic fill up to whole columns of h pixels, as numpy's resize to the web UI's next_size.
  std::size_t n = packed.size() + (h - packed.size() % h);
  n += h * d - n % (h * d);
  const std::size_t block_w = n / (h * d);
  const std::vector<std::uint8_t> shades = embedded_detail::shades_of(data);
  auto block = [&](bool high) {
    RgbImage b(static_cast<std::uint32_t>(block_w), cover.height);
    Lcg lcg;
    for (std::size_t i = 0; i < n; ++i) {
      const unsigned char byte = packed[i % packed.size()];
      const std::uint8_t nibble = high ? byte >> 4 : byte & 0x0f;
      // A nonzero high nibble on every channel keeps the block from being cropped as black.
      const std::size_t pixel = i / d;
      const std::uint8_t shade =
          shades[(high ? shades.size() - 1 - pixel % shades.size() : pixel % shades.size())];
      const auto style = static_cast<std::uint8_t>((shade & 0xf0) == 0 ? 0x10 : shade & 0xf0);
      b.pixels[i] = static_cast<std::uint8_t>((nibble ^ (lcg.next() & 0x0f)) | style);
    }
    return b;
  };
  const RgbImage low = block(false), high = block(true);
  RgbImage out(cover.width + low.width + high.width + 2, cover.height);
  auto paste = [&](const RgbImage& src, std::uint32_t x0) {
    for (std::uint32_t y = 0; y < src.height; ++y)
      std::memcpy(out.at(x0, y), src.at(0, y), std::size_t{src.width} * 3);
  };
  paste(low, 0);
  paste(cover, low.width + 1);
  paste(high, low.width + 1 + cover.width + 1);
  return out;
}

/// The data of the image-data variant, or nothing when the picture carries none (fewer than two
/// black separator columns: an ordinary preview image). Corrupt data is a FormatError.
inline std::optional<TorchValue> extract_image_data(const RgbImage& image, const std::string& where,
                                                    std::uint64_t max_json_bytes = std::uint64_t{1}
                                                                                   << 28) {
  using embedded_detail::Lcg;
  const std::uint32_t w = image.width, h = image.height;
  if (w == 0 || h == 0) return std::nullopt;
  // Crop rows and columns that have no pixel with all three channels nonzero (numpy argmax rules:
  // with no such pixel at all, nothing is cropped).
  std::vector<bool> col_any(w, false), row_any(h, false);
  for (std::uint32_t y = 0; y < h; ++y)
    for (std::uint32_t x = 0; x < w; ++x) {
      const auto* p = image.at(x, y);
      if (p[0] > 0 && p[1] > 0 && p[2] > 0) col_any[x] = row_any[y] = true;
    }
  auto first = [](const std::vector<bool>& v) {
    for (std::size_t i = 0; i < v.size(); ++i)
      if (v[i]) return i;
    return std::size_t{0};
  };
  auto end = [](const std::vector<bool>& v) {
    for (std::size_t i = v.size(); i > 0; --i)
      if (v[i - 1]) return i;
    return v.size();
  };
  // A picture with no lit pixel at all (all black, or every pixel missing a channel) carries no
  // data blocks: the data and its cover are drawn with all three channels lit.
  if (std::find(col_any.begin(), col_any.end(), true) == col_any.end()) return std::nullopt;
  const std::size_t x0 = first(col_any), x1 = end(col_any), y0 = first(row_any), y1 = end(row_any);
  if (x1 <= x0 || y1 <= y0) return std::nullopt;
  const std::size_t cw = x1 - x0, ch = y1 - y0;
  auto nib = [&](std::size_t x, std::size_t y, std::size_t c) {
    return static_cast<std::uint8_t>(
        image.at(static_cast<std::uint32_t>(x0 + x), static_cast<std::uint32_t>(y0 + y))[c] & 0x0f);
  };
  std::optional<std::size_t> black_min, black_max;
  for (std::size_t x = 0; x < cw; ++x) {
    bool black = true;
    for (std::size_t y = 0; y < ch && black; ++y)
      for (std::size_t c = 0; c < 3 && black; ++c) black = nib(x, y, c) == 0;
    if (black) {
      if (!black_min) black_min = x;
      black_max = x;
    }
  }
  if (!black_min || *black_min == *black_max) return std::nullopt;
  const std::size_t low_w = *black_min, high_x = *black_max + 1, high_w = cw - high_x;
  if (low_w != high_w || low_w == 0)
    throw FormatError("has data blocks of different widths (" + std::to_string(low_w) + " and " +
                          std::to_string(high_w) + " columns)",
                      where);
  std::vector<unsigned char> bytes(ch * low_w * 3);
  Lcg lcg_low, lcg_high;
  std::size_t i = 0;
  for (std::size_t y = 0; y < ch; ++y)
    for (std::size_t x = 0; x < low_w; ++x)
      for (std::size_t c = 0; c < 3; ++c, ++i) {
        const auto lo = static_cast<std::uint8_t>(nib(x, y, c) ^ (lcg_low.next() & 0x0f));
        const auto hi = static_cast<std::uint8_t>(nib(high_x + x, y, c) ^ (lcg_high.next() & 0x0f));
        bytes[i] = static_cast<unsigned char>((hi << 4) | lo);
      }
  const std::string json = inflate_capped(bytes, max_json_bytes, where + " (image data)");
  return embedded_detail::parse_json_data(json, where + " (image data)");
}

/// Reads data embedded in a PNG: the text chunk if present, else the image-data variant.
/// Nothing when the PNG carries neither (the web UI then treats it as a preview picture).
inline std::optional<TorchValue> read_embedded_data(const std::filesystem::path& path,
                                                    const PngLimits& limits = {}) {
  const PngFile png = read_png(path, limits);
  const std::string where = path.string();
  if (const auto it = png.text.find(kEmbeddingTextKey); it != png.text.end())
    return embedded_detail::parse_json_data(
        embedded_detail::base64_decode(it->second, where + " text '" + kEmbeddingTextKey + "'"),
        where + " text '" + kEmbeddingTextKey + "'");
  return extract_image_data(png.image, where, limits.max_text_bytes);
}

/// Writes `data` into a PNG built on `cover`, atomically.
inline void write_embedded_data(const std::filesystem::path& path, const RgbImage& cover,
                                const c10::IValue& data,
                                EmbedCarrier carrier = EmbedCarrier::both) {
  std::map<std::string, std::string> text;
  if (carrier != EmbedCarrier::image_data)
    text[kEmbeddingTextKey] = embedded_detail::base64_encode(embedded_json(data));
  const RgbImage picture =
      carrier == EmbedCarrier::text_chunk ? cover : insert_image_data(cover, data);
  write_png(path, picture, text);
}

}  // namespace difftrain::io
