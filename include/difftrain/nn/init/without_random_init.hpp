#pragma once
// Building a model whose every parameter is loaded right after, without drawing its random initial
// values: what accelerate's init_empty_weights gives diffusers' from_pretrained and
// from_single_file. LibTorch's layers draw theirs in their constructors (kaiming_uniform_ through
// Tensor::uniform_, a serial generator at a few nanoseconds per value: most of the time a model
// takes to load).
//
// Within a WithoutRandomInit scope, the in-place random fills (uniform_, normal_) on this thread
// leave the tensor as it was allocated. Everything else runs as usual: allocation, fill_/zero_
// (cheap, and what buffers computed at construction rely on), arithmetic. The scope must end
// with every parameter overwritten; difftrain's loaders are strict (a missing tensor is an error
// before any model is returned), so what they return never holds an undrawn value.
//
// How: LibTorch's dispatcher has a key for out-of-core deferred module initialisation
// (DispatchKey::DeferredInit, which torchdistx uses from Python). difftrain registers, once per
// process, a fall-through for every operator at that key and a do-nothing kernel for the two
// fills; the scope puts the key in this thread's included set. A process that also loads
// torchdistx cannot use both (the dispatcher refuses a second fallback for the key: the
// registration below is then skipped and the scope draws values as usual).

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <memory>
#include <optional>

namespace difftrain::nn::init {
namespace without_random_init_detail {

inline at::Tensor& leave_uniform(at::Tensor& self, double, double, std::optional<at::Generator>) {
  return self;
}
inline at::Tensor& leave_normal(at::Tensor& self, double, double, std::optional<at::Generator>) {
  return self;
}

/// Registers the kernels once; false if the key is already taken by another library.
inline bool registered() {
  static const bool ok = [] {
    try {
      static torch::Library fallback(torch::Library::IMPL, "_", c10::DispatchKey::DeferredInit,
                                     __FILE__, __LINE__);
      fallback.fallback(torch::CppFunction::makeFallthrough());
      static torch::Library fills(torch::Library::IMPL, "aten", c10::DispatchKey::DeferredInit,
                                  __FILE__, __LINE__);
      fills.impl("uniform_", TORCH_FN(leave_uniform));
      fills.impl("normal_", TORCH_FN(leave_normal));
      return true;
    } catch (const c10::Error&) {
      return false;
    }
  }();
  return ok;
}
}  // namespace without_random_init_detail

/// While alive, modules built on this thread skip their random initial values (see above).
class WithoutRandomInit {
 public:
  WithoutRandomInit() {
    if (without_random_init_detail::registered())
      guard_.emplace(c10::DispatchKeySet(c10::DispatchKey::DeferredInit));
  }
  WithoutRandomInit(const WithoutRandomInit&) = delete;
  WithoutRandomInit& operator=(const WithoutRandomInit&) = delete;

 private:
  std::optional<c10::impl::IncludeDispatchKeyGuard> guard_;
};

}  // namespace difftrain::nn::init
