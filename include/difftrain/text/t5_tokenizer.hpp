#pragma once
// T5's tokenizer as transformers 5's T5Tokenizer runs it (the tokenizers library's Unigram model
// over the SentencePiece vocabulary), so the ids equal theirs: the T5 encoders of SD3, Flux,
// PixArt and CogVideoX read these ids.
//
//   added tokens  matched first in the raw text, leftmost-longest: <pad>, </s>, <unk>, the
//                 sentinels <extra_id_0> ... <extra_id_{n-1}>, the model's control and
//                 user-defined pieces;
//   normalizer    the model's precompiled character map (SentencePiece's nmt_nfkc and the like),
//                 applied per grapheme cluster as the tokenizers library applies it;
//   pre-tokenizer split at white space; "▁" before every word; a new piece at every "▁";
//   model         Unigram: the Viterbi path of highest total log-probability over the pieces,
//                 unknown characters scored (lowest score - 10) and adjacent ones fused into one
//                 unknown token;
//   post          ids </s>; truncation keeps the </s>, padding with <pad> on the right.
//
// This is not SentencePiece's own encoder: libsentencepiece normalizes white space and matches
// user-defined pieces differently, and gives other ids on a fifth of the generated strings of the
// parity sweep (docs/text.md). Pipelines and training scripts run transformers' tokenizer, so
// difftrain follows it.
//
// Read from a tokenizer folder: spiece.model (with tokenizer_config.json / special_tokens_map.json
// for the number of sentinels and the maximum length), or tokenizer.json, which transformers
// prefers when both are there.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/io/json_file.hpp"
#include "difftrain/io/protobuf_reader.hpp"
#include "difftrain/io/read_file.hpp"
#include "difftrain/text/tokenizer_common.hpp"
#include "difftrain/text/unicode.hpp"

namespace difftrain::text {

/// SentencePiece's precompiled normalization map: a double-array trie (darts-clone) from UTF-8
/// byte strings to offsets in a pool of NUL-terminated replacements.
class PrecompiledCharsMap {
 public:
  PrecompiledCharsMap() = default;
  PrecompiledCharsMap(std::string_view blob, std::string where) : where_(std::move(where)) {
    if (blob.empty()) return;
    if (blob.size() < 4) fail("is shorter than its 4-byte trie size");
    std::uint32_t trie_bytes = 0;
    for (int i = 0; i < 4; ++i)
      trie_bytes |=
          static_cast<std::uint32_t>(static_cast<std::uint8_t>(blob[static_cast<std::size_t>(i)]))
          << (8 * i);
    if (trie_bytes % 4 != 0 || trie_bytes > blob.size() - 4 || trie_bytes == 0)
      fail("states a trie of " + std::to_string(trie_bytes) + " bytes in a map of " +
           std::to_string(blob.size()) + " bytes");
    units_.resize(trie_bytes / 4);
    for (std::size_t u = 0; u < units_.size(); ++u) {
      std::uint32_t v = 0;
      for (std::size_t i = 0; i < 4; ++i)
        v |= static_cast<std::uint32_t>(static_cast<std::uint8_t>(blob[4 + 4 * u + i])) << (8 * i);
      units_[u] = v;
    }
    pool_ = std::string(blob.substr(4 + trie_bytes));
  }

  [[nodiscard]] bool empty() const noexcept { return units_.empty(); }

  /// The replacement of `chunk`: that of its shortest prefix in the map (the tokenizers library
  /// replaces the whole chunk by it), or nothing.
  [[nodiscard]] std::optional<std::string_view> transform(std::string_view chunk) const {
    std::size_t node = offset(unit(0));
    for (const char ch : chunk) {
      const auto c = static_cast<std::uint8_t>(ch);
      if (c == 0) break;
      node ^= c;
      const std::uint32_t u = unit(node);
      if ((u & ((1U << 31) | 0xFFU)) != c) return std::nullopt;
      node ^= offset(u);
      if (((u >> 8) & 1U) != 0) {
        const std::size_t at = unit(node) & ((1U << 31) - 1);
        if (at >= pool_.size()) fail("points past its replacement strings");
        const std::size_t end = pool_.find('\0', at);
        return std::string_view(pool_).substr(at, end == std::string::npos ? end : end - at);
      }
    }
    return std::nullopt;
  }

