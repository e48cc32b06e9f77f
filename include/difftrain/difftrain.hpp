#pragma once
// Everything difftrain offers. Each layer also has its own umbrella header
// (`difftrain/core/core.hpp`, ...) for users who want to include less.

#include "difftrain/adapters/adapters.hpp"
#include "difftrain/core/core.hpp"
#include "difftrain/diffusion/diffusion.hpp"
#include "difftrain/distributed/distributed.hpp"
#include "difftrain/ema/ema.hpp"
#include "difftrain/eval/eval.hpp"
#include "difftrain/io/io.hpp"
#include "difftrain/log/log.hpp"
#include "difftrain/models/models.hpp"
#include "difftrain/nn/nn.hpp"
#include "difftrain/schedule/schedule.hpp"
#include "difftrain/text/text.hpp"
#include "difftrain/train/train.hpp"
