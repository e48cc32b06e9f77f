#pragma once
// The adapters on diffusers' UNet2DConditionModel, as the tools users know put them there:
//   * LoRA on every attention projection (to_q, to_k, to_v, to_out.0 — the targets of diffusers'
//     LoRA training scripts), saved under "unet." in the PEFT layout diffusers' load_lora_weights
//     reads, or under "lora_unet_" in the kohya layout the web UI reads;
//   * kohya's LoCon on the resnets' and resamplers' layers (unet_conv_lora_targets);
//   * the web UI's hypernetworks on every attention layer's context (attn1's is the image tokens,
//     attn2's the text), chosen by the context width as the web UI does.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "difftrain/adapters/hypernetwork.hpp"
#include "difftrain/adapters/lora_inject.hpp"
#include "difftrain/models/unet_2d_condition.hpp"

namespace difftrain::adapters {

/// diffusers' UNet LoRA targets (train_text_to_image_lora.py, train_dreambooth_lora.py).
inline LoraTargets unet_lora_targets() { return {{"to_k", "to_q", "to_v", "to_out.0"}, {}}; }

/// kohya's LoCon (networks/lora.py with `conv_dim`): the layers of every ResnetBlock2D (conv1,
/// conv2, conv_shortcut, time_emb_proj) and of every resampler (downsamplers.0.conv,
/// upsamplers.0.conv), beside the attention layers.
inline LoraTargets unet_conv_lora_targets() {
  return {
      {},
      R"((down_blocks\.\d+|up_blocks\.\d+|mid_block)\.(resnets\.\d+\.(conv1|conv2|conv_shortcut|)"
      R"(time_emb_proj)|(down|up)samplers\.0\.conv))"};
}

/// Whether kohya gives `module` (one of unet_conv_lora_targets) the convolution rank
/// (`conv_dim`, a 3×3 convolution) rather than the linear one (a Linear or a 1×1 convolution).
inline bool kohya_conv_3x3(const std::string& module) {
  for (const char* tail : {".conv1", ".conv2", "samplers.0.conv"})
    if (module.ends_with(tail)) return true;
  return false;
}

/// kohya's block of a UNet module (networks/lora.py's get_block_index on the module's kohya name):
/// 1 + 3i + j for down_blocks.i's resnets/attentions.j (3i + 2 for its downsampler), 12 for the
/// mid block, 13 + 3i + j for up_blocks.i (3i + 2 for its upsampler); -1 for any other module.
inline int kohya_block_index(const std::string& module) {
  static const std::regex updown(
      R"((up|down)_blocks_(\d+)_(resnets|upsamplers|downsamplers|attentions)_(\d+)_)");
  constexpr int kBlocks = 12;  // kohya's NUM_OF_BLOCKS
  const std::string name = "lora_unet_" + kohya_name(module) + "_";
  std::smatch m;
  if (std::regex_search(name, m, updown)) {
    const int i = std::stoi(m[2].str()), j = std::stoi(m[4].str());
    const int idx = m[3] == "resnets" || m[3] == "attentions" ? 3 * i + j : 3 * i + 2;
    return m[1] == "down" ? 1 + idx : kBlocks + 1 + idx;
  }
  if (name.find("mid_block_") != std::string::npos) return kBlocks;
  return -1;
}

/// kohya's `block_dims` / `block_alphas` (network_args of networks/lora.py): 25 ranks and alphas,
/// one per UNet block (kohya_block_index; a module of no block takes the last, as Python's [-1]
/// does); a rank of 0 leaves the block's layers without a branch.
struct BlockDims {
  std::vector<std::int64_t> dims;
  std::vector<double> alphas;  ///< empty: every block's alpha is `alpha`
  double alpha = 1.0;          ///< kohya's network_alpha
  double dropout = 0.0;

  static constexpr std::size_t kCount = 25;
  /// Refuses a count other than 25 and negative ranks, naming the setting as `dims_where` /
  /// `alphas_where` (a program's flags).
  void validate(const std::string& dims_where = "block_dims",
                const std::string& alphas_where = "block_alphas") const {
    if (dims.size() != kCount)
      throw ConfigError("needs " + std::to_string(kCount) +
                            " ranks (IN00-11, MID, OUT00-11), got " + std::to_string(dims.size()),
                        dims_where);
    if (!alphas.empty() && alphas.size() != kCount)
      throw ConfigError(
          "needs " + std::to_string(kCount) + " alphas, got " + std::to_string(alphas.size()),
          alphas_where);
    for (const auto d : dims)
      if (d < 0) throw ConfigError("a rank is negative", dims_where);
    for (const auto a : alphas)
      if (!(std::isfinite(a) && a > 0)) throw ConfigError("an alpha is not > 0", alphas_where);
  }
  /// The options of `module` (none for a block of rank 0).
  [[nodiscard]] std::optional<LoraOptions> of(const std::string& module) const {
    const int b = kohya_block_index(module);
    if (b >= static_cast<int>(kCount))
      throw ConfigError("module '" + module + "' is in block " + std::to_string(b) +
                            ", past kohya's " + std::to_string(kCount),
                        "block_dims");
    const std::size_t at = b < 0 ? kCount - 1 : static_cast<std::size_t>(b);
    if (dims[at] == 0) return std::nullopt;
    return LoraOptions{
        .rank = dims[at], .alpha = alphas.empty() ? alpha : alphas[at], .dropout = dropout};
  }
};

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
