#pragma once
// The adaptable layers under the names LoRA code in adapters/ uses. They are defined in
// nn/layers/adaptable.hpp, below the attention and feed-forward blocks that are built of them.

#include "difftrain/nn/layers/adaptable.hpp"

namespace difftrain::adapters {

using nn::AdaptableConv2d;
using nn::AdaptableConv2dImpl;
using nn::AdaptableImpl;
using nn::AdaptableLinear;
using nn::AdaptableLinearImpl;
using nn::Conv2dLoraTraits;
using nn::DoraAxis;
using nn::LinearLoraTraits;
using nn::LoraHost;
using nn::LoraOptions;

}  // namespace difftrain::adapters
