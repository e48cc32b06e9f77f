#pragma once
// The web UI's EmbeddingDatabase: the textual-inversion embeddings a prompt may name, looked up by
// the tokens of their names.
//
// An embedding is registered under the token ids of its name (the tokenizer is the caller's: the
// web UI uses its text encoder's, without start and end tokens). Lookup at a position tries the
// embeddings whose names start with that token, longest first, so "cat-toy-xl" wins over "cat".
// `expand` walks a prompt's tokens and gives the web UI's result: each name replaced by as many
// placeholder tokens (0) as the embedding has vectors, and the positions where `apply_embeddings`
// writes the vectors over the token embeddings (the web UI's EmbeddingsWithFixes).
//
// Loading a directory registers every embedding whose width matches the text encoder (the
// `expected_shape`; -1 takes any) and sets the others aside as skipped, as the web UI does; a file
// that cannot be read is reported with its typed error and the scan goes on.

#include <ATen/ATen.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "difftrain/adapters/embedding.hpp"
#include "difftrain/core/error.hpp"
#include "difftrain/text/webui_prompt.hpp"

namespace difftrain::adapters {

class EmbeddingDatabase {
 public:
  using Tokenize = std::function<std::vector<std::int64_t>(const std::string&)>;
  using Ptr = std::shared_ptr<const Embedding>;

  struct Match {
    Ptr embedding;
    std::int64_t length = 0;  ///< tokens of the name matched
  };
  /// A prompt with its embeddings resolved: `tokens` has `vectors()` zeros where each name was;
  /// `fixes` are (position in `tokens`, embedding).
  struct Expanded {
    std::vector<std::int64_t> tokens;
    std::vector<std::pair<std::int64_t, Ptr>> fixes;
  };
  struct LoadReport {
    std::vector<std::string> loaded, skipped;
    std::vector<std::pair<std::filesystem::path, std::string>> errors;  ///< file, what was wrong
  };

  explicit EmbeddingDatabase(Tokenize tokenize, std::int64_t expected_shape = -1)
      : tokenize_(std::move(tokenize)), expected_shape_(expected_shape) {
    if (!tokenize_) throw ConfigError("needs a tokenizer", "EmbeddingDatabase");
  }

