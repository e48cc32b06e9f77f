#pragma once
// The .pt / .bin files that Python's torch.save writes and the web UI and diffusers exchange:
// nested dicts (string or integer keys), lists, tuples, tensors, strings, numbers, bools and None.
// `load_torch_file` reads one and checks it before anything touches tensor data (every tensor's
// extent lies inside its storage, nesting is bounded); `TorchValue` walks the result and names the
// exact path of whatever is missing or of the wrong kind, e.g. `emb.pt['string_to_param']['*']`.

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/io/read_file.hpp"
#include "difftrain/io/torch_pickle.hpp"

namespace difftrain::io {

/// A read-only view of one value inside a loaded torch file, carrying its path for error messages.
class TorchValue {
 public:
  TorchValue(c10::IValue value, std::string where)
      : value_(std::move(value)), where_(std::move(where)) {}

  [[nodiscard]] const c10::IValue& ivalue() const { return value_; }
  [[nodiscard]] const std::string& where() const { return where_; }
  /// Python's name for what this is: dict, list, tuple, tensor, str, int, float, bool, None.
  [[nodiscard]] std::string kind() const { return kind_of(value_); }

  [[nodiscard]] bool is_dict() const { return value_.isGenericDict(); }
  [[nodiscard]] bool is_sequence() const { return value_.isList() || value_.isTuple(); }
  [[nodiscard]] bool is_tensor() const { return value_.isTensor(); }
  [[nodiscard]] bool is_none() const { return value_.isNone(); }
  [[nodiscard]] bool is_string() const { return value_.isString(); }
  [[nodiscard]] bool is_int() const { return value_.isInt(); }

  [[nodiscard]] std::optional<TorchValue> find(std::string_view key) const {
    return find_key(c10::IValue(std::string(key)), "['" + std::string(key) + "']");
  }
  [[nodiscard]] std::optional<TorchValue> find(std::int64_t key) const {
    return find_key(c10::IValue(key), "[" + std::to_string(key) + "]");
  }
  [[nodiscard]] bool contains(std::string_view key) const { return find(key).has_value(); }
  [[nodiscard]] TorchValue at(std::string_view key) const {
    if (auto v = find(key)) return *v;
    throw FormatError("has no key '" + std::string(key) + "'", where_);
  }
  [[nodiscard]] TorchValue at(std::int64_t key) const {
    if (auto v = find(key)) return *v;
    throw FormatError("has no key " + std::to_string(key), where_);
  }

  /// Entries of a dict in file order.
  [[nodiscard]] std::vector<std::pair<c10::IValue, TorchValue>> items() const {
    expect(is_dict(), "dict");
    std::vector<std::pair<c10::IValue, TorchValue>> out;
    for (const auto& item : value_.toGenericDict())
      out.emplace_back(item.key(), TorchValue(item.value(), where_ + key_text(item.key())));
    return out;
  }
  /// Elements of a list or tuple.
  [[nodiscard]] std::vector<TorchValue> elements() const {
    expect(is_sequence(), "list or tuple");
    const auto& ref = value_.isList() ? value_.toListRef() : value_.toTupleRef().elements();
    std::vector<TorchValue> out;
    out.reserve(ref.size());
    for (std::size_t i = 0; i < ref.size(); ++i)
      out.emplace_back(ref[i], where_ + "[" + std::to_string(i) + "]");
    return out;
  }
  [[nodiscard]] std::size_t size() const {
    if (is_dict()) return value_.toGenericDict().size();
    return elements().size();
  }

  [[nodiscard]] at::Tensor tensor() const {
    expect(is_tensor(), "tensor");
    return value_.toTensor();
  }
  [[nodiscard]] std::int64_t integer() const {
    expect(value_.isInt(), "int");
    return value_.toInt();
  }
  /// An int or a float, as double.
  [[nodiscard]] double number() const {
    expect(value_.isInt() || value_.isDouble(), "number");
    return value_.isInt() ? static_cast<double>(value_.toInt()) : value_.toDouble();
  }
  [[nodiscard]] bool boolean() const {
    expect(value_.isBool(), "bool");
    return value_.toBool();
  }
  [[nodiscard]] std::string string() const {
    expect(value_.isString(), "str");
    return value_.toStringRef();
  }
  /// A str, or nothing for None.
  [[nodiscard]] std::optional<std::string> optional_string() const {
    if (is_none()) return std::nullopt;
    return string();
  }
  /// A dict of str → tensor (a state dict, `string_to_param`, a diffusers concept file).
  [[nodiscard]] std::map<std::string, at::Tensor> tensor_map() const {
    std::map<std::string, at::Tensor> out;
    for (const auto& [k, v] : items()) {
      if (!k.isString()) throw FormatError("has a key that is not a string", where_);
      out.emplace(k.toStringRef(), v.tensor());
    }
    return out;
  }

  static std::string kind_of(const c10::IValue& v) {
    if (v.isGenericDict()) return "dict";
    if (v.isList()) return "list";
    if (v.isTuple()) return "tuple";
    if (v.isTensor()) return "tensor";
    if (v.isString()) return "str";
    if (v.isInt()) return "int";
    if (v.isDouble()) return "float";
    if (v.isBool()) return "bool";
    if (v.isNone()) return "None";
    return v.tagKind();
  }

