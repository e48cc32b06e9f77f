#pragma once
// Reading a diffusers `config.json` field by field. Every field read is remembered, so after a
// model has taken what it understands, the rest can be refused by name: a field difftrain does not
// know is a ConfigError, never silently ignored (a model built without it would not be the model
// the file describes). Fields starting with "_" (`_class_name`, `_diffusers_version`, ...) are
// bookkeeping and always accepted.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "difftrain/core/error.hpp"

namespace difftrain::models {

/// An optional config value as JSON: the value, or null (diffusers writes absent options as null).
template <class T>
nlohmann::json value_or_null(const std::optional<T>& v) {
  return v ? nlohmann::json(*v) : nlohmann::json(nullptr);
}

/// Bounds on the sizes a model config may state, checked when it is read: far above every published
/// diffusers model (SDXL's widest block has 1,280 channels, its cross-attention 2,048, its deepest
/// block 10 transformer layers), low enough that a typo or a hostile file is refused before a
/// parameter is allocated (10,000 blocks of 1,280 channels would otherwise take about 10 GB first).
struct ConfigLimits {
  static constexpr std::int64_t channels = std::int64_t{1} << 16;  // any width or embedding size
  static constexpr std::int64_t blocks = 16;                       // down (and up) blocks
  static constexpr std::int64_t layers = 256;                      // layers of one block
  static constexpr std::int64_t kernel = 15;                       // a convolution's kernel side
  static constexpr std::int64_t classes = std::int64_t{1} << 24;   // class-embedding rows
  static constexpr std::int64_t spatial = std::int64_t{1} << 16;   // a sample or patch side
};

namespace config_detail {
inline void check_range(const std::string& label, std::int64_t value, std::int64_t lo,
                        std::int64_t hi, const std::string& where) {
  if (value < lo || value > hi)
    throw ConfigError(label + " = " + std::to_string(value) + " is out of range (" +
                          std::to_string(lo) + " to " + std::to_string(hi) + ")",
                      where);
}
}  // namespace config_detail

/// A ConfigError naming the field and its value unless lo <= value <= hi.
inline void check_config_range(const std::string& field, std::int64_t value, std::int64_t lo,
                               std::int64_t hi, const std::string& where) {
  config_detail::check_range("'" + field + "'", value, lo, hi, where);
}

/// The same for every entry of a per-block list ("'layers_per_block' entry 2 = -1 is ...").
inline void check_config_range(const std::string& field, const std::vector<std::int64_t>& values,
                               std::int64_t lo, std::int64_t hi, const std::string& where) {
  for (std::size_t i = 0; i < values.size(); ++i)
    config_detail::check_range("'" + field + "' entry " + std::to_string(i), values[i], lo, hi,
                               where);
}

/// The same for an optional field, when present.
inline void check_config_range(const std::string& field, const std::optional<std::int64_t>& value,
                               std::int64_t lo, std::int64_t hi, const std::string& where) {
  if (value) check_config_range(field, *value, lo, hi, where);
}

/// The sizes every diffusers convolutional model states (UNet, VAE): `blocks` (counted by the
/// field `blocks_field`) and each channel count in range, and every block's width a multiple of
/// the group norm's groups. Checked before anything divides by one or allocates with one.
inline void check_conv_model_sizes(const std::string& blocks_field, std::size_t blocks,
                                   std::int64_t in_channels, std::int64_t out_channels,
                                   std::int64_t norm_num_groups,
                                   const std::vector<std::int64_t>& block_out_channels,
                                   const std::string& where) {
  using L = ConfigLimits;
  check_config_range(blocks_field, static_cast<std::int64_t>(blocks), 1, L::blocks, where);
  check_config_range("in_channels", in_channels, 1, L::channels, where);
  check_config_range("out_channels", out_channels, 1, L::channels, where);
  check_config_range("norm_num_groups", norm_num_groups, 1, L::channels, where);
  check_config_range("block_out_channels", block_out_channels, 1, L::channels, where);
  for (auto c : block_out_channels)
    if (c % norm_num_groups != 0)
      throw ConfigError("'block_out_channels' entry " + std::to_string(c) +
                            " is not a positive multiple of norm_num_groups " +
                            std::to_string(norm_num_groups),
                        where);
}

/// What every diffusers VAE config states (AutoencoderKL, CogVideoX's): one down and one up block
/// per `block_out_channels` entry, each of the one type the model builds, every size in range
/// (check_conv_model_sizes, latent_channels, layers_per_block) and a usable scaling factor.
template <class VaeConfig>
void check_vae_config(const VaeConfig& c, const std::string& down_type, const std::string& up_type,
                      const std::string& where) {
  const std::size_t n = c.block_out_channels.size();
  if (n == 0) throw ConfigError("'block_out_channels' is empty", where);
  if (c.down_block_types.size() != n || c.up_block_types.size() != n)
    throw ConfigError(
        "'down_block_types' and 'up_block_types' need one entry per 'block_out_channels' entry (" +
            std::to_string(n) + ")",
        where);
  for (const auto& [field, types, want] :
       {std::tuple{"down_block_types", &c.down_block_types, &down_type},
        std::tuple{"up_block_types", &c.up_block_types, &up_type}})
    for (const auto& t : *types)
      if (t != *want)
        throw ConfigError(std::string("'") + field + "' has \"" + t + "\"; difftrain builds only " +
                              *want + " here",
                          where);
  // Every size in range before anything divides by one or allocates with one.
  check_conv_model_sizes("block_out_channels", n, c.in_channels, c.out_channels, c.norm_num_groups,
                         c.block_out_channels, where);
  check_config_range("latent_channels", c.latent_channels, 1, ConfigLimits::channels, where);
  check_config_range("layers_per_block", c.layers_per_block, 1, ConfigLimits::layers, where);
  if (!std::isfinite(c.scaling_factor) || c.scaling_factor == 0.0)
    throw ConfigError("'scaling_factor' must be finite and non-zero", where);
}

/// What a config implies about its weights, compared with the weights' names and shapes before the
/// model is built (diffusers builds on the meta device for the same reason): a config that says
/// 8 blocks or 1,280 channels where the file holds 4 blocks of 320 is refused before memory for
/// the larger model is allocated. Not the whole model's shapes — `load_weights` checks every one
/// after the build — but enough that the model built is no larger than its weights.
struct WeightSignature {
  /// Tensors the weights must hold, with these shapes.
  std::vector<std::pair<std::string, std::vector<std::int64_t>>> shapes;
  /// "down_blocks." → 4: the names that continue that prefix with an index use exactly 0 to 3.
  std::vector<std::pair<std::string, std::int64_t>> counts;
};

class ConfigReader {
 public:
  ConfigReader(nlohmann::json config, std::string where)
      : j_(std::move(config)), where_(std::move(where)) {
    if (!j_.is_object())
      throw ConfigError("a model config must be a JSON object, got " + std::string(j_.type_name()),
                        where_);
  }

