#pragma once
// What the tokenizers share: added tokens and how they cut a text (leftmost-longest, with the
// tokenizers library's strip and single-word rules), the batch options and result, and reading
// the JSON files of a transformers tokenizer folder.

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/text/unicode.hpp"

namespace difftrain::text {

/// A token beside the BPE vocabulary (special tokens, textual-inversion names) with the matching
/// flags of the tokenizers library.
struct AddedToken {
  std::string content;
  std::int64_t id = -1;
  bool special = false;
  bool normalized = true;    ///< matched in the normalized (lower-cased) text, else in the raw text
  bool lstrip = false;       ///< takes the white space before it
  bool rstrip = false;       ///< takes the white space after it
  bool single_word = false;  ///< only where no letter or digit touches it
};

enum class Padding { none, longest, max_length };

/// How a batch is made; the defaults are what diffusers' pipelines and training scripts ask:
/// `tokenizer(prompt, padding="max_length", max_length=tokenizer.model_max_length,
/// truncation=True)`.
struct EncodeOptions {
  bool add_special_tokens = true;
  bool truncation = true;
  Padding padding = Padding::max_length;
  std::int64_t max_length = 0;  ///< 0: the tokenizer's model_max_length
};

struct BatchEncoding {
  std::vector<std::vector<std::int64_t>> input_ids;
  std::vector<std::vector<std::int64_t>> attention_mask;
};

/// What every tokenizer has: the vocabulary both ways and the added tokens, and the lookups on
/// them. A tokenizer derives from it and fills it while it reads its files.
class TokenTable {
 public:
  [[nodiscard]] std::optional<std::int64_t> token_to_id(const std::string& token) const {
    for (const auto& t : added_)
      if (t.content == token) return t.id;
    if (const auto it = vocab_.find(token); it != vocab_.end()) return it->second;
    return std::nullopt;
  }
  [[nodiscard]] const std::string& id_to_token(std::int64_t id) const {
    if (id < 0 || id >= size())
      throw ConfigError("token id " + std::to_string(id) + " is not in the vocabulary", where_);
    return id_to_token_[static_cast<std::size_t>(id)];
  }
  /// Every id, added tokens included (the size the text encoder's token table needs).
  [[nodiscard]] std::int64_t size() const noexcept {
    return static_cast<std::int64_t>(id_to_token_.size());
  }
  [[nodiscard]] const std::vector<AddedToken>& added_tokens() const noexcept { return added_; }
  [[nodiscard]] bool is_special(std::int64_t id) const {
    for (const auto& t : added_)
      if (t.id == id && t.special) return true;
    return false;
  }

 protected:
  TokenTable() = default;
  TokenTable(std::unordered_map<std::string, std::int64_t> vocab, std::string where)
      : vocab_(std::move(vocab)), where_(std::move(where)) {}

  std::unordered_map<std::string, std::int64_t> vocab_;
  std::vector<std::string> id_to_token_;
  std::vector<AddedToken> added_;
  std::string where_;
};

namespace tokenizer_detail {

/// `read()`, a tokenizer's reading of the folder `dir`, with nlohmann's type errors from anywhere
/// below (an object where a string belongs, a number where a list does) turned into a FormatError
/// naming the folder: the files' JSON is taken apart in many places, and no reader should let
/// nlohmann's own error escape.
template <class Read>
auto with_typed_json_errors(const std::filesystem::path& dir, Read&& read) -> decltype(read()) {
  try {
    return read();
  } catch (const nlohmann::json::exception& e) {
    throw FormatError(
        std::string("holds a tokenizer file with a field of the wrong type: ") + e.what(),
        dir.string());
  }
}

inline const nlohmann::json& at_key(const nlohmann::json& j, const char* key,
                                    const std::string& where) {
  if (!j.is_object() || !j.contains(key))
    throw FormatError(std::string("has no '") + key + "'", where);
  return j.at(key);
}

/// A special token's value in tokenizer_config.json / special_tokens_map.json: a string, or an
/// AddedToken dict ({"content": ..., "normalized": ...}).
inline AddedToken token_from_json(const nlohmann::json& v, bool special_by_default,
                                  const std::string& where) {
  AddedToken t;
  if (v.is_string()) {
    t.content = v.get<std::string>();
    t.special = true;
    t.normalized = false;
    return t;
  }
  if (!v.is_object() || !v.contains("content") || !v["content"].is_string())
    throw FormatError("is neither a string nor a token object with a 'content'", where);
  t.content = v["content"].get<std::string>();
  t.special = v.contains("special") && v["special"].is_boolean() ? v["special"].get<bool>()
                                                                 : special_by_default;
  t.normalized = v.contains("normalized") && v["normalized"].is_boolean()
                     ? v["normalized"].get<bool>()
                     : !t.special;
  auto flag = [&](const char* key) {
    return v.contains(key) && v[key].is_boolean() && v[key].get<bool>();
  };
  t.lstrip = flag("lstrip");
  t.rstrip = flag("rstrip");
  t.single_word = flag("single_word");
  return t;
}

/// Added tokens of one kind (raw or normalized), as code points, longest first.
struct AddedTokenMatcher {
  std::vector<std::pair<std::u32string, AddedToken>> tokens;

