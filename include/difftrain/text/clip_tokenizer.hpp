#pragma once
// CLIP's tokenizer as transformers' CLIPTokenizer runs it (the tokenizers library under it), so
// the ids equal theirs: every Stable Diffusion text encoder (SD 1.x, SD 2.x, both of SDXL's)
// reads these ids.
//
//   added tokens  matched first, leftmost-longest: those not "normalized" in the raw text, the
//                 others in the normalized text (special tokens, textual-inversion names);
//   normalizer    NFC, every run of white space to one space, lower case by code point;
//   pre-tokenizer CLIP's regex  <|startoftext|>|<|endoftext|>|'s|'t|'re|'ve|'m|'ll|'d|\p{L}+|\p{N}|
//                 [^\s\p{L}\p{N}]+  (matches kept, the rest dropped), then GPT-2's byte-level
//                 regex inside each match when the file says use_regex;
//   model         byte-level BPE: a word's UTF-8 bytes as symbols of the byte alphabet, "</w>"
//                 on the last, merged lowest rank first;
//   post          <|startoftext|> ids <|endoftext|>; truncation to model_max_length keeps the
//                 end token, padding with the pad token (SD 2's tokenizer pads with "!").
//
// Read from a transformers tokenizer folder: tokenizer.json alone, or vocab.json + merges.txt with
// tokenizer_config.json / special_tokens_map.json, resolved as transformers resolves them.

#include <algorithm>
#include <array>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <queue>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/io/json_file.hpp"
#include "difftrain/io/read_file.hpp"
#include "difftrain/text/tokenizer_common.hpp"
#include "difftrain/text/unicode.hpp"

namespace difftrain::text {

namespace clip_detail {

/// GPT-2's map of bytes to printable code points (the byte-level alphabet): printable Latin-1
/// bytes stand for themselves, the others for 256 + n.
inline std::array<char32_t, 256> byte_alphabet() {
  std::array<char32_t, 256> out{};
  std::array<bool, 256> printable{};
  for (int b = '!'; b <= '~'; ++b) printable[static_cast<std::size_t>(b)] = true;
  for (int b = 0xA1; b <= 0xAC; ++b) printable[static_cast<std::size_t>(b)] = true;
  for (int b = 0xAE; b <= 0xFF; ++b) printable[static_cast<std::size_t>(b)] = true;
  char32_t next = 256;
  for (std::size_t b = 0; b < 256; ++b) out[b] = printable[b] ? static_cast<char32_t>(b) : next++;
  return out;
}

}  // namespace clip_detail

class CLIPTokenizer : public TokenTable {
 public:
  /// The names of transformers' special-token attributes, in the order it registers them (a
  /// later registration of the same text sets its flags).
  static constexpr std::array<const char*, 7> special_keys{
      "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"};

  /// How far past the ids before it an id may lie (the id table is sized by the largest id).
  static constexpr std::int64_t kIdGap = std::int64_t{1} << 16;

