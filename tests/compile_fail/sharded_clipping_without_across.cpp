// expect: under a sharding Config::Parallel, Config::Clipping needs .*AcrossRanks
// A clipping policy that sees only the gradients handed to it, under a policy that shards them
// over ranks: its norm would be this rank's share's, so the trainer refuses it.
#include <difftrain/train/trainer.hpp>

struct Net : torch::nn::Module {
  struct Batch {};
  at::Tensor loss(const Batch& /*b*/) { return at::zeros({}); }
};

struct LocalNorm {
  static constexpr std::string_view name = "local-norm";
  struct Options {};
  explicit LocalNorm(const Options& /*o*/) {}
  double apply(const std::vector<at::Tensor>& /*p*/, std::int64_t /*step*/) { return 0.0; }
};

struct Sharding : difftrain::train::SingleProcess {
  using SingleProcess::SingleProcess;
  [[nodiscard]] std::vector<difftrain::train::ParamGroup> groups_of_rank(
      const std::vector<difftrain::train::ParamGroup>& g, std::int64_t /*rank*/) const {
    return g;
  }
  [[nodiscard]] std::vector<at::Tensor> owned_params() const { return {}; }
  void sum_across(at::Tensor& /*t*/) {}
  void max_across(at::Tensor& /*t*/) {}
  void after_optimizer_step() {}
  void after_skipped_step() {}
  void zero_grad() {}
  [[nodiscard]] int stage() const { return 1; }
};

struct Config : difftrain::train::DefaultConfig {
  using Parallel = Sharding;
  using Clipping = LocalNorm;
};

int main() {
  Net net;
  difftrain::train::Trainer<Net, Config> trainer(net, {});
  return trainer.global_step() == 0 ? 0 : 1;
}
