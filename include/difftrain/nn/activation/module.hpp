#pragma once
// Activations as torch modules, by type or by name. An elementwise policy becomes a parameterless
// module that calls the policy; a module policy builds its own.

#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/pimpl.h>

#include <string>
#include <string_view>

#include "difftrain/core/registry.hpp"
#include "difftrain/nn/activation/concepts.hpp"
#include "difftrain/nn/activation/elementwise.hpp"
#include "difftrain/nn/activation/parametric.hpp"

namespace difftrain::nn {

/// A module that applies the elementwise activation `A` with fixed options.
template <class A>
class ActivationModuleImpl : public torch::nn::Cloneable<ActivationModuleImpl<A>> {
  static_assert(diagnose_activation<A>());
  static_assert(ElementwiseActivation<A>,
                "difftrain: ActivationModule wraps elementwise activations; module activations "
                "build their own module with make_activation_module<A>()");

 public:
  explicit ActivationModuleImpl(typename A::Options options = {}) : options_(options) {}
  void reset() override {}
  at::Tensor forward(const at::Tensor& x) { return A::forward(x, options_); }
  void pretty_print(std::ostream& stream) const override {
    stream << "difftrain::ActivationModule(" << A::name << ")";
  }
  [[nodiscard]] const typename A::Options& options() const noexcept { return options_; }

 private:
  typename A::Options options_;
};

template <class A>
class ActivationModule : public torch::nn::ModuleHolder<ActivationModuleImpl<A>> {
 public:
  using torch::nn::ModuleHolder<ActivationModuleImpl<A>>::ModuleHolder;
};

/// The activation `A` as a module that a `torch::nn::Sequential` can hold.
template <class A>
torch::nn::AnyModule make_activation_module(const typename A::Options& options = {}) {
  static_assert(diagnose_activation<A>());
  if constexpr (ModuleActivation<A>) {
    return A::make_module(options);
  } else {
    return torch::nn::AnyModule(ActivationModule<A>(options));
  }
}

namespace act = activation;

/// Every activation reachable by name: the web UI hypernetwork's list (its own seven plus every
/// class of torch.nn.modules.activation by lowercase name) and GEGLU.
using Activations =
    type_list<act::Linear, act::ReLU, act::LeakyReLU, act::ELU, act::Swish, act::Tanh, act::Sigmoid,
              act::CELU, act::GELU, act::GELUTanh, act::GLU, act::Hardshrink, act::Hardsigmoid,
              act::Hardswish, act::Hardtanh, act::LogSigmoid, act::LogSoftmax, act::Mish,
              act::PReLU, act::ReLU6, act::RReLU, act::SELU, act::SiLU, act::Softmax,
              act::Softmax2d, act::Softmin, act::Softplus, act::Softshrink, act::Softsign,
              act::Tanhshrink, act::Threshold, act::GEGLU>;

inline constexpr Registry<Activations> activations{"activation"};

/// The activation named `name` (default options) as a module; unknown names throw ConfigError.
inline torch::nn::AnyModule make_activation(std::string_view name, std::string_view where = {}) {
  return activations.visit(
      name, [](auto tag) { return make_activation_module<typename decltype(tag)::type>(); }, where);
}

}  // namespace difftrain::nn
