#pragma once
// Flux LoRA files in kohya's layout (sd-scripts' networks/lora_flux.py, what ComfyUI and the
// Flux tools load): Black Forest Labs' module names under "lora_unet_" —
// double_blocks_N_{img,txt}_attn_{qkv,proj}, _{img,txt}_mlp_{0,2}, _{img,txt}_mod_lin,
// single_blocks_N_linear1 / _linear2 / _modulation_lin — where diffusers' layout (PEFT keys
// under "transformer.", lora_inject.hpp) has its own names. BFL fuses projections diffusers keeps
// apart: img_attn.qkv is to_q, to_k, to_v; txt_attn.qkv the add_*_proj; a single block's linear1
// is to_q, to_k, to_v and proj_mlp side by side. A fused file branch holds the separate branches
// side by side: lora_down stacks their A's, lora_up is block-diagonal, and alpha = n·α keeps the
// scale α/r (diffusers' converter recognises such a "sparse" up and splits it exactly).

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "difftrain/adapters/lora_inject.hpp"
#include "difftrain/core/error.hpp"

namespace difftrain::adapters {

/// diffusers' Flux LoRA targets (train_dreambooth_lora_flux.py without --lora_layers): both
/// streams' attention projections and feed-forwards; in the single blocks that reaches to_q,
/// to_k and to_v.
inline LoraTargets flux_lora_targets() {
  return {{"attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj",
           "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2",
           "ff_context.net.0.proj", "ff_context.net.2"},
          {}};
}

/// One kohya module and the diffusers modules it stands for (several: fused, in order).
struct FluxKohyaModule {
  std::string kohya;
  std::vector<std::string> diffusers;
};

/// kohya's Flux names for a transformer of `double_blocks` and `single_blocks` blocks.
inline std::vector<FluxKohyaModule> flux_kohya_table(std::int64_t double_blocks,
                                                     std::int64_t single_blocks) {
  std::vector<FluxKohyaModule> t;
  for (std::int64_t i = 0; i < double_blocks; ++i) {
    const std::string k = "double_blocks_" + std::to_string(i) + "_",
                      d = "transformer_blocks." + std::to_string(i) + ".";
    t.push_back({k + "img_attn_qkv", {d + "attn.to_q", d + "attn.to_k", d + "attn.to_v"}});
    t.push_back({k + "img_attn_proj", {d + "attn.to_out.0"}});
    t.push_back({k + "img_mlp_0", {d + "ff.net.0.proj"}});
    t.push_back({k + "img_mlp_2", {d + "ff.net.2"}});
    t.push_back({k + "img_mod_lin", {d + "norm1.linear"}});
    t.push_back({k + "txt_attn_qkv",
                 {d + "attn.add_q_proj", d + "attn.add_k_proj", d + "attn.add_v_proj"}});
    t.push_back({k + "txt_attn_proj", {d + "attn.to_add_out"}});
    t.push_back({k + "txt_mlp_0", {d + "ff_context.net.0.proj"}});
    t.push_back({k + "txt_mlp_2", {d + "ff_context.net.2"}});
    t.push_back({k + "txt_mod_lin", {d + "norm1_context.linear"}});
  }
  for (std::int64_t i = 0; i < single_blocks; ++i) {
    const std::string k = "single_blocks_" + std::to_string(i) + "_",
                      d = "single_transformer_blocks." + std::to_string(i) + ".";
    t.push_back(
        {k + "linear1", {d + "attn.to_q", d + "attn.to_k", d + "attn.to_v", d + "proj_mlp"}});
    t.push_back({k + "linear2", {d + "proj_out"}});
    t.push_back({k + "modulation_lin", {d + "norm.linear"}});
  }
  return t;
}

/// The LoRA branches of a Flux transformer (`root`, diffusers' module names) in kohya's Flux
/// layout under `prefix` (CPU tensors). The modules of a fused kohya module must share rank and
/// alpha; one without a branch beside others that have one contributes zeros. A branch on a
/// module kohya's layout does not name (x_embedder, the time embedding, ...) is a ConfigError.
inline std::map<std::string, at::Tensor> flux_kohya_lora_state_dict(
    torch::nn::Module& root, std::int64_t double_blocks, std::int64_t single_blocks,
    const std::string& prefix = "lora_unet_") {
  const std::string where = "flux_kohya_lora_state_dict";
  std::map<std::string, LoraHost*> branches;
  for (const auto& [name, h] : lora_layers(root)) branches[name] = h;
  std::set<std::string> written;
  std::map<std::string, at::Tensor> out;
  for (const auto& m : flux_kohya_table(double_blocks, single_blocks)) {
    std::vector<LoraHost*> hosts;
    bool any = false;
    for (const auto& d : m.diffusers) {
      const auto it = branches.find(d);
      hosts.push_back(it == branches.end() ? nullptr : it->second);
      any = any || it != branches.end();
    }
    if (!any) continue;
    const LoraHost* first = nullptr;
    for (const auto* h : hosts)
      if (h != nullptr && first == nullptr) first = h;
    const LoraOptions& o = first->lora_options();
    const double alpha = o.alpha.value_or(static_cast<double>(o.rank));
    for (std::size_t i = 0; i < hosts.size(); ++i) {
      if (hosts[i] == nullptr) continue;
      written.insert(m.diffusers[i]);
      const LoraOptions& oi = hosts[i]->lora_options();
      if (oi.use_dora)
        throw ConfigError("'" + m.diffusers[i] + "' is DoRA; kohya's Flux layout holds LoRA",
                          where);
      if (oi.rank != o.rank || oi.alpha.value_or(static_cast<double>(oi.rank)) != alpha)
        throw ConfigError("'" + m.diffusers[i] + "' has another rank or alpha than the modules " +
                              "kohya fuses it with into " + m.kohya,
                          where);
    }
    const std::string key = prefix + m.kohya;
    const auto n = static_cast<std::int64_t>(hosts.size());
    if (n == 1) {
      out[key + ".lora_down.weight"] = first->lora_a().detach().cpu().clone();
      out[key + ".lora_up.weight"] = first->lora_b().detach().cpu().clone();
      out[key + ".alpha"] = at::scalar_tensor(alpha, at::kFloat);
      continue;
    }
    // Side by side: A's stacked, B's on the diagonal (a module without a branch: zeros).
    const std::int64_t r = o.rank, in = first->lora_a().size(1);
    const auto dtype = first->lora_a().scalar_type();
    std::vector<at::Tensor> downs;
    std::vector<std::int64_t> rows;
    for (std::size_t i = 0; i < hosts.size(); ++i) {
      if (hosts[i] != nullptr) {
        downs.push_back(hosts[i]->lora_a().detach().cpu());
        rows.push_back(hosts[i]->lora_b().size(0));
      } else {
        // The module's output width: from its weight, as the layer's `weight` parameter.
        const auto mod = root.named_modules("", false)[m.diffusers[i]];
        downs.push_back(at::zeros({r, in}, at::TensorOptions().dtype(dtype)));
        rows.push_back(mod->named_parameters(false)["weight"].size(0));
      }
    }
    std::int64_t total = 0;
    for (const auto v : rows) total += v;
    at::Tensor up = at::zeros({total, n * r}, at::TensorOptions().dtype(dtype));
    std::int64_t row = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      if (hosts[static_cast<std::size_t>(i)] != nullptr)
        up.narrow(0, row, rows[static_cast<std::size_t>(i)])
            .narrow(1, i * r, r)
            .copy_(hosts[static_cast<std::size_t>(i)]->lora_b().detach().cpu());
      row += rows[static_cast<std::size_t>(i)];
    }
    out[key + ".lora_down.weight"] = at::cat(downs, 0);
    out[key + ".lora_up.weight"] = up;
    out[key + ".alpha"] = at::scalar_tensor(alpha * static_cast<double>(n), at::kFloat);
  }
  for (const auto& [name, h] : branches)
    if (!written.contains(name))
      throw ConfigError("'" + name + "' has a LoRA branch kohya's Flux layout has no name for",
                        where);
  return out;
}

}  // namespace difftrain::adapters