  /// `s` normalized: each grapheme cluster shorter than 6 bytes replaced as a whole when the map
  /// has it, else each code point on its own.
  [[nodiscard]] std::u32string normalize(const std::u32string& s) const {
    if (empty()) return s;
    std::u32string out;
    out.reserve(s.size());
    std::size_t begin = 0;
    std::string bytes;
    for (const std::size_t end : grapheme_ends(s)) {
      bytes.clear();
      for (std::size_t i = begin; i < end && bytes.size() < 6; ++i) append_utf8(bytes, s[i]);
      if (bytes.size() < 6) {
        if (const auto r = transform(bytes)) {
          out += utf8_to_u32(*r, where_ + " replacement");
          begin = end;
          continue;
        }
      }
      for (std::size_t i = begin; i < end; ++i) {
        bytes.clear();
        append_utf8(bytes, s[i]);
        if (const auto r = transform(bytes))
          out += utf8_to_u32(*r, where_ + " replacement");
        else
          out.push_back(s[i]);
      }
      begin = end;
    }
    return out;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw FormatError("damaged precompiled character map: " + what, where_);
  }
  std::uint32_t unit(std::size_t i) const {
    if (i >= units_.size())
      fail("a trie index past its " + std::to_string(units_.size()) + " units");
    return units_[i];
  }
  static std::size_t offset(std::uint32_t u) {
    return static_cast<std::size_t>((u >> 10) << ((u & (1U << 9)) >> 6));
  }

  std::vector<std::uint32_t> units_;
  std::string pool_;
  std::string where_;
};

class T5Tokenizer : public TokenTable {
 public:
  /// A piece of the Unigram vocabulary and its log-probability.
  struct Piece {
    std::string text;
    double score = 0;
  };

  static T5Tokenizer from_folder(const std::filesystem::path& dir) {
    return tokenizer_detail::with_typed_json_errors(dir, [&] { return read_folder(dir); });
  }

  /// A bare SentencePiece model file (T5's `spiece.model`, as a single file's users have it): what
  /// transformers' T5Tokenizer builds from it alone (its 100 sentinels, `</s>`, `<unk>`, `<pad>`).
  static T5Tokenizer from_sentencepiece_model(const std::filesystem::path& file) {
    if (!std::filesystem::is_regular_file(file))
      throw IoError("is not a file (name T5's SentencePiece model, spiece.model)", file.string());
    return tokenizer_detail::with_typed_json_errors(file, [&] { return read_parts({}, file); });
  }

  /// from_folder's reading; from_folder turns its JSON type errors into FormatErrors.
  static T5Tokenizer read_folder(const std::filesystem::path& dir) {
    const bool has_json = std::filesystem::exists(dir / "tokenizer.json");
    if (!has_json && !std::filesystem::exists(dir / "spiece.model"))
      throw IoError("has neither tokenizer.json nor spiece.model", dir.string());
    return read_parts(dir, dir / (has_json ? "tokenizer.json" : "spiece.model"));
  }

