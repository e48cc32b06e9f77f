#pragma once
// Initialising a whole module by the web UI's rule: every Linear gets the init policy, every
// LayerNorm gets Normal(0.01) whatever the policy (its weights are *not* ones: files trained with
// the reference start there), and Kaiming's nonlinearity follows the activation name.

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <string_view>

#include "difftrain/core/registry.hpp"
#include "difftrain/nn/init/concepts.hpp"
#include "difftrain/nn/init/policies.hpp"

namespace difftrain::nn {

inline constexpr Registry<Inits> inits{"weight init"};

/// Applies `I` to every Linear of `module` (in registration order, as the reference iterates its
/// Sequential) and Normal to every LayerNorm.
template <class I>
void apply_init(torch::nn::Module& module, std::string_view activation = "linear") {
  static_assert(diagnose_init<I>());
  typename I::Options options{};
  if constexpr (std::is_same_v<I, init::KaimingUniform> || std::is_same_v<I, init::KaimingNormal>)
    options.nonlinearity = init::kaiming_nonlinearity_for(activation);
  for (const auto& child : module.modules(/*include_self=*/true)) {
    if (auto* linear = child->as<torch::nn::LinearImpl>()) {
      I::apply(linear->weight, linear->bias, options);
    } else if (auto* norm = child->as<torch::nn::LayerNormImpl>()) {
      init::Normal::apply(norm->weight, norm->bias, {});
    }
  }
}

/// `apply_init` with the policy named at run time ("Normal", "XavierUniform", ...).
inline void apply_init(std::string_view init_name, torch::nn::Module& module,
                       std::string_view activation = "linear") {
  inits.visit(
      init_name, [&](auto tag) { apply_init<typename decltype(tag)::type>(module, activation); },
      "weight_init");
}

}  // namespace difftrain::nn
