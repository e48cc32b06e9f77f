// The core layer stands for the rest: run.cmake checks that every header was installed, and
// headers.self_contained that each compiles on its own.
#include <difftrain/core/core.hpp>

#include <ATen/ATen.h>

#include <iostream>

namespace {
struct Relu {
  static constexpr std::string_view name = "relu";
};
struct Tanh {
  static constexpr std::string_view name = "tanh";
};
}  // namespace

int main() {
  // Uses the core layer (a registry and a typed error) and LibTorch through the package's
  // usage requirements.
  constexpr difftrain::Registry<difftrain::type_list<Relu, Tanh>> activations{"activation"};
  try {
    activations.visit("tahn", [](auto) {});
    return 1;
  } catch (const difftrain::ConfigError& e) {
    if (std::string(e.what()).find("did you mean 'tanh'") == std::string::npos) return 2;
  }
  const at::Tensor t = at::ones({2, 3}).sum();
  if (t.item<float>() != 6.0F) return 3;
  std::cout << "consumer ok " << difftrain::version_string << '\n';
  return 0;
}