 private:
  /// The tokenizer from `weights_file` (tokenizer.json or a SentencePiece model) and the configs in
  /// `dir` (none where `dir` is empty).
  static T5Tokenizer read_parts(const std::filesystem::path& dir,
                                const std::filesystem::path& weights_file) {
    namespace fs = std::filesystem;
    const fs::path config_file = dir.empty() ? fs::path() : dir / "tokenizer_config.json";
    const fs::path map_file = dir.empty() ? fs::path() : dir / "special_tokens_map.json";
    const bool is_json = weights_file.extension() == ".json";
    const fs::path json_file = is_json ? weights_file : fs::path();
    const fs::path model_file = is_json ? fs::path() : weights_file;
    nlohmann::json config =
        fs::exists(config_file) ? io::read_json(config_file) : nlohmann::json::object();
    if (!config.is_object()) throw FormatError("is not a JSON object", config_file.string());
    if (fs::exists(map_file)) {
      const nlohmann::json map = io::read_json(map_file);
      if (!map.is_object()) throw FormatError("is not a JSON object", map_file.string());
      for (const auto& [key, value] : map.items())
        if (!config.contains(key)) config[key] = value;
    }
    std::int64_t extra_ids = 100;
    if (config.contains("extra_ids")) {
      if (!config["extra_ids"].is_number_integer() || config["extra_ids"].get<std::int64_t>() < 0 ||
          config["extra_ids"].get<std::int64_t>() > 100000)
        throw FormatError("'extra_ids' is not a count from 0 to 100000", config_file.string());
      extra_ids = config["extra_ids"].get<std::int64_t>();
    }

    T5Tokenizer t;
    std::vector<AddedToken> added;
    if (!json_file.empty()) {
      t.where_ = json_file.string();
      read_tokenizer_json(io::read_json(json_file), t, added);
    } else {
      t.where_ = model_file.string();
      const std::vector<char> bytes = io::read_file(model_file);
      read_sentencepiece(std::string_view(bytes.data(), bytes.size()), t, added);
      // transformers appends the sentinels to the model's pieces, the last one first.
      for (std::int64_t i = extra_ids - 1; i >= 0; --i)
        t.pieces_.push_back({"<extra_id_" + std::to_string(i) + ">", 0.0});
    }
    if (t.pieces_.size() < 3)
      throw FormatError("has " + std::to_string(t.pieces_.size()) +
                            " pieces; T5's layout needs <pad>, </s> and <unk> first",
                        t.where_);
    t.base_vocab_size_ = static_cast<std::int64_t>(t.pieces_.size());

    // The special tokens the config names, then the sentinels; strings are special tokens
    // matched in the raw text.
    auto special_token = [&](const char* key, const char* fallback) {
      if (config.contains(key) && !config[key].is_null())
        return tokenizer_detail::token_from_json(config[key], true,
                                                 config_file.string() + " " + key);
      AddedToken d;
      d.content = fallback;
      d.special = true;
      d.normalized = false;
      return d;
    };
    const AddedToken eos = special_token("eos_token", "</s>");
    const AddedToken unk = special_token("unk_token", "<unk>");
    const AddedToken pad = special_token("pad_token", "<pad>");
    for (AddedToken s : {pad, eos, unk}) {
      s.special = true;
      added.push_back(std::move(s));
    }
    bool has_sentinel = false;
    for (const char* key : {"additional_special_tokens", "extra_special_tokens"}) {
      if (!config.contains(key) || !config[key].is_array()) continue;
      for (std::size_t i = 0; i < config[key].size(); ++i) {
        AddedToken s = tokenizer_detail::token_from_json(
            config[key][i], true, config_file.string() + " " + key + "[" + std::to_string(i) + "]");
        s.special = true;
        has_sentinel = has_sentinel || s.content.starts_with("<extra_id_");
        added.push_back(std::move(s));
      }
    }
    if (!has_sentinel)
      for (std::int64_t i = 0; i < extra_ids; ++i) {
        AddedToken s;
        s.content = "<extra_id_" + std::to_string(i) + ">";
        s.special = true;
        s.normalized = false;
        added.push_back(std::move(s));
      }

    for (std::size_t i = 0; i < t.pieces_.size(); ++i) {
      auto [it, fresh] = t.vocab_.try_emplace(t.pieces_[i].text, static_cast<std::int64_t>(i));
      if (!fresh) it->second = static_cast<std::int64_t>(i);  // the tokenizers library: last wins
      t.max_piece_chars_ =
          std::max(t.max_piece_chars_, utf8_to_u32(t.pieces_[i].text, t.where_).size());
    }
    t.id_to_token_.reserve(t.pieces_.size());
    for (const auto& p : t.pieces_) t.id_to_token_.push_back(p.text);
    t.min_score_ = std::numeric_limits<double>::infinity();
    for (const auto& p : t.pieces_) t.min_score_ = std::min(t.min_score_, p.score);
    for (AddedToken& a : added) t.register_added(std::move(a));
    t.eos_ = *t.token_to_id(eos.content);
    t.unk_ = *t.token_to_id(unk.content);
    t.pad_ = *t.token_to_id(pad.content);
    if (config.contains("model_max_length") && config["model_max_length"].is_number()) {
      const double v = config["model_max_length"].get<double>();
      if (v >= 1 && v < 1e18) t.model_max_length_ = static_cast<std::int64_t>(v);
    }
    t.refresh_added();
    return t;
  }

