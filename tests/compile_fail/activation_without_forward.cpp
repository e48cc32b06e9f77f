// expect: an activation needs either `static at::Tensor forward
// An activation with a name and options but no way to apply it.
#include <difftrain/nn/activation/module.hpp>

struct Broken {
  static constexpr std::string_view name = "broken";
  struct Options {};
};

int main() {
  auto m = difftrain::nn::make_activation_module<Broken>();
  return m.is_empty() ? 1 : 0;
}
