#pragma once
// Every JSON text difftrain reads goes through `parse_json`: model and tokenizer configs,
// `metadata.jsonl` rows, checkpoint settings, LoRA metadata, embedded data. A first SAX pass
// counts the nesting (linear time, no tree built) and refuses a text nested deeper than any file
// difftrain reads needs; only then is the tree built. nlohmann's tree copies, compares, dumps
// and frees itself recursively, so an unbounded nesting (a few hundred kilobytes of '[') would
// overflow the stack wherever the value went next. `json_brief` quotes a value in an error
// message without ever printing a large one whole.

#include <cstddef>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>

#include "difftrain/core/error.hpp"

namespace difftrain::io {

/// Deeper than every config, tokenizer and metadata file in use (they nest under ten levels),
/// far below what the recursive copy and dump can take on any thread's stack.
inline constexpr std::size_t kJsonMaxDepth = 256;

/// A SAX consumer that builds nothing: it counts the nesting and refuses it past `max_depth`
/// ("<what>nests deeper than N levels", naming `where`). A check that needs more derives from it
/// and hides the callbacks it extends (nlohmann's sax_parse calls them by the static type), as
/// the safetensors header check adds its duplicate-key rule.
template <class Json = nlohmann::json>
class JsonDepthCheck {
 public:
  JsonDepthCheck(std::size_t max_depth, std::string where, std::string what = {})
      : max_(max_depth), where_(std::move(where)), what_(std::move(what)) {}
  using number_integer_t = typename Json::number_integer_t;
  using number_unsigned_t = typename Json::number_unsigned_t;
  using number_float_t = typename Json::number_float_t;
  using string_t = typename Json::string_t;
  using binary_t = typename Json::binary_t;
  bool null() { return true; }
  bool boolean(bool) { return true; }
  bool number_integer(number_integer_t) { return true; }
  bool number_unsigned(number_unsigned_t) { return true; }
  bool number_float(number_float_t, const string_t&) { return true; }
  bool string(string_t&) { return true; }
  bool binary(binary_t&) { return true; }
  bool key(string_t&) { return true; }
  bool start_object(std::size_t) { return open(); }
  bool start_array(std::size_t) { return open(); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }
  bool parse_error(std::size_t position, const std::string&, const nlohmann::json::exception& e) {
    throw FormatError(
        std::string("is not valid JSON (byte ") + std::to_string(position) + "): " + e.what(),
        where_);
  }

 private:
  bool open() {
    if (++depth_ > max_)
      throw FormatError(what_ + "nests deeper than " + std::to_string(max_) + " levels", where_);
    return true;
  }
  bool close() {
    --depth_;
    return true;
  }
  std::size_t max_, depth_ = 0;
  std::string where_, what_;
};

/// `text` parsed as JSON (`Json` = nlohmann::json or ordered_json); text that is not JSON, or
/// nests deeper than `max_depth`, is a FormatError naming `where`.
template <class Json = nlohmann::json>
Json parse_json(std::string_view text, const std::string& where,
                std::size_t max_depth = kJsonMaxDepth) {
  JsonDepthCheck<Json> check(max_depth, where);
  try {
    Json::sax_parse(text.begin(), text.end(), &check);
    return Json::parse(text.begin(), text.end());
  } catch (const nlohmann::json::exception& e) {
    throw FormatError(std::string("is not valid JSON: ") + e.what(), where);
  }
}

/// A value quoted for an error message: scalars and short values whole, anything longer than
/// `max_chars` cut there ("... (N characters)"), so a message stays one readable line.
template <class Json>
std::string json_brief(const Json& v, std::size_t max_chars = 80) {
  std::string s = v.dump();
  if (s.size() <= max_chars) return s;
  const std::size_t n = s.size();
  s.resize(max_chars);
  return s + "... (" + std::to_string(n) + " characters)";
}

}  // namespace difftrain::io