  /// A tokenizer from a vocabulary (token → id), merges in rank order, and the special tokens.
  /// A merge whose parts or result the vocabulary lacks is a FormatError naming its rank.
  CLIPTokenizer(std::unordered_map<std::string, std::int64_t> vocab,
                const std::vector<std::pair<std::string, std::string>>& merges,
                std::vector<AddedToken> added, std::string bos = "<|startoftext|>",
                std::string eos = "<|endoftext|>", std::string pad = "<|endoftext|>",
                std::string unk = "<|endoftext|>", std::int64_t model_max_length = 77,
                bool byte_level_regex = true, std::string where = "CLIP tokenizer")
      : TokenTable(std::move(vocab), std::move(where)),
        model_max_length_(model_max_length),
        byte_level_regex_(byte_level_regex) {
    std::int64_t max_id = -1;
    // The id table is sized by the largest id: an id far past the entries (a typo, a hostile
    // file) would allocate gigabytes for a handful of tokens. No tokenizer leaves such a gap.
    const auto id_bound = static_cast<std::int64_t>(vocab_.size()) + kIdGap;
    for (const auto& [token, id] : vocab_) {
      if (id < 0 || id >= id_bound)
        throw FormatError("gives token '" + token + "' the id " + std::to_string(id) +
                              " (the vocabulary has " + std::to_string(vocab_.size()) +
                              " entries; ids run from 0 to fewer than " + std::to_string(id_bound) +
                              ")",
                          where_);
      max_id = std::max(max_id, id);
    }
    id_to_token_.assign(static_cast<std::size_t>(max_id + 1), std::string());
    for (const auto& [token, id] : vocab_) {
      if (!id_to_token_[static_cast<std::size_t>(id)].empty())
        throw FormatError("gives the id " + std::to_string(id) + " to two tokens ('" +
                              id_to_token_[static_cast<std::size_t>(id)] + "' and '" + token + "')",
                          where_);
      id_to_token_[static_cast<std::size_t>(id)] = token;
    }
    base_vocab_size_ = static_cast<std::int64_t>(id_to_token_.size());
    alphabet_ = clip_detail::byte_alphabet();
    for (std::size_t b = 0; b < 256; ++b) {
      std::string ch;
      append_utf8(ch, alphabet_[b]);
      byte_of_char_[alphabet_[b]] = static_cast<std::uint8_t>(b);
      const auto plain = vocab_.find(ch);
      const auto end = vocab_.find(ch + "</w>");
      if (plain == vocab_.end() || end == vocab_.end())
        throw FormatError("lacks the byte-level symbol '" + ch + "' or '" + ch +
                              "</w>' (a CLIP vocabulary holds all 512)",
                          where_);
      byte_id_[b] = static_cast<std::int32_t>(plain->second);
      byte_end_id_[b] = static_cast<std::int32_t>(end->second);
    }
    merges_.reserve(merges.size() * 2);
    for (std::size_t rank = 0; rank < merges.size(); ++rank) {
      const auto& [a, b] = merges[rank];
      const auto ia = vocab_.find(a), ib = vocab_.find(b), ic = vocab_.find(a + b);
      if (ia == vocab_.end() || ib == vocab_.end() || ic == vocab_.end())
        throw FormatError("merge " + std::to_string(rank + 1) + " ('" + a + " " + b +
                              "') names a symbol the vocabulary lacks ('" +
                              (ia == vocab_.end()   ? a
                               : ib == vocab_.end() ? b
                                                    : a + b) +
                              "')",
                          where_);
      merges_.try_emplace(
          pair_key(ia->second, ib->second),
          Merge{static_cast<std::int32_t>(rank), static_cast<std::int32_t>(ic->second)});
    }
    for (auto& t : added) add_token(std::move(t));
    auto id_of = [&](const std::string& name, const char* role) -> std::int64_t {
      if (name.empty()) return -1;
      const auto id = token_to_id(name);
      if (!id)
        throw FormatError(std::string("names '") + name + "' as its " + role +
                              " token, which is not in the vocabulary",
                          where_);
      return *id;
    };
    bos_ = id_of(bos, "start");
    eos_ = id_of(eos, "end");
    pad_ = id_of(pad, "padding");
    unk_ = id_of(unk, "unknown");
    if (bos_ < 0 || eos_ < 0) throw FormatError("needs a start and an end token", where_);
    if (model_max_length_ < 2)
      throw ConfigError("model_max_length " + std::to_string(model_max_length_) +
                            " leaves no room for the start and end tokens",
                        where_);
  }

  /// From a transformers tokenizer folder: tokenizer.json when present (as transformers prefers
  /// it), else vocab.json + merges.txt; tokenizer_config.json and special_tokens_map.json name the
  /// special tokens and model_max_length. A missing or malformed file is an IoError or
  /// FormatError naming it; a tokenizer.json that is not CLIP's (another normalizer,
  /// pre-tokenizer or model) is refused by name rather than tokenized differently.
  static CLIPTokenizer from_folder(const std::filesystem::path& dir) {
    return tokenizer_detail::with_typed_json_errors(dir, [&] { return read_folder(dir); });
  }

