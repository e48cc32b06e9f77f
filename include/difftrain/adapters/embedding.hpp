#pragma once
// Textual-inversion embeddings as the Stable Diffusion web UI keeps them: the learned vectors of
// one name, the step and checkpoint they were trained at, and the short checksum the web UI shows.
//
// `load_embedding` reads every format the web UI reads and identifies the contents as it does
// (create_embedding_from_data): a dict with `string_to_param` (the web UI's own .pt, exactly one
// term), an SDXL pair (`clip_l` and `clip_g`), or a one-tensor dict (diffusers' learned_embeds.bin
// and .safetensors concept files); from .pt / .bin (torch.save), .safetensors, or a PNG carrying
// the embedding (text chunk or image data). Anything else is a FormatError that says so.
// `save` writes the web UI's .pt layout.

#include <ATen/ATen.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <map>
#include <optional>
#include <string>

#include "difftrain/core/error.hpp"
#include "difftrain/io/embedded_data.hpp"
#include "difftrain/io/safetensors.hpp"
#include "difftrain/io/torch_file.hpp"

namespace difftrain::adapters {

struct Embedding {
  /// (vectors, width) for SD1/SD2; for SDXL, `vec` is empty and `pair` holds clip_l and clip_g.
  at::Tensor vec;
  std::map<std::string, at::Tensor> pair;
  std::string name;
  std::optional<std::int64_t> step;
  std::optional<std::string> sd_checkpoint, sd_checkpoint_name;

  [[nodiscard]] bool is_sdxl() const { return !pair.empty(); }
  /// Tokens it takes in a prompt.
  [[nodiscard]] std::int64_t vectors() const {
    return is_sdxl() ? pair.at("clip_g").size(0) : vec.size(0);
  }
  /// The text-encoder width it fits (clip_g + clip_l for SDXL), what the database checks.
  [[nodiscard]] std::int64_t shape() const {
    return is_sdxl() ? pair.at("clip_g").size(-1) + pair.at("clip_l").size(-1) : vec.size(-1);
  }
  /// The vectors for one text encoder: `vec` for SD1/SD2 (the key is ignored), `pair[key]`
  /// ("clip_l" or "clip_g") for SDXL.
  [[nodiscard]] const at::Tensor& vectors_for(const std::string& key) const {
    if (!is_sdxl()) return vec;
    const auto it = pair.find(key);
    if (it == pair.end())
      throw ConfigError("is an SDXL pair with no '" + key + "' vectors (it has clip_l and clip_g)",
                        "embedding '" + name + "'");
    return it->second;
  }

  /// The web UI's checksum: a 32-bit rolling hash of trunc(100·v) over the flattened vectors, its
  /// low 16 bits as four hex digits.
  [[nodiscard]] std::string checksum() const {
    if (is_sdxl())
      throw ConfigError("the web UI computes no checksum for SDXL pairs", "Embedding::checksum");
    const at::Tensor flat = (vec.detach().reshape({-1}) * 100).to(at::kFloat).contiguous().cpu();
    std::int64_t r = 0;
    const float* p = flat.data_ptr<float>();
    for (std::int64_t i = 0; i < flat.numel(); ++i) {
      const auto v = static_cast<std::int64_t>(std::trunc(p[i]));  // Python's int(tensor)
      r = ((r * 281) ^ (v * 997)) & 0xFFFFFFFF;  // two's complement XOR, as Python's ints
    }
    char buf[8];
    std::snprintf(buf, sizeof buf, "%04llx", static_cast<unsigned long long>(r & 0xffff));
    return buf;
  }