 public:
  /// The ids of `text`, with </s> when `add_special_tokens`; no truncation.
  [[nodiscard]] std::vector<std::int64_t> encode(std::string_view text,
                                                 bool add_special_tokens = true) const {
    std::vector<std::int64_t> ids;
    const std::u32string raw = utf8_to_u32(text, where_ + " input");
    for (const auto& [segment, token] : tokenizer_detail::split_added(raw, added_matcher_)) {
      if (token >= 0) {
        ids.push_back(token);
        continue;
      }
      const std::u32string norm = charsmap_.normalize(segment);
      for (std::size_t i = 0; i < norm.size();) {
        while (i < norm.size() && is_space(norm[i])) ++i;
        std::size_t j = i;
        while (j < norm.size() && !is_space(norm[j])) ++j;
        if (j > i) word(std::u32string_view(norm).substr(i, j - i), ids);
        i = j;
      }
    }
    if (add_special_tokens) ids.push_back(eos_);
    return ids;
  }

  /// A batch as transformers' `tokenizer(texts, padding=..., max_length=..., truncation=...)`
  /// gives it (what SD3's pipeline asks: max_length 256, padded, truncated).
  [[nodiscard]] BatchEncoding operator()(const std::vector<std::string>& texts,
                                         const EncodeOptions& o = {}) const {
    return tokenizer_detail::make_batch(texts, o, model_max_length_, -1, eos_, pad_, "</s>", where_,
                                        [this](const std::string& t) { return encode(t, false); });
  }

  /// The text of `ids` as transformers decodes it: "▁" as a space, none in the first token.
  [[nodiscard]] std::string decode(std::span<const std::int64_t> ids,
                                   bool skip_special_tokens = false) const {
    std::string out;
    bool first = true;
    for (std::size_t i = 0; i < ids.size(); ++i) {
      const std::int64_t id = ids[i];
      if (id < 0 || id >= size())
        throw ConfigError("token id " + std::to_string(id) + " at position " + std::to_string(i) +
                              " is not in the vocabulary (" + std::to_string(size()) + " ids)",
                          where_ + " decode");
      if (skip_special_tokens && is_special(id)) continue;
      const std::string& tok = id_to_token_[static_cast<std::size_t>(id)];
      for (std::size_t k = 0; k < tok.size();) {
        if (tok.compare(k, kSpace.size(), kSpace) == 0) {
          if (!first) out.push_back(' ');
          k += kSpace.size();
        } else {
          out.push_back(tok[k++]);
        }
      }
      first = false;
    }
    return out;
  }

  /// The token strings of `text` (no </s>), for inspection.
  [[nodiscard]] std::vector<std::string> tokenize(std::string_view text) const {
    std::vector<std::string> out;
    for (const std::int64_t id : encode(text, false))
      out.push_back(id_to_token_[static_cast<std::size_t>(id)]);
    return out;
  }

