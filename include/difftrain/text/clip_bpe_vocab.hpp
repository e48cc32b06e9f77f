#pragma once
// CLIP's tokenizer from OpenAI's BPE merges file alone (`bpe_simple_vocab_16e6.txt.gz`, as
// open_clip and the original CLIP code ship it), for a single-file model that comes without a
// tokenizer folder. The 49,408-entry vocabulary follows from the merges as open_clip builds it:
// the 256 byte-level symbols, the same with "</w>", one token per merge (its two parts joined),
// then <|startoftext|> and <|endoftext|>; the merges are the file's lines 2 to 48,895.
//
//   auto tok = text::clip_tokenizer_from_bpe_merges("bpe_simple_vocab_16e6.txt.gz");
//   auto tok2 = text::clip_tokenizer_from_bpe_merges(path, "!");  // SD 2.x / SDXL's second: pads
//   with "!"

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "difftrain/core/error.hpp"
#include "difftrain/io/atomic_file.hpp"
#include "difftrain/io/inflate.hpp"
#include "difftrain/io/read_file.hpp"
#include "difftrain/text/clip_tokenizer.hpp"

namespace difftrain::text {

/// The number of merges open_clip takes from the file (49152 - 256 - 2).
inline constexpr std::size_t kClipBpeMerges = 48894;

namespace clip_bpe_detail {

/// The merges of a BPE merges file (gzipped or plain), and the vocabulary open_clip builds from
/// them, ids in order.
struct BpeVocabulary {
  std::vector<std::pair<std::string, std::string>> merges;
  std::vector<std::string> tokens;
};

inline BpeVocabulary read_bpe_vocabulary(const std::filesystem::path& path) {
  const std::string where = path.string();
  const std::vector<char> raw = io::read_file(path);
  const bool gz = raw.size() >= 2 && static_cast<unsigned char>(raw[0]) == 0x1f &&
                  static_cast<unsigned char>(raw[1]) == 0x8b;
  // The real file inflates to 1.36 MB; 64 MiB bounds a hostile one.
  const std::string text =
      gz ? io::inflate_capped(
               std::span(reinterpret_cast<const unsigned char*>(raw.data()), raw.size()),
               std::uint64_t{64} << 20, where, io::Compression::gzip)
         : std::string(raw.begin(), raw.end());
  BpeVocabulary v;
  v.merges.reserve(kClipBpeMerges);
  std::size_t at = text.find('\n');  // the first line is a version header
  std::size_t line = 1;
  while (at != std::string::npos && v.merges.size() < kClipBpeMerges) {
    const std::size_t start = at + 1;
    at = text.find('\n', start);
    ++line;
    const std::string_view l(text.data() + start,
                             (at == std::string::npos ? text.size() : at) - start);
    const std::size_t space = l.find(' ');
    if (space == std::string_view::npos || space == 0 || space + 1 >= l.size() ||
        l.find(' ', space + 1) != std::string_view::npos)
      throw FormatError("line " + std::to_string(line) + " is not a merge of two symbols ('" +
                            std::string(l.substr(0, 60)) + "')",
                        where);
    v.merges.emplace_back(std::string(l.substr(0, space)), std::string(l.substr(space + 1)));
  }
  if (v.merges.size() != kClipBpeMerges)
    throw FormatError("holds " + std::to_string(v.merges.size()) +
                          " merges; CLIP's vocabulary is built from " +
                          std::to_string(kClipBpeMerges) + " (bpe_simple_vocab_16e6.txt.gz)",
                      where);
  v.tokens.reserve(49408);
  // The byte-level symbols in GPT-2's bytes_to_unicode order: the printable bytes ('!'..'~',
  // '\xa1'..'\xac', '\xae'..'\xff') first, then the others, each in byte order.
  const auto alphabet = clip_detail::byte_alphabet();
  const auto printable = [](int b) {
    return (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
  };
  std::vector<std::string> symbols;
  for (const bool first : {true, false})
    for (int b = 0; b < 256; ++b)
      if (printable(b) == first) {
        std::string s;
        append_utf8(s, alphabet[static_cast<std::size_t>(b)]);
        symbols.push_back(std::move(s));
      }
  for (const auto& s : symbols) v.tokens.push_back(s);
  for (const auto& s : symbols) v.tokens.push_back(s + "</w>");
  for (const auto& [a, b] : v.merges) v.tokens.push_back(a + b);
  v.tokens.emplace_back("<|startoftext|>");
  v.tokens.emplace_back("<|endoftext|>");
  return v;
}

inline AddedToken special_token(const std::string& content, bool normalized) {
  return AddedToken{.content = content,
                    .id = -1,
                    .special = true,
                    .normalized = normalized,
                    .lstrip = false,
                    .rstrip = false,
                    .single_word = false};
}

}  // namespace clip_bpe_detail

/// CLIPTokenizer from a BPE merges file, gzipped or plain. `pad`: the padding token (SD 1.x's
/// tokenizer pads with <|endoftext|>, SD 2.x's and SDXL's second with "!"). A file with fewer
/// merges, or a merge that is not two symbols, is a FormatError naming the line.
inline CLIPTokenizer clip_tokenizer_from_bpe_merges(const std::filesystem::path& path,
                                                    const std::string& pad = "<|endoftext|>",
                                                    std::int64_t model_max_length = 77) {
  const std::string where = path.string();
  auto v = clip_bpe_detail::read_bpe_vocabulary(path);
  std::unordered_map<std::string, std::int64_t> vocab;
  vocab.reserve(v.tokens.size());
  for (std::size_t i = 0; i < v.tokens.size(); ++i)
    if (!vocab.emplace(v.tokens[i], static_cast<std::int64_t>(i)).second)
      throw FormatError("makes the token '" + v.tokens[i] + "' twice", where);
  // As the published tokenizer folders register them: the start and end tokens as normalized
  // AddedTokens, the padding token as a plain string (transformers then matches it in the raw
  // text only: SD 1.x's "<|ENDOFTEXT|>" is text, "<|StartOfText|>" the start token).
  const std::string end = "<|endoftext|>";
  std::vector<AddedToken> added = {clip_bpe_detail::special_token("<|startoftext|>", true),
                                   clip_bpe_detail::special_token(end, pad != end)};
  if (pad != end) added.push_back(clip_bpe_detail::special_token(pad, false));
  return CLIPTokenizer(std::move(vocab), v.merges, std::move(added), "<|startoftext|>",
                       "<|endoftext|>", pad, "<|endoftext|>", model_max_length, true, where);
}

/// Writes the tokenizer folder transformers saves for that tokenizer (vocab.json, merges.txt,
/// tokenizer_config.json, special_tokens_map.json), which diffusers' pipelines and
/// CLIPTokenizer::from_folder read.
inline void write_clip_tokenizer_folder(const std::filesystem::path& bpe_file,
                                        const std::filesystem::path& out,
                                        const std::string& pad = "<|endoftext|>",
                                        std::int64_t model_max_length = 77) {
  const auto v = clip_bpe_detail::read_bpe_vocabulary(bpe_file);
  std::filesystem::create_directories(out);
  nlohmann::ordered_json vocab = nlohmann::ordered_json::object();
  for (std::size_t i = 0; i < v.tokens.size(); ++i) vocab[v.tokens[i]] = i;
  std::string merges = "#version: 0.2\n";
  for (const auto& [a, b] : v.merges) merges += a + " " + b + "\n";
  const auto special = [](const std::string& content) {
    return nlohmann::ordered_json{{"content", content},
                                  {"lstrip", false},
                                  {"normalized", true},
                                  {"rstrip", false},
                                  {"single_word", false}};
  };
  const nlohmann::ordered_json map = {{"bos_token", special("<|startoftext|>")},
                                      {"eos_token", special("<|endoftext|>")},
                                      {"pad_token", pad},
                                      {"unk_token", special("<|endoftext|>")}};
  nlohmann::ordered_json config = map;
  config["add_prefix_space"] = false;
  config["do_lower_case"] = true;
  config["errors"] = "replace";
  config["model_max_length"] = model_max_length;
  config["tokenizer_class"] = "CLIPTokenizer";
  const auto write = [&](const char* name, const std::string& text) {
    io::write_file_atomic(out / name, std::span(text.data(), text.size()));
  };
  write("vocab.json", vocab.dump());
  write("merges.txt", merges);
  write("tokenizer_config.json", config.dump(2));
  write("special_tokens_map.json", map.dump(2));
}

}  // namespace difftrain::text
