#pragma once
// The Stable Diffusion web UI's prompt syntax, as its prompt parser and CLIP wrapper apply it
// (modules/prompt_parser.py parse_prompt_attention, modules/sd_hijack_clip.py tokenize_line):
//
//   (word)  ×1.1     ((word)) ×1.21     [word] ÷1.1     (word:1.3) ×1.3
//   \( \) \[ \] \\   literal brackets and backslash
//   BREAK            (as a word of its own) ends the chunk here
//   unbalanced       an unclosed ( or [ applies its multiplier to the end; a stray ) or ] is text
//
// then the text is tokenized piece by piece and cut into chunks of 75 tokens (each encoded as
// <start> + 75 + <end>, 77 positions); a chunk that fills up moves the words after its last comma
// (when that comma is at most `comma_padding_backtrack` tokens back) into the next chunk.
// Embedding names found in the tokens (longest first) take their vectors' count of positions and
// are never split across chunks.

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/text/clip_tokenizer.hpp"
#include "difftrain/text/unicode.hpp"

namespace difftrain::text {

/// A run of prompt text and its attention multiplier; BREAK is {"BREAK", -1}.
struct WeightedText {
  std::string text;
  double weight = 1.0;
  bool operator==(const WeightedText&) const = default;
};

namespace webui_detail {

inline bool is_word_char(char32_t c) { return c == U'_' || is_letter(c) || is_number(c); }

/// Python's `\s` on str (str.isspace): the White_Space characters and also U+001C-U+001F, which
/// Python counts (bidirectional class B or S) and Unicode's White_Space does not.
inline bool is_python_space(char32_t c) { return (c >= 0x1C && c <= 0x1F) || is_space(c); }

/// Python's `\d` on str: a decimal digit of any script (category Nd); its value, or -1.
inline int decimal_digit(char32_t c) {
  if (c < 0x80) return c >= U'0' && c <= U'9' ? static_cast<int>(c - U'0') : -1;
  return u_charType(static_cast<UChar32>(c)) == U_DECIMAL_DIGIT_NUMBER
             ? u_charDigitValue(static_cast<UChar32>(c))
             : -1;
}

/// The code point of UTF-8 `text` at byte `i` and its length in bytes (a byte that starts no
/// valid sequence: itself, length 1; the prompt was checked as UTF-8 where it matters).
inline std::pair<char32_t, std::size_t> code_point_at(std::string_view text, std::size_t i) {
  const auto* p = reinterpret_cast<const std::uint8_t*>(text.data());
  if (p[i] < 0x80) return {p[i], 1};
  auto k = static_cast<std::int32_t>(i);
  UChar32 c = 0;
  U8_NEXT(p, k, static_cast<std::int32_t>(text.size()), c);
  if (c < 0) return {p[i], 1};
  return {static_cast<char32_t>(c), static_cast<std::size_t>(k) - i};
}

/// Python's re.split(r"\s*\bBREAK\b\s*", text): the pieces between the BREAK words.
inline std::vector<std::string> split_break(const std::string& text) {
  const std::u32string s = utf8_to_u32(text, "prompt");
  std::vector<std::string> parts;
  std::size_t piece_start = 0;
  for (std::size_t i = 0; i < s.size();) {
    // The leftmost match: a run of white space (possibly empty) then BREAK between word
    // boundaries, then white space.
    std::size_t j = i;
    while (j < s.size() && is_python_space(s[j])) ++j;
    const bool at_word = s.compare(j, 5, U"BREAK") == 0 && (j == 0 || !is_word_char(s[j - 1])) &&
                         (j + 5 == s.size() || !is_word_char(s[j + 5]));
    if (!at_word) {
      i = j > i ? j : i + 1;
      continue;
    }
    std::size_t end = j + 5;
    while (end < s.size() && is_python_space(s[end])) ++end;
    parts.push_back(u32_to_utf8(s.substr(piece_start, i - piece_start)));
    piece_start = end;
    i = end;
  }
  parts.push_back(u32_to_utf8(s.substr(piece_start)));
  return parts;
}

}  // namespace webui_detail

/// The web UI's parse_prompt_attention: the prompt as runs of text with their multipliers,
/// neighbours of equal weight merged; an empty prompt is {"", 1}. A weight the web UI's float()
/// would refuse ("(a:1.2.3)") is a ConfigError naming it.
inline std::vector<WeightedText> parse_prompt_attention(std::string_view text) {
  std::vector<WeightedText> res;
  std::vector<std::size_t> round, square;
  const double round_mult = 1.1, square_mult = 1 / 1.1;
  auto multiply_range = [&](std::size_t start, double m) {
    for (std::size_t p = start; p < res.size(); ++p) res[p].weight *= m;
  };
  auto plain = [&](const std::string& t) {
    const auto parts = webui_detail::split_break(t);
    for (std::size_t i = 0; i < parts.size(); ++i) {
      if (i > 0) res.push_back({"BREAK", -1.0});
      res.push_back({parts[i], 1.0});
    }
  };
  const std::size_t n = text.size();
  for (std::size_t i = 0; i < n;) {
    const char c = text[i];
    if (c == '\\') {
      // \( \) \[ \] \\ : the character; a lone backslash: nothing.
      if (i + 1 < n && (text[i + 1] == '(' || text[i + 1] == ')' || text[i + 1] == '[' ||
                        text[i + 1] == ']' || text[i + 1] == '\\')) {
        res.push_back({std::string(1, text[i + 1]), 1.0});
        i += 2;
      } else {
        res.push_back({"", 1.0});
        ++i;
      }
    } else if (c == '(') {
      round.push_back(res.size());
      ++i;
    } else if (c == '[') {
      square.push_back(res.size());
      ++i;
    } else if (c == ':') {
      // ":<number>)" is one token when a number of dots and digits (Python's \d: any script's
      // decimal digits, which Python's float() reads too) is followed by ')'.
      std::size_t j = i + 1;
      std::string number;  // in ASCII digits
      if (j < n && (text[j] == '+' || text[j] == '-')) number.push_back(text[j++]);
      const std::size_t digits = j;
      while (j < n) {
        const auto [cp, len] = webui_detail::code_point_at(text, j);
        const int d = cp == U'.' ? -2 : webui_detail::decimal_digit(cp);
        if (d == -1) break;
        number.push_back(d == -2 ? '.' : static_cast<char>('0' + d));
        j += len;
      }
      if (j > digits && j < n && text[j] == ')') {
        if (!round.empty()) {
          char* end = nullptr;
          const double w = std::strtod(number.c_str(), &end);
          if (end != number.c_str() + number.size() || number.find('.') != number.rfind('.') ||
              number == "." || number == "+." || number == "-.")
            throw ConfigError("the emphasis weight '" + number + "' is not a number",
                              "prompt \"" + std::string(text) + "\"");
          multiply_range(round.back(), w);
          round.pop_back();
        } else {
          plain(std::string(text.substr(i, j + 1 - i)));
        }
        i = j + 1;
      } else {
        plain(":");
        ++i;
      }
    } else if (c == ')' && !round.empty()) {
      multiply_range(round.back(), round_mult);
      round.pop_back();
      ++i;
    } else if (c == ']' && !square.empty()) {
      multiply_range(square.back(), square_mult);
      square.pop_back();
      ++i;
    } else if (c == ')' || c == ']') {
      plain(std::string(1, c));
      ++i;
    } else {
      std::size_t j = i;
      while (j < n && text[j] != '\\' && text[j] != '(' && text[j] != ')' && text[j] != '[' &&
             text[j] != ']' && text[j] != ':')
        ++j;
      plain(std::string(text.substr(i, j - i)));
      i = j;
    }
  }
  for (const std::size_t pos : round) multiply_range(pos, round_mult);
  for (const std::size_t pos : square) multiply_range(pos, square_mult);
  if (res.empty()) res.push_back({"", 1.0});
  // Neighbours of equal weight merged, in one pass (erasing one at a time was quadratic: a
  // prompt of 100,000 ':' took tens of seconds).
  std::vector<WeightedText> merged;
  merged.reserve(res.size());
  for (auto& r : res) {
    if (!merged.empty() && merged.back().weight == r.weight)
      merged.back().text += r.text;
    else
      merged.push_back(std::move(r));
  }
  return merged;
}

/// How the web UI treats emphasis (its "Emphasis mode" setting).
enum class Emphasis {
  none,      ///< no parsing: brackets are text
  ignore,    ///< parsed, multipliers not applied
  original,  ///< multiplied into the encoder's output, the mean restored (the default)
  no_norm,   ///< multiplied, the mean not restored (SDXL)
};

/// An embedding found in a prompt's tokens: its name, how many vectors (positions) it takes, how
/// many tokens of the prompt its name spans.
struct FoundEmbedding {
  std::string name;
  std::int64_t vectors = 1;
  std::int64_t tokens = 1;
};
/// Looks for an embedding name starting at `position` of `tokens` (the web UI's
/// EmbeddingDatabase::find_embedding_at_position, longest match first).
using EmbeddingFinder = std::function<std::optional<FoundEmbedding>(
    const std::vector<std::int64_t>& tokens, std::size_t position)>;

/// Where an embedding's vectors go in a chunk.
struct ChunkFix {
  std::size_t offset = 0;  ///< the web UI's offset: the vectors go at offset + 1 of the 77
  std::string name;
  std::int64_t vectors = 1;
  bool operator==(const ChunkFix&) const = default;
};

/// 77 token ids (start, 75, end) with a multiplier each, and the embeddings to place.
struct PromptChunk {
  std::vector<std::int64_t> tokens;
  std::vector<double> multipliers;
  std::vector<ChunkFix> fixes;
};

struct WebuiPromptOptions {
  Emphasis emphasis = Emphasis::original;
  /// The web UI's "Prompt word wrap length limit": how far back a comma may be for the words after
  /// it to move to the next chunk (0: never).
  std::int64_t comma_padding_backtrack = 20;
  std::int64_t chunk_length = 75;
};

struct TokenizedPrompt {
  std::vector<PromptChunk> chunks;
  std::int64_t token_count = 0;  ///< as the web UI counts it (the "75/150" under the prompt)
};

/// The web UI's tokenize_line: a prompt as chunks of 77 ids, multipliers and embedding fixes.
inline TokenizedPrompt tokenize_prompt(const CLIPTokenizer& tok, std::string_view line,
                                       const WebuiPromptOptions& o = {},
                                       const EmbeddingFinder& find_embedding = {}) {
  if (o.chunk_length < 1) throw ConfigError("chunk_length must be positive", "web UI prompt");
  const std::vector<WeightedText> parsed = o.emphasis == Emphasis::none
                                               ? std::vector<WeightedText>{{std::string(line), 1.0}}
                                               : parse_prompt_attention(line);
  const std::int64_t id_start = tok.bos_token_id(), id_end = tok.eos_token_id();
  const auto comma = tok.token_to_id(",</w>");
  const auto len = static_cast<std::size_t>(o.chunk_length);
  TokenizedPrompt out;
  PromptChunk chunk;
  std::int64_t last_comma = -1;
  auto next_chunk = [&](bool is_last) {
    out.token_count += is_last ? static_cast<std::int64_t>(chunk.tokens.size()) : o.chunk_length;
    if (chunk.tokens.size() < len) {
      chunk.multipliers.resize(len, 1.0);
      chunk.tokens.resize(len, id_end);
    }
    chunk.tokens.insert(chunk.tokens.begin(), id_start);
    chunk.tokens.push_back(id_end);
    chunk.multipliers.insert(chunk.multipliers.begin(), 1.0);
    chunk.multipliers.push_back(1.0);
    last_comma = -1;
    out.chunks.push_back(std::move(chunk));
    chunk = PromptChunk{};
  };
  for (const auto& [text, weight] : parsed) {
    if (text == "BREAK" && weight == -1.0) {
      next_chunk(false);
      continue;
    }
    const std::vector<std::int64_t> tokens = tok.encode(text, false);
    for (std::size_t position = 0; position < tokens.size();) {
      const std::int64_t token = tokens[position];
      if (comma && token == *comma) {
        last_comma = static_cast<std::int64_t>(chunk.tokens.size());
      } else if (o.comma_padding_backtrack != 0 && chunk.tokens.size() == len && last_comma != -1 &&
                 static_cast<std::int64_t>(chunk.tokens.size()) - last_comma <=
                     o.comma_padding_backtrack) {
        const auto at = static_cast<std::size_t>(last_comma + 1);
        std::vector<std::int64_t> reloc_tokens(
            chunk.tokens.begin() + static_cast<std::ptrdiff_t>(at), chunk.tokens.end());
        std::vector<double> reloc_mults(chunk.multipliers.begin() + static_cast<std::ptrdiff_t>(at),
                                        chunk.multipliers.end());
        chunk.tokens.resize(at);
        chunk.multipliers.resize(at);
        next_chunk(false);
        chunk.tokens = std::move(reloc_tokens);
        chunk.multipliers = std::move(reloc_mults);
      }
      if (chunk.tokens.size() == len) next_chunk(false);
      const std::optional<FoundEmbedding> emb =
          find_embedding ? find_embedding(tokens, position) : std::nullopt;
      if (!emb) {
        chunk.tokens.push_back(token);
        chunk.multipliers.push_back(weight);
        ++position;
        continue;
      }
      const auto vectors = static_cast<std::size_t>(emb->vectors);
      if (chunk.tokens.size() + vectors > len) next_chunk(false);
      chunk.fixes.push_back({chunk.tokens.size(), emb->name, emb->vectors});
      chunk.tokens.insert(chunk.tokens.end(), vectors, 0);
      chunk.multipliers.insert(chunk.multipliers.end(), vectors, weight);
      position += static_cast<std::size_t>(std::max<std::int64_t>(emb->tokens, 1));
    }
  }
  if (!chunk.tokens.empty() || out.chunks.empty()) next_chunk(true);
  return out;
}

}  // namespace difftrain::text