  /// Registers `e` under its name, replacing an embedding of the same name.
  Ptr register_embedding(Embedding e) {
    const std::string name = e.name;
    return register_embedding_by_name(std::make_shared<const Embedding>(std::move(e)), name);
  }
  /// Registers `e` under `name` (the web UI's register_embedding_by_name); a null `e` removes
  /// the name.
  Ptr register_embedding_by_name(Ptr e, const std::string& name) {
    const std::vector<std::int64_t> ids = tokenize_(name);
    if (ids.empty())
      throw ConfigError("tokenizes to no tokens, so no prompt can name it",
                        "embedding name '" + name + "'");
    auto& lookup = ids_lookup_[ids.front()];
    std::erase_if(lookup, [&](const auto& entry) { return entry.second->name == name; });
    if (e) lookup.emplace_back(ids, e);
    std::stable_sort(lookup.begin(), lookup.end(),
                     [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
    if (!e) {
      word_embeddings_.erase(name);
      if (lookup.empty()) ids_lookup_.erase(ids.front());
      return nullptr;
    }
    word_embeddings_[name] = e;
    return e;
  }
  void unregister(const std::string& name) { register_embedding_by_name(nullptr, name); }

  /// The embedding whose name's tokens start at `tokens[offset]`, longest name first.
  [[nodiscard]] std::optional<Match> find_embedding_at_position(
      std::span<const std::int64_t> tokens, std::size_t offset) const {
    if (offset >= tokens.size()) return std::nullopt;
    const auto it = ids_lookup_.find(tokens[offset]);
    if (it == ids_lookup_.end()) return std::nullopt;
    for (const auto& [ids, e] : it->second)
      if (offset + ids.size() <= tokens.size() &&
          std::equal(ids.begin(), ids.end(), tokens.begin() + static_cast<std::ptrdiff_t>(offset)))
        return Match{e, static_cast<std::int64_t>(ids.size())};
    return std::nullopt;
  }

  /// The prompt's tokens with each embedding name replaced by placeholders for its vectors.
  [[nodiscard]] Expanded expand(std::span<const std::int64_t> tokens) const {
    Expanded out;
    std::size_t i = 0;
    while (i < tokens.size()) {
      if (const auto m = find_embedding_at_position(tokens, i)) {
        out.fixes.emplace_back(static_cast<std::int64_t>(out.tokens.size()), m->embedding);
        out.tokens.insert(out.tokens.end(), static_cast<std::size_t>(m->embedding->vectors()), 0);
        i += static_cast<std::size_t>(m->length);
      } else {
        out.tokens.push_back(tokens[i++]);
      }
    }
    return out;
  }

  /// Reads one file and registers it (or sets it aside when its width does not fit). Gives the
  /// embedding, or nothing for a PNG without one. Errors are typed and name the file.
  std::optional<Ptr> load_from_file(const std::filesystem::path& path) {
    auto e = load_embedding(path);
    if (!e) return std::nullopt;
    if (expected_shape_ != -1 && e->shape() != expected_shape_) {
      auto p = std::make_shared<const Embedding>(std::move(*e));
      skipped_[p->name] = p;
      return p;
    }
    return register_embedding(std::move(*e));
  }

  /// Loads every embedding under `dir` (recursively, following links), skipping empty files and
  /// extensions the web UI does not read; a file that fails is reported and the scan goes on.
  LoadReport load_from_dir(const std::filesystem::path& dir) {
    namespace fs = std::filesystem;
    LoadReport report;
    if (!fs::is_directory(dir)) throw ConfigError("is not a directory of embeddings", dir.string());
    std::vector<fs::path> files;
    for (const auto& entry :
         fs::recursive_directory_iterator(dir, fs::directory_options::follow_directory_symlink))
      if (entry.is_regular_file()) files.push_back(entry.path());
    std::sort(files.begin(), files.end());
    for (const auto& f : files) {
      std::string ext = f.extension().string();
      std::transform(ext.begin(), ext.end(), ext.begin(),
                     [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
      if (ext != ".pt" && ext != ".bin" && ext != ".safetensors" && ext != ".png") continue;
      if (fs::file_size(f) == 0) continue;
      try {
        const auto got = load_from_file(f);
        if (!got) continue;
        const bool skipped = expected_shape_ != -1 && (*got)->shape() != expected_shape_;
        (skipped ? report.skipped : report.loaded).push_back((*got)->name);
      } catch (const Error& err) {
        report.errors.emplace_back(f, err.what());
      } catch (const c10::Error& err) {
        report.errors.emplace_back(f, err.what_without_backtrace());
      }
    }
    return report;
  }

  /// For text::tokenize_prompt: the embedding whose name starts at a position of a prompt's
  /// tokens (the database must outlive the finder).
  [[nodiscard]] text::EmbeddingFinder prompt_finder() const {
    return [this](const std::vector<std::int64_t>& tokens,
                  std::size_t position) -> std::optional<text::FoundEmbedding> {
      const auto m = find_embedding_at_position(tokens, position);
      if (!m) return std::nullopt;
      return text::FoundEmbedding{m->embedding->name, m->embedding->vectors(), m->length};
    };
  }
  /// For text::encode_webui_prompts: an embedding's vectors for the text encoder `key` names
  /// ("clip_l" or "clip_g" for an SDXL pair; ignored otherwise).
  [[nodiscard]] std::function<at::Tensor(const std::string&)> prompt_vectors(
      std::string key = "clip_l") const {
    return [this, key](const std::string& name) -> at::Tensor {
      const auto it = word_embeddings_.find(name);
      if (it == word_embeddings_.end())
        throw ConfigError("is not registered", "embedding '" + name + "'");
      return it->second->vectors_for(key);
    };
  }

  /// Registered embeddings by name.
  [[nodiscard]] const std::map<std::string, Ptr>& word_embeddings() const {
    return word_embeddings_;
  }
  /// Embeddings loaded but not registered because their width is not the text encoder's.
  [[nodiscard]] const std::map<std::string, Ptr>& skipped_embeddings() const { return skipped_; }
  [[nodiscard]] std::int64_t expected_shape() const { return expected_shape_; }
  /// Names in the web UI's display order (case-insensitive).
  [[nodiscard]] std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& [name, e] : word_embeddings_) out.push_back(name);
    auto lower = [](std::string s) {
      std::transform(s.begin(), s.end(), s.begin(),
                     [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
      return s;
    };
    std::stable_sort(out.begin(), out.end(),
                     [&](const auto& a, const auto& b) { return lower(a) < lower(b); });
    return out;
  }

 private:
  Tokenize tokenize_;
  std::int64_t expected_shape_;
  std::map<std::int64_t, std::vector<std::pair<std::vector<std::int64_t>, Ptr>>> ids_lookup_;
  std::map<std::string, Ptr> word_embeddings_, skipped_;
};

/// Writes each fix's vectors over the token embeddings (B, T, D), as the web UI's
/// EmbeddingsWithFixes: row b's fixes start at `first_position` + their position (1 when the
/// sequence begins with a start token the prompt's tokens did not include); vectors that would
/// run past T are cut off. `key` picks the SDXL encoder ("clip_l" / "clip_g"). Differentiable in
/// the embeddings' vectors, which is how textual inversion trains them.
inline at::Tensor apply_embeddings(
    const at::Tensor& token_embeddings,
    const std::vector<std::vector<std::pair<std::int64_t, EmbeddingDatabase::Ptr>>>& fixes,
    std::int64_t first_position = 1, const std::string& key = "clip_l") {
  if (token_embeddings.dim() != 3)
    throw ShapeError(
        "expects token embeddings (B, T, D), got " + c10::str(token_embeddings.sizes()),
        "apply_embeddings");
  if (static_cast<std::int64_t>(fixes.size()) != token_embeddings.size(0))
    throw ShapeError("has fixes for " + std::to_string(fixes.size()) + " prompts and a batch of " +
                         std::to_string(token_embeddings.size(0)),
                     "apply_embeddings");
  const std::int64_t t = token_embeddings.size(1), d = token_embeddings.size(2);
  std::vector<at::Tensor> rows;
  for (std::size_t b = 0; b < fixes.size(); ++b) {
    at::Tensor row = token_embeddings[static_cast<std::int64_t>(b)];
    for (const auto& [pos, e] : fixes[b]) {
      const at::Tensor& v = e->vectors_for(key);
      if (v.size(-1) != d)
        throw ShapeError("has vectors of width " + std::to_string(v.size(-1)) +
                             ", the text encoder's are " + std::to_string(d),
                         "embedding '" + e->name + "'");
      const std::int64_t at_pos = first_position + pos;
      if (at_pos < 0 || at_pos >= t)
        throw ShapeError(
            "is placed at token " + std::to_string(at_pos) + " of " + std::to_string(t),
            "embedding '" + e->name + "'");
      const std::int64_t len = std::min(v.size(0), t - at_pos);
      row = at::cat({row.narrow(0, 0, at_pos), v.narrow(0, 0, len).to(row.options()),
                     row.narrow(0, at_pos + len, t - at_pos - len)});
    }
    rows.push_back(row);
  }
  return at::stack(rows);
}

}  // namespace difftrain::adapters
