#pragma once
// A module's tensors by name, out and back in. Loading is strict: the names must be exactly the
// module's (no tensor missing, none extra) and every shape must match, or a FormatError names the
// tensor and where it came from. Nothing is copied until everything has been checked.

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <map>
#include <string>

#include "difftrain/core/error.hpp"

namespace difftrain::nn {

/// The parameters (and, with `buffers`, the buffers) of `m` by their dotted names; views, not
/// copies.
inline std::map<std::string, at::Tensor> module_tensors(const torch::nn::Module& m,
                                                        bool buffers = true) {
  std::map<std::string, at::Tensor> out;
  for (const auto& item : m.named_parameters(true)) out[item.key()] = item.value();
  if (buffers)
    for (const auto& item : m.named_buffers(true)) out[item.key()] = item.value();
  return out;
}

/// Copies `tensors` into the module's parameters (and buffers), after checking names and shapes.
inline void load_module_tensors(torch::nn::Module& m,
                                const std::map<std::string, at::Tensor>& tensors,
                                const std::string& where, bool buffers = true) {
  const auto own = module_tensors(m, buffers);
  for (const auto& [name, t] : tensors)
    if (!own.contains(name))
      throw FormatError("has '" + name + "', which the module does not", where);
  for (const auto& [name, dst] : own) {
    const auto it = tensors.find(name);
    if (it == tensors.end()) throw FormatError("lacks '" + name + "'", where);
    if (it->second.sizes() != dst.sizes())
      throw FormatError("'" + name + "' has shape " + c10::str(it->second.sizes()) +
                            ", the module's is " + c10::str(dst.sizes()),
                        where);
  }
  at::NoGradGuard no_grad;
  for (const auto& [name, dst] : own) dst.copy_(tensors.at(name));
}

}  // namespace difftrain::nn
