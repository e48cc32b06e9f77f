// expect: the model is a TORCH_MODULE holder
// The TORCH_MODULE holder where the module type belongs.
#include <difftrain/train/trainer.hpp>

struct NetImpl : torch::nn::Module {
  struct Batch {};
  at::Tensor loss(const Batch& /*b*/) { return at::zeros({}); }
};
TORCH_MODULE(Net);

int main() {
  Net net;
  difftrain::train::Trainer<Net> trainer(*net, {});
  return trainer.global_step() == 0 ? 0 : 1;
}
