#pragma once
// A cache on disk of tensors computed once from a frozen producer (a VAE's posteriors, a text
// encoder's outputs), so later runs read them instead of running the producer.
//
//   layout      ROOT/<first 16 hex digits of the producer's fingerprint>/shard-NNNNNN.safetensors
//               and producer.json (the whole fingerprint and what it describes). A changed
//               producer gets its own folder: the old entries are never read for it.
//   entries     a string key (a hash of what the entry was computed from) names a few tensors;
//               in a shard they are "KEY/FIELD". A changed input gets a new key, so only its
//               entry is computed again.
//   shards      entries are written `entries_per_shard` at a time, each shard atomically with
//               the SHA-256 of its tensors in its metadata. A build that is interrupted keeps
//               every finished shard and computes only the missing entries when it runs again.
//   damage      on opening, a shard that does not parse, belongs to another producer or fails
//               its checksum is renamed to NAME.damaged (kept for inspection, never read) and
//               reported; its entries count as missing and are computed again.
//
// Shards are memory-mapped: reading an entry touches only its pages, so a cache larger than
// memory works. One process writes a cache folder at a time.

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/io/atomic_file.hpp"
#include "difftrain/io/read_file.hpp"
#include "difftrain/io/safetensors.hpp"
#include "difftrain/io/sha256.hpp"

namespace difftrain::data {

/// The SHA-256 of named tensors (names in order, dtype, shape, bytes): equal for equal weights
/// however they were loaded, different when any value changes. Weights of a module: pass its
/// named parameters and buffers (see module_fingerprint).
inline std::string tensors_fingerprint(const std::map<std::string, at::Tensor>& tensors) {
  io::Sha256 h;
  for (const auto& [name, t0] : tensors) {
    const at::Tensor t = t0.detach().to(at::kCPU).contiguous();
    std::string head =
        name + "|" + std::string(c10::toString(t.scalar_type())) + "|" + c10::str(t.sizes()) + "|";
    h.update(head.data(), head.size());
    h.update(static_cast<const char*>(t.data_ptr()), t.nbytes());
  }
  return h.hex();
}

/// tensors_fingerprint of a torch module's parameters and buffers (by their dotted names).
template <class Module>
std::string module_fingerprint(const Module& m) {
  std::map<std::string, at::Tensor> all;
  for (const auto& p : m.named_parameters(true)) all.emplace(p.key(), p.value());
  for (const auto& b : m.named_buffers(true)) all.emplace(b.key(), b.value());
  return tensors_fingerprint(all);
}

struct TensorCacheOptions {
  std::size_t entries_per_shard = 256;
};

struct DamagedShard {
  std::filesystem::path path;  ///< where it was (now path + ".damaged")
  std::string reason;
};

class TensorCache {
 public:
  using Entry = std::map<std::string, at::Tensor>;

  /// Opens the cache of the producer `fingerprint` under `root` (created when absent), checks
  /// every shard and indexes their entries. `description` (e.g. "VAE posteriors, mean and std")
  /// goes to producer.json for whoever looks at the folder.
  TensorCache(const std::filesystem::path& root, std::string fingerprint,
              const std::string& description, TensorCacheOptions o = {})
      : fingerprint_(std::move(fingerprint)), o_(o) {
    if (fingerprint_.size() < 16)
      throw ConfigError(
          "the producer's fingerprint '" + fingerprint_ + "' is shorter than 16 characters",
          "tensor cache " + root.string());
    if (o_.entries_per_shard == 0)
      throw ConfigError("entries_per_shard must be at least 1", "tensor cache " + root.string());
    folder_ = root / fingerprint_.substr(0, 16);
    io::ensure_writable_folder(folder_);
    for (const auto& stale : io::stale_temporary_files(folder_)) {
      std::error_code ec;
      std::filesystem::remove(stale, ec);
    }
    const auto producer = folder_ / "producer.json";
    if (!std::filesystem::exists(producer)) {
      const nlohmann::json j{{"fingerprint", fingerprint_}, {"description", description}};
      const std::string text = j.dump(2) + "\n";
      io::write_file_atomic(producer, std::span<const char>(text.data(), text.size()));
    }
    std::vector<std::filesystem::path> shards;
    for (const auto& entry : std::filesystem::directory_iterator(folder_)) {
      const std::string name = entry.path().filename().string();
      if (const auto n = shard_number(name)) {
        next_shard_ = std::max(next_shard_, *n + 1);
        if (entry.path().extension() == ".safetensors") shards.push_back(entry.path());
      }
    }
    std::sort(shards.begin(), shards.end());  // later shards win a key written twice
    for (const auto& path : shards) open_shard(path);
  }

