#pragma once
// Umbrella header of the distributed layer.

#include "difftrain/distributed/sampler.hpp"