  [[nodiscard]] const std::string& where() const { return where_; }
  [[nodiscard]] const nlohmann::json& json() const { return j_; }

  /// The field, or `fallback` when absent or null.
  template <class T>
  T get(const std::string& key, T fallback) {
    return optional<T>(key).value_or(std::move(fallback));
  }

  /// The field, or nothing when absent or null.
  template <class T>
  std::optional<T> optional(const std::string& key) {
    read_.insert(key);
    const auto it = j_.find(key);
    if (it == j_.end() || it->is_null()) return std::nullopt;
    return convert<T>(*it, key);
  }

  /// An integer (or bool, string...) that diffusers lets be one value for every block or a list
  /// with one entry per block: always returns `n` entries.
  template <class T>
  std::vector<T> per_block(const std::string& key, std::size_t n, T fallback) {
    read_.insert(key);
    const auto it = j_.find(key);
    if (it == j_.end() || it->is_null()) return std::vector<T>(n, fallback);
    if (!it->is_array()) return std::vector<T>(n, convert<T>(*it, key));
    auto v = convert<std::vector<T>>(*it, key);
    if (v.size() != n)
      throw ConfigError("'" + key + "' has " + std::to_string(v.size()) +
                            " entries; it needs one " + "per block (" + std::to_string(n) +
                            ") or a single value",
                        where_);
    return v;
  }

  /// A field difftrain reads but supports only at `supported` (its diffusers default): any other
  /// value is refused by name.
  void require_default(const std::string& key, const nlohmann::json& supported,
                       const std::string& why = "") {
    read_.insert(key);
    const auto it = j_.find(key);
    if (it == j_.end() || *it == supported) return;
    throw ConfigError("'" + key + "' = " + it->dump() + " is not supported (only " +
                          supported.dump() + ")" + (why.empty() ? "" : ": " + why),
                      where_);
  }

  /// A field with no effect on the model difftrain builds (as in diffusers for this model).
  void accept(const std::string& key) { read_.insert(key); }