  /// from_folder's reading; from_folder turns its JSON type errors into FormatErrors.
  static CLIPTokenizer read_folder(const std::filesystem::path& dir) {
    namespace fs = std::filesystem;
    const fs::path config_file = dir / "tokenizer_config.json";
    const fs::path map_file = dir / "special_tokens_map.json";
    const fs::path json_file = dir / "tokenizer.json";
    nlohmann::json config =
        fs::exists(config_file) ? io::read_json(config_file) : nlohmann::json::object();
    if (!config.is_object()) throw FormatError("is not a JSON object", config_file.string());

    std::unordered_map<std::string, std::int64_t> vocab;
    std::vector<std::pair<std::string, std::string>> merges;
    std::vector<AddedToken> added;  // in the order the tokenizer registers them
    bool byte_level_regex = true;
    std::string where;
    if (fs::exists(json_file)) {
      where = json_file.string();
      const nlohmann::json j = io::read_json(json_file);
      check_pipeline(j, where, byte_level_regex);
      const auto& model = tokenizer_detail::at_key(j, "model", where);
      read_vocab(tokenizer_detail::at_key(model, "vocab", where + " model"), vocab,
                 where + " vocab");
      const auto& m = tokenizer_detail::at_key(model, "merges", where + " model");
      if (!m.is_array()) throw FormatError("'merges' is not a list", where + " model");
      merges.reserve(m.size());
      for (std::size_t i = 0; i < m.size(); ++i) {
        if (m[i].is_string()) {
          merges.push_back(
              split_merge(m[i].get<std::string>(), where + " merge " + std::to_string(i + 1)));
        } else if (m[i].is_array() && m[i].size() == 2 && m[i][0].is_string() &&
                   m[i][1].is_string()) {
          merges.emplace_back(m[i][0].get<std::string>(), m[i][1].get<std::string>());
        } else {
          throw FormatError("is neither \"a b\" nor [\"a\", \"b\"]",
                            where + " merge " + std::to_string(i + 1));
        }
      }
      if (j.contains("added_tokens") && j["added_tokens"].is_array())
        for (std::size_t i = 0; i < j["added_tokens"].size(); ++i) {
          const auto& e = j["added_tokens"][i];
          const std::string at = where + " added_tokens[" + std::to_string(i) + "]";
          AddedToken t = tokenizer_detail::token_from_json(e, false, at);
          if (!e.contains("id") || !e["id"].is_number_integer())
            throw FormatError("has no integer 'id'", at);
          t.id = e["id"].get<std::int64_t>();
          added.push_back(std::move(t));
        }
    } else {
      const fs::path vocab_file = dir / "vocab.json";
      const fs::path merges_file = dir / "merges.txt";
      where = dir.string() + " (vocab.json, merges.txt)";
      read_vocab(io::read_json(vocab_file), vocab, vocab_file.string());
      merges = read_merges(merges_file);
    }

    // Special tokens as transformers resolves them: tokenizer_config.json's added_tokens_decoder
    // when it has one (its entries name the flags); otherwise special_tokens_map.json's values
    // over tokenizer_config.json's.
    std::unordered_map<std::string, AddedToken> by_content;
    if (config.contains("added_tokens_decoder") && config["added_tokens_decoder"].is_object()) {
      for (const auto& [key, value] : config["added_tokens_decoder"].items()) {
        const std::string at = config_file.string() + " added_tokens_decoder." + key;
        AddedToken t = tokenizer_detail::token_from_json(value, false, at);
        try {
          t.id = std::stoll(key);
        } catch (const std::exception&) {
          throw FormatError("is not an integer id", at);
        }
        by_content[t.content] = t;
        added.push_back(std::move(t));
      }
    } else if (fs::exists(map_file)) {
      const nlohmann::json map = io::read_json(map_file);
      if (!map.is_object()) throw FormatError("is not a JSON object", map_file.string());
      for (const char* key : special_keys)
        if (map.contains(key) && !map[key].is_null()) {
          nlohmann::json v = map[key];
          if (v.is_object()) v["special"] = true;
          config[key] = v;
        }
    }
    for (const auto& t : added) by_content.try_emplace(t.content, t);
    std::array<std::string, special_keys.size()> names;
    for (std::size_t k = 0; k < special_keys.size(); ++k) {
      const char* key = special_keys[k];
      if (!config.contains(key) || config[key].is_null()) continue;
      const std::string at = config_file.string() + " " + key;
      AddedToken t;
      if (config[key].is_string() && by_content.contains(config[key].get<std::string>())) {
        t = by_content.at(config[key].get<std::string>());
      } else {
        t = tokenizer_detail::token_from_json(config[key], false, at);
      }
      t.special = true;  // registered as a special token whatever its dict said
      t.id = -1;         // the vocabulary's id, or the next free one
      names[k] = t.content;
      added.push_back(std::move(t));
    }
    // CLIPTokenizer's defaults for those the files do not name.
    if (names[0].empty()) names[0] = "<|startoftext|>";
    if (names[1].empty()) names[1] = "<|endoftext|>";
    if (names[2].empty()) names[2] = "<|endoftext|>";
    if (names[4].empty()) names[4] = "<|endoftext|>";

    std::int64_t max_length = std::numeric_limits<std::int64_t>::max();
    if (config.contains("model_max_length") && config["model_max_length"].is_number()) {
      const double v = config["model_max_length"].get<double>();
      if (v < 1e18) max_length = static_cast<std::int64_t>(v);
    }
    return CLIPTokenizer(std::move(vocab), merges, std::move(added), names[0], names[1], names[4],
                         names[2], max_length, byte_level_regex, where);
  }

