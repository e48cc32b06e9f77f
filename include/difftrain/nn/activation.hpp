#pragma once
// Activation policies: elementwise and module activations, their registry and module wrappers.

#include "difftrain/nn/activation/concepts.hpp"
#include "difftrain/nn/activation/elementwise.hpp"
#include "difftrain/nn/activation/module.hpp"
#include "difftrain/nn/activation/parametric.hpp"
