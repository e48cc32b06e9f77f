#pragma once
// The web UI's `.optim` sidecars: beside `name.pt`, `name.pt.optim` holds the optimizer state of
// the training run that wrote it, in Python's layout, with a hash of the adapter it belongs to, so
// a run continues with its Adam moments only when the adapter file is the one they were made
// for:
//
//   {'hash': <adapter hash>, 'optimizer_state_dict': {...}[, 'optimizer_name': 'AdamW']}
//
// Embeddings use their 4-digit checksum as the hash, hypernetworks the first 10 hex digits of
// their file's SHA-256 (`file_shorthash`).

#include <torch/optim/optimizer.h>

#include <filesystem>
#include <optional>
#include <string>

#include "difftrain/core/error.hpp"
#include "difftrain/io/sha256.hpp"
#include "difftrain/io/torch_file.hpp"
#include "difftrain/train/torch_optimizer_state.hpp"

namespace difftrain::adapters {

/// The first 10 hex digits of a file's SHA-256, the web UI's hypernetwork short hash.
inline std::string file_shorthash(const std::filesystem::path& path) {
  return io::sha256_file(path).substr(0, 10);
}

inline std::filesystem::path sidecar_path(const std::filesystem::path& adapter_file) {
  return adapter_file.string() + ".optim";
}

/// Writes `adapter_file`.optim for `optimizer`, tagged with `hash`.
inline void save_optim_sidecar(const std::filesystem::path& adapter_file, const std::string& hash,
                               const torch::optim::Optimizer& optimizer, bool with_optimizer_name) {
  auto root = io::torch_dict();
  if (with_optimizer_name) root.insert("optimizer_name", train::torch_optimizer_name(optimizer));
  root.insert("hash", hash);
  root.insert("optimizer_state_dict", train::torch_optimizer_state(optimizer));
  io::save_torch_file(sidecar_path(adapter_file), root);
}

enum class SidecarStatus { loaded, missing, hash_mismatch, other_optimizer };

[[nodiscard]] inline const char* to_string(SidecarStatus s) {
  switch (s) {
    case SidecarStatus::loaded:
      return "loaded";
    case SidecarStatus::missing:
      return "missing";
    case SidecarStatus::hash_mismatch:
      return "hash mismatch";
    case SidecarStatus::other_optimizer:
      return "written for another optimizer";
  }
  return "?";
}

/// Restores `optimizer` from `adapter_file`.optim when the sidecar exists, its hash is `hash`
/// and it was written for this kind of optimizer; otherwise leaves the optimizer as it is and
/// says why. A sidecar that exists but does not read is a FormatError.
inline SidecarStatus load_optim_sidecar(const std::filesystem::path& adapter_file,
                                        const std::string& hash,
                                        torch::optim::Optimizer& optimizer) {
  const auto path = sidecar_path(adapter_file);
  if (!std::filesystem::exists(path)) return SidecarStatus::missing;
  const io::TorchValue root = io::load_torch_file(path);
  const auto saved = root.find("hash");
  if (!saved || !saved->is_string() || saved->string() != hash) return SidecarStatus::hash_mismatch;
  if (const auto name = root.find("optimizer_name");
      name && name->is_string() && name->string() != train::torch_optimizer_name(optimizer))
    return SidecarStatus::other_optimizer;
  train::load_torch_optimizer_state(optimizer, root.at("optimizer_state_dict"));
  return SidecarStatus::loaded;
}

}  // namespace difftrain::adapters