  /// Adds a token (a textual-inversion name) and returns its id: the vocabulary's id when the
  /// text is a token already, else the next free id. Adding the same text again updates its
  /// flags, as the tokenizers library does.
  std::int64_t add_token(AddedToken t) {
    if (t.content.empty()) throw ConfigError("an added token cannot be empty", where_);
    (void)utf8_to_u32(t.content, where_ + " added token");
    for (auto& have : added_)
      if (have.content == t.content) {
        t.id = have.id;
        have = t;
        refresh_added();
        return t.id;
      }
    if (const auto v = vocab_.find(t.content); v != vocab_.end()) {
      t.id = v->second;
    } else if (t.id < 0 || t.id < static_cast<std::int64_t>(id_to_token_.size())) {
      t.id = static_cast<std::int64_t>(id_to_token_.size());
    }
    if (t.id >= static_cast<std::int64_t>(id_to_token_.size()) + kIdGap)
      throw FormatError("gives the added token '" + t.content + "' the id " + std::to_string(t.id) +
                            ", past the " + std::to_string(id_to_token_.size()) +
                            " ids before it by more than " + std::to_string(kIdGap),
                        where_);
    if (t.id >= static_cast<std::int64_t>(id_to_token_.size()))
      id_to_token_.resize(static_cast<std::size_t>(t.id + 1));
    id_to_token_[static_cast<std::size_t>(t.id)] = t.content;
    added_.push_back(t);
    refresh_added();
    return t.id;
  }

  /// The ids of `text`, with the start and end tokens when `add_special_tokens`; no truncation.
  [[nodiscard]] std::vector<std::int64_t> encode(std::string_view text,
                                                 bool add_special_tokens = true) const {
    std::vector<std::int64_t> ids;
    if (add_special_tokens) ids.push_back(bos_);
    const std::u32string raw = utf8_to_u32(text, where_ + " input");
    for (const auto& [seg, token] : tokenizer_detail::split_added(raw, raw_tokens_)) {
      if (token >= 0) {
        ids.push_back(token);
        continue;
      }
      const std::u32string norm = normalize(seg);
      for (const auto& [piece, id] : tokenizer_detail::split_added(norm, normalized_tokens_)) {
        if (id >= 0)
          ids.push_back(id);
        else
          tokenize_piece(piece, ids);
      }
    }
    if (add_special_tokens) ids.push_back(eos_);
    return ids;
  }

  /// A batch as transformers' `tokenizer(texts, padding=..., max_length=..., truncation=...)`
  /// gives it.
  [[nodiscard]] BatchEncoding operator()(const std::vector<std::string>& texts,
                                         const EncodeOptions& o = {}) const {
    return tokenizer_detail::make_batch(texts, o, model_max_length_, bos_, eos_, pad_,
                                        "the start and end tokens", where_,
                                        [this](const std::string& t) { return encode(t, false); });
  }

