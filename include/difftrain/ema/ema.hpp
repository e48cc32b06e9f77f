#pragma once
// Umbrella header of the EMA layer: decay rules, update engines, Ema<Rule, Engine>, post-hoc EMA.

#include "difftrain/ema/by_name.hpp"
#include "difftrain/ema/concepts.hpp"
#include "difftrain/ema/engines.hpp"
#include "difftrain/ema/moving_average.hpp"
#include "difftrain/ema/post_hoc.hpp"
#include "difftrain/ema/rules.hpp"
