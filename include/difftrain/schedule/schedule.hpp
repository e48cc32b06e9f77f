#pragma once
// Umbrella header of the schedule layer.

#include "difftrain/schedule/bind.hpp"
#include "difftrain/schedule/by_name.hpp"
#include "difftrain/schedule/cogvideox.hpp"
#include "difftrain/schedule/concepts.hpp"
#include "difftrain/schedule/diffusers.hpp"
#include "difftrain/schedule/parse.hpp"
#include "difftrain/schedule/plateau.hpp"
#include "difftrain/schedule/registry.hpp"
#include "difftrain/schedule/step_string.hpp"
#include "difftrain/schedule/table.hpp"
#include "difftrain/schedule/timm.hpp"
#include "difftrain/schedule/torch_schedulers.hpp"
#include "difftrain/schedule/warmup.hpp"