  /// The text of `ids` as transformers decodes it (the byte-level decode, then "</w>" as a space,
  /// trimmed). An id outside the vocabulary is a ConfigError naming its position.
  [[nodiscard]] std::string decode(std::span<const std::int64_t> ids,
                                   bool skip_special_tokens = false) const {
    std::string bytes;
    for (std::size_t i = 0; i < ids.size(); ++i) {
      const std::int64_t id = ids[i];
      if (id < 0 || id >= static_cast<std::int64_t>(id_to_token_.size()) ||
          id_to_token_[static_cast<std::size_t>(id)].empty())
        throw ConfigError("token id " + std::to_string(id) + " at position " + std::to_string(i) +
                              " is not in the vocabulary (" + std::to_string(id_to_token_.size()) +
                              " ids)",
                          where_ + " decode");
      if (skip_special_tokens && is_special(id)) continue;
      const std::string& tok = id_to_token_[static_cast<std::size_t>(id)];
      // A token made only of byte-alphabet symbols gives their bytes; any other as its UTF-8.
      const std::u32string cps = utf8_to_u32(tok, where_);
      std::string b;
      bool all_bytes = true;
      for (const char32_t c : cps) {
        const auto it = byte_of_char_.find(c);
        if (it == byte_of_char_.end()) {
          all_bytes = false;
          break;
        }
        b.push_back(static_cast<char>(it->second));
      }
      bytes += all_bytes ? b : tok;
    }
    std::string text = lossy_utf8(bytes);
    std::string out;
    for (std::size_t i = 0; i < text.size();) {
      if (text.compare(i, 4, "</w>") == 0) {
        out.push_back(' ');
        i += 4;
      } else {
        out.push_back(text[i++]);
      }
    }
    const auto first = out.find_first_not_of(" \t\n\r\f\v");
    if (first == std::string::npos) return {};
    return out.substr(first, out.find_last_not_of(" \t\n\r\f\v") - first + 1);
  }

  /// The token strings of `text` (no start or end token), for inspection.
  [[nodiscard]] std::vector<std::string> tokenize(std::string_view text) const {
    std::vector<std::string> out;
    for (const std::int64_t id : encode(text, false))
      out.push_back(id_to_token_[static_cast<std::size_t>(id)]);
    return out;
  }

  /// The BPE vocabulary alone.
  [[nodiscard]] std::int64_t vocab_size() const noexcept { return base_vocab_size_; }
  [[nodiscard]] std::int64_t bos_token_id() const noexcept { return bos_; }
  [[nodiscard]] std::int64_t eos_token_id() const noexcept { return eos_; }
  [[nodiscard]] std::int64_t pad_token_id() const noexcept { return pad_; }
  [[nodiscard]] std::int64_t unk_token_id() const noexcept { return unk_; }
  [[nodiscard]] std::int64_t model_max_length() const noexcept { return model_max_length_; }

 private:
  struct Merge {
    std::int32_t rank;
    std::int32_t id;
  };
  struct Cache {  // words already split (as the tokenizers library keeps them), shared by threads
    std::mutex mutex;
    std::unordered_map<std::string, std::vector<std::int64_t>> words;
  };

  static std::uint64_t pair_key(std::int64_t a, std::int64_t b) {
    return (static_cast<std::uint64_t>(a) << 32) | static_cast<std::uint64_t>(b);
  }

  static void read_vocab(const nlohmann::json& v,
                         std::unordered_map<std::string, std::int64_t>& out,
                         const std::string& where) {
    if (!v.is_object()) throw FormatError("is not a JSON object of token → id", where);
    out.reserve(v.size());
    for (const auto& [token, id] : v.items()) {
      if (!id.is_number_integer())
        throw FormatError("gives token '" + token + "' the id " + id.dump() + " (not an integer)",
                          where);
      out.emplace(token, id.get<std::int64_t>());
    }
    if (out.empty()) throw FormatError("is empty", where);
  }

