#pragma once
// Umbrella header of the train layer.

#include "difftrain/train/callbacks.hpp"
#include "difftrain/train/clipping.hpp"
#include "difftrain/train/consolidate.hpp"
#include "difftrain/train/gradient_groups.hpp"
#include "difftrain/train/multi_trainer.hpp"
#include "difftrain/train/optimizer.hpp"
#include "difftrain/train/optimizer_archive.hpp"
#include "difftrain/train/precision.hpp"
#include "difftrain/train/profile.hpp"
#include "difftrain/train/progress.hpp"
#include "difftrain/train/seeding.hpp"
#include "difftrain/train/tensorboard.hpp"
#include "difftrain/train/threads.hpp"
#include "difftrain/train/trainer.hpp"
