#pragma once
// Precompiled for the unit-test binary only; library headers include what they use.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <string_view>
#include <vector>

#include "test_dirs.hpp"  // the golden and corpus folders, for every test source