  /// The Unigram vocabulary with the sentinels (32,100 for T5's).
  [[nodiscard]] std::int64_t vocab_size() const noexcept { return base_vocab_size_; }
  [[nodiscard]] std::int64_t eos_token_id() const noexcept { return eos_; }
  [[nodiscard]] std::int64_t pad_token_id() const noexcept { return pad_; }
  [[nodiscard]] std::int64_t unk_token_id() const noexcept { return unk_; }
  [[nodiscard]] std::int64_t model_max_length() const noexcept { return model_max_length_; }
  [[nodiscard]] const std::vector<Piece>& pieces() const noexcept { return pieces_; }

 private:
  static constexpr std::string_view kSpace = "\xE2\x96\x81";  // U+2581 "▁"
  static constexpr char32_t kSpaceCp = U'\u2581';
  /// The Unigram model's unknown id: T5Tokenizer builds its model with unk_id=2 whatever the
  /// file says (the <unk> of T5's layout).
  static constexpr std::int64_t kModelUnk = 2;
  static constexpr double kUnkPenalty = 10.0;

  T5Tokenizer() = default;

  static void read_sentencepiece(std::string_view bytes, T5Tokenizer& t,
                                 std::vector<AddedToken>& added) {
    io::ProtoReader model(bytes, t.where_);
    while (!model.done()) {
      const auto f = model.next();
      if (f.number == 1) {  // SentencePiece { piece = 1; score = 2; type = 3 }
        io::ProtoReader p = model.message(f, "piece " + std::to_string(t.pieces_.size()));
        Piece piece;
        std::int64_t type = 1;
        bool has_text = false;
        while (!p.done()) {
          const auto g = p.next();
          if (g.number == 1) {
            piece.text = std::string(p.as_bytes(g, "piece"));
            has_text = true;
          } else if (g.number == 2) {
            piece.score = static_cast<double>(p.as_float(g, "score"));
          } else if (g.number == 3) {
            type = p.as_int(g, "type");
          }
        }
        if (!has_text || piece.text.empty())
          throw FormatError("piece " + std::to_string(t.pieces_.size()) + " has no text", t.where_);
        (void)utf8_to_u32(piece.text, t.where_ + " piece " + std::to_string(t.pieces_.size()));
        if (type == 3 || type == 4) {  // control and user-defined pieces are added tokens
          AddedToken a;
          a.content = piece.text;
          a.id = static_cast<std::int64_t>(t.pieces_.size());
          a.special = type == 3;
          a.normalized = false;
          added.push_back(std::move(a));
        }
        t.pieces_.push_back(std::move(piece));
      } else if (f.number == 2) {  // TrainerSpec { model_type = 3 }
        io::ProtoReader spec = model.message(f, "trainer_spec");
        while (!spec.done()) {
          const auto g = spec.next();
          if (g.number == 3 && spec.as_int(g, "model_type") != 1)
            throw FormatError("is a SentencePiece model of type " +
                                  std::to_string(spec.as_int(g, "model_type")) +
                                  ", not Unigram (1) as T5's",
                              t.where_);
        }
      } else if (f.number == 3) {  // NormalizerSpec { precompiled_charsmap = 2 }
        io::ProtoReader spec = model.message(f, "normalizer_spec");
        while (!spec.done()) {
          const auto g = spec.next();
          if (g.number == 2)
            t.charsmap_ = PrecompiledCharsMap(spec.as_bytes(g, "precompiled_charsmap"),
                                              t.where_ + " precompiled_charsmap");
        }
      }
    }
    if (t.pieces_.empty()) throw FormatError("has no pieces (not a SentencePiece model)", t.where_);
  }

