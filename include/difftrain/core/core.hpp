#pragma once
// Umbrella header of the core layer: errors, type lists, registries, shared concepts.

#include "difftrain/core/agreed.hpp"
#include "difftrain/core/concepts.hpp"
#include "difftrain/core/error.hpp"
#include "difftrain/core/python_strings.hpp"
#include "difftrain/core/registry.hpp"
#include "difftrain/core/type_list.hpp"
#include "difftrain/core/version.hpp"
