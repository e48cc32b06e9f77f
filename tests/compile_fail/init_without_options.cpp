// expect: an init policy needs a nested, default-constructible `struct Options
#include <difftrain/nn/init/apply.hpp>

struct NoOptions {
  static constexpr std::string_view name = "NoOptions";
  static void apply(at::Tensor&, at::Tensor&, int) {}
};

int main() {
  torch::nn::Module m;
  difftrain::nn::apply_init<NoOptions>(m);
  return 0;
}
