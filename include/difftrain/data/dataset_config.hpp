#pragma once
// kohya's dataset config (sd-scripts' --dataset_config dataset.toml, library/config_util.py): a
// [general] table, then [[datasets]] with their [[datasets.subsets]], each subset a folder of
// images with its own repeats, caption extension, class tokens and caption options. A value is
// looked up in the subset, then its dataset, then [general], then the program's flags, as kohya's
// sanitizer ascends. Every key must be one of kohya's, in a table where kohya takes it: a
// misspelt key is a ConfigError naming the file, line and column and the nearest key. kohya's
// keys difftrain does not act on (color_aug, face_crop_aug_range, ...) are taken at their neutral
// value and refused otherwise, rather than silently ignored.
//
// TOML is read with toml++ (Debian: libtomlplusplus-dev), a maintained TOML 1.0 parser whose
// errors carry the source position.

#if !__has_include(<toml++/toml.h>)
#error "difftrain/data/dataset_config.hpp reads TOML with toml++ (Debian: libtomlplusplus-dev)"
#endif

#include <toml++/toml.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/core/registry.hpp"
#include "difftrain/data/caption_options.hpp"

namespace difftrain::data {

/// One [[datasets.subsets]] table with what it inherits.
struct DatasetSubsetConfig {
  std::filesystem::path image_dir;
  std::string class_tokens;  ///< the caption of an image without a caption file
  std::int64_t num_repeats = 1;
  std::string caption_extension = ".caption";  ///< kohya's default
  bool is_reg = false;                         ///< regularization (prior) images
  bool flip_aug = false, random_crop = false;
  bool alpha_mask = false;  ///< the loss masked by each image's alpha channel
  /// kohya's conditioning images, here masks for the loss (an image's of the same stem; its red
  /// channel); empty: none.
  std::filesystem::path conditioning_data_dir{};
  CaptionOptions captions;
  std::string where;  ///< "file:line:column" of the table
};

/// One [[datasets]] table: its subsets and the settings kohya keeps per dataset.
struct DatasetBlueprint {
  std::vector<DatasetSubsetConfig> subsets;
  std::optional<std::int64_t> batch_size, resolution;  ///< resolution: square side
  std::optional<bool> enable_bucket, bucket_no_upscale;
  std::optional<std::int64_t> min_bucket_reso, max_bucket_reso, bucket_reso_steps;
  std::string where;
};

struct DatasetConfig {
  std::filesystem::path file;
  std::vector<DatasetBlueprint> datasets;
};

namespace dataset_config_detail {

enum class Level { general, dataset, subset };

/// kohya's keys by where they may stand: subset keys ascend to datasets and [general] (except
/// the distinct ones), dataset keys to [general].
inline const std::set<std::string>& subset_ascendable() {
  static const std::set<std::string> keys = {
      "num_repeats", "caption_extension", "class_tokens", "flip_aug", "random_crop",
      "shuffle_caption", "keep_tokens", "keep_tokens_separator", "secondary_separator",
      "caption_separator", "enable_wildcard", "token_warmup_min", "token_warmup_step",
      "caption_prefix", "caption_suffix", "caption_dropout_rate", "caption_dropout_every_n_epochs",
      "caption_tag_dropout_rate",
      // kohya's, taken at their neutral value only
      "color_aug", "face_crop_aug_range", "custom_attributes", "system_prompt",
      "resize_interpolation", "cache_info"};
  return keys;
}
inline const std::set<std::string>& subset_distinct() {
  static const std::set<std::string> keys = {"image_dir", "is_reg", "alpha_mask", "metadata_file",
                                             "conditioning_data_dir"};
  return keys;
}
inline const std::set<std::string>& dataset_ascendable() {
  static const std::set<std::string> keys = {
      "batch_size",       "bucket_no_upscale", "bucket_reso_steps", "enable_bucket",
      "max_bucket_reso",  "min_bucket_reso",   "resolution",        "validation_seed",
      "validation_split", "network_multiplier"};
  return keys;
}

inline std::string position(const std::filesystem::path& file, const toml::source_region& r) {
  return file.string() + ":" + std::to_string(r.begin.line) + ":" + std::to_string(r.begin.column);
}

/// Refuses a key kohya does not take at `level`, suggesting the nearest one.
inline void check_key(const std::string& key, Level level, const std::string& where) {
  const bool subset = subset_ascendable().contains(key);
  const bool distinct = subset_distinct().contains(key);
  const bool dataset = dataset_ascendable().contains(key);
  const bool subsets = key == "subsets", datasets = key == "datasets";
  const bool ok = (level == Level::subset && (subset || distinct)) ||
                  (level == Level::dataset && (subset || dataset || subsets)) ||
                  (level == Level::general && (subset || dataset));
  if (ok) return;
  const char* table = level == Level::subset    ? "[[datasets.subsets]]"
                      : level == Level::dataset ? "[[datasets]]"
                                                : "[general]";
  if (subset || distinct || dataset || subsets || datasets)
    throw ConfigError("'" + key + "' is kohya's but does not belong in " + table, where);
  std::string nearest;
  std::size_t best = 4;  // suggest only a near miss
  for (const auto* keys : {&subset_ascendable(), &subset_distinct(), &dataset_ascendable()})
    for (const auto& k : *keys)
      if (const std::size_t d = difftrain::detail::edit_distance(key, k); d < best)
        best = d, nearest = k;
  throw ConfigError("'" + key + "' is not a key of kohya's dataset config in " + table +
                        (nearest.empty() ? "" : "; did you mean '" + nearest + "'?"),
                    where);
}

/// A value of the type kohya's schema gives the key, or a ConfigError naming it.
template <class T>
T get(const toml::node& n, const std::string& key, const std::string& where) {
  if constexpr (std::is_same_v<T, double>) {
    if (auto v = n.value<double>()) return *v;  // integers too, as kohya's Any(float, int)
  } else if constexpr (std::is_same_v<T, bool>) {
    if (n.is_boolean()) return *n.value<bool>();
  } else if constexpr (std::is_same_v<T, std::int64_t>) {
    if (n.is_integer()) return *n.value<std::int64_t>();
  } else {
    if (n.is_string()) return *n.value<std::string>();
  }
  const char* want = std::is_same_v<T, double>         ? "a number"
                     : std::is_same_v<T, bool>         ? "true or false"
                     : std::is_same_v<T, std::int64_t> ? "an integer"
                                                       : "a string";
  throw ConfigError("'" + key + "' must be " + std::string(want), where);
}

/// The settings a table holds, as a map from key to node (ascending: subset, dataset, general).
using Scope = std::vector<const toml::table*>;

inline const toml::node* lookup(const Scope& scope, const std::string& key) {
  for (const toml::table* t : scope)
    if (t != nullptr)
      if (const toml::node* n = t->get(key)) return n;
  return nullptr;
}

/// kohya's keys difftrain does not act on: accepted at their neutral value, refused otherwise.
inline void refuse_unsupported(const Scope& scope, const std::filesystem::path& file) {
  for (const toml::table* t : scope) {
    if (t == nullptr) continue;
    for (const auto& [k, v] : *t) {
      const std::string key(k.str());
      const std::string where = position(file, v.source());
      bool neutral = true;
      if (key == "color_aug" || key == "cache_info")
        neutral = v.is_boolean() && !*v.value<bool>();
      else if (key == "face_crop_aug_range" || key == "custom_attributes" ||
               key == "system_prompt" || key == "metadata_file" || key == "validation_split" ||
               key == "validation_seed")
        neutral =
            (v.is_array() && v.as_array()->empty()) || (v.is_table() && v.as_table()->empty()) ||
            (v.is_string() && v.value<std::string>()->empty()) ||
            (key == "validation_split" && v.value<double>() == 0.0) || key == "validation_seed";
      else if (key == "network_multiplier")
        neutral = v.value<double>() == 1.0;
      else if (key == "resize_interpolation")
        neutral = v.is_string() &&
                  (v.value<std::string>()->empty() || *v.value<std::string>() == "lanczos" ||
                   *v.value<std::string>() == "area");
      else
        continue;
      if (!neutral)
        throw ConfigError("'" + key + "' is kohya's, but difftrain does not act on it; remove it",
                          where);
    }
  }
}

inline void read_captions(const Scope& scope, CaptionOptions& c, const std::string& where) {
  auto take = [&](const char* key, auto& field) {
    if (const toml::node* n = lookup(scope, key))
      field = get<std::decay_t<decltype(field)>>(*n, key, where);
  };
  take("shuffle_caption", c.shuffle_caption);
  take("keep_tokens", c.keep_tokens);
  take("keep_tokens_separator", c.keep_tokens_separator);
  take("secondary_separator", c.secondary_separator);
  take("caption_separator", c.caption_separator);
  take("enable_wildcard", c.enable_wildcard);
  take("token_warmup_min", c.token_warmup_min);
  take("token_warmup_step", c.token_warmup_step);
  take("caption_prefix", c.caption_prefix);
  take("caption_suffix", c.caption_suffix);
  take("caption_dropout_rate", c.caption_dropout_rate);
  take("caption_dropout_every_n_epochs", c.caption_dropout_every_n_epochs);
  take("caption_tag_dropout_rate", c.caption_tag_dropout_rate);
}

}  // namespace dataset_config_detail

/// Reads and checks `file` (kohya's dataset config). `defaults` are the caption options the
/// program's flags give, which the file's keys override. Every subset names an existing folder.
inline DatasetConfig read_dataset_config(const std::filesystem::path& file,
                                         const CaptionOptions& defaults = {}) {
  namespace dd = dataset_config_detail;
  using dd::Level;
  toml::table root;
  try {
    root = toml::parse_file(file.string());
  } catch (const toml::parse_error& e) {
    if (!std::filesystem::exists(file)) throw IoError("does not exist", file.string());
    throw FormatError("is not valid TOML: " + std::string(e.description()),
                      dd::position(file, e.source()));
  }
  DatasetConfig config;
  config.file = file;
  const toml::table* general = nullptr;
  for (const auto& [k, v] : root) {
    const std::string key(k.str()), where = dd::position(file, k.source());
    if (key == "general") {
      general = v.as_table();
      if (general == nullptr) throw ConfigError("[general] must be a table", where);
    } else if (key != "datasets") {
      throw ConfigError(
          "'" + key + "' is not a table of kohya's dataset config (general, datasets)", where);
    }
  }
  if (general != nullptr)
    for (const auto& [k, v] : *general)
      dd::check_key(std::string(k.str()), Level::general, dd::position(file, k.source()));
  const toml::array* datasets = root["datasets"].as_array();
  if (datasets == nullptr || datasets->empty())
    throw ConfigError("has no [[datasets]]", file.string());
  for (const toml::node& dn : *datasets) {
    const toml::table* dataset = dn.as_table();
    const std::string dwhere = dd::position(file, dn.source());
    if (dataset == nullptr) throw ConfigError("a [[datasets]] entry must be a table", dwhere);
    for (const auto& [k, v] : *dataset)
      dd::check_key(std::string(k.str()), Level::dataset, dd::position(file, k.source()));
    DatasetBlueprint b;
    b.where = dwhere;
    const dd::Scope dscope{dataset, general};
    auto dataset_int = [&](const char* key, std::optional<std::int64_t>& field) {
      if (const toml::node* n = dd::lookup(dscope, key))
        field = dd::get<std::int64_t>(*n, key, dd::position(file, n->source()));
    };
    auto dataset_bool = [&](const char* key, std::optional<bool>& field) {
      if (const toml::node* n = dd::lookup(dscope, key))
        field = dd::get<bool>(*n, key, dd::position(file, n->source()));
    };
    dataset_int("batch_size", b.batch_size);
    dataset_int("min_bucket_reso", b.min_bucket_reso);
    dataset_int("max_bucket_reso", b.max_bucket_reso);
    dataset_int("bucket_reso_steps", b.bucket_reso_steps);
    dataset_bool("enable_bucket", b.enable_bucket);
    dataset_bool("bucket_no_upscale", b.bucket_no_upscale);
    if (const toml::node* n = dd::lookup(dscope, "resolution")) {
      const std::string where = dd::position(file, n->source());
      if (n->is_integer()) {
        b.resolution = *n->value<std::int64_t>();
      } else if (const toml::array* a = n->as_array();
                 a != nullptr && a->size() == 2 && (*a)[0].is_integer() && (*a)[1].is_integer()) {
        if ((*a)[0].value<std::int64_t>() != (*a)[1].value<std::int64_t>())
          throw ConfigError(
              "'resolution' is not square; difftrain trains a square resolution "
              "(with enable_bucket, its area sets the buckets)",
              where);
        b.resolution = *(*a)[0].value<std::int64_t>();
      } else {
        throw ConfigError("'resolution' must be an integer or [width, height]", where);
      }
    }
    if (b.batch_size && *b.batch_size < 1) throw ConfigError("'batch_size' must be >= 1", dwhere);
    const toml::array* subsets = (*dataset)["subsets"].as_array();
    if (subsets == nullptr || subsets->empty())
      throw ConfigError("has no [[datasets.subsets]]", dwhere);
    for (const toml::node& sn : *subsets) {
      const toml::table* subset = sn.as_table();
      const std::string swhere = dd::position(file, sn.source());
      if (subset == nullptr) throw ConfigError("a subsets entry must be a table", swhere);
      for (const auto& [k, v] : *subset)
        dd::check_key(std::string(k.str()), Level::subset, dd::position(file, k.source()));
      const dd::Scope scope{subset, dataset, general};
      dd::refuse_unsupported(scope, file);
      DatasetSubsetConfig c;
      c.where = swhere;
      c.captions = defaults;
      const toml::node* dir = subset->get("image_dir");
      if (dir == nullptr) throw ConfigError("has no 'image_dir' (kohya requires one)", swhere);
      c.image_dir = dd::get<std::string>(*dir, "image_dir", dd::position(file, dir->source()));
      if (!std::filesystem::is_directory(c.image_dir))
        throw IoError("'image_dir' " + c.image_dir.string() + " is not a folder",
                      dd::position(file, dir->source()));
      auto take = [&](const char* key, auto& field) {
        if (const toml::node* n = dd::lookup(scope, key))
          field = dd::get<std::decay_t<decltype(field)>>(*n, key, dd::position(file, n->source()));
      };
      take("class_tokens", c.class_tokens);
      take("num_repeats", c.num_repeats);
      take("caption_extension", c.caption_extension);
      take("is_reg", c.is_reg);
      take("flip_aug", c.flip_aug);
      take("random_crop", c.random_crop);
      take("alpha_mask", c.alpha_mask);
      if (const toml::node* n = subset->get("conditioning_data_dir")) {
        const std::string where = dd::position(file, n->source());
        c.conditioning_data_dir = dd::get<std::string>(*n, "conditioning_data_dir", where);
        if (!std::filesystem::is_directory(c.conditioning_data_dir))
          throw IoError(
              "'conditioning_data_dir' " + c.conditioning_data_dir.string() + " is not a folder",
              where);
      }
      dd::read_captions(scope, c.captions, swhere);
      if (c.num_repeats < 1) throw ConfigError("'num_repeats' must be >= 1", swhere);
      if (c.caption_extension.empty() || c.caption_extension.front() != '.')
        throw ConfigError("'caption_extension' must start with a dot, as \".txt\"", swhere);
      try {
        c.captions.check();
      } catch (const ConfigError& e) {
        throw ConfigError(e.what(), swhere);
      }
      b.subsets.push_back(std::move(c));
    }
    config.datasets.push_back(std::move(b));
  }
  return config;
}

}  // namespace difftrain::data
