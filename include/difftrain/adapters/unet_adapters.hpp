#pragma once
// The adapters on diffusers' UNet2DConditionModel, as the tools users know put them there:
//   * LoRA on every attention projection (to_q, to_k, to_v, to_out.0 — the targets of diffusers'
//     LoRA training scripts), saved under "unet." in the PEFT layout diffusers' load_lora_weights
//     reads, or under "lora_unet_" in the kohya layout the web UI reads;
//   * the web UI's hypernetworks on every attention layer's context (attn1's is the image tokens,
//     attn2's the text), chosen by the context width as the web UI does.

#include <cstddef>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "difftrain/adapters/hypernetwork.hpp"
#include "difftrain/adapters/lora_inject.hpp"
#include "difftrain/models/unet_2d_condition.hpp"

namespace difftrain::adapters {

/// diffusers' UNet LoRA targets (train_text_to_image_lora.py, train_dreambooth_lora.py).
inline LoraTargets unet_lora_targets() { return {{"to_k", "to_q", "to_v", "to_out.0"}, {}}; }

/// Key options for a UNet LoRA file: PEFT names under "unet." (diffusers), or kohya names under
/// "lora_unet_" (the web UI, kohya's scripts).
inline LoraKeyOptions unet_lora_keys(LoraLayout layout) {
  return {layout, layout == LoraLayout::peft ? "unet." : "lora_unet_"};
}

/// Puts `hypernetwork` on the keys and values of every attention layer of `unet` (self- and
/// cross-attention); returns how many layers it hooked. The hypernetwork must outlive the hooks
/// (detach_hypernetwork removes them).
template <class Backend, class Act>
std::size_t attach_hypernetwork(models::UNet2DConditionModelImpl<Backend, Act>& unet,
                                const Hypernetwork& hypernetwork) {
  std::size_t hooked = 0;
  for (auto& [name, transformer] : unet.transformers())
    for (auto block : transformer->blocks())  // holders share their module: a copy is a handle
      for (auto attn : {block->attn1, block->attn2}) {
        attn->set_context_hook(
            [&hypernetwork](const at::Tensor& c) { return hypernetwork.apply(c, c); });
        ++hooked;
      }
  return hooked;
}

/// The widths of the contexts attach_hypernetwork's hooks see: every self-attention layer's
/// channels and every cross-attention layer's text width. A hypernetwork acts on a layer only
/// where it has a module of that width.
template <class Backend, class Act>
std::set<std::int64_t> hypernetwork_context_widths(
    models::UNet2DConditionModelImpl<Backend, Act>& unet) {
  std::set<std::int64_t> widths;
  for (auto& [name, transformer] : unet.transformers())
    for (auto block : transformer->blocks())
      for (auto attn : {block->attn1, block->attn2})
        widths.insert(attn->to_k->options.in_features());
  return widths;
}

/// Removes every context hook attach_hypernetwork put on `unet`.
template <class Backend, class Act>
void detach_hypernetwork(models::UNet2DConditionModelImpl<Backend, Act>& unet) {
  for (auto& [name, transformer] : unet.transformers())
    for (auto block : transformer->blocks()) {
      block->attn1->set_context_hook(nullptr);
      block->attn2->set_context_hook(nullptr);
    }
}

}  // namespace difftrain::adapters
