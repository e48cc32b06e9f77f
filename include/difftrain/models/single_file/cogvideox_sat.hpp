#pragma once
// CogVideoX checkpoints as the SAT (SwissArmyTransformer) training code writes them, read as
// diffusers' convert_cogvideox_to_diffusers.py maps them:
//
//   transformer  `mp_rank_00_model_states.pt` (DeepSpeed's: the weights under "module", beside
//                the run's argparse.Namespace, random states and counters, read as inert
//                placeholders), names under `model.diffusion_model.`:
//                  transformer.layers.N.{input_layernorm, attention.query_key_value (q, k and v
//                  in one tensor), attention.dense, post_attention_layernorm,
//                  mlp.dense_h_to_4h / dense_4h_to_h}, transformer.final_layernorm,
//                  time_embed.0/2, ofs_embed.0/2 (1.5), mixins.patch_embed.{proj, text_proj},
//                  mixins.pos_embed.pos_embedding (I2V's learned table), mixins.final_layer.*,
//                  mixins.adaln_layer.adaLN_modulations.N.1 (both LayerNormZero modulations of
//                  a block in one tensor of 12 chunks),
//                  mixins.adaln_layer.{query,key}_layernorm_list.N
//                and, from SAT's LoRA fine-tuning (sat.model.finetune.lora2), each adapted linear
//                as `original.{weight,bias}` with `matrix_A.i` / `matrix_B.i` per partition (three
//                for query_key_value): merged into the weight, W + (α / r) · [B₀A₀; B₁A₁; B₂A₂],
//                as SAT's merge_lora does (α: LoraMixin's lora_alpha, 1 unless the run set it).
//   VAE          `3d-vae.pt` (a `state_dict`): encoder.down.N.block.M, .downsample, mid.block_1/2,
//                decoder.up.N (numbered from the top: diffusers' up_blocks count from the
//                bottom), nin_shortcut; the training loss's tensors are not the model's.
//
// The configs are not in these files: they come from a CogVideoX pipeline folder of the same model
// (diffusers' script takes them as flags).

#include <ATen/ATen.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/core/python_strings.hpp"
#include "difftrain/io/torch_file.hpp"
#include "difftrain/models/autoencoder_kl_cogvideox.hpp"
#include "difftrain/models/cogvideox_transformer_3d.hpp"
#include "difftrain/models/pretrained.hpp"