  /// Throws for the first field nobody read.
  void finish() const {
    for (const auto& [key, value] : j_.items()) {
      if (key.starts_with("_") || read_.contains(key)) continue;
      throw ConfigError("unknown field '" + key + "' = " + value.dump() +
                            " (not a field this model has; a newer diffusers option?)",
                        where_);
    }
  }

 private:
  template <class T>
  T convert(const nlohmann::json& v, const std::string& key) const {
    try {
      // nlohmann converts a float to an integer by truncation; a config that says 2.5 layers is
      // wrong, not 2.
      if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
        if (!v.is_number_integer())
          throw ConfigError("'" + key + "' must be an integer, got " + v.dump(), where_);
      }
      if constexpr (std::is_same_v<T, bool>) {
        if (!v.is_boolean())
          throw ConfigError("'" + key + "' must be true or false, got " + v.dump(), where_);
      }
      if constexpr (std::is_same_v<T, std::vector<std::int64_t>>) {
        for (const auto& e : v)
          if (!e.is_number_integer())
            throw ConfigError("'" + key + "' must be a list of integers, got " + v.dump(), where_);
      }
      return v.get<T>();
    } catch (const nlohmann::json::exception&) {
      throw ConfigError("'" + key + "' has the wrong type: " + v.dump(), where_);
    }
  }

  nlohmann::json j_;
  std::string where_;
  std::set<std::string> read_;
};

/// The config.json a config was read from, kept by from_pretrained. Saving writes it back as it
/// was while the config still describes the same model: a fine-tune's config equals its base's,
/// scalars stay scalars and every field keeps its type and place, as diffusers' own save keeps
/// them (tools downstream, ControlNetModel.from_unet among them, read fields by their type). Not
/// part of what the config says: two configs that differ only here are the same model.
struct ConfigAsRead {
  std::shared_ptr<const nlohmann::json> json;
};

/// A number as diffusers' configs write it: an integer when it has no fraction (the published
/// configs write `4`, not `4.0`, and pipelines use some such fields in integer arithmetic).
inline nlohmann::json config_number(double v) {
  if (std::isfinite(v) && v == std::floor(v) && std::fabs(v) < 9.0e15)
    return nlohmann::json(static_cast<std::int64_t>(v));
  return nlohmann::json(v);
}

/// A per-block list as diffusers writes a field whose signature takes an int or a list: the one
/// value when every block has it (what a config that named one value read into), else the list.
template <class T>
nlohmann::json per_block_json(const std::vector<T>& v) {
  if (!v.empty() && std::all_of(v.begin(), v.end(), [&](const T& x) { return x == v.front(); }))
    return nlohmann::json(static_cast<T>(v.front()));
  return nlohmann::json(v);
}

/// What save_pretrained writes for `c`: the file it was read from when that still reads into the
/// same config (the file's own keys, values and types), else `c.to_json()`.
template <class Config>
nlohmann::json config_json_to_save(const Config& c) {
  nlohmann::json mine = c.to_json();
  if constexpr (requires { c.as_read.json; }) {
    if (c.as_read.json && c.as_read.json->is_object()) {
      bool same = false;
      try {
        same = Config::from_json(*c.as_read.json, "config.json").to_json() == mine;
      } catch (const Error&) {
        same = false;
      }
      if (same) {
        nlohmann::json j = *c.as_read.json;
        for (const char* key : {"_class_name", "_diffusers_version", "architectures", "model_type"})
          if (!j.contains(key) && mine.contains(key)) j[key] = mine[key];
        return j;
      }
    }
  }
  return mine;
}

/// One plain field of a config: its name in config.json and the member that holds it. A config
/// lists its plain fields once (`static constexpr auto fields()`), and read_fields and
/// write_fields serve reading and writing from that one list, so a field cannot be read and then
/// forgotten when written. Fields with rules of their own (legacy names, a null refused, a number
/// diffusers writes as an integer) stay outside the list, read and written by hand.
template <class C, class T>
struct ConfigField {
  std::string_view name;
  T C::*member;
};

template <class C, class T>
constexpr ConfigField<C, T> config_field(std::string_view name, T C::*member) {
  return {name, member};
}

