#pragma once
// diffusers model folders: `config.json` + `diffusion_pytorch_model.safetensors`, or shards listed
// by `diffusion_pytorch_model.safetensors.index.json`, each optionally in a variant
// (`diffusion_pytorch_model.fp16.safetensors`, `...safetensors.index.fp16.json`,
// `diffusion_pytorch_model.fp16-00001-of-00002.safetensors`), as diffusers' save_pretrained
// writes them and from_pretrained reads them; also the `diffusion_pytorch_model.bin` files
// (single or sharded) of older folders, which torch.save wrote (read without running any of the
// pickle's code, as torch.load(weights_only=True) does; not memory-mapped).
//
// Loading is strict and all-or-nothing: every shard is opened (memory-mapped) and every name,
// shape and dtype checked against the model before one parameter changes; a missing, extra or
// mis-shaped tensor, a shard the index names but the folder lacks, a truncated file — each is a
// typed error naming the file and the tensor. Saving writes every file atomically (a crash leaves
// the previous save readable), the config first as diffusers does, then removes shards of a
// previous save that the new one does not use.

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/io/atomic_file.hpp"
#include "difftrain/io/json_file.hpp"
#include "difftrain/io/safetensors.hpp"
#include "difftrain/io/torch_file.hpp"
#include "difftrain/models/config_reader.hpp"
#include "difftrain/nn/init/without_random_init.hpp"

