#pragma once
// LoRA on transformers' CLIP text encoders as diffusers' and kohya's training scripts put it:
// the attention projections q_proj, k_proj, v_proj, out_proj (and, when asked, the MLP's fc1 and
// fc2) of every encoder layer; saved with PEFT names under "text_encoder." / "text_encoder_2."
// (what diffusers' lora_state_dict and load_lora_weights read) or kohya names under "lora_te_"
// (SD 1.x/2.x) and "lora_te1_" / "lora_te2_" (SDXL's two encoders).

#include <stdexcept>
#include <string>

#include "difftrain/adapters/lora_inject.hpp"
#include "difftrain/core/error.hpp"
#include "difftrain/models/clip_text_model.hpp"

namespace difftrain::adapters {

/// diffusers' text-encoder LoRA targets (train_dreambooth_lora.py,
/// train_text_to_image_lora_sdxl.py: q_proj, k_proj, v_proj, out_proj); `with_mlp` adds fc1 and fc2
/// as kohya's scripts can.
inline LoraTargets text_encoder_lora_targets(bool with_mlp = false) {
  LoraTargets t{{"q_proj", "k_proj", "v_proj", "out_proj"}, {}};
  if (with_mlp) {
    t.target_modules.push_back("fc1");
    t.target_modules.push_back("fc2");
  }
  return t;
}

/// Which text encoder a LoRA file's keys name.
enum class TextEncoderSlot {
  single,  ///< SD 1.x / 2.x: "text_encoder." / "lora_te_"
  first,   ///< SDXL's CLIP ViT-L: "text_encoder." / "lora_te1_"
  second,  ///< SDXL's OpenCLIP bigG: "text_encoder_2." / "lora_te2_"
};

inline LoraKeyOptions text_encoder_lora_keys(LoraLayout layout,
                                             TextEncoderSlot slot = TextEncoderSlot::single) {
  if (layout == LoraLayout::peft)
    return {layout, slot == TextEncoderSlot::second ? "text_encoder_2." : "text_encoder.",
            /*magnitude_as_weight=*/true};
  return {layout, slot == TextEncoderSlot::single  ? "lora_te_"
                  : slot == TextEncoderSlot::first ? "lora_te1_"
                                                   : "lora_te2_"};
}

}  // namespace difftrain::adapters
