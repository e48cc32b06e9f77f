#pragma once
// A checkpoint's model as one safetensors file, or as a diffusers model folder: the weights a
// training run saved, trained or EMA, ready for from_pretrained, safetensors.load_file or another
// tool. A sharded set (each rank wrote the parameters it steps beside the checkpoint) is read one
// tensor at a time: the ranks' weights files are memory-mapped and each tensor goes to the output
// as it is read, so the model is never held whole in memory (only rank 0's file, which holds what
// is not sharded: buffers and frozen parameters, is read into memory). A checkpoint of one process
// or of DataParallel works alike.
//
//   train::consolidate_checkpoint("ckpt/checkpoint-1000.pt", "model.safetensors", {.ema = true});
//   train::consolidate_to_folder("ckpt/checkpoint-1000.pt", "out/unet", unet_config,
//                                {.ema = true, .prefix = "unet."});

#include <ATen/ATen.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/io/atomic_file.hpp"
#include "difftrain/io/safetensors.hpp"
#include "difftrain/io/torch_file.hpp"
#include "difftrain/train/checkpoint_header.hpp"
#include "difftrain/train/weight_shards.hpp"

namespace difftrain::train {

struct ConsolidateOptions {
  /// The EMA's weights: each tensor the EMA tracks is its shadow, the others as trained. A
  /// checkpoint without an EMA is then a ConfigError.
  bool ema = false;
  /// Only the tensors whose names start with it, written without it ("unet." takes a UNet out of
  /// a model that holds it); empty: every tensor.
  std::string prefix = {};
  /// The output file's metadata (`__metadata__`).
  std::map<std::string, std::string> metadata = {};
};

/// What consolidate_checkpoint wrote.
struct ConsolidateReport {
  std::int64_t step = 0;
  std::int64_t world_size = 1;  ///< the ranks that wrote the checkpoint
  bool sharded = false;         ///< its weights were in one file per rank
  std::size_t tensors = 0;
  std::uint64_t bytes = 0;  ///< of tensor data written
};

namespace consolidate_detail {

// The model's tensors (or its EMA's weights) by name, those of a sharded set memory-mapped.
inline std::map<std::string, at::Tensor> model_tensors(const std::filesystem::path& checkpoint,
                                                       const ConsolidateOptions& o,
                                                       ConsolidateReport& report) {
  const std::string where = checkpoint.string();
  const io::TorchValue root = io::load_torch_file(checkpoint);
  check_checkpoint_format(root, "difftrain.checkpoint", "a difftrain checkpoint");
  const nlohmann::json js = checkpoint_json(root, "settings");
  report.step = root.at("step").integer();
  report.world_size = js.is_object() ? js.value("world_size", std::int64_t{1}) : 1;
  std::map<std::string, at::Tensor> model = root.at("model").tensor_map();
  std::map<std::string, at::Tensor> shadows;
  if (o.ema) {
    if (!root.contains("ema"))
      throw ConfigError("has no EMA; consolidate its trained weights instead", where);
    shadows = root.at("ema").tensor_map();
  }
  if (js.is_object() && js.contains("sharding") && js["sharding"].is_object() &&
      js["sharding"].contains("weights")) {
    report.sharded = true;
    read_weight_shards(checkpoint, js["sharding"], report.step, where, model,
                       o.ema ? &shadows : nullptr);
  }
  for (auto& [name, shadow] : shadows) {
    const auto it = model.find(name);
    if (it == model.end())
      throw FormatError("has an EMA shadow '" + name + "' of no tensor of the model", where);
    it->second = shadow;
  }
  if (o.prefix.empty()) return model;
  std::map<std::string, at::Tensor> out;
  for (auto& [name, t] : model)
    if (name.starts_with(o.prefix)) out.emplace(name.substr(o.prefix.size()), t);
  if (out.empty())
    throw ConfigError("no tensor of the checkpoint's model starts with '" + o.prefix + "'",
                      where + " (ConsolidateOptions::prefix)");
  return out;
}

}  // namespace consolidate_detail

/// Writes the model held by `checkpoint` (a file save_checkpoint wrote; a sharded set's other
/// files beside it) to the safetensors file `out`, atomically. A missing file of the set is an
/// IoError; a damaged one, or one of another checkpoint, a FormatError naming it.
inline ConsolidateReport consolidate_checkpoint(const std::filesystem::path& checkpoint,
                                                const std::filesystem::path& out,
                                                const ConsolidateOptions& o = {}) {
  ConsolidateReport report;
  const std::map<std::string, at::Tensor> tensors =
      consolidate_detail::model_tensors(checkpoint, o, report);
  std::map<std::string, std::string> metadata = o.metadata;
  if (!metadata.contains("step")) metadata["step"] = std::to_string(report.step);
  io::save_safetensors(out, tensors, metadata);
  report.tensors = tensors.size();
  for (const auto& [name, t] : tensors)
    report.bytes += static_cast<std::uint64_t>(t.numel()) * t.element_size();
  return report;
}

/// The same as a diffusers model folder: `dir/config.json` (`config`, the model's, as the
/// folder it was loaded from or save_pretrained has it) and `dir/diffusion_pytorch_model.
/// safetensors`, which from_pretrained reads. `config` must be a JSON object.
inline ConsolidateReport consolidate_to_folder(const std::filesystem::path& checkpoint,
                                               const std::filesystem::path& dir,
                                               const nlohmann::json& config,
                                               const ConsolidateOptions& o = {}) {
  if (!config.is_object())
    throw ConfigError("must be a JSON object (the model's config.json)",
                      "consolidate_to_folder: config");
  std::filesystem::create_directories(dir);
  ConsolidateOptions with = o;
  with.metadata.emplace("format", "pt");  // what diffusers writes
  const ConsolidateReport report =
      consolidate_checkpoint(checkpoint, dir / "diffusion_pytorch_model.safetensors", with);
  const std::string text = config.dump(2) + "\n";
  io::write_file_atomic(dir / "config.json", std::span<const char>(text.data(), text.size()));
  return report;
}

}  // namespace difftrain::train
