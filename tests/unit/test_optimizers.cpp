// Adam and AdamW on torch's fused kernels against torch.optim's fused=True, and LibTorch's own
// against Python's for-loop, over the swept settings of tests/reference/ref_optimizers.py (kind,
// amsgrad, weight decay, betas/eps), two parameter groups, 200 steps; and a state saved by one
// kernel resumes under the other.
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>
#include <difftrain/io/safetensors.hpp>
#include <difftrain/train/optimizer.hpp>

#include <filesystem>
#include <sstream>

#include "golden.hpp"

namespace dt = difftrain;
namespace tr = difftrain::train;
namespace fs = std::filesystem;

namespace {

struct OptNetImpl : torch::nn::Module {
  OptNetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(6, 16));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({16})));
    fc2 = register_module("fc2", torch::nn::Linear(16, 4));
  }
  at::Tensor forward(const at::Tensor& x) { return fc2(torch::silu(norm(fc1(x)))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::LayerNorm norm{nullptr};
};

struct Case {
  nlohmann::json settings;
  std::string name;
};

std::vector<tr::ParamGroup> groups_of(OptNetImpl& net, const nlohmann::json& c) {
  tr::ParamGroup decay, plain;
  decay.label = "decay";
  plain.label = "plain";
  decay.lr = c["lr"].get<double>();
  decay.weight_decay = c["weight_decay"].get<double>();
  plain.lr = c["lr_no_decay"].get<double>();
  plain.weight_decay = 0.0;
  for (const auto& p : net.named_parameters()) {
    tr::ParamGroup& g = p.value().dim() >= 2 ? decay : plain;
    g.names.push_back(p.key());
    g.params.push_back(p.value());
  }
  return {decay, plain};
}

std::unique_ptr<torch::optim::Optimizer> make(OptNetImpl& net, const nlohmann::json& c,
                                              tr::AdamKernel kernel) {
  auto fill = [&](auto o) {
    o.lr = c["lr"].get<double>();
    o.beta1 = c["beta1"].get<double>();
    o.beta2 = c["beta2"].get<double>();
    o.eps = c["eps"].get<double>();
    o.weight_decay = c["weight_decay"].get<double>();
    o.amsgrad = c["amsgrad"].get<bool>();
    o.kernel = kernel;
    return o;
  };
  if (c["kind"] == "adamw") return tr::AdamW::make(groups_of(net, c), fill(tr::AdamW::Options{}));
  return tr::Adam::make(groups_of(net, c), fill(tr::Adam::Options{}));
}

const std::map<std::string, at::Tensor>& golden_tensors() {
  static const auto t =
      dt::io::load_safetensors(fs::path(DIFFTRAIN_GOLDEN_DIR) / "optimizers.safetensors", true)
          .tensors;
  return t;
}

std::shared_ptr<OptNetImpl> net_for(const std::string& name, c10::Device device = c10::kCPU) {
  auto net = std::make_shared<OptNetImpl>();
  const at::NoGradGuard no_grad;
  for (auto& p : net->named_parameters())
    p.value().copy_(golden_tensors().at(name + ".init." + p.key()));
  net->to(device);
  return net;
}

/// Runs steps [from, to] (1-based, as the Python loop) and checks the weights against
/// `<name>.<variant>.step<k>` at every checkpoint step; returns the largest difference.
double run_and_compare(OptNetImpl& net, torch::optim::Optimizer& opt, const std::string& name,
                       const std::string& variant, int from, int to) {
  const auto& t = golden_tensors();
  const at::Tensor x = t.at("x").to(net.fc1->weight.device()),
                   y = t.at("y").to(net.fc1->weight.device());
  double worst = 0;
  for (int step = from; step <= to; ++step) {
    opt.zero_grad(true);
    torch::mse_loss(net.forward(x[step % x.size(0)]), y[step % y.size(0)]).backward();
    opt.step();
    if (step % 50 != 0) continue;
    for (const auto& p : net.named_parameters()) {
      const at::Tensor& want =
          t.at(name + "." + variant + ".step" + std::to_string(step) + "." + p.key());
      worst = std::max(worst, (p.value().cpu() - want).abs().max().item<double>());
    }
  }
  return worst;
}

}  // namespace

