#pragma once
// Umbrella header of the attention backends and the attention modules that are not blocks.

#include "difftrain/nn/attention/chunked.hpp"
#include "difftrain/nn/attention/concepts.hpp"
#include "difftrain/nn/attention/fallback.hpp"
#include "difftrain/nn/attention/linear_attention.hpp"
#include "difftrain/nn/attention/math.hpp"
#include "difftrain/nn/attention/sdpa.hpp"
#include "difftrain/nn/attention/spatial_self_attention.hpp"
