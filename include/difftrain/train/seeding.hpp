#pragma once
// One call seeds every generator a training run draws from (diffusers' set_seed): the CPU
// generator and every CUDA device's. `deterministic` also asks torch for deterministic kernels
// (an error where none exists) and turns off cuDNN's benchmark mode.

#include <ATen/Context.h>
#include <torch/cuda.h>
#include <torch/utils.h>

#include <cstdint>

namespace difftrain::train {

inline void set_seed(std::uint64_t seed, bool deterministic = false) {
  torch::manual_seed(seed);  // CPU, and every CUDA device when CUDA is initialised
  if (torch::cuda::is_available()) torch::cuda::manual_seed_all(seed);
  if (deterministic) {
    at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);
    at::globalContext().setDeterministicCuDNN(true);
    at::globalContext().setBenchmarkCuDNN(false);
  }
}

}  // namespace difftrain::train