  void sort_longest_first() {
    std::stable_sort(tokens.begin(), tokens.end(),
                     [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
  }
};

using Segment = std::pair<std::u32string, std::int64_t>;  // text, or an added token's id (>= 0)

inline bool is_word_char(char32_t c) { return is_letter(c) || is_number(c); }

/// `s` cut at the added tokens of `m`, leftmost-longest, with their strip and single-word rules.
inline std::vector<Segment> split_added(const std::u32string& s, const AddedTokenMatcher& m) {
  std::vector<Segment> out;
  if (m.tokens.empty()) {
    out.emplace_back(s, -1);
    return out;
  }
  std::size_t start_offset = 0;
  for (std::size_t i = 0; i < s.size();) {
    const std::pair<std::u32string, AddedToken>* hit = nullptr;
    for (const auto& cand : m.tokens)
      if (!cand.first.empty() && s.compare(i, cand.first.size(), cand.first) == 0) {
        hit = &cand;
        break;
      }
    if (hit == nullptr) {
      ++i;
      continue;
    }
    std::size_t start = i, stop = i + hit->first.size();
    const AddedToken& t = hit->second;
    i = stop;
    if (t.single_word &&
        ((start > 0 && is_word_char(s[start - 1])) || (stop < s.size() && is_word_char(s[stop]))))
      continue;
    if (t.lstrip)
      while (start > start_offset && is_space(s[start - 1])) --start;
    if (t.rstrip)
      while (stop < s.size() && is_space(s[stop])) ++stop;
    if (start_offset < start) out.emplace_back(s.substr(start_offset, start - start_offset), -1);
    out.emplace_back(std::u32string(), t.id);
    start_offset = stop;
    i = stop;
  }
  if (start_offset < s.size()) out.emplace_back(s.substr(start_offset), -1);
  return out;
}

/// A batch as transformers' `tokenizer(texts, padding=..., max_length=..., truncation=...)` makes
/// it: each text's ids from `encode` (without special tokens) truncated to leave room for the
/// special tokens, `bos` (when >= 0) before and `eos` after them, then padded with `pad`.
/// `specials_name` says which tokens the room is for, in errors.
template <class Encode>
BatchEncoding make_batch(const std::vector<std::string>& texts, const EncodeOptions& o,
                         std::int64_t model_max_length, std::int64_t bos, std::int64_t eos,
                         std::int64_t pad, const std::string& specials_name,
                         const std::string& where, Encode&& encode) {
  if (o.max_length < 0)
    throw ConfigError("max_length " + std::to_string(o.max_length) + " is negative", where);
  const std::int64_t max_len = o.max_length > 0 ? o.max_length : model_max_length;
  const std::int64_t specials = o.add_special_tokens ? (bos >= 0 ? 2 : 1) : 0;
  if (o.truncation && max_len < specials)
    throw ConfigError(
        "max_length " + std::to_string(max_len) + " leaves no room for " + specials_name, where);
  if (o.padding == Padding::max_length && max_len == std::numeric_limits<std::int64_t>::max())
    throw ConfigError(
        "padding to max_length needs a max_length (the tokenizer states no model_max_length)",
        where);
  BatchEncoding out;
  std::size_t longest = 0;
  for (const auto& text : texts) {
    std::vector<std::int64_t> ids = encode(text);
    if (o.truncation && static_cast<std::int64_t>(ids.size()) > max_len - specials)
      ids.resize(static_cast<std::size_t>(max_len - specials));
    if (o.add_special_tokens) {
      if (bos >= 0) ids.insert(ids.begin(), bos);
      ids.push_back(eos);
    }
    longest = std::max(longest, ids.size());
    out.attention_mask.emplace_back(ids.size(), 1);
    out.input_ids.push_back(std::move(ids));
  }
  const std::size_t target = o.padding == Padding::max_length ? static_cast<std::size_t>(max_len)
                             : o.padding == Padding::longest  ? longest
                                                              : 0;
  if (target > 0 && pad < 0 && o.padding != Padding::none)
    throw ConfigError("cannot pad: the tokenizer has no padding token", where);
  for (std::size_t i = 0; i < out.input_ids.size(); ++i)
    if (out.input_ids[i].size() < target) {
      out.attention_mask[i].resize(target, 0);
      out.input_ids[i].resize(target, pad);
    }
  return out;
}

}  // namespace tokenizer_detail

}  // namespace difftrain::text
