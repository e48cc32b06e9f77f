#pragma once
// Umbrella header of the adapters layer: textual-inversion embeddings and their database, LoRA
// (layers, injection, file layouts), LoHa and LoKr, the web UI's hypernetworks, `.optim` sidecars
// and the web UI's adapter training loops.

#include "difftrain/adapters/embedding.hpp"
#include "difftrain/adapters/embedding_database.hpp"
#include "difftrain/adapters/hypernetwork.hpp"
#include "difftrain/adapters/lora.hpp"
#include "difftrain/adapters/lora_inject.hpp"
#include "difftrain/adapters/optimizer_sidecar.hpp"
#include "difftrain/adapters/stable_diffusion_lora_files.hpp"
#include "difftrain/adapters/text_encoder_adapters.hpp"
#include "difftrain/adapters/unet_adapters.hpp"
#include "difftrain/adapters/webui_training.hpp"
#include "difftrain/adapters/weight_delta.hpp"