  TensorCache(const TensorCache&) = delete;
  TensorCache& operator=(const TensorCache&) = delete;
  /// Writes what is still buffered, unless an exception is on its way (then the buffered entries
  /// are computed again next time). Call flush() to see a write's error.
  ~TensorCache() {
    if (std::uncaught_exceptions() > 0) return;
    try {
      flush();
    } catch (...) {  // a destructor must not throw; flush() reports errors to those who ask
    }
  }

  [[nodiscard]] bool contains(const std::string& key) const {
    return index_.contains(key) || pending_.contains(key);
  }
  [[nodiscard]] std::size_t size() const { return index_.size() + pending_.size(); }
  [[nodiscard]] const std::filesystem::path& folder() const { return folder_; }
  [[nodiscard]] const std::string& fingerprint() const { return fingerprint_; }
  /// Shards found damaged when the cache was opened (renamed to .damaged, their entries missing).
  [[nodiscard]] const std::vector<DamagedShard>& damaged() const { return damaged_; }
  /// Shards written since the cache was opened.
  [[nodiscard]] std::size_t shards_written() const { return written_; }

  /// The tensors of `key` (views of the mapped shard, or the buffered entry).
  [[nodiscard]] Entry get(const std::string& key) const {
    if (const auto p = pending_.find(key); p != pending_.end()) return p->second;
    const auto i = index_.find(key);
    if (i == index_.end())
      throw ConfigError("has no entry '" + key + "'", "tensor cache " + folder_.string());
    Entry out;
    const auto& tensors = shards_[i->second.shard]->tensors;
    for (const auto& field : i->second.fields) out.emplace(field, tensors.at(key + "/" + field));
    return out;
  }

  /// Adds `key` (its tensors are copied to the CPU); a full buffer is written as a shard.
  void put(const std::string& key, const Entry& entry) {
    check_name(key, "key");
    if (entry.empty())
      throw ConfigError("entry '" + key + "' has no tensors", "tensor cache " + folder_.string());
    Entry copy;
    for (const auto& [field, t] : entry) {
      check_name(field, "field of '" + key + "'");
      copy.emplace(field, t.detach().to(at::kCPU).contiguous().clone());
    }
    pending_[key] = std::move(copy);
    if (pending_.size() >= o_.entries_per_shard) flush();
  }

  /// Writes the buffered entries as one shard (nothing when none are buffered).
  void flush() {
    if (pending_.empty()) return;
    std::map<std::string, at::Tensor> tensors;
    std::vector<std::pair<std::string, std::vector<std::string>>> entries;
    for (const auto& [key, e] : pending_) {
      std::vector<std::string> fields;
      for (const auto& [field, t] : e) {
        tensors.emplace(key + "/" + field, t);
        fields.push_back(field);
      }
      entries.emplace_back(key, std::move(fields));
    }
    const auto path = folder_ / shard_name(next_shard_);
    io::save_safetensors(path, tensors,
                         {{"format", kFormat},
                          {"fingerprint", fingerprint_},
                          {"checksum", tensors_fingerprint(tensors)}});
    ++next_shard_;
    ++written_;
    shards_.push_back(std::make_unique<io::SafetensorsFile>(io::load_safetensors(path)));
    for (auto& [key, fields] : entries) index_[key] = {shards_.size() - 1, std::move(fields)};
    pending_.clear();
  }

