#pragma once
// Umbrella header of the nn layer.

#include "difftrain/nn/activation.hpp"
#include "difftrain/nn/attention/attention.hpp"
#include "difftrain/nn/block_swap.hpp"
#include "difftrain/nn/blocks/blocks.hpp"
#include "difftrain/nn/init.hpp"
#include "difftrain/nn/layers/adaptable.hpp"
#include "difftrain/nn/module_tensors.hpp"
