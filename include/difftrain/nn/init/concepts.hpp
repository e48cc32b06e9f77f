#pragma once
// The weight-init family: `static void apply(at::Tensor& weight, at::Tensor& bias, const Options&)`
// fills a layer's weight and bias in place (without recording autograd history).

#include <ATen/core/Tensor.h>

#include "difftrain/core/concepts.hpp"

namespace difftrain::nn {

template <class I>
concept InitFillsWeightAndBias = HasOptions<I> &&
    requires(at::Tensor& w, at::Tensor& b, const typename I::Options& o) {
  I::apply(w, b, o);
};

template <class I>
concept Init = NamedPolicy<I> && HasOptions<I> && InitFillsWeightAndBias<I>;

template <class I>
consteval bool diagnose_init() {
  static_assert(diagnose_named_policy<I>());
  static_assert(
      HasOptions<I>,
      "difftrain: an init policy needs a nested, default-constructible `struct Options {}`");
  static_assert(
      InitFillsWeightAndBias<I>,
      "difftrain: an init policy needs `static void apply(at::Tensor& weight, at::Tensor& "
      "bias, const Options&)`");
  return Init<I>;
}

}  // namespace difftrain::nn
