#pragma once
// Textual-inversion embeddings in the token table, as diffusers loads and trains them
// (loaders/textual_inversion.py load_textual_inversion and _maybe_convert_prompt; the training
// script examples/textual_inversion/textual_inversion.py): a name becomes new tokens ("<name>",
// "<name>_1", ... one per vector) with new rows of the text encoder's token table; a prompt naming
// a multi-vector embedding is expanded to all its tokens; training updates the table and then puts
// back every row but the embedding's, so the rest of the table and the encoder stay as they were,
// to the bit. (The web UI's way — vectors placed into the looked-up embeddings, the table never
// touched — is text::encode_webui_prompts with an EmbeddingDatabase.)

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/text/clip_tokenizer.hpp"

namespace difftrain::text {

/// diffusers' load_textual_inversion for one token: `vectors` (width) or (n, width) become the
/// rows of "<token>", "<token>_1", ..., "<token>_{n-1}", added to `tok` and to `encoder`'s table
/// (resized to the tokenizer's size). Returns their ids. A token the tokenizer has already, or
/// vectors of another width than the encoder's, are refused before anything changes.
template <class Encoder>
std::vector<std::int64_t> load_textual_inversion(CLIPTokenizer& tok, Encoder& encoder,
                                                 const std::string& token,
                                                 const at::Tensor& vectors) {
  const std::string where = "textual inversion '" + token + "'";
  const at::Tensor v = vectors.dim() == 1 ? vectors.unsqueeze(0) : vectors;
  const std::int64_t width = encoder->token_embedding->weight.size(1);
  if (v.dim() != 2 || v.size(0) < 1 || v.size(1) != width)
    throw ShapeError("has vectors of shape " + c10::str(vectors.sizes()) +
                         "; the text encoder's token table is " + std::to_string(width) + " wide",
                     where);
  std::vector<std::string> names{token};
  for (std::int64_t i = 1; i < v.size(0); ++i) names.push_back(token + "_" + std::to_string(i));
  for (const auto& n : names)
    if (tok.token_to_id(n))
      throw ConfigError("'" + n + "' is already a token of the tokenizer; choose another name",
                        where);
  if (tok.size() != encoder->token_embedding->weight.size(0))
    throw ShapeError("the tokenizer has " + std::to_string(tok.size()) +
                         " ids but the text encoder's table " +
                         std::to_string(encoder->token_embedding->weight.size(0)) + " rows",
                     where);
  encoder->resize_token_embeddings(tok.size() + v.size(0));
  std::vector<std::int64_t> ids;
  at::NoGradGuard no_grad;
  for (std::size_t i = 0; i < names.size(); ++i) {
    const std::int64_t id = tok.add_token({.content = names[i]});
    encoder->token_embedding->weight[id].copy_(v[static_cast<std::int64_t>(i)]);
    ids.push_back(id);
  }
  return ids;
}

/// diffusers' _maybe_convert_prompt: each added token of the prompt that has "_1", "_2", ...
/// companions is replaced (as text) by all of them, so a multi-vector embedding gets every row.
inline std::string convert_prompt(const CLIPTokenizer& tok, std::string prompt) {
  std::set<std::string> added;
  for (const auto& t : tok.added_tokens()) added.insert(t.content);
  // The added tokens with companions and what replaces them; with none (no multi-vector
  // embedding loaded) nothing can change, and the prompt is not tokenized a second time.
  std::map<std::string, std::string> replacements;
  for (const auto& token : added) {
    std::string replacement = token;
    for (int i = 1; added.contains(token + "_" + std::to_string(i)); ++i)
      replacement += " " + token + "_" + std::to_string(i);
    if (replacement != token) replacements.emplace(token, std::move(replacement));
  }
  if (replacements.empty()) return prompt;
  const std::vector<std::string> tokens = tok.tokenize(prompt);
  for (const auto& token : std::set<std::string>(tokens.begin(), tokens.end())) {
    const auto r = replacements.find(token);
    if (r == replacements.end()) continue;
    const std::string& replacement = r->second;
    std::string out;
    for (std::size_t at = 0;;) {
      const auto hit = prompt.find(token, at);
      out += prompt.substr(at, hit == std::string::npos ? std::string::npos : hit - at);
      if (hit == std::string::npos) break;
      out += replacement;
      at = hit + token.size();
    }
    prompt = std::move(out);
  }
  return prompt;
}

/// Keeps every row of a token table but the trained ones: snapshot once, restore after each
/// optimizer step (weight decay and momentum would otherwise move every row), as diffusers'
/// textual-inversion script does with its index_no_updates.
class TokenRowsKeeper {
 public:
  TokenRowsKeeper(const at::Tensor& table, const std::vector<std::int64_t>& trained)
      : table_(table), original_(table.detach().clone()) {
    at::Tensor keep = at::ones({table.size(0)}, at::kBool);
    for (const std::int64_t id : trained) {
      if (id < 0 || id >= table.size(0))
        throw ConfigError("trained row " + std::to_string(id) + " is outside the table (" +
                              std::to_string(table.size(0)) + " rows)",
                          "TokenRowsKeeper");
      keep[id] = false;
    }
    keep_ = keep.nonzero().squeeze(1).to(table.device());
  }
  /// Puts back every row that is not trained.
  void restore() {
    at::NoGradGuard no_grad;
    table_.index_copy_(0, keep_, original_.index_select(0, keep_));
  }

 private:
  at::Tensor table_, original_, keep_;
};

}  // namespace difftrain::text