  static std::pair<std::string, std::string> split_merge(const std::string& line,
                                                         const std::string& where) {
    const auto space = line.find(' ');
    if (space == std::string::npos || space == 0 || space + 1 >= line.size() ||
        line.find(' ', space + 1) != std::string::npos)
      throw FormatError("is not two symbols separated by one space: '" + line + "'", where);
    return {line.substr(0, space), line.substr(space + 1)};
  }

  /// merges.txt as the tokenizers library reads it: a "#version" first line skipped, one merge
  /// per line, empty lines skipped.
  static std::vector<std::pair<std::string, std::string>> read_merges(
      const std::filesystem::path& file) {
    const std::vector<char> bytes = io::read_file(file);
    std::vector<std::pair<std::string, std::string>> out;
    std::size_t line_no = 0;
    for (std::size_t i = 0; i < bytes.size();) {
      std::size_t end = i;
      while (end < bytes.size() && bytes[end] != '\n') ++end;
      std::string line(bytes.data() + i, end - i);
      if (!line.empty() && line.back() == '\r') line.pop_back();
      ++line_no;
      i = end + 1;
      if (line.empty() || (line_no == 1 && line.starts_with("#version"))) continue;
      out.push_back(split_merge(line, file.string() + " line " + std::to_string(line_no)));
    }
    if (out.empty()) throw FormatError("holds no merges", file.string());
    return out;
  }

  // tokenizer.json must describe CLIP's pipeline: what it does not, this class would not do.
  static void check_pipeline(const nlohmann::json& j, const std::string& where, bool& use_regex) {
    auto refuse = [&](const std::string& what, const nlohmann::json& v) {
      throw FormatError(what + " is " + v.dump().substr(0, 200) +
                            ", not CLIP's (difftrain's CLIPTokenizer does not run it)",
                        where);
    };
    const auto& model = tokenizer_detail::at_key(j, "model", where);
    if (model.value("type", std::string("BPE")) != "BPE") refuse("the model", model["type"]);
    if (model.value("end_of_word_suffix", nlohmann::json()) != "</w>")
      refuse("the BPE end_of_word_suffix", model.value("end_of_word_suffix", nlohmann::json()));
    for (const char* key : {"dropout", "continuing_subword_prefix"})
      if (model.contains(key) && !model[key].is_null() && model[key] != "")
        refuse(std::string("the BPE ") + key, model[key]);
    if (model.value("byte_fallback", false))
      refuse("the BPE byte_fallback", model["byte_fallback"]);
    const auto& norm = tokenizer_detail::at_key(j, "normalizer", where);
    const nlohmann::json want_norm = {
        {"type", "Sequence"},
        {"normalizers",
         {{{"type", "NFC"}},
          {{"type", "Replace"}, {"pattern", {{"Regex", "\\s+"}}}, {"content", " "}},
          {{"type", "Lowercase"}}}}};
    if (norm != want_norm) refuse("the normalizer", norm);
    const auto& pre = tokenizer_detail::at_key(j, "pre_tokenizer", where);
    const std::string clip_regex =
        "<\\|startoftext\\|>|<\\|endoftext\\|>|'s|'t|'re|'ve|'m|'ll|'d|[\\p{L}]+|[\\p{N}]|"
        "[^\\s\\p{L}\\p{N}]+";
    bool ok = pre.value("type", "") == "Sequence" && pre.contains("pretokenizers") &&
              pre["pretokenizers"].is_array() && pre["pretokenizers"].size() == 2;
    if (ok) {
      const auto& split = pre["pretokenizers"][0];
      const auto& bl = pre["pretokenizers"][1];
      ok = split.value("type", "") == "Split" && split.contains("pattern") &&
           split["pattern"].value("Regex", "") == clip_regex &&
           split.value("behavior", "") == "Removed" && split.value("invert", false) &&
           bl.value("type", "") == "ByteLevel" && !bl.value("add_prefix_space", false);
      if (ok) use_regex = bl.value("use_regex", true);
    }
    if (!ok) refuse("the pre_tokenizer", pre);
  }

