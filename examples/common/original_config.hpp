#pragma once
// The original configs Stable Diffusion's checkpoints ship with (v1-inference.yaml,
// v2-inference-v.yaml, sd_xl_base.yaml; the web UI reads `model.yaml` beside `model.safetensors`):
// what a single file's keys cannot tell, read as diffusers' `original_config=` reads it. The
// prediction (`model.params.parameterization`: "v", else ε), the heads (`num_heads` or
// `num_head_channels` of the UNet's params) and the VAE's `scale_factor`. Read with yaml-cpp
// (Debian: libyaml-cpp-dev), a well-kept YAML 1.2 parser, rather than by hand; a build without it
// refuses the flag by name.

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <difftrain/core/error.hpp>
#include <nlohmann/json.hpp>

#if DIFFTRAIN_HAS_YAML_CPP
#include <yaml-cpp/yaml.h>
#endif

namespace examples {

/// What an original config says beyond a single file's keys.
struct OriginalConfig {
  std::filesystem::path path;
  std::string prediction = "epsilon";  // "v_prediction" for parameterization "v"
  std::optional<std::int64_t> num_heads, num_head_channels;
  std::optional<double> scale_factor;
};

/// `model.yaml` beside `model.safetensors` (or `.ckpt`), where the web UI looks for it.
inline std::optional<std::filesystem::path> sibling_original_config(
    const std::filesystem::path& file) {
  std::filesystem::path yaml = file;
  yaml.replace_extension(".yaml");
  if (std::filesystem::is_regular_file(yaml)) return yaml;
  return std::nullopt;
}

inline OriginalConfig read_original_config(const std::filesystem::path& path) {
  const std::string where = path.string();
#if DIFFTRAIN_HAS_YAML_CPP
  OriginalConfig o;
  o.path = path;
  if (!std::filesystem::is_regular_file(path))
    throw difftrain::IoError("is not a file (name the model's original .yaml config)", where);
  try {
    const YAML::Node root = YAML::LoadFile(where);
    const YAML::Node model = root.IsMap() ? root["model"] : YAML::Node();
    const YAML::Node params = model && model.IsMap() ? model["params"] : YAML::Node();
    if (!params || !params.IsMap())
      throw difftrain::FormatError(
          "has no model.params map: not a Stable Diffusion original config", where);
    if (const YAML::Node p = params["parameterization"]; p) {
      const auto kind = p.as<std::string>();
      if (kind == "v")
        o.prediction = "v_prediction";
      else if (kind != "eps")
        throw difftrain::FormatError(
            "model.params.parameterization is '" + kind + "'; the original code knows eps and v",
            where);
    }
    if (const YAML::Node s = params["scale_factor"]; s) o.scale_factor = s.as<double>();
    YAML::Node unet = params["unet_config"];
    if (!unet || !unet.IsMap()) unet = params["network_config"];  // SDXL's
    if (unet && unet.IsMap() && unet["params"] && unet["params"].IsMap()) {
      const YAML::Node u = unet["params"];
      // -1 means "not given" in the original configs.
      if (u["num_heads"] && u["num_heads"].as<std::int64_t>() > 0)
        o.num_heads = u["num_heads"].as<std::int64_t>();
      if (u["num_head_channels"] && u["num_head_channels"].as<std::int64_t>() > 0)
        o.num_head_channels = u["num_head_channels"].as<std::int64_t>();
    }
  } catch (const YAML::BadFile&) {
    throw difftrain::IoError("cannot be read", where);
  } catch (const YAML::Exception& e) {
    throw difftrain::FormatError(
        "is not a config this program reads: " + e.msg +
            (e.mark.is_null() ? "" : " (line " + std::to_string(e.mark.line + 1) + ")"),
        where);
  }
  return o;
#else
  throw difftrain::ConfigError(
      "needs yaml-cpp, which this build was made without (Debian: libyaml-cpp-dev)", where);
#endif
}

/// The told UNet config with the heads the original config gives: `num_heads` a block, or
/// `num_head_channels` a head (diffusers' configs call the per-block head counts
/// attention_head_dim).
inline void apply_original_heads(nlohmann::json& unet, const OriginalConfig& o) {
  if (!o.num_heads && !o.num_head_channels) return;
  std::vector<std::int64_t> heads;
  for (const auto& c : unet.at("block_out_channels")) {
    const auto channels = c.get<std::int64_t>();
    if (o.num_head_channels && channels % *o.num_head_channels != 0)
      throw difftrain::ConfigError("num_head_channels " + std::to_string(*o.num_head_channels) +
                                       " does not divide a block of " + std::to_string(channels),
                                   o.path.string());
    heads.push_back(o.num_heads ? *o.num_heads : channels / *o.num_head_channels);
  }
  unet["attention_head_dim"] = heads;
}

}  // namespace examples