namespace config_detail {
template <class T>
struct IsOptional : std::false_type {};
template <class T>
struct IsOptional<std::optional<T>> : std::true_type {};

template <class C, class T>
void read_field(ConfigReader& r, C& c, const ConfigField<C, T>& f) {
  const std::string key(f.name);
  if constexpr (IsOptional<T>::value) {
    // Absent: the config's default; null: none (diffusers writes an absent option as null).
    const bool present = r.json().contains(key);
    auto v = r.optional<typename T::value_type>(key);
    if (present) c.*f.member = std::move(v);
  } else {
    c.*f.member = r.get(key, c.*f.member);
  }
}

template <class C, class T>
void write_field(nlohmann::json& j, const C& c, const ConfigField<C, T>& f) {
  if constexpr (IsOptional<T>::value)
    j[std::string(f.name)] = value_or_null(c.*f.member);
  else
    j[std::string(f.name)] = c.*f.member;
}
}  // namespace config_detail

/// Reads every field of `fields` into `c` (an absent or null field keeps `c`'s default; an
/// optional one that is null becomes none).
template <class C, class... F>
void read_fields(ConfigReader& r, C& c, const std::tuple<F...>& fields) {
  std::apply([&](const auto&... f) { (config_detail::read_field(r, c, f), ...); }, fields);
}

/// Writes every field of `fields` from `c` into `j` (an optional that is none as null).
template <class C, class... F>
void write_fields(nlohmann::json& j, const C& c, const std::tuple<F...>& fields) {
  std::apply([&](const auto&... f) { (config_detail::write_field(j, c, f), ...); }, fields);
}

/// The diffusers version the configs difftrain writes name: the one its tests load them in.
inline constexpr std::string_view kDiffusersVersion = "0.42.1";

/// The start of a diffusers config.json for `Config`: its `_class_name` and `_diffusers_version`.
template <class Config>
nlohmann::json diffusers_config_json() {
  nlohmann::json j;
  j["_class_name"] = std::string(Config::class_name);
  j["_diffusers_version"] = std::string(kDiffusersVersion);
  return j;
}

/// The fields every diffusers VAE config has (AutoencoderKL's, CogVideoX's), read with the
/// config's own defaults: the sizes and the latent space's scaling and statistics.
template <class VaeConfig>
void read_vae_fields(ConfigReader& r, VaeConfig& c) {
  c.in_channels = r.get("in_channels", c.in_channels);
  c.out_channels = r.get("out_channels", c.out_channels);
  c.down_block_types = r.get("down_block_types", c.down_block_types);
  c.up_block_types = r.get("up_block_types", c.up_block_types);
  c.block_out_channels = r.get("block_out_channels", c.block_out_channels);
  c.layers_per_block = r.get("layers_per_block", c.layers_per_block);
  c.act_fn = r.get("act_fn", c.act_fn);
  c.latent_channels = r.get("latent_channels", c.latent_channels);
  c.norm_num_groups = r.get("norm_num_groups", c.norm_num_groups);
  c.scaling_factor = r.get("scaling_factor", c.scaling_factor);
  c.shift_factor = r.optional<double>("shift_factor");
  c.latents_mean = r.optional<std::vector<double>>("latents_mean");
  c.latents_std = r.optional<std::vector<double>>("latents_std");
  c.force_upcast = r.get("force_upcast", c.force_upcast);
  c.use_quant_conv = r.get("use_quant_conv", c.use_quant_conv);
  c.use_post_quant_conv = r.get("use_post_quant_conv", c.use_post_quant_conv);
}

/// The same fields written as diffusers writes them, after diffusers_config_json's start.
template <class VaeConfig>
nlohmann::json vae_config_json(const VaeConfig& c) {
  nlohmann::json j = diffusers_config_json<VaeConfig>();
  j["in_channels"] = c.in_channels;
  j["out_channels"] = c.out_channels;
  j["down_block_types"] = c.down_block_types;
  j["up_block_types"] = c.up_block_types;
  j["block_out_channels"] = c.block_out_channels;
  j["layers_per_block"] = c.layers_per_block;
  j["act_fn"] = c.act_fn;
  j["latent_channels"] = c.latent_channels;
  j["norm_num_groups"] = c.norm_num_groups;
  j["scaling_factor"] = c.scaling_factor;
  j["shift_factor"] = value_or_null(c.shift_factor);
  j["latents_mean"] = value_or_null(c.latents_mean);
  j["latents_std"] = value_or_null(c.latents_std);
  j["force_upcast"] = c.force_upcast;
  j["use_quant_conv"] = c.use_quant_conv;
  j["use_post_quant_conv"] = c.use_post_quant_conv;
  return j;
}

}  // namespace difftrain::models