  void refresh_added() {
    raw_tokens_.tokens.clear();
    normalized_tokens_.tokens.clear();
    for (const auto& t : added_) {
      const std::u32string cps = utf8_to_u32(t.content, where_ + " added token");
      if (t.normalized)
        normalized_tokens_.tokens.emplace_back(normalize(cps), t);
      else
        raw_tokens_.tokens.emplace_back(cps, t);
    }
    // Longest first, so the first that matches at a position is the longest.
    raw_tokens_.sort_longest_first();
    normalized_tokens_.sort_longest_first();
  }

  /// NFC, white-space runs to one space, lower case.
  static std::u32string normalize(std::u32string_view s) {
    const std::u32string composed = nfc(s);
    std::u32string out;
    out.reserve(composed.size());
    for (std::size_t i = 0; i < composed.size();) {
      if (is_space(composed[i])) {
        while (i < composed.size() && is_space(composed[i])) ++i;
        out.push_back(U' ');
      } else {
        append_lower(out, composed[i++]);
      }
    }
    return out;
  }

  static bool contraction_at(std::u32string_view s, std::size_t i, std::size_t& len) {
    if (s[i] != U'\'' || i + 1 >= s.size()) return false;
    const char32_t a = s[i + 1];
    if (a == U's' || a == U't' || a == U'm' || a == U'd') {
      len = 2;
      return true;
    }
    if (i + 2 < s.size()) {
      const char32_t b = s[i + 2];
      if ((a == U'r' && b == U'e') || (a == U'v' && b == U'e') || (a == U'l' && b == U'l')) {
        len = 3;
        return true;
      }
    }
    return false;
  }

  /// CLIP's pre-tokenizer regex over a normalized piece; each match goes to `emit_word`.
  void tokenize_piece(std::u32string_view s, std::vector<std::int64_t>& ids) const {
    static constexpr std::u32string_view specials[] = {U"<|startoftext|>", U"<|endoftext|>"};
    for (std::size_t i = 0; i < s.size();) {
      const char32_t c = s[i];
      if (is_space(c)) {
        ++i;
        continue;
      }
      std::size_t len = 0;
      for (const auto sp : specials)
        if (len == 0 && s.substr(i, sp.size()) == sp) len = sp.size();
      if (len == 0 && !contraction_at(s, i, len)) {
        len = 1;
        if (is_letter(c)) {
          while (i + len < s.size() && is_letter(s[i + len])) ++len;
        } else if (!is_number(c)) {
          while (i + len < s.size() && !is_space(s[i + len]) && !is_letter(s[i + len]) &&
                 !is_number(s[i + len]))
            ++len;
        }
      }
      const std::u32string_view word = s.substr(i, len);
      i += len;
      if (byte_level_regex_)
        byte_level_split(word, ids);
      else
        bpe(word, ids);
    }
  }

  /// GPT-2's regex of the ByteLevel pre-tokenizer inside one CLIP match (which holds no white
  /// space): contractions, letter runs, number runs, runs of anything else.
  void byte_level_split(std::u32string_view w, std::vector<std::int64_t>& ids) const {
    for (std::size_t i = 0; i < w.size();) {
      std::size_t len = 0;
      if (!contraction_at(w, i, len)) {
        len = 1;
        const bool letter = is_letter(w[i]), number = !letter && is_number(w[i]);
        while (i + len < w.size()) {
          const char32_t d = w[i + len];
          const bool same = letter   ? is_letter(d)
                            : number ? is_number(d)
                                     : !is_letter(d) && !is_number(d) && !is_space(d);
          if (!same) break;
          ++len;
        }
      }
      bpe(w.substr(i, len), ids);
      i += len;
    }
  }