  static void read_tokenizer_json(const nlohmann::json& j, T5Tokenizer& t,
                                  std::vector<AddedToken>& added) {
    const auto& model = tokenizer_detail::at_key(j, "model", t.where_);
    if (model.value("type", "") != "Unigram")
      throw FormatError("has a '" + model.value("type", std::string("?")) +
                            "' model, not the Unigram of T5's tokenizer",
                        t.where_ + " model");
    const auto& vocab = tokenizer_detail::at_key(model, "vocab", t.where_ + " model");
    if (!vocab.is_array()) throw FormatError("'vocab' is not a list", t.where_ + " model");
    t.pieces_.reserve(vocab.size());
    for (std::size_t i = 0; i < vocab.size(); ++i) {
      const auto& e = vocab[i];
      if (!e.is_array() || e.size() != 2 || !e[0].is_string() || !e[1].is_number())
        throw FormatError("is not [\"piece\", score]",
                          t.where_ + " vocab[" + std::to_string(i) + "]");
      Piece p{e[0].get<std::string>(), e[1].get<double>()};
      (void)utf8_to_u32(p.text, t.where_ + " vocab[" + std::to_string(i) + "]");
      t.pieces_.push_back(std::move(p));
    }
    // T5Tokenizer keeps only the precompiled map of the normalizer (it builds the rest itself).
    if (j.contains("normalizer") && j["normalizer"].is_object()) {
      const nlohmann::json& norm = j["normalizer"];
      const bool sequence = norm.value("type", "") == "Sequence" && norm.contains("normalizers") &&
                            norm["normalizers"].is_array();
      const nlohmann::json parts = sequence ? norm["normalizers"] : nlohmann::json::array({norm});
      for (const auto& n : parts)
        if (n.is_object() && n.value("type", "") == "Precompiled" &&
            n.contains("precompiled_charsmap") && n["precompiled_charsmap"].is_string()) {
          t.charsmap_ = PrecompiledCharsMap(base64(n["precompiled_charsmap"].get<std::string>(),
                                                   t.where_ + " precompiled_charsmap"),
                                            t.where_ + " precompiled_charsmap");
          break;
        }
    }
    if (j.contains("added_tokens") && j["added_tokens"].is_array())
      for (std::size_t i = 0; i < j["added_tokens"].size(); ++i) {
        const auto& e = j["added_tokens"][i];
        const std::string at = t.where_ + " added_tokens[" + std::to_string(i) + "]";
        AddedToken a = tokenizer_detail::token_from_json(e, false, at);
        if (!e.contains("id") || !e["id"].is_number_integer())
          throw FormatError("has no integer 'id'", at);
        a.id = e["id"].get<std::int64_t>();
        added.push_back(std::move(a));
      }
  }

  static std::string base64(const std::string& s, const std::string& where) {
    std::string out;
    out.reserve(s.size() / 4 * 3);
    std::uint32_t acc = 0;
    int bits = 0;
    for (std::size_t i = 0; i < s.size(); ++i) {
      const char c = s[i];
      int v = -1;
      if (c >= 'A' && c <= 'Z')
        v = c - 'A';
      else if (c >= 'a' && c <= 'z')
        v = c - 'a' + 26;
      else if (c >= '0' && c <= '9')
        v = c - '0' + 52;
      else if (c == '+')
        v = 62;
      else if (c == '/')
        v = 63;
      else if (c == '=')
        break;
      else
        throw FormatError("is not base64 (character " + std::to_string(i) + ")", where);
      acc = (acc << 6) | static_cast<std::uint32_t>(v);
      bits += 6;
      if (bits >= 8) {
        bits -= 8;
        out.push_back(static_cast<char>((acc >> bits) & 0xFF));
      }
    }
    return out;
  }