  /// The web UI's .pt layout.
  [[nodiscard]] c10::IValue state() const {
    if (is_sdxl())
      throw ConfigError("SDXL pairs are saved as safetensors (clip_l, clip_g)", "Embedding::save");
    auto token = io::torch_dict();
    token.insert("*", std::int64_t{265});
    auto param = io::torch_dict();
    param.insert("*", vec.detach().cpu().clone());
    auto root = io::torch_dict();
    auto opt = [](const auto& v) { return v ? c10::IValue(*v) : c10::IValue(); };
    root.insert("string_to_token", token);
    root.insert("string_to_param", param);
    root.insert("name", name);
    root.insert("step", opt(step));
    root.insert("sd_checkpoint", opt(sd_checkpoint));
    root.insert("sd_checkpoint_name", opt(sd_checkpoint_name));
    return root;
  }
  void save(const std::filesystem::path& path) const {
    if (is_sdxl()) {
      std::map<std::string, at::Tensor> t;
      for (const auto& [k, v] : pair) t[k] = v.detach().cpu().contiguous();
      io::save_safetensors(path, t);
      return;
    }
    io::save_torch_file(path, state());
  }
};

namespace embedding_detail {
inline at::Tensor as_vectors(const at::Tensor& t, const std::string& where) {
  if (!at::isFloatingType(t.scalar_type()))
    throw FormatError("holds " + std::string(c10::toString(t.scalar_type())) +
                          " values, not floating point vectors",
                      where);
  at::Tensor v = t.detach().to(at::kCPU, at::kFloat);
  if (v.dim() == 1) v = v.unsqueeze(0);
  if (v.dim() != 2 || v.size(0) == 0 || v.size(1) == 0)
    throw FormatError("has shape " + c10::str(t.sizes()) + ", not (vectors, width)", where);
  return v;
}
}  // namespace embedding_detail

/// Identifies an embedding in loaded data as the web UI does; `name` is used unless the data
/// names itself (PNG payloads do).
inline Embedding embedding_from_data(const io::TorchValue& data, std::string name) {
  const std::string where = data.where();
  if (!data.is_dict()) throw FormatError("is a " + data.kind() + ", not an embedding dict", where);
  Embedding e;
  e.name = std::move(name);
  if (const auto p = data.find("string_to_param")) {
    const auto items = p->items();
    if (items.size() != 1)
      throw FormatError("embedding file has multiple terms in it (" + std::to_string(items.size()) +
                            " in string_to_param)",
                        p->where());
    e.vec =
        embedding_detail::as_vectors(items.front().second.tensor(), items.front().second.where());
  } else if (data.contains("clip_g") && data.contains("clip_l")) {
    for (const char* k : {"clip_l", "clip_g"})
      e.pair[k] = embedding_detail::as_vectors(data.at(k).tensor(), data.at(k).where());
    if (e.pair["clip_l"].size(0) != e.pair["clip_g"].size(0))
      throw FormatError("clip_l and clip_g hold different numbers of vectors", where);
  } else {
    const auto items = data.items();
    if (items.empty() || !items.front().second.is_tensor())
      throw FormatError(
          "Couldn't identify it as neither textual inversion embedding nor diffuser "
          "concept",
          where);
    if (items.size() != 1)
      throw FormatError(
          "embedding file has multiple terms in it (" + std::to_string(items.size()) + " keys)",
          where);
    e.vec =
        embedding_detail::as_vectors(items.front().second.tensor(), items.front().second.where());
  }
  if (const auto v = data.find("step"); v && !v->is_none()) e.step = v->integer();
  if (const auto v = data.find("sd_checkpoint")) e.sd_checkpoint = v->optional_string();
  if (const auto v = data.find("sd_checkpoint_name")) e.sd_checkpoint_name = v->optional_string();
  if (const auto v = data.find("name"); v && v->is_string()) e.name = v->string();
  return e;
}

/// Reads an embedding file by extension (.pt, .bin, .safetensors, .png). A PNG that carries no
/// embedding (a preview picture) gives std::nullopt, as the web UI skips it.
inline std::optional<Embedding> load_embedding(const std::filesystem::path& path) {
  std::string ext = path.extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(),
                 [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
  const std::string stem = path.stem().string();
  if (ext == ".PT" || ext == ".BIN") return embedding_from_data(io::load_torch_file(path), stem);
  if (ext == ".SAFETENSORS") {
    const auto file = io::load_safetensors(path, /*copy=*/true);
    auto dict = io::torch_dict();
    for (const auto& [k, v] : file.tensors) dict.insert(k, v);
    return embedding_from_data(io::TorchValue(dict, path.string()), stem);
  }
  if (ext == ".PNG") {
    if (std::filesystem::path(stem).extension().string() == ".preview") return std::nullopt;
    const auto data = io::read_embedded_data(path);
    if (!data) return std::nullopt;
    return embedding_from_data(*data, stem);
  }
  throw ConfigError("is not an embedding file the web UI reads (.pt, .bin, .safetensors, .png)",
                    path.string());
}

}  // namespace difftrain::adapters
