#pragma once
// What the configs of diffusers' patched 2-D transformers (DiT, PixArt: the Transformer2DModel
// lineage) check alike: the sizes of the patched image and its attention, the inner width the 2-D
// sine-cosine position table needs, one patch within the sample, a feed-forward activation
// diffusers has, the dropout and the norm's eps; and the legacy Transformer2DModel class name that
// diffusers remaps to each by its norm type.

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "difftrain/core/error.hpp"
#include "difftrain/models/config_reader.hpp"
#include "difftrain/models/feed_forward.hpp"

namespace difftrain::models {

/// Checks the fields every patched 2-D transformer config has (`C` names them as diffusers does:
/// num_attention_heads, attention_head_dim, in_channels, out(), num_layers, sample_size,
/// patch_size, activation_fn, dropout, norm_eps, inner_dim()).
template <class C>
void validate_patched_transformer(const C& c, const std::string& where) {
  check_config_range("num_attention_heads", c.num_attention_heads, 1, ConfigLimits::channels,
                     where);
  check_config_range("attention_head_dim", c.attention_head_dim, 1, ConfigLimits::channels, where);
  check_config_range("in_channels", c.in_channels, 1, ConfigLimits::channels, where);
  check_config_range("out_channels", c.out(), 1, ConfigLimits::channels, where);
  check_config_range("num_layers", c.num_layers, 1, ConfigLimits::layers, where);
  check_config_range("sample_size", c.sample_size, 1, ConfigLimits::spatial, where);
  check_config_range("patch_size", c.patch_size, 1, ConfigLimits::spatial, where);
  if (c.inner_dim() > ConfigLimits::channels || c.inner_dim() % 4 != 0)
    throw ConfigError(
        "num_attention_heads × attention_head_dim = " + std::to_string(c.inner_dim()) +
            " must be a multiple of 4 (the 2-D sine-cosine position table) and at "
            "most " +
            std::to_string(ConfigLimits::channels),
        where);
  if (c.sample_size < c.patch_size)
    throw ConfigError("'sample_size' " + std::to_string(c.sample_size) +
                          " is smaller than one patch ('patch_size' " +
                          std::to_string(c.patch_size) + ")",
                      where);
  if (!feed_forward_activation(c.activation_fn))
    throw ConfigError("'activation_fn' = \"" + c.activation_fn +
                          "\" is not a feed-forward activation diffusers has",
                      where);
  if (!(c.dropout >= 0.0 && c.dropout < 1.0))
    throw ConfigError("'dropout' must lie in [0, 1), got " + std::to_string(c.dropout), where);
  if (!(c.norm_eps > 0.0))
    throw ConfigError("'norm_eps' must be positive, got " + std::to_string(c.norm_eps), where);
}

/// Whether a folder's `_class_name` is `own`, or diffusers' legacy Transformer2DModel with the
/// norm type diffusers remaps to that class ("ada_norm_zero": DiT, "ada_norm_single": PixArt).
inline bool reads_transformer_2d_class(std::string_view own, std::string_view norm_type,
                                       const std::string& name, const nlohmann::json& j) {
  if (name == own) return true;
  return name == "Transformer2DModel" && j.contains("norm_type") && j["norm_type"] == norm_type;
}

}  // namespace difftrain::models
