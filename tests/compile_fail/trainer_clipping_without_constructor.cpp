// expect: Config::Clipping needs a constructor from `const Options&`
// A clipping policy with a name, Options and apply, but no way to build it from its Options: the
// message names exactly that, not the pieces it has.
#include <difftrain/train/trainer.hpp>

struct Net : torch::nn::Module {
  struct Batch {};
  at::Tensor loss(const Batch& /*b*/) { return at::zeros({}); }
};

struct Clip {
  static constexpr std::string_view name = "clip";
  struct Options {};
  Clip() = delete;
  double apply(const std::vector<at::Tensor>& /*p*/, std::int64_t /*step*/) { return 0.0; }
};

struct Config : difftrain::train::DefaultConfig {
  using Clipping = Clip;
};

int main() {
  Net net;
  difftrain::train::Trainer<Net, Config> trainer(net, {});
  return trainer.global_step() == 0 ? 0 : 1;
}