  /// Byte-level BPE of one word: its UTF-8 bytes as alphabet symbols ("</w>" on the last), the
  /// lowest-ranked adjacent pair merged first, leftmost among equals.
  void bpe(std::u32string_view word, std::vector<std::int64_t>& ids) const {
    std::string bytes;
    for (const char32_t c : word) append_utf8(bytes, c);
    if (bytes.empty()) return;
    {
      const std::lock_guard<std::mutex> lock(cache_->mutex);
      if (const auto it = cache_->words.find(bytes); it != cache_->words.end()) {
        ids.insert(ids.end(), it->second.begin(), it->second.end());
        return;
      }
    }
    const std::size_t n = bytes.size();
    std::vector<std::int32_t> sym(n), prev(n), next(n);
    std::vector<bool> alive(n, true);
    for (std::size_t k = 0; k < n; ++k) {
      const auto b = static_cast<std::uint8_t>(bytes[k]);
      sym[k] = k + 1 == n ? byte_end_id_[b] : byte_id_[b];
      prev[k] = static_cast<std::int32_t>(k) - 1;
      next[k] = k + 1 == n ? -1 : static_cast<std::int32_t>(k + 1);
    }
    // (rank, position, left id, right id): an entry is stale when its symbols have changed.
    using Entry = std::tuple<std::int32_t, std::int32_t, std::int32_t, std::int32_t>;
    std::priority_queue<Entry, std::vector<Entry>, std::greater<>> heap;
    auto push = [&](std::int32_t pos) {
      if (pos < 0 || next[static_cast<std::size_t>(pos)] < 0) return;
      const std::int32_t a = sym[static_cast<std::size_t>(pos)];
      const std::int32_t b = sym[static_cast<std::size_t>(next[static_cast<std::size_t>(pos)])];
      if (const auto it = merges_.find(pair_key(a, b)); it != merges_.end())
        heap.emplace(it->second.rank, pos, a, b);
    };
    for (std::size_t k = 0; k + 1 < n; ++k) push(static_cast<std::int32_t>(k));
    while (!heap.empty()) {
      const auto [rank, pos, a, b] = heap.top();
      heap.pop();
      const auto p = static_cast<std::size_t>(pos);
      if (!alive[p] || next[p] < 0 || sym[p] != a || sym[static_cast<std::size_t>(next[p])] != b)
        continue;
      const auto q = static_cast<std::size_t>(next[p]);
      sym[p] = merges_.at(pair_key(a, b)).id;
      alive[q] = false;
      next[p] = next[q];
      if (next[q] >= 0) prev[static_cast<std::size_t>(next[q])] = pos;
      push(prev[p]);
      push(pos);
    }
    std::vector<std::int64_t> word_ids;
    for (std::int32_t k = 0; k >= 0; k = next[static_cast<std::size_t>(k)])
      word_ids.push_back(sym[static_cast<std::size_t>(k)]);
    ids.insert(ids.end(), word_ids.begin(), word_ids.end());
    const std::lock_guard<std::mutex> lock(cache_->mutex);
    if (cache_->words.size() >= kCacheCapacity) cache_->words.clear();
    cache_->words.emplace(std::move(bytes), std::move(word_ids));
  }

  /// Bytes to text, each invalid UTF-8 sequence as U+FFFD (Rust's from_utf8_lossy).
  static std::string lossy_utf8(const std::string& b) {
    std::string out;
    const auto* p = reinterpret_cast<const std::uint8_t*>(b.data());
    const auto n = static_cast<std::int32_t>(b.size());
    for (std::int32_t i = 0; i < n;) {
      UChar32 c = 0;
      U8_NEXT(p, i, n, c);
      append_utf8(out, c < 0 ? U'\uFFFD' : static_cast<char32_t>(c));
    }
    return out;
  }

  static constexpr std::size_t kCacheCapacity = 10000;

  std::int64_t base_vocab_size_ = 0;
  std::unordered_map<std::uint64_t, Merge> merges_;
  std::array<char32_t, 256> alphabet_{};
  std::unordered_map<char32_t, std::uint8_t> byte_of_char_;
  std::array<std::int32_t, 256> byte_id_{};
  std::array<std::int32_t, 256> byte_end_id_{};
  tokenizer_detail::AddedTokenMatcher raw_tokens_, normalized_tokens_;
  std::int64_t bos_ = -1, eos_ = -1, pad_ = -1, unk_ = -1;
  std::int64_t model_max_length_ = 77;
  bool byte_level_regex_ = true;
  std::shared_ptr<Cache> cache_ = std::make_shared<Cache>();
};

}  // namespace difftrain::text
