#pragma once
// Evaluation measures for generated samples.

#include "difftrain/eval/frechet_distance.hpp"
