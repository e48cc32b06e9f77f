#pragma once
// Umbrella header of the adapters layer: textual-inversion embeddings, LoRA (layers, injection,
// file layouts) and the web UI's hypernetworks.

#include "difftrain/adapters/embedding.hpp"
#include "difftrain/adapters/hypernetwork.hpp"
#include "difftrain/adapters/lora.hpp"
#include "difftrain/adapters/lora_inject.hpp"