 private:
  static std::string key_text(const c10::IValue& k) {
    if (k.isString()) return "['" + k.toStringRef() + "']";
    if (k.isInt()) return "[" + std::to_string(k.toInt()) + "]";
    return "[<" + kind_of(k) + ">]";
  }
  void expect(bool ok, const char* what) const {
    if (!ok) throw FormatError("is a " + kind() + " where a " + what + " was expected", where_);
  }
  [[nodiscard]] std::optional<TorchValue> find_key(const c10::IValue& key,
                                                   const std::string& text) const {
    expect(is_dict(), "dict");
    const auto d = value_.toGenericDict();
    for (const auto& item : d) {
      const auto& k = item.key();
      const bool same = (k.isString() && key.isString() && k.toStringRef() == key.toStringRef()) ||
                        (k.isInt() && key.isInt() && k.toInt() == key.toInt());
      if (same) return TorchValue(item.value(), where_ + text);
    }
    return std::nullopt;
  }

  c10::IValue value_;
  std::string where_;
};

namespace torch_file_detail {
inline constexpr int kMaxDepth = 64;

// Refuses tensors whose sizes/strides reach outside their storage (a hostile file could otherwise
// make any later read run off the end of a buffer) and nesting deeper than kMaxDepth.
inline void check_value(const c10::IValue& v, const std::string& where, int depth) {
  if (depth > kMaxDepth)
    throw FormatError("is nested more than " + std::to_string(kMaxDepth) + " levels deep", where);
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (!t.defined()) return;
    if (!t.has_storage()) throw FormatError("is a tensor without storage", where);
    const auto sizes = t.sizes();
    const auto strides = t.strides();
    if (t.storage_offset() < 0) throw FormatError("has a negative storage offset", where);
    bool empty = false;
    for (auto s : sizes) empty = empty || s == 0;
    if (empty) return;
    // Largest element index reached, with overflow checks.
    std::uint64_t last = static_cast<std::uint64_t>(t.storage_offset());
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      if (sizes[i] < 0 || strides[i] < 0)
        throw FormatError("has a negative size or stride in dimension " + std::to_string(i), where);
      std::uint64_t reach = 0;
      if (__builtin_mul_overflow(static_cast<std::uint64_t>(sizes[i] - 1),
                                 static_cast<std::uint64_t>(strides[i]), &reach) ||
          __builtin_add_overflow(last, reach, &last))
        throw FormatError("has sizes and strides that overflow", where);
    }
    std::uint64_t need = 0;
    if (__builtin_add_overflow(last, 1, &need) ||
        __builtin_mul_overflow(need, static_cast<std::uint64_t>(t.element_size()), &need))
      throw FormatError("has sizes and strides that overflow", where);
    const auto have = static_cast<std::uint64_t>(t.storage().nbytes());
    if (need > have)
      throw FormatError("reaches byte " + std::to_string(need) + " of a storage of " +
                            std::to_string(have) + " bytes (shape " + c10::str(sizes) +
                            ", strides " + c10::str(strides) + ")",
                        where);
    return;
  }
  if (v.isGenericDict()) {
    for (const auto& item : v.toGenericDict()) {
      const auto& k = item.key();
      const std::string text = k.isString() ? "['" + k.toStringRef() + "']"
                               : k.isInt()  ? "[" + std::to_string(k.toInt()) + "]"
                                            : "[<" + TorchValue::kind_of(k) + ">]";
      check_value(item.value(), where + text, depth + 1);
    }
    return;
  }
  if (v.isList() || v.isTuple()) {
    const auto& ref = v.isList() ? v.toListRef() : v.toTupleRef().elements();
    for (std::size_t i = 0; i < ref.size(); ++i)
      check_value(ref[i], where + "[" + std::to_string(i) + "]", depth + 1);
  }
}
}  // namespace torch_file_detail

/// How a torch.save file's objects other than tensors and plain containers are read: refused as
/// torch.load(weights_only=True) refuses them, or (a training checkpoint's argparse.Namespace,
/// numpy states) as inert placeholders that are never called.
using ObjectPolicy = pickle_detail::ObjectPolicy;

/// Parses the bytes of a torch.save file (zip format, torch ≥ 1.6) named `where` in errors.
inline TorchValue parse_torch_file(const std::vector<char>& bytes, const std::string& where,
                                   ObjectPolicy objects = ObjectPolicy::refuse) {
  if (bytes.size() < 4) throw FormatError("is too short to be a torch.save file", where);
  const auto b = [&](std::size_t i) { return static_cast<unsigned char>(bytes[i]); };
  if (b(0) == 0x80 && b(1) <= 5)
    throw FormatError(
        "is a legacy (pre-zip) torch.save file; load it in Python and save it again with a torch "
        "newer than 1.6 (the default format since then)",
        where);
  if (!(b(0) == 'P' && b(1) == 'K' && b(2) == 3 && b(3) == 4))
    throw FormatError("is not a torch.save file (no zip signature)", where);
  c10::IValue value = load_pickle_bytes(bytes, where, objects);
  torch_file_detail::check_value(value, where, 0);
  return TorchValue(std::move(value), where);
}

/// Reads a .pt / .bin file. Errors name the file and, for content, the path inside it.
inline TorchValue load_torch_file(const std::filesystem::path& path,
                                  ObjectPolicy objects = ObjectPolicy::refuse) {
  return parse_torch_file(read_file(path), path.string(), objects);
}

/// An empty dict that takes keys of any kind (the web UI's hypernetwork files mix int and str
/// keys).
inline c10::impl::GenericDict torch_dict() {
  return c10::impl::GenericDict(c10::AnyType::get(), c10::AnyType::get());
}

/// A list of any values.
inline c10::impl::GenericList torch_list() { return c10::impl::GenericList(c10::AnyType::get()); }

/// Writes `value` as torch.save does, atomically; Python reads it with
/// torch.load(weights_only=True).
inline void save_torch_file(const std::filesystem::path& path, const c10::IValue& value) {
  save_pickle(path, value);
}

}  // namespace difftrain::io