namespace difftrain::models {

inline constexpr std::string_view kSatDiffusionPrefix = "model.diffusion_model.";

namespace cogvideox_sat_detail {

/// The digits of `s` as a number, or -1 (short, digits only).
inline std::int64_t index_of(std::string_view s) {
  if (s.empty() || s.size() > 9 || s.find_first_not_of("0123456789") != std::string_view::npos)
    return -1;
  return std::stoll(std::string(s));
}

// diffusers' TRANSFORMER_KEYS_RENAME_DICT, applied in this order to every name.
inline constexpr std::pair<std::string_view, std::string_view> kTransformerRenames[] = {
    {"transformer.final_layernorm", "norm_final"},
    {"transformer", "transformer_blocks"},
    {"attention", "attn1"},
    {"mlp", "ff.net"},
    {"dense_h_to_4h", "0.proj"},
    {"dense_4h_to_h", "2"},
    {".layers", ""},
    {"dense", "to_out.0"},
    {"input_layernorm", "norm1.norm"},
    {"post_attn1_layernorm", "norm2.norm"},
    {"time_embed.0", "time_embedding.linear_1"},
    {"time_embed.2", "time_embedding.linear_2"},
    {"ofs_embed.0", "ofs_embedding.linear_1"},
    {"ofs_embed.2", "ofs_embedding.linear_2"},
    {"mixins.patch_embed", "patch_embed"},
    {"mixins.final_layer.norm_final", "norm_out.norm"},
    {"mixins.final_layer.linear", "proj_out"},
    {"mixins.final_layer.adaLN_modulation.1", "norm_out.linear"},
    {"mixins.pos_embed.pos_embedding", "patch_embed.pos_embedding"},
};

// Buffers SAT saves that diffusers recomputes (the rotary tables, the token and position tables
// of SAT's base transformer, unused by CogVideoX).
inline bool dropped(const std::string& key) {
  for (std::string_view part : {"embed_tokens", "freqs_sin", "freqs_cos", "position_embedding"})
    if (key.find(part) != std::string::npos) return true;
  return false;
}

/// SAT's LoRA layers merged into their weights: for every `X.original.weight` with
/// `X.matrix_A.i` / `X.matrix_B.i`, `X.weight` = original + (alpha / r) · [B_i A_i stacked].
inline void merge_sat_lora(std::map<std::string, at::Tensor>& sd, double lora_alpha,
                           const std::string& where) {
  std::vector<std::string> adapted;
  for (const auto& [key, t] : sd)
    if (key.ends_with(".original.weight"))
      adapted.push_back(key.substr(0, key.size() - std::string_view(".original.weight").size()));
  for (const std::string& layer : adapted) {
    const at::Tensor base = sd.at(layer + ".original.weight");
    std::vector<at::Tensor> deltas;
    std::int64_t rank = -1;
    for (int i = 0;; ++i) {
      const auto a = sd.find(layer + ".matrix_A." + std::to_string(i));
      const auto b = sd.find(layer + ".matrix_B." + std::to_string(i));
      if (a == sd.end() && b == sd.end()) break;
      if (a == sd.end() || b == sd.end())
        throw FormatError("'" + layer + "' has matrix_" + (a == sd.end() ? "B." : "A.") +
                              std::to_string(i) + " without its matrix_" +
                              (a == sd.end() ? "A" : "B"),
                          where);
      const at::Tensor& A = a->second;
      const at::Tensor& B = b->second;
      if (A.dim() != 2 || B.dim() != 2 || B.size(1) != A.size(0) || A.size(1) != base.size(1) ||
          (rank >= 0 && A.size(0) != rank))
        throw FormatError("'" + layer + "' has LoRA matrices of shapes " + c10::str(A.sizes()) +
                              " and " + c10::str(B.sizes()) + " that do not fit its weight " +
                              c10::str(base.sizes()),
                          where);
      rank = A.size(0);
      deltas.push_back(at::matmul(B.to(at::kFloat), A.to(at::kFloat)));
      sd.erase(a);
      sd.erase(b);
    }
    if (deltas.empty())
      throw FormatError("'" + layer + ".original.weight' has no LoRA matrices beside it", where);
    const at::Tensor delta = at::cat(deltas, 0);
    if (delta.sizes() != base.sizes())
      throw FormatError("'" + layer + "': its " + std::to_string(deltas.size()) +
                            " LoRA partitions give " + c10::str(delta.sizes()) +
                            ", its weight is " + c10::str(base.sizes()),
                        where);
    const double scaling = lora_alpha / static_cast<double>(rank);
    sd[layer + ".weight"] = (base.to(at::kFloat) + delta * scaling).to(base.scalar_type());
    sd.erase(layer + ".original.weight");
    const auto bias = sd.find(layer + ".original.bias");
    if (bias != sd.end()) {
      sd[layer + ".bias"] = bias->second;
      sd.erase(layer + ".original.bias");
    }
  }
  for (const auto& [key, t] : sd)
    if (key.find(".matrix_A.") != std::string::npos || key.find(".matrix_B.") != std::string::npos)
      throw FormatError("'" + key + "' is a LoRA matrix without the layer's original weight",
                        where);
}

}  // namespace cogvideox_sat_detail

/// The weights of a SAT checkpoint (`mp_rank_00_model_states.pt`, `3d-vae.pt`): its dict's
/// "model", "module" or "state_dict" entry as diffusers' get_state_dict picks it, or the dict
/// itself. Objects beside the weights (argparse.Namespace, numpy states) are read as inert
/// placeholders, never called; non-tensor entries are left out.
inline std::map<std::string, at::Tensor> read_sat_state_dict(const std::filesystem::path& path) {
  const io::TorchValue root = io::load_torch_file(path, io::ObjectPolicy::inert);
  if (!root.is_dict())
    throw FormatError("is not a checkpoint (its root is not a dict)", path.string());
  io::TorchValue sd = root;
  for (const char* key : {"model", "module", "state_dict"})
    if (root.contains(key)) sd = root.at(key);
  if (!sd.is_dict())
    throw FormatError("holds its weights in something that is not a dict", path.string());
  std::map<std::string, at::Tensor> out;
  for (const auto& [key, value] : sd.items())
    if (key.isString() && value.is_tensor()) out.emplace(key.toStringRef(), value.tensor());
  if (out.empty()) throw FormatError("holds no tensors", path.string());
  return out;
}

/// A SAT CogVideoX transformer's weights under diffusers' CogVideoXTransformer3DModel names, as
/// convert_cogvideox_to_diffusers.py's convert_transformer renames them, SAT LoRA layers merged
/// with `lora_alpha` (SAT's LoraMixin default: 1, a scale of 1 / r).
inline std::map<std::string, at::Tensor> cogvideox_transformer_tensors_from_sat(
    std::map<std::string, at::Tensor> sat, const std::string& where, double lora_alpha = 1.0) {
  using namespace cogvideox_sat_detail;
  std::map<std::string, at::Tensor> sd;
  std::vector<std::string> outside;
  for (auto& [key, t] : sat) {
    if (key.starts_with(kSatDiffusionPrefix))
      sd.emplace(key.substr(kSatDiffusionPrefix.size()), std::move(t));
    else
      outside.push_back(key);
  }
  if (sd.empty())
    throw FormatError("holds no '" + std::string(kSatDiffusionPrefix) +
                          "*' tensors: not a SAT CogVideoX transformer checkpoint" +
                          (outside.empty() ? "" : " (its first is '" + outside.front() + "')"),
                      where);
  merge_sat_lora(sd, lora_alpha, where);
  std::map<std::string, at::Tensor> out;
  auto put = [&](const std::string& name, at::Tensor t) {
    if (!out.emplace(name, std::move(t)).second)
      throw FormatError("gives diffusers' '" + name + "' twice", where);
  };
  for (auto& [sat_key, t] : sd) {
    if (dropped(sat_key)) continue;
    std::string key = sat_key;
    for (const auto& [from, to] : kTransformerRenames) key = python_replace(key, from, to);
    const std::vector<std::string> parts = python_split(key, ".");
    const std::string& last = parts.back();
    if (key.find("query_key_value") != std::string::npos) {
      if (t.dim() < 1 || t.size(0) % 3 != 0)
        throw FormatError(
            "'" + sat_key + "' is not q, k and v of equal rows (shape " + c10::str(t.sizes()) + ")",
            where);
      const auto qkv = t.chunk(3, 0);
      const char* names[] = {"to_q", "to_k", "to_v"};
      for (int i = 0; i < 3; ++i) put(python_replace(key, "query_key_value", names[i]), qkv[i]);
    } else if (key.find("query_layernorm_list") != std::string::npos ||
               key.find("key_layernorm_list") != std::string::npos) {
      if (parts.size() < 2 || index_of(parts[parts.size() - 2]) < 0)
        throw FormatError("'" + sat_key + "' is not a numbered layer's q/k norm", where);
      const bool query = key.find("query") != std::string::npos;
      put("transformer_blocks." + parts[parts.size() - 2] + ".attn1." +
              (query ? "norm_q." : "norm_k.") + last,
          t);
    } else if (key.find("adaln_layer.adaLN_modulations") != std::string::npos) {
      if (parts.size() < 3 || index_of(parts[parts.size() - 3]) < 0)
        throw FormatError("'" + sat_key + "' is not a numbered layer's modulation", where);
      if (t.dim() < 1 || t.size(0) % 12 != 0)
        throw FormatError(
            "'" + sat_key + "' is not 12 chunks of modulation (shape " + c10::str(t.sizes()) + ")",
            where);
      // Chunks 0-2 and 6-8 modulate norm1 (attention), 3-5 and 9-11 norm2 (feed-forward).
      const auto c = t.chunk(12, 0);
      const std::string block = "transformer_blocks." + parts[parts.size() - 3];
      put(block + ".norm1.linear." + last, at::cat({c[0], c[1], c[2], c[6], c[7], c[8]}));
      put(block + ".norm2.linear." + last, at::cat({c[3], c[4], c[5], c[9], c[10], c[11]}));
    } else {
      put(key, t);
    }
  }
  return out;
}

/// A SAT CogVideoX VAE's weights (`3d-vae.pt`) under diffusers' AutoencoderKLCogVideoX names, as
/// convert_vae renames them (the decoder's up blocks renumbered from the bottom).
inline std::map<std::string, at::Tensor> cogvideox_vae_tensors_from_sat(
    std::map<std::string, at::Tensor> sat, const std::string& where) {
  using namespace cogvideox_sat_detail;
  constexpr std::pair<std::string_view, std::string_view> renames[] = {
      {"block.", "resnets."},
      {"down.", "down_blocks."},
      {"downsample", "downsamplers.0"},
      {"upsample", "upsamplers.0"},
      {"nin_shortcut", "conv_shortcut"},
      {"encoder.mid.block_1", "encoder.mid_block.resnets.0"},
      {"encoder.mid.block_2", "encoder.mid_block.resnets.1"},
      {"decoder.mid.block_1", "decoder.mid_block.resnets.0"},
      {"decoder.mid.block_2", "decoder.mid_block.resnets.1"},
  };
  // The decoder's up blocks: diffusers' script renumbers 4 of them; the count here is the file's.
  std::set<std::int64_t> ups;
  for (const auto& [key, t] : sat)
    if (key.starts_with("decoder.up.")) {
      const auto parts = python_split(key, ".");
      if (parts.size() > 2 && index_of(parts[2]) >= 0) ups.insert(index_of(parts[2]));
    }
  const auto up_count = static_cast<std::int64_t>(ups.size());
  std::map<std::string, at::Tensor> out;
  for (auto& [sat_key, t] : sat) {
    if (sat_key.find("loss") != std::string::npos) continue;  // the training loss's (LPIPS, ...)
    std::string key = sat_key;
    for (const auto& [from, to] : renames) key = python_replace(key, from, to);
    if (key.find("up.") != std::string::npos) {
      std::vector<std::string> parts = python_split(key, ".");
      const std::int64_t i = parts.size() > 2 ? index_of(parts[2]) : -1;
      if (parts.size() < 3 || parts[1] != "up" || i < 0 || i >= up_count)
        throw FormatError("'" + sat_key + "' is not a numbered decoder up block's", where);
      parts[1] = "up_blocks";
      parts[2] = std::to_string(up_count - 1 - i);
      key.clear();
      for (std::size_t j = 0; j < parts.size(); ++j) key += (j ? "." : "") + parts[j];
    }
    if (!out.emplace(key, std::move(t)).second)
      throw FormatError("gives diffusers' '" + key + "' twice", where);
  }
  return out;
}

/// A CogVideoX transformer of `config` (its pipeline folder's) from a SAT checkpoint: every tensor
/// the model has must be there, and nothing else (the fixed sin-cos position table SAT keeps,
/// which the model recomputes, aside).
template <class Holder = CogVideoXTransformer3DModel<>>
Holder cogvideox_transformer_from_sat(const std::filesystem::path& file,
                                      CogVideoXTransformer3DConfig config,
                                      double lora_alpha = 1.0) {
  const std::string where = file.string();
  auto weights =
      cogvideox_transformer_tensors_from_sat(read_sat_state_dict(file), where, lora_alpha);
  auto model = built_to_load<Holder>(std::move(config), where + " (told by its config folder)");
  bool has_table = false;
  for (const auto& b : model->named_buffers(true))
    has_table |= b.key() == "patch_embed.pos_embedding";
  if (!has_table) weights.erase("patch_embed.pos_embedding");
  load_weights(*model, weights, where + " (CogVideoX transformer)");
  return model;
}

/// A CogVideoX VAE of `config` from SAT's `3d-vae.pt`.
template <class Holder = AutoencoderKLCogVideoX<>>
Holder cogvideox_vae_from_sat(const std::filesystem::path& file,
                              AutoencoderKLCogVideoXConfig config) {
  const std::string where = file.string();
  auto weights = cogvideox_vae_tensors_from_sat(read_sat_state_dict(file), where);
  auto model = built_to_load<Holder>(std::move(config), where + " (told by its config folder)");
  load_weights(*model, weights, where + " (CogVideoX VAE)");
  return model;
}

}  // namespace difftrain::models