namespace difftrain::models {

inline constexpr const char* kWeightsName = "diffusion_pytorch_model.safetensors";
inline constexpr const char* kWeightsIndexName = "diffusion_pytorch_model.safetensors.index.json";
inline constexpr const char* kBinWeightsName = "diffusion_pytorch_model.bin";
inline constexpr const char* kBinWeightsIndexName = "diffusion_pytorch_model.bin.index.json";

/// The weight files' names of a model folder: diffusers' (the default) or transformers'
/// (`model.safetensors`, `pytorch_model.bin`, ...); the variant and shard rules are the same.
struct WeightNames {
  const char* single = kWeightsName;
  const char* index = kWeightsIndexName;
  const char* bin = kBinWeightsName;
  const char* bin_index = kBinWeightsIndexName;
};
inline constexpr WeightNames kDiffusersWeights{};
inline constexpr WeightNames kTransformersWeights{
    "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
    "pytorch_model.bin.index.json"};

/// The names a model type's folders use: transformers' for a config that says so.
template <class Config>
constexpr WeightNames weight_names_for() {
  if constexpr (requires { Config::transformers_folder; })
    return Config::transformers_folder ? kTransformersWeights : kDiffusersWeights;
  else
    return kDiffusersWeights;
}

/// diffusers' _add_variant: the variant goes before the last extension.
inline std::string add_variant(const std::string& name, const std::optional<std::string>& variant) {
  if (!variant) return name;
  const auto dot = name.rfind('.');
  return name.substr(0, dot) + "." + *variant + name.substr(dot);
}

/// "diffusion_pytorch_model[.variant]": what shard names start with.
inline std::string shard_stem(const std::optional<std::string>& variant,
                              const WeightNames& names = kDiffusersWeights) {
  const std::string base = add_variant(names.single, variant);
  return base.substr(0, base.size() - std::string(".safetensors").size());
}

/// The folder's config.json, parsed.
inline nlohmann::json read_model_config(const std::filesystem::path& folder) {
  const auto path = folder / "config.json";
  if (!std::filesystem::is_directory(folder)) throw IoError("not a folder", folder.string());
  if (!std::filesystem::exists(path))
    throw IoError("the model folder has no config.json", path.string());
  return io::read_json(path);
}

/// Which file each tensor of the folder's weights comes from.
struct WeightFiles {
  std::vector<std::filesystem::path> files;
  std::map<std::string, std::filesystem::path> weight_map;  // empty: one unsharded file
};

namespace pretrained_detail {
/// The weight map of a shard index; every file it names must be in the folder.
inline WeightFiles read_shard_index(const std::filesystem::path& folder,
                                    const std::filesystem::path& index) {
  WeightFiles out;
  const nlohmann::json j = io::read_json(index);
  if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
    throw FormatError("a shard index needs a \"weight_map\" object", index.string());
  std::set<std::filesystem::path> files;
  for (const auto& [name, file] : j["weight_map"].items()) {
    if (!file.is_string())
      throw FormatError("weight_map entry '" + name + "' is not a file name", index.string());
    const std::filesystem::path shard = file.get<std::string>();
    if (shard.has_parent_path() || shard.filename() == ".." || shard.empty())
      throw FormatError("weight_map entry '" + name + "' names '" + shard.string() +
                            "', which is not a file in the folder",
                        index.string());
    const auto path = folder / shard;
    if (!std::filesystem::exists(path))
      throw IoError("the shard index names '" + shard.string() + "' (for '" + name +
                        "') but the folder has no such file",
                    index.string());
    out.weight_map[name] = path;
    files.insert(path);
  }
  out.files.assign(files.begin(), files.end());
  return out;
}

/// A weight file torch.save wrote (diffusers' `.bin`), as opposed to safetensors.
inline bool is_pickled(const std::filesystem::path& file) { return file.extension() == ".bin"; }
}  // namespace pretrained_detail

/// The weight files of a folder, as diffusers' from_pretrained picks them: safetensors (an index
/// before a single file) before torch.save's `.bin` (likewise), each in the requested variant.
inline WeightFiles find_weight_files(const std::filesystem::path& folder,
                                     const std::optional<std::string>& variant = std::nullopt,
                                     const WeightNames& names = kDiffusersWeights) {
  for (const auto& [index_name, single_name] :
       {std::pair{names.index, names.single}, std::pair{names.bin_index, names.bin}}) {
    const auto index = folder / add_variant(index_name, variant);
    if (std::filesystem::exists(index)) return pretrained_detail::read_shard_index(folder, index);
    if (const auto single = folder / add_variant(single_name, variant);
        std::filesystem::exists(single))
      return WeightFiles{{single}, {}};
  }
  std::string hint;
  if (variant && (std::filesystem::exists(folder / names.single) ||
                  std::filesystem::exists(folder / names.bin)))
    hint = "; it has the weights without the \"" + *variant + "\" variant";
  else if (!variant)
    for (const auto& e : std::filesystem::directory_iterator(folder)) {
      const std::string f = e.path().filename().string();
      const std::string single(names.single);
      const std::string prefix = single.substr(0, single.find('.') + 1);
      for (const std::string suffix : {".safetensors", ".bin"})
        if (hint.empty() && f.size() > prefix.size() + suffix.size() && f.starts_with(prefix) &&
            f.ends_with(suffix) && f.find(".index.") == std::string::npos)
          hint = "; it has " + f + ", weights saved with variant \"" +
                 f.substr(prefix.size(), f.size() - prefix.size() - suffix.size()) +
                 "\" (pass it as LoadOptions::variant, a program's --variant)";
    }
  throw IoError("the model folder has none of " + add_variant(names.single, variant) + ", " +
                    add_variant(names.index, variant) + ", " + add_variant(names.bin, variant) +
                    " or " + add_variant(names.bin_index, variant) + hint,
                folder.string());
}

namespace pretrained_detail {
/// diffusers' renaming of the attention parameters of VAE files saved before 0.14.
inline std::string modern_name(const std::string& name) {
  static const std::vector<std::pair<std::string, std::string>> renames = {
      {".query.", ".to_q."},
      {".key.", ".to_k."},
      {".value.", ".to_v."},
      {".proj_attn.", ".to_out.0."}};
  for (const auto& [old_part, new_part] : renames)
    if (const auto at = name.find(old_part);
        at != std::string::npos && name.find(".attentions.") != std::string::npos)
      return name.substr(0, at) + new_part + name.substr(at + old_part.size());
  return name;
}
}  // namespace pretrained_detail

/// Every tensor of the folder's weights by name (memory-mapped views), checked against the index.
inline std::map<std::string, at::Tensor> read_model_weights(
    const std::filesystem::path& folder, const std::optional<std::string>& variant = std::nullopt,
    const WeightNames& names = kDiffusersWeights) {
  const WeightFiles wf = find_weight_files(folder, variant, names);
  std::map<std::string, at::Tensor> out;
  std::map<std::string, std::filesystem::path> from;
  for (const auto& file : wf.files) {
    std::map<std::string, at::Tensor> tensors = pretrained_detail::is_pickled(file)
                                                    ? io::load_torch_file(file).tensor_map()
                                                    : io::load_safetensors(file).tensors;
    for (auto& [name, t] : tensors) {
      if (!wf.weight_map.empty()) {
        const auto it = wf.weight_map.find(name);
        if (it == wf.weight_map.end() || it->second != file)
          throw FormatError(
              "holds '" + name + "', which the shard index puts " +
                  (it == wf.weight_map.end() ? std::string("nowhere")
                                             : "in " + it->second.filename().string()),
              file.string());
      }
      const std::string modern = pretrained_detail::modern_name(name);
      if (from.contains(modern))
        throw FormatError(
            "'" + modern + "' is stored twice (also in " + from[modern].filename().string() + ")",
            file.string());
      from[modern] = file;
      out.emplace(modern, std::move(t));
    }
  }
  for (const auto& [name, file] : wf.weight_map)
    if (!out.contains(pretrained_detail::modern_name(name)))
      throw FormatError("lacks '" + name + "', which the shard index puts here", file.string());
  return out;
}

/// Copies `weights` into `model`, strictly: the same names (buffers too), the same shapes,
/// floating-point data for floating-point parameters. All checks come first; on any error the
/// model is unchanged. The error lists up to ten offending names.
inline void load_weights(torch::nn::Module& model, const std::map<std::string, at::Tensor>& weights,
                         const std::string& where) {
  std::map<std::string, at::Tensor> own;
  for (const auto& p : model.named_parameters(true)) own[p.key()] = p.value();
  for (const auto& b : model.named_buffers(true)) own[b.key()] = b.value();
  std::vector<std::string> problems;
  for (const auto& [name, t] : weights)
    if (!own.contains(name)) problems.push_back("unexpected '" + name + "'");
  for (const auto& [name, dst] : own) {
    const auto it = weights.find(name);
    if (it == weights.end()) {
      problems.push_back("missing '" + name + "'");
      continue;
    }
    if (it->second.sizes() != dst.sizes())
      problems.push_back("'" + name + "' has shape " + c10::str(it->second.sizes()) +
                         ", the model's is " + c10::str(dst.sizes()));
    else if (at::isFloatingType(dst.scalar_type()) != at::isFloatingType(it->second.scalar_type()))
      problems.push_back("'" + name + "' is " +
                         std::string(c10::toString(it->second.scalar_type())) +
                         ", the model's is " + std::string(c10::toString(dst.scalar_type())));
  }
  if (!problems.empty()) {
    std::string msg = std::to_string(problems.size()) + " tensor(s) do not fit the model: ";
    for (std::size_t i = 0; i < problems.size() && i < 10; ++i)
      msg += (i ? "; " : "") + problems[i];
    if (problems.size() > 10) msg += "; ...";
    throw FormatError(msg, where);
  }
  at::NoGradGuard no_grad;
  for (const auto& [name, dst] : own) dst.copy_(weights.at(name));
}

/// Throws a ConfigError (at `where`, the config) for the first way `weights` differ from what the
/// config implies; reads only names and shapes.
inline void check_weight_signature(const WeightSignature& sig,
                                   const std::map<std::string, at::Tensor>& weights,
                                   const std::string& where) {
  for (const auto& [prefix, want] : sig.counts) {
    std::set<std::int64_t> seen;
    for (auto it = weights.lower_bound(prefix);
         it != weights.end() && it->first.starts_with(prefix); ++it) {
      const std::string rest = it->first.substr(prefix.size());
      const auto dot = rest.find('.');
      const std::string index = rest.substr(0, dot);
      if (index.empty() || index.size() > 9 ||
          index.find_first_not_of("0123456789") != std::string::npos)
        continue;
      seen.insert(std::stoll(index));
    }
    const auto have = static_cast<std::int64_t>(seen.size());
    const bool dense = seen.empty() || (*seen.begin() == 0 && *seen.rbegin() == have - 1);
    if (have != want || !dense)
      throw ConfigError("the config implies " + std::to_string(want) + " of '" + prefix +
                            "N', the weights hold " + std::to_string(have) +
                            (dense ? "" : " (not numbered from 0 without gaps)") +
                            "; the config and the weights describe different models",
                        where);
  }
  for (const auto& [name, shape] : sig.shapes) {
    const auto it = weights.find(name);
    if (it == weights.end())
      throw ConfigError("the config implies a tensor '" + name +
                            "' that the weights lack; the config and the weights describe "
                            "different models",
                        where);
    if (it->second.sizes() != at::IntArrayRef(shape))
      throw ConfigError("the config implies '" + name + "' of shape " + c10::str(shape) +
                            ", the weights hold " + c10::str(it->second.sizes()) +
                            "; the config and the weights describe different models",
                        where);
  }
}

/// Whether a folder whose config says `_class_name` = name is one a `Config` reads: its own class,
/// or one the config type also accepts (diffusers' legacy classes it remaps).
template <class Config>
bool reads_class_name(const std::string& name, const nlohmann::json& j) {
  if constexpr (requires { Config::reads_class(name, j); })
    return Config::reads_class(name, j);
  else
    return name == Config::class_name;
}

/// A model of type `Holder` built from `config` to have every parameter loaded at once: without
/// drawing random initial values (nn::init::WithoutRandomInit), as diffusers builds its models
/// under init_empty_weights. Only for strict loaders: a parameter left unloaded would be undrawn.
template <class Holder, class Config>
Holder built_to_load(Config config, const std::string& where) {
  const nn::init::WithoutRandomInit undrawn;
  return Holder(std::move(config), where);
}

struct LoadOptions {
  std::optional<std::string> variant;  // "fp16": the weights diffusers saved with variant="fp16"
  /// The model's parameter dtype after loading (diffusers' torch_dtype); none: float32.
  std::optional<at::ScalarType> dtype;
  std::optional<at::Device> device;
};

/// A model of type `Holder` (e.g. UNet2DConditionModel<>) built from the folder's config and
/// loaded with its weights.
template <class Holder>
Holder from_pretrained(const std::filesystem::path& folder, const LoadOptions& options = {}) {
  using Impl = typename Holder::ContainedType;
  using Config = typename Impl::Config;
  const nlohmann::json j = read_model_config(folder);
  const std::string config_path = (folder / "config.json").string();
  const std::string expected(Config::class_name);
  if (j.is_object() && j.contains("_class_name") && j["_class_name"].is_string() &&
      !reads_class_name<Config>(j["_class_name"].get<std::string>(), j))
    throw ConfigError(
        "the folder holds a " + j["_class_name"].get<std::string>() + ", not a " + expected,
        config_path);
  Config config = Config::from_json(j, config_path);
  config.as_read.json = std::make_shared<const nlohmann::json>(j);
  // The weights are memory-mapped (names and shapes cost no parameter memory): compared with what
  // the config implies before the model is built.
  auto weights = read_model_weights(folder, options.variant, weight_names_for<Config>());
  // Names that changed between library versions, put the way this model names them.
  if constexpr (requires { Config::adapt_weight_names(weights); })
    Config::adapt_weight_names(weights);
  if constexpr (requires { config.weight_signature(); })
    check_weight_signature(config.weight_signature(), weights, config_path);
  auto model = built_to_load<Holder>(std::move(config), config_path);
  load_weights(*model, weights, folder.string());
  if (options.dtype) model->to(*options.dtype);
  if (options.device) model->to(*options.device);
  return model;
}

struct SaveOptions {
  std::optional<std::string> variant;
  /// Shards of at most this many bytes (a larger tensor gets a shard of its own); diffusers'
  /// default is 10 GB.
  std::uint64_t max_shard_size = 10'000'000'000ULL;
  std::optional<at::ScalarType> dtype;  // e.g. kHalf for an fp16 variant; none: as stored
};

/// Writes `tensors` and `config` as a diffusers model folder. Returns the weight files written.
inline std::vector<std::filesystem::path> save_pretrained_tensors(
    const std::map<std::string, at::Tensor>& tensors, const nlohmann::json& config,
    const std::filesystem::path& folder, const SaveOptions& options = {},
    const WeightNames& names = kDiffusersWeights) {
  std::filesystem::create_directories(folder);
  io::ensure_writable_folder(folder);
  const std::string text = config.dump(2) + "\n";
  io::write_file_atomic(folder / "config.json", std::span<const char>(text.data(), text.size()));

  // Shards in name order (the order diffusers' state_dict has is the module order; any order
  // loads), each up to max_shard_size.
  std::vector<std::map<std::string, at::Tensor>> shards(1);
  std::uint64_t in_shard = 0;
  for (const auto& [name, t0] : tensors) {
    at::Tensor t =
        options.dtype && at::isFloatingType(t0.scalar_type()) ? t0.to(*options.dtype) : t0;
    const auto bytes = static_cast<std::uint64_t>(t.numel()) * t.element_size();
    if (in_shard > 0 && in_shard + bytes > options.max_shard_size) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back()[name] = t.detach().contiguous().cpu();
    in_shard += bytes;
  }
  const std::map<std::string, std::string> metadata{{"format", "pt"}};
  std::vector<std::filesystem::path> written;
  const auto index_path = folder / add_variant(names.index, options.variant);
  if (shards.size() == 1) {
    written.push_back(folder / add_variant(names.single, options.variant));
    io::save_safetensors(written.back(), shards[0], metadata);
    // An index left from an earlier sharded save would win over the new file: remove it.
    std::error_code ec;
    std::filesystem::remove(index_path, ec);
  } else {
    const std::string stem = shard_stem(options.variant, names);
    nlohmann::json index;
    std::uint64_t total = 0;
    for (std::size_t i = 0; i < shards.size(); ++i) {
      char suffix[48];  // two 20-digit counts fit
      std::snprintf(suffix, sizeof suffix, "-%05zu-of-%05zu", i + 1, shards.size());
      const std::string name = stem + suffix + ".safetensors";
      written.push_back(folder / name);
      io::save_safetensors(written.back(), shards[i], metadata);
      for (const auto& [tensor, t] : shards[i]) {
        index["weight_map"][tensor] = name;
        total += static_cast<std::uint64_t>(t.numel()) * t.element_size();
      }
    }
    index["metadata"]["total_size"] = total;
    const std::string body = index.dump(2) + "\n";
    io::write_file_atomic(index_path, std::span<const char>(body.data(), body.size()));
  }
  // Shards of an earlier save (same variant) that this one does not use, as diffusers cleans.
  std::string escaped;
  for (char ch : shard_stem(options.variant, names)) {
    if (std::string_view(".^$|()[]{}*+?\\").find(ch) != std::string_view::npos) escaped += '\\';
    escaped += ch;
  }
  const std::regex shard_name(escaped + R"(-\d{5}-of-\d{5}\.safetensors)");
  const std::set<std::filesystem::path> keep(written.begin(), written.end());
  for (const auto& entry : std::filesystem::directory_iterator(folder)) {
    if (!entry.is_regular_file() || keep.contains(entry.path())) continue;
    if (std::regex_match(entry.path().filename().string(), shard_name)) {
      std::error_code ec;
      std::filesystem::remove(entry.path(), ec);
    }
  }
  return written;
}

/// Saves `model` (its parameters and buffers, by name) and its config as a diffusers folder that
/// diffusers' from_pretrained and difftrain's from_pretrained both read.
template <class Holder>
std::vector<std::filesystem::path> save_pretrained(const Holder& model,
                                                   const std::filesystem::path& folder,
                                                   const SaveOptions& options = {}) {
  std::map<std::string, at::Tensor> tensors;
  for (const auto& p : model->named_parameters(true)) tensors[p.key()] = p.value();
  for (const auto& b : model->named_buffers(true)) tensors[b.key()] = b.value();
  using Config = std::decay_t<decltype(model->config())>;
  return save_pretrained_tensors(tensors, config_json_to_save(model->config()), folder, options,
                                 weight_names_for<Config>());
}

}  // namespace difftrain::models