TEST(Optimizers, FusedAndPerParameterKernelsMatchTorchOnEverySweptSetting) {
  const auto& g = dt::test::golden("optimizers.json");
  ASSERT_EQ(g["cases"].size(), 16U);
  for (const auto& c : g["cases"]) {
    const std::string name = c["name"];
    SCOPED_TRACE(name);
    // Torch's own variants differ by a few float32 ulps here; difftrain must match each within
    // 1e-6 (absolute, weights of order 1).
    EXPECT_LT(c["torch_variant_spread"].get<double>(), 1e-6);
    {
      auto net = net_for(name);
      auto opt = make(*net, c, tr::AdamKernel::fused);
      EXPECT_TRUE(dynamic_cast<tr::FusedAdamWOptimizer*>(opt.get()) != nullptr ||
                  dynamic_cast<tr::FusedAdamOptimizer*>(opt.get()) != nullptr);
      EXPECT_LT(run_and_compare(*net, *opt, name, "fused", 1, 200), 1e-6) << "fused";
    }
    {
      auto net = net_for(name);
      auto opt = make(*net, c, tr::AdamKernel::per_parameter);
      EXPECT_LT(run_and_compare(*net, *opt, name, "for_loop", 1, 200), 1e-6) << "per_parameter";
    }
  }
}

// A state saved halfway by one kernel loads into the other (LibTorch's archive either way), and
// the run ends where Python's does: the fused kernel's float32 step scalars are rebuilt from the
// loaded integer steps.
TEST(Optimizers, AStateSavedByOneKernelResumesUnderTheOther) {
  const auto& g = dt::test::golden("optimizers.json");
  for (const auto& c : g["cases"]) {
    if (c["amsgrad"].get<bool>() == (c["kind"] == "adamw")) continue;  // half the cases suffice
    const std::string name = c["name"];
    SCOPED_TRACE(name);
    for (const auto& [first, second] :
         {std::pair{tr::AdamKernel::fused, tr::AdamKernel::per_parameter},
          std::pair{tr::AdamKernel::per_parameter, tr::AdamKernel::fused},
          std::pair{tr::AdamKernel::fused, tr::AdamKernel::fused}}) {
      auto net = net_for(name);
      auto opt = make(*net, c, first);
      (void)run_and_compare(*net, *opt, name, "fused", 1, 100);
      torch::serialize::OutputArchive out;
      opt->save(out);
      std::ostringstream bytes;
      out.save_to(bytes);
      // A fresh optimizer of the other kernel over the same (trained) parameters.
      auto next = make(*net, c, second);
      torch::serialize::InputArchive in;
      const std::string b = bytes.str();
      in.load_from(b.data(), b.size());
      next->load(in);
      EXPECT_LT(run_and_compare(*net, *next, name,
                                second == tr::AdamKernel::fused ? "fused" : "for_loop", 101, 200),
                1e-6);
    }
  }
}

TEST(Optimizers, FusedKernelsRefuseIntegerParameters) {
  auto net = std::make_shared<OptNetImpl>();
  tr::ParamGroup grp;
  grp.label = "ints";
  grp.params.push_back(at::zeros({3}, at::kLong));
  grp.params.back().mutable_grad() = at::ones({3}, at::kLong);
  auto opt = tr::AdamW::make({grp}, {});
  try {
    opt->step();
    FAIL() << "an integer parameter was stepped";
  } catch (const dt::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("floating-point"), std::string::npos) << e.what();
  }
}

// On a GPU the fused kernels are CUDA's: the run ends within float32 rounding of Python's fused
// run on the CPU (TF32 off for the network's matmuls).
TEST(Optimizers, FusedKernelsOnTheGpuMatchTorchsCpuRun) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device on this machine";
  const bool tf32 = at::globalContext().allowTF32CuBLAS();
  at::globalContext().setAllowTF32CuBLAS(false);
  const auto& g = dt::test::golden("optimizers.json");
  for (const auto& c : g["cases"]) {
    const std::string name = c["name"];
    SCOPED_TRACE(name);
    auto net = net_for(name, c10::Device(c10::kCUDA, 0));
    auto opt = make(*net, c, tr::AdamKernel::fused);
    EXPECT_LT(run_and_compare(*net, *opt, name, "fused", 1, 200), 1e-5);
  }
  at::globalContext().setAllowTF32CuBLAS(tf32);
}
