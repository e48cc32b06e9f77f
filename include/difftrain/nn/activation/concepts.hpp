#pragma once
// The activation family. An activation is either
//   - elementwise: `static at::Tensor forward(const at::Tensor&, const Options&)`, no state; or
//   - a module: `static torch::nn::AnyModule make_module(const Options&)`, for activations with
//     parameters (PReLU) or train/eval behaviour (RReLU), so state dicts keep their keys.
// Both have a `name` (the lowercase torch class name the web UI's hypernetworks use) and `Options`.

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/any.h>

#include <concepts>

#include "difftrain/core/concepts.hpp"

namespace difftrain::nn {

template <class A>
concept ElementwiseActivation = HasOptions<A> &&
    requires(const at::Tensor& x, const typename A::Options& o) {
  { A::forward(x, o) } -> std::same_as<at::Tensor>;
};

template <class A>
concept ModuleActivation = HasOptions<A> && requires(const typename A::Options& o) {
  { A::make_module(o) } -> std::same_as<torch::nn::AnyModule>;
};

template <class A>
concept Activation = NamedPolicy<A> && HasOptions<A> &&
    (ElementwiseActivation<A> || ModuleActivation<A>);

template <class A>
consteval bool diagnose_activation() {
  static_assert(diagnose_named_policy<A>());
  static_assert(
      HasOptions<A>,
      "difftrain: an activation needs a nested, default-constructible `struct Options {}`");
  static_assert(
      ElementwiseActivation<A> || ModuleActivation<A>,
      "difftrain: an activation needs either `static at::Tensor forward(const at::Tensor&, "
      "const Options&)` or `static torch::nn::AnyModule make_module(const Options&)`");
  return Activation<A>;
}

}  // namespace difftrain::nn
