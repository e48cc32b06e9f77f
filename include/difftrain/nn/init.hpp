#pragma once
// Weight-init policies, their registry, and whole-module initialisation by the web UI's rules.

#include "difftrain/nn/init/apply.hpp"
#include "difftrain/nn/init/concepts.hpp"
#include "difftrain/nn/init/policies.hpp"