  /// An added token takes the vocabulary's id of its text, its own id when it names one past the
  /// vocabulary, else the next free one; a text registered already keeps its first flags (a
  /// user-defined piece listed again among the special tokens stays what tokenizer.json says).
  void register_added(AddedToken a) {
    for (const auto& have : added_)
      if (have.content == a.content) return;
    if (const auto v = vocab_.find(a.content); v != vocab_.end()) {
      a.id = v->second;
    } else if (a.id < static_cast<std::int64_t>(id_to_token_.size())) {
      a.id = static_cast<std::int64_t>(id_to_token_.size());
    }
    if (a.id >= static_cast<std::int64_t>(id_to_token_.size()))
      id_to_token_.resize(static_cast<std::size_t>(a.id + 1));
    id_to_token_[static_cast<std::size_t>(a.id)] = a.content;
    added_.push_back(std::move(a));
  }

  void refresh_added() {
    added_matcher_.tokens.clear();
    for (const auto& a : added_)
      added_matcher_.tokens.emplace_back(utf8_to_u32(a.content, where_ + " added token"), a);
    added_matcher_.sort_longest_first();
  }

  /// One white-space-free word: "▁" before it unless it starts with one, then a piece from each
  /// "▁" to the next, each cut by the Viterbi path.
  void word(std::u32string_view w, std::vector<std::int64_t>& ids) const {
    std::u32string s;
    s.reserve(w.size() + 1);
    if (w.front() != kSpaceCp) s.push_back(kSpaceCp);
    s.append(w);
    std::size_t start = 0;
    for (std::size_t i = 1; i <= s.size(); ++i)
      if (i == s.size() || s[i] == kSpaceCp) {
        viterbi(std::u32string_view(s).substr(start, i - start), ids);
        start = i;
      }
  }

  void viterbi(std::u32string_view s, std::vector<std::int64_t>& ids) const {
    struct Node {
      double score = 0;
      std::int64_t id = -1;
      std::size_t start = 0;
      bool reached = false;
    };
    const std::size_t n = s.size();
    std::vector<Node> best(n + 1);
    best[0].reached = true;
    std::string key;
    for (std::size_t i = 0; i < n; ++i) {
      const double here = best[i].score;
      bool single = false;
      key.clear();
      for (std::size_t j = i; j < n && j - i < max_piece_chars_; ++j) {
        append_utf8(key, s[j]);
        const auto it = vocab_.find(key);
        if (it == vocab_.end()) continue;
        const double cand = here + pieces_[static_cast<std::size_t>(it->second)].score;
        Node& target = best[j + 1];
        if (!target.reached || cand > target.score) target = {cand, it->second, i, true};
        single = single || j == i;
      }
      if (!single) {
        const double cand = here + min_score_ - kUnkPenalty;
        Node& target = best[i + 1];
        if (!target.reached || cand > target.score) target = {cand, kModelUnk, i, true};
      }
    }
    // Back from the end; adjacent unknowns become one token, looked up by its text.
    std::vector<std::pair<std::size_t, std::size_t>> spans;  // [start, end) of each token
    std::vector<bool> unknown;
    for (std::size_t end = n; end > 0;) {
      const Node& node = best[end];
      const bool unk = node.id == kModelUnk;
      if (unk && !unknown.empty() && unknown.back())
        spans.back().first = node.start;
      else {
        spans.emplace_back(node.start, end);
        unknown.push_back(unk);
      }
      end = node.start;
    }
    for (std::size_t k = spans.size(); k-- > 0;) {
      const auto [b, e] = spans[k];
      const auto it = vocab_.find(u32_to_utf8(s.substr(b, e - b)));
      ids.push_back(it == vocab_.end() ? kModelUnk : it->second);
    }
  }

  std::vector<Piece> pieces_;
  std::size_t max_piece_chars_ = 1;
  double min_score_ = 0;
  std::int64_t base_vocab_size_ = 0;
  PrecompiledCharsMap charsmap_;
  tokenizer_detail::AddedTokenMatcher added_matcher_;
  std::int64_t eos_ = 1, unk_ = 2, pad_ = 0;
  std::int64_t model_max_length_ = std::numeric_limits<std::int64_t>::max();
};

}  // namespace difftrain::text
