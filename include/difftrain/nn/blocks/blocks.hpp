#pragma once
// Umbrella header of the transformer blocks.

#include "difftrain/nn/blocks/checkpoint.hpp"
#include "difftrain/nn/blocks/cross_attention.hpp"
#include "difftrain/nn/blocks/feed_forward.hpp"
#include "difftrain/nn/blocks/spatial_transformer.hpp"
#include "difftrain/nn/blocks/transformer_block.hpp"
