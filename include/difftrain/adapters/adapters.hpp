#pragma once
// Umbrella header of the adapters layer: LoRA (layers, injection, file layouts) and the web UI's
// hypernetworks.

#include "difftrain/adapters/hypernetwork.hpp"
#include "difftrain/adapters/lora.hpp"
#include "difftrain/adapters/lora_inject.hpp"