  /// The entry of each text in `texts`, computing the missing ones in batches of `batch` with
  /// `compute(texts) -> Entry of tensors batched on dim 0`. The key of a text is its SHA-256 (the
  /// producer's fingerprint keeps encoders apart). For frozen text encoders' outputs.
  std::vector<Entry> entries_for_texts(
      const std::vector<std::string>& texts,
      const std::function<Entry(const std::vector<std::string>&)>& compute,
      std::size_t batch = 16) {
    std::vector<std::string> keys, missing;
    for (const auto& text : texts) {
      keys.push_back(io::sha256_hex(text));
      if (!contains(keys.back()) &&
          std::find(missing.begin(), missing.end(), text) == missing.end())
        missing.push_back(text);
    }
    for (std::size_t i = 0; i < missing.size(); i += std::max<std::size_t>(batch, 1)) {
      const std::vector<std::string> chunk(
          missing.begin() + static_cast<std::ptrdiff_t>(i),
          missing.begin() + static_cast<std::ptrdiff_t>(std::min(missing.size(), i + batch)));
      const Entry batched = compute(chunk);
      for (std::size_t k = 0; k < chunk.size(); ++k) {
        Entry one;
        for (const auto& [field, t] : batched) {
          if (t.dim() < 1 || t.size(0) != static_cast<std::int64_t>(chunk.size()))
            throw ShapeError("field '" + field + "' has shape " + c10::str(t.sizes()) + " for " +
                                 std::to_string(chunk.size()) + " texts",
                             "tensor cache " + folder_.string());
          one.emplace(field, t[static_cast<std::int64_t>(k)]);
        }
        put(io::sha256_hex(chunk[k]), one);
      }
    }
    std::vector<Entry> out;
    out.reserve(keys.size());
    for (const auto& k : keys) out.push_back(get(k));
    return out;
  }

 private:
  static constexpr const char* kFormat = "difftrain.tensor_cache.v1";

  struct Located {
    std::size_t shard = 0;
    std::vector<std::string> fields;
  };

  static std::string shard_name(std::uint64_t n) {
    std::string digits = std::to_string(n);
    return "shard-" + std::string(digits.size() < 6 ? 6 - digits.size() : 0, '0') + digits +
           ".safetensors";
  }
  /// The number of "shard-N.safetensors" (or of its ".damaged" copy).
  static std::optional<std::uint64_t> shard_number(const std::string& name) {
    if (name.rfind("shard-", 0) != 0) return std::nullopt;
    const auto dot = name.find(".safetensors");
    if (dot == std::string::npos || dot == 6) return std::nullopt;
    const std::string digits = name.substr(6, dot - 6);
    if (digits.find_first_not_of("0123456789") != std::string::npos || digits.size() > 12)
      return std::nullopt;
    return std::stoull(digits);
  }
  void check_name(const std::string& name, const std::string& what) const {
    if (name.empty() || name.find('/') != std::string::npos)
      throw ConfigError("a " + what + " '" + name + "' must be non-empty and hold no '/'",
                        "tensor cache " + folder_.string());
  }

  void open_shard(const std::filesystem::path& path) {
    std::string reason;
    try {
      auto file = std::make_unique<io::SafetensorsFile>(io::load_safetensors(path));
      const auto meta = [&](const std::string& k) {
        const auto it = file->metadata.find(k);
        return it == file->metadata.end() ? std::string() : it->second;
      };
      if (meta("format") != kFormat)
        reason = "is not a tensor cache shard (format '" + meta("format") + "')";
      else if (meta("fingerprint") != fingerprint_)
        reason = "belongs to another producer (" + meta("fingerprint").substr(0, 16) + "…)";
      else if (meta("checksum") != tensors_fingerprint(file->tensors))
        reason = "fails its checksum (its tensors changed after it was written)";
      if (reason.empty()) {
        std::map<std::string, std::vector<std::string>> entries;
        for (const auto& [name, t] : file->tensors) {
          const auto slash = name.rfind('/');
          if (slash == std::string::npos || slash == 0 || slash + 1 == name.size()) {
            reason = "holds the tensor '" + name + "', not named KEY/FIELD";
            break;
          }
          entries[name.substr(0, slash)].push_back(name.substr(slash + 1));
        }
        if (reason.empty()) {
          shards_.push_back(std::move(file));
          for (auto& [key, fields] : entries) index_[key] = {shards_.size() - 1, std::move(fields)};
          return;
        }
      }
    } catch (const Error& e) {
      reason = e.what();
    }
    auto damaged = path;
    damaged += ".damaged";
    std::error_code ec;
    std::filesystem::rename(path, damaged, ec);
    if (ec)
      throw IoError("is damaged (" + reason + ") and cannot be moved aside: " + ec.message(),
                    path.string());
    damaged_.push_back({path, reason});
  }

  std::string fingerprint_;
  TensorCacheOptions o_;
  std::filesystem::path folder_;
  std::vector<std::unique_ptr<io::SafetensorsFile>> shards_;
  std::map<std::string, Located> index_;
  std::map<std::string, Entry> pending_;
  std::vector<DamagedShard> damaged_;
  std::uint64_t next_shard_ = 0;
  std::size_t written_ = 0;
};

}  // namespace difftrain::data
