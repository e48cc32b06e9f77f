// Adam and AdamW on torch's fused kernels against torch.optim's fused=True, on its multi-tensor
// kernels against foreach=True, and LibTorch's own against Python's for-loop; SGD's multi-tensor
// and per-parameter steps likewise; over the swept settings of tests/reference/ref_optimizers.py
// (kind, amsgrad, weight decay, betas/eps; momentum, dampening, Nesterov), two parameter groups,
// 200 steps; Lion against lion-pytorch. A state saved by one kernel resumes under another, and the
// gradient scaler hands its scale to the fused kernel with the same result as unscaling first.
// Gradient-norm clipping on the multi-tensor kernels against Python's clip_grad_norm_ over a sweep
// of norms and limits.
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>
#include <difftrain/io/safetensors.hpp>
#include <difftrain/train/clipping.hpp>
#include <difftrain/train/optimizer.hpp>
#include <difftrain/train/optimizer_archive.hpp>
#include <difftrain/train/precision.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
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

/// Which kernel a test asks for: one of Adam's, or one of SGD's for the SGD cases.
struct Kernel {
  tr::AdamKernel adam = tr::AdamKernel::fused;
  tr::SgdKernel sgd = tr::SgdKernel::foreach;
};

std::unique_ptr<torch::optim::Optimizer> make(OptNetImpl& net, const nlohmann::json& c,
                                              Kernel kernel) {
  auto number = [&](const char* key) { return c[key].get<double>(); };
  if (c["kind"] == "adafactor") {
    tr::Adafactor::Options o;
    o.lr = number("lr");
    o.eps1 = number("eps1");
    o.eps2 = number("eps2");
    o.clip_threshold = number("clip_threshold");
    o.decay_rate = number("decay_rate");
    if (!c["beta1"].is_null()) o.beta1 = number("beta1");
    o.weight_decay = number("weight_decay");
    o.scale_parameter = c["scale_parameter"].get<bool>();
    o.relative_step = c["relative_step"].get<bool>();
    o.warmup_init = c["warmup_init"].get<bool>();
    return tr::Adafactor::make(groups_of(net, c), o);
  }
  if (c["kind"] == "came") {
    tr::CAME::Options o;
    o.lr = number("lr");
    o.eps1 = number("eps1");
    o.eps2 = number("eps2");
    o.clip_threshold = number("clip_threshold");
    o.beta1 = number("beta1");
    o.beta2 = number("beta2");
    o.beta3 = number("beta3");
    o.weight_decay = number("weight_decay");
    return tr::CAME::make(groups_of(net, c), o);
  }
  if (c["kind"] == "adamw8bit") {
    tr::AdamW8bit::Options o;
    o.lr = number("lr");
    o.beta1 = number("beta1");
    o.beta2 = number("beta2");
    o.eps = number("eps");
    o.weight_decay = number("weight_decay");
    o.min_8bit_size = c["min_8bit_size"].get<std::int64_t>();
    return tr::AdamW8bit::make(groups_of(net, c), o);
  }
  if (c["kind"] == "adamw_schedulefree") {
    tr::AdamWScheduleFree::Options o;
    o.lr = number("lr");
    o.beta1 = number("beta1");
    o.beta2 = number("beta2");
    o.eps = number("eps");
    o.weight_decay = number("weight_decay");
    o.warmup_steps = c["warmup_steps"].get<std::int64_t>();
    o.r = number("r");
    o.weight_lr_power = number("weight_lr_power");
    return tr::AdamWScheduleFree::make(groups_of(net, c), o);
  }
  if (c["kind"] == "prodigy") {
    tr::Prodigy::Options o;
    o.lr = c["lr"].get<double>();
    o.beta1 = c["beta1"].get<double>();
    o.beta2 = c["beta2"].get<double>();
    o.eps = c["eps"].get<double>();
    o.weight_decay = c["weight_decay"].get<double>();
    o.decouple = c["decouple"].get<bool>();
    o.use_bias_correction = c["use_bias_correction"].get<bool>();
    o.safeguard_warmup = c["safeguard_warmup"].get<bool>();
    o.d0 = c["d0"].get<double>();
    o.d_coef = c["d_coef"].get<double>();
    if (!c["growth_rate"].is_null()) o.growth_rate = c["growth_rate"].get<double>();
    o.slice_p = c["slice_p"].get<std::int64_t>();
    return tr::Prodigy::make(groups_of(net, c), o);
  }
  if (c["kind"] == "lion") {
    tr::Lion::Options o;
    o.lr = c["lr"].get<double>();
    o.beta1 = c["beta1"].get<double>();
    o.beta2 = c["beta2"].get<double>();
    o.weight_decay = c["weight_decay"].get<double>();
    o.decoupled_weight_decay = c["decoupled_weight_decay"].get<bool>();
    return tr::Lion::make(groups_of(net, c), o);
  }
  if (c["kind"] == "sgd") {
    tr::SGD::Options o;
    o.lr = c["lr"].get<double>();
    o.momentum = c["momentum"].get<double>();
    o.dampening = c["dampening"].get<double>();
    o.nesterov = c["nesterov"].get<bool>();
    o.weight_decay = c["weight_decay"].get<double>();
    o.kernel = kernel.sgd;
    return tr::SGD::make(groups_of(net, c), o);
  }
  auto fill = [&](auto o) {
    o.lr = c["lr"].get<double>();
    o.beta1 = c["beta1"].get<double>();
    o.beta2 = c["beta2"].get<double>();
    o.eps = c["eps"].get<double>();
    o.weight_decay = c["weight_decay"].get<double>();
    o.amsgrad = c["amsgrad"].get<bool>();
    o.kernel = kernel.adam;
    return o;
  };
  if (c["kind"] == "adamw") return tr::AdamW::make(groups_of(net, c), fill(tr::AdamW::Options{}));
  return tr::Adam::make(groups_of(net, c), fill(tr::Adam::Options{}));
}
std::unique_ptr<torch::optim::Optimizer> make(OptNetImpl& net, const nlohmann::json& c,
                                              tr::AdamKernel kernel) {
  return make(net, c, Kernel{.adam = kernel});
}

/// The golden variant a kernel is compared with.
std::string variant_of(tr::AdamKernel k) {
  switch (k) {
    case tr::AdamKernel::fused:
      return "fused";
    case tr::AdamKernel::foreach:
      return "foreach";
    case tr::AdamKernel::per_parameter:
      return "for_loop";
  }
  return "";
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

TEST(Optimizers, EveryAdamKernelMatchesTorchOnEverySweptSetting) {
  const auto& g = dt::test::golden("optimizers.json");
  ASSERT_EQ(g["cases"].size(), 55U);
  int adam_cases = 0;
  for (const auto& c : g["cases"]) {
    if (c["kind"] != "adam" && c["kind"] != "adamw") continue;
    ++adam_cases;
    const std::string name = c["name"];
    SCOPED_TRACE(name);
    // Torch's own variants differ by a few float32 ulps here; difftrain must match each within
    // 1e-6 (absolute, weights of order 1).
    EXPECT_LT(c["torch_variant_spread"].get<double>(), 1e-6);
    for (const auto kernel :
         {tr::AdamKernel::fused, tr::AdamKernel::foreach, tr::AdamKernel::per_parameter}) {
      auto net = net_for(name);
      auto opt = make(*net, c, kernel);
      const bool is_fused = dynamic_cast<tr::FusedAdamWOptimizer*>(opt.get()) != nullptr ||
                            dynamic_cast<tr::FusedAdamOptimizer*>(opt.get()) != nullptr;
      const bool is_foreach = dynamic_cast<tr::ForeachAdamWOptimizer*>(opt.get()) != nullptr ||
                              dynamic_cast<tr::ForeachAdamOptimizer*>(opt.get()) != nullptr;
      EXPECT_EQ(is_fused, kernel == tr::AdamKernel::fused);
      EXPECT_EQ(is_foreach, kernel == tr::AdamKernel::foreach);
      EXPECT_LT(run_and_compare(*net, *opt, name, variant_of(kernel), 1, 200), 1e-6)
          << variant_of(kernel);
    }
  }
  EXPECT_EQ(adam_cases, 16);
}

TEST(Optimizers, BothSgdKernelsMatchTorchOnEverySweptSetting) {
  const auto& g = dt::test::golden("optimizers.json");
  int sgd_cases = 0;
  for (const auto& c : g["cases"]) {
    if (c["kind"] != "sgd") continue;
    ++sgd_cases;
    const std::string name = c["name"];
    SCOPED_TRACE(name);
    EXPECT_LT(c["torch_variant_spread"].get<double>(), 1e-6);
    for (const auto& [kernel, variant] : {std::pair{tr::SgdKernel::foreach, "foreach"},
                                          std::pair{tr::SgdKernel::per_parameter, "for_loop"}}) {
      auto net = net_for(name);
      auto opt = make(*net, c, Kernel{.sgd = kernel});
      EXPECT_EQ(dynamic_cast<tr::ForeachSGDOptimizer*>(opt.get()) != nullptr,
                kernel == tr::SgdKernel::foreach);
      EXPECT_LT(run_and_compare(*net, *opt, name, variant, 1, 200), 1e-6) << variant;
    }
  }
  EXPECT_EQ(sgd_cases, 8);
  // The default picks by device, as torch does; on these CPU tensors, LibTorch's loop, with the
  // same numbers.
  EXPECT_EQ(tr::SGD::Options{}.kernel, tr::SgdKernel::automatic);
  for (const auto& c : g["cases"]) {
    if (c["kind"] != "sgd") continue;
    const std::string name = c["name"];
    auto net = net_for(name);
    auto opt = make(*net, c, Kernel{.sgd = tr::SgdKernel::automatic});
    EXPECT_LT(run_and_compare(*net, *opt, name, "for_loop", 1, 200), 1e-6) << name;
  }
}

// A state saved halfway by one kernel loads into another (LibTorch's archive every way), and
// the run ends where Python's does: the fused kernel's float32 step scalars are rebuilt from the
// loaded integer steps; SGD's momentum buffers carry over.
TEST(Optimizers, AStateSavedByOneKernelResumesUnderAnother) {
  const auto& g = dt::test::golden("optimizers.json");
  auto round_trip = [](torch::optim::Optimizer& from, torch::optim::Optimizer& to) {
    torch::serialize::OutputArchive out;
    from.save(out);
    std::ostringstream bytes;
    out.save_to(bytes);
    torch::serialize::InputArchive in;
    const std::string b = bytes.str();
    in.load_from(b.data(), b.size());
    to.load(in);
  };
  using K = tr::AdamKernel;
  for (const auto& c : g["cases"]) {
    const std::string name = c["name"];
    SCOPED_TRACE(name);
    if (c["kind"] != "adam" && c["kind"] != "adamw" && c["kind"] != "sgd")
      continue;  // tested with their packages
    if (c["kind"] == "sgd") {
      if (c["momentum"].get<double>() == 0.0) continue;  // nothing to carry
      for (const auto& [first, second] :
           {std::pair{tr::SgdKernel::foreach, tr::SgdKernel::per_parameter},
            std::pair{tr::SgdKernel::per_parameter, tr::SgdKernel::foreach}}) {
        auto net = net_for(name);
        auto opt = make(*net, c, Kernel{.sgd = first});
        (void)run_and_compare(*net, *opt, name, "foreach", 1, 100);
        auto next = make(*net, c, Kernel{.sgd = second});
        round_trip(*opt, *next);
        EXPECT_LT(run_and_compare(*net, *next, name, "foreach", 101, 200), 1e-6);
      }
      continue;
    }
    if (c["amsgrad"].get<bool>() == (c["kind"] == "adamw")) continue;  // half the cases suffice
    for (const auto& [first, second] :
         {std::pair{K::fused, K::per_parameter}, std::pair{K::per_parameter, K::fused},
          std::pair{K::fused, K::fused}, std::pair{K::foreach, K::fused},
          std::pair{K::fused, K::foreach}, std::pair{K::per_parameter, K::foreach}}) {
      auto net = net_for(name);
      auto opt = make(*net, c, first);
      (void)run_and_compare(*net, *opt, name, "fused", 1, 100);
      // A fresh optimizer of the other kernel over the same (trained) parameters.
      auto next = make(*net, c, second);
      round_trip(*opt, *next);
      EXPECT_LT(run_and_compare(*net, *next, name, variant_of(second), 101, 200), 1e-6);
    }
  }
}

// Lion against lion-pytorch (betas, weight decay, decoupled) and Prodigy against prodigyopt (its
// defaults, bias correction, safeguarded warm-up, coupled and decoupled decay, d_coef with a
// growth limit, β₁ = 0, a sliced estimate), two groups, 200 steps; saved halfway through
// difftrain's checkpoint archive and loaded into a fresh optimizer, the run ends where the
// uninterrupted one does (Prodigy's estimate of d travels in the groups' options).
void check_package_optimizer(const std::string& kind, int expected_cases) {
  const auto& g = dt::test::golden("optimizers.json");
  int cases = 0;
  for (const auto& c : g["cases"]) {
    if (c["kind"] != kind) continue;
    ++cases;
    const std::string name = c["name"];
    SCOPED_TRACE(name);
    auto net = net_for(name);
    auto opt = make(*net, c, Kernel{});
    EXPECT_LT(run_and_compare(*net, *opt, name, "for_loop", 1, 200), 1e-6);
    auto half = net_for(name);
    auto first = make(*half, c, Kernel{});
    (void)run_and_compare(*half, *first, name, "for_loop", 1, 100);
    if (kind == "lion") {  // one moment per parameter
      std::size_t moments = 0;
      for (const auto& [key, state] : first->state()) {
        (void)key;
        moments += static_cast<std::size_t>(
            static_cast<const tr::LionParamState&>(*state).exp_avg().numel());
      }
      std::size_t params = 0;
      for (const auto& p : half->parameters()) params += static_cast<std::size_t>(p.numel());
      EXPECT_EQ(moments, params);
    }
    const std::string bytes = tr::optimizer_state_bytes(*first);
    torch::serialize::InputArchive in;
    in.load_from(bytes.data(), bytes.size());
    auto second = make(*half, c, Kernel{});
    second->load(in);
    EXPECT_LT(run_and_compare(*half, *second, name, "for_loop", 101, 200), 1e-6);
    if (kind == "adamw_schedulefree") {  // the evaluation weights, and back
      std::map<std::string, at::Tensor> trained;
      for (const auto& p : half->named_parameters()) trained[p.key()] = p.value().clone();
      {
        const tr::EvaluationWeights eval(*second);
        for (const auto& p : half->named_parameters())
          EXPECT_LT((p.value() - golden_tensors().at(name + ".for_loop.eval200." + p.key()))
                        .abs()
                        .max()
                        .item<double>(),
                    1e-6)
              << p.key();
        EXPECT_THROW(second->step(), dt::ConfigError);  // no step on the evaluation weights
      }
      for (const auto& p : half->named_parameters())
        EXPECT_LT((p.value() - trained[p.key()]).abs().max().item<double>(), 1e-6) << p.key();
    }
  }
  EXPECT_EQ(cases, expected_cases);
}

TEST(Optimizers, AdafactorMatchesTransformersOnEverySweptSetting) {
  check_package_optimizer("adafactor", 6);
  auto net = std::make_shared<OptNetImpl>();
  tr::ParamGroup all;
  for (const auto& p : net->parameters()) all.params.push_back(p);
  EXPECT_THROW((void)tr::Adafactor::make({all}, {.relative_step = false, .warmup_init = true}),
               dt::ConfigError);
  EXPECT_THROW((void)tr::Adafactor::make({all}, {.decay_rate = 0.5}), dt::ConfigError);
  // The factored second moment: n + m values for an n×m matrix.
  auto opt = tr::Adafactor::make({all}, {});
  torch::mse_loss(net->forward(at::randn({3, 6})), at::randn({3, 4})).backward();
  opt->step();
  const auto& st = static_cast<const tr::FactoredParamState&>(
      *opt->state().at(net->fc1->weight.unsafeGetTensorImpl()));
  EXPECT_EQ(st.exp_avg_sq_row().numel() + st.exp_avg_sq_col().numel(), 16 + 6);
  EXPECT_FALSE(st.exp_avg_sq().defined());
}

TEST(Optimizers, CameMatchesCamePytorchOnEverySweptSetting) {
  check_package_optimizer("came", 3);
  auto net = std::make_shared<OptNetImpl>();
  tr::ParamGroup all;
  for (const auto& p : net->parameters()) all.params.push_back(p);
  EXPECT_THROW((void)tr::CAME::make({all}, {.lr = 0.0}), dt::ConfigError);
  EXPECT_THROW((void)tr::CAME::make({all}, {.beta3 = 1.5}), dt::ConfigError);
}

TEST(Optimizers, ScheduleFreeAdamWMatchesSchedulefreeOnEverySweptSetting) {
  check_package_optimizer("adamw_schedulefree", 5);
  auto net = std::make_shared<OptNetImpl>();
  tr::ParamGroup all;
  for (const auto& p : net->parameters()) all.params.push_back(p);
  EXPECT_THROW((void)tr::AdamWScheduleFree::make({all}, {.beta1 = 0.0}), dt::ConfigError);
  // Another optimizer's parameters stay as they are under EvaluationWeights.
  auto adam = tr::AdamW::make({all}, {});
  const at::Tensor before = net->fc1->weight.clone();
  {
    const tr::EvaluationWeights eval(*adam);
    EXPECT_TRUE(net->fc1->weight.equal(before));
  }
}

// bitsandbytes' dynamic codes, and its CPU block-wise encoding and decoding, value for value:
// whole and partial blocks, blocks of zeros, magnitudes over many decades, both codes.
TEST(Optimizers, EightBitCodesEqualBitsandbytes) {
  const auto& t = golden_tensors();
  for (const bool is_signed : {true, false}) {
    const std::string tag = is_signed ? "signed" : "unsigned";
    const auto& code = is_signed ? tr::quantize8::signed_code() : tr::quantize8::unsigned_code();
    EXPECT_TRUE(code.map.equal(t.at("q8." + tag + ".map"))) << tag;
    for (const int n : {1, 255, 256, 1000, 4096, 70001}) {
      SCOPED_TRACE(tag + " " + std::to_string(n));
      const std::string key = "q8." + tag + "." + std::to_string(n);
      const at::Tensor x = t.at(key + ".x");
      at::Tensor codes = at::zeros({n}, at::kByte);
      at::Tensor absmax = at::zeros({(n + 255) / 256}, at::kFloat);
      tr::quantize8::encode(x, code, codes, absmax);
      EXPECT_TRUE(absmax.equal(t.at(key + ".absmax")));
      const at::Tensor want = t.at(key + ".codes");
      EXPECT_EQ(codes.ne(want).sum().item<std::int64_t>(), 0);
      EXPECT_TRUE(tr::quantize8::decode(codes, absmax, code).equal(t.at(key + ".decoded")));
    }
  }
}

TEST(Optimizers, AdamW8bitMatchesBitsandbytesOnEverySweptSetting) {
  check_package_optimizer("adamw8bit", 3);
  // State bytes as bitsandbytes keeps them: 1 B per value per moment plus 4 B per block of 256
  // per moment for a quantized tensor; float32 moments below min_8bit_size.
  auto big = torch::nn::Linear(64, 96);
  tr::ParamGroup all;
  for (const auto& p : big->parameters()) all.params.push_back(p);
  auto opt = tr::AdamW8bit::make({all}, {});
  big->forward(at::randn({5, 64})).sum().backward();
  opt->step();
  const auto& w = static_cast<const tr::AdamW8bitParamState&>(
      *opt->state().at(big->weight.unsafeGetTensorImpl()));
  EXPECT_TRUE(w.quantized());
  EXPECT_EQ(w.nbytes(), 2 * 64 * 96 + 2 * 4 * 24);
  const auto& b = static_cast<const tr::AdamW8bitParamState&>(
      *opt->state().at(big->bias.unsafeGetTensorImpl()));
  EXPECT_FALSE(b.quantized());
  EXPECT_EQ(b.nbytes(), 2 * 4 * 96);
  EXPECT_THROW((void)tr::AdamW8bit::make({all}, {.beta2 = 1.0}), dt::ConfigError);
}

TEST(Optimizers, LionMatchesLionPytorchOnEverySweptSetting) {
  check_package_optimizer("lion", 6);
  auto net = std::make_shared<OptNetImpl>();
  tr::ParamGroup all;
  for (const auto& p : net->parameters()) all.params.push_back(p);
  EXPECT_THROW((void)tr::Lion::make({all}, {.lr = 0.0}), dt::ConfigError);
  EXPECT_THROW((void)tr::Lion::make({all}, {.beta1 = 1.5}), dt::ConfigError);
}

TEST(Optimizers, ProdigyMatchesProdigyoptOnEverySweptSetting) {
  check_package_optimizer("prodigy", 8);
  auto net = std::make_shared<OptNetImpl>();
  tr::ParamGroup all;
  for (const auto& p : net->parameters()) all.params.push_back(p);
  tr::Prodigy::Options bad;
  bad.d0 = 0.0;
  EXPECT_THROW((void)tr::Prodigy::make({all}, bad), dt::ConfigError);
  bad = {};
  bad.growth_rate = 0.5;
  EXPECT_THROW((void)tr::Prodigy::make({all}, bad), dt::ConfigError);
  // Groups at different rates are refused at the step, as prodigyopt refuses them.
  tr::ParamGroup a, b;
  a.params = {net->fc1->weight};
  b.params = {net->fc2->weight};
  b.lr = 0.5;
  auto opt = tr::Prodigy::make({a, b}, tr::Prodigy::Options{});
  torch::mse_loss(net->forward(at::randn({3, 6})), at::randn({3, 4})).backward();
  EXPECT_THROW(opt->step(), dt::ConfigError);
}

// torch.amp.GradScaler hands its scale to a fused optimizer instead of unscaling the gradients
// first; the weights after a run with loss scaling, overflows included, are the same either way
// (the scale is a power of two, so dividing in the kernel and multiplying by the inverse before
// agree), and an overflow leaves weights, moments and step counts untouched.
TEST(Optimizers, GradScalerHandsItsScaleToTheFusedKernel) {
  const auto& g = dt::test::golden("optimizers.json");
  const auto& t = golden_tensors();
  for (const auto& c : g["cases"]) {
    if (c["kind"] != "adam" && c["kind"] != "adamw") continue;
    if (c["weight_decay"].get<double>() == 0.0) continue;
    const std::string name = c["name"];
    SCOPED_TRACE(name);
    std::vector<std::vector<at::Tensor>> finals;
    std::vector<std::int64_t> skips;
    for (const bool unscale_first : {true, false}) {
      auto net = net_for(name);
      auto opt = make(*net, c, tr::AdamKernel::fused);
      ASSERT_NE(dynamic_cast<tr::ScaledStepOptimizer*>(opt.get()), nullptr);
      tr::GradScaler scaler(tr::GradScaler::Options{
          .init_scale = 1024.0, .growth_interval = 7, .hand_scale = tr::HandScale::always});
      std::int64_t skipped = 0;
      for (int step = 1; step <= 60; ++step) {
        opt->zero_grad(true);
        at::Tensor loss = torch::mse_loss(net->forward(t.at("x")[step % 7]), t.at("y")[step % 7]);
        // Every 13th step overflows: the step must be skipped whichever path runs.
        if (step % 13 == 0) loss = loss * std::numeric_limits<float>::infinity();
        scaler.scale(loss).backward();
        if (unscale_first) scaler.unscale_(*opt);
        std::vector<at::Tensor> before;
        for (const auto& p : net->parameters()) before.push_back(p.detach().clone());
        const bool stepped = scaler.step(*opt);
        scaler.update();
        EXPECT_EQ(stepped, step % 13 != 0) << "step " << step;
        // A skipped handed step leaves the gradients scaled and says so; one that ran leaves
        // them unscaled (the kernel writes them back).
        EXPECT_EQ(scaler.scale_left_in_grads().has_value(), !unscale_first && !stepped);
        if (!stepped) {
          ++skipped;
          std::size_t i = 0;
          for (const auto& p : net->parameters()) EXPECT_TRUE(at::equal(p, before[i++]));
        }
      }
      skips.push_back(skipped);
      std::vector<at::Tensor> w;
      for (const auto& p : net->parameters()) w.push_back(p.detach().clone());
      finals.push_back(w);
      // The integer steps LibTorch keeps count the steps taken.
      for (const auto& p : net->parameters()) {
        const auto& st = opt->state().at(p.unsafeGetTensorImpl());
        const std::int64_t steps = c["kind"] == "adamw"
                                       ? static_cast<torch::optim::AdamWParamState&>(*st).step()
                                       : static_cast<torch::optim::AdamParamState&>(*st).step();
        EXPECT_EQ(steps, 60 - skipped);
      }
    }
    EXPECT_EQ(skips[0], 4);
    EXPECT_EQ(skips[1], 4);
    for (std::size_t i = 0; i < finals[0].size(); ++i)
      EXPECT_TRUE(at::equal(finals[0][i], finals[1][i])) << "parameter " << i;
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

// torch.nn.utils.clip_grad_norm_ as Python runs it, over ref_clipping.py's sweep: five norm
// types, a limit that clips and one that does not, gradients of one dtype and of two (grouped
// kind by kind), a parameter without gradient. The returned norm and every clipped gradient
// match Python's; ClipByNorm and ScheduledClip (norm mode) give the same; LibTorch's per-tensor
// clip_grad_norm_ agrees to rounding.
TEST(Optimizers, MultiTensorClippingMatchesPythonOnEverySweptSetting) {
  const auto& meta = dt::test::golden("clipping.json");
  static const auto t =
      dt::io::load_safetensors(fs::path(DIFFTRAIN_GOLDEN_DIR) / "clipping.safetensors", true)
          .tensors;
  const auto params_of = [&](const std::string& layout) {
    std::vector<at::Tensor> params;
    for (std::size_t i = 0; i < meta["params"].get<std::size_t>(); ++i) {
      const auto it = t.find(layout + ".grad" + std::to_string(i));
      if (it == t.end()) {
        params.push_back(at::zeros({2}));  // no gradient
        continue;
      }
      at::Tensor p = at::zeros_like(it->second);
      p.mutable_grad() = it->second.clone();
      params.push_back(p);
    }
    return params;
  };
  ASSERT_EQ(meta["cases"].size(), 20U);
  for (const auto& c : meta["cases"]) {
    const std::string name = c["name"];
    const std::string layout = c["layout"];
    const double norm_type = c["norm_type"].is_string() ? std::numeric_limits<double>::infinity()
                                                        : c["norm_type"].get<double>();
    const double max_norm = c["max_norm"];
    const double want = t.at(name + ".total").item<double>();
    const auto check = [&](const std::vector<at::Tensor>& params, double total, double tol,
                           const std::string& how) {
      EXPECT_LE(std::abs(total - want), tol * std::max(1.0, std::abs(want))) << name << " " << how;
      for (std::size_t i = 0; i < params.size(); ++i) {
        const auto it = t.find(name + ".grad" + std::to_string(i));
        if (it == t.end()) {
          EXPECT_FALSE(params[i].grad().defined()) << name << " " << how << " param " << i;
          continue;
        }
        ASSERT_EQ(params[i].grad().scalar_type(), it->second.scalar_type()) << name;
        EXPECT_LE(dt::test::max_rel_error(params[i].grad(), it->second, 1e-3), tol)
            << name << " " << how << " param " << i;
      }
    };
    auto multi = params_of(layout);
    check(multi, tr::clip_grad_norm_multi_tensor(multi, max_norm, norm_type), 1e-6, "multi");
    auto policy = params_of(layout);
    tr::ClipByNorm by_norm({.max_norm = max_norm, .norm_type = norm_type});
    check(policy, by_norm.apply(policy, 0), 1e-6, "ClipByNorm");
    if (norm_type == 2.0) {
      auto scheduled = params_of(layout);
      tr::ScheduledClip sched(
          {.mode = tr::ScheduledClip::Mode::norm, .limits = std::to_string(max_norm)});
      check(scheduled, sched.apply(scheduled, 0), 1e-6, "ScheduledClip");
    }
    // Sharded over two ranks (each holds every other parameter's gradient): each clips its
    // share with the norm combined across ranks, and together they equal one process's clip.
    {
      auto all = params_of(layout);
      const bool inf = std::isinf(norm_type);
      const auto part_of = [&](int shard) {  // what rank `shard` adds to the combined norm
        double part = 0.0;
        for (std::size_t i = 0; i < all.size(); ++i) {
          if (static_cast<int>(i % 2) != shard || !all[i].grad().defined()) continue;
          const double n =
              at::linalg_vector_norm(all[i].grad().to(at::kDouble), norm_type).item<double>();
          const double nonzero = n != 0.0 ? 1.0 : 0.0;
          part = inf ? std::max(part, n)
                     : part + (norm_type == 0.0 ? nonzero : std::pow(n, norm_type));
        }
        return part;
      };
      const double parts[2] = {part_of(0), part_of(1)};
      double totals[2] = {0.0, 0.0};
      for (int shard = 0; shard < 2; ++shard) {
        std::vector<at::Tensor> mine;
        for (std::size_t i = 0; i < all.size(); ++i)
          if (static_cast<int>(i % 2) == shard) mine.push_back(all[i]);
        const double other = parts[1 - shard];
        tr::AcrossRanks across{[&](at::Tensor& x) { x += other; },
                               [&](at::Tensor& x) { x.clamp_min_(other); }};
        totals[shard] =
            tr::ClipByNorm({.max_norm = max_norm, .norm_type = norm_type}).apply(mine, 0, across);
      }
      EXPECT_NEAR(totals[0], totals[1], 1e-6 * std::max(1.0, totals[0])) << name;
      check(all, totals[0], 1e-6, "sharded");
    }
    // LibTorch's own (a norm and a multiply per tensor) agrees to rounding where it is defined
    // like Python's (it counts parameters for the 0-norm; that order is not swept).
    auto libtorch = params_of(layout);
    check(libtorch, torch::nn::utils::clip_grad_norm_(libtorch, max_norm, norm_type), 1e-5,
          "LibTorch");
  }
  // Nothing to clip: no gradient anywhere is a zero norm and no error, as in Python.
  std::vector<at::Tensor> none{at::zeros({3})};
  EXPECT_EQ(tr::clip_grad_norm_multi_tensor(none, 1.0), 0.0);
  // ... also over ranks: a rank without gradients still takes part in combining the norm.
  int calls = 0;
  tr::AcrossRanks across{[&](at::Tensor& x) {
                           ++calls;
                           x += 9.0;
                         },
                         [&](at::Tensor& /*x*/) { ++calls; }};
  EXPECT_DOUBLE_EQ(tr::clip_grad_norm_multi_tensor(none, 1.0, 2.0, across), 3.0);
  EXPECT_EQ(calls, 1);
}

// Under sharded training each rank checks only its gradients for inf/NaN: the combined flag
// makes every rank skip the step when any rank saw an overflow.
TEST(Optimizers, GradScalerSkipsWhenAnotherRankOverflowed) {
  for (const bool elsewhere : {false, true}) {
    at::Tensor w = at::ones({3}).requires_grad_(true);
    auto opt = std::make_unique<torch::optim::SGD>(std::vector<at::Tensor>{w},
                                                   torch::optim::SGDOptions(0.1));
    tr::GradScaler scaler({.enabled = true});
    scaler.set_found_inf_across([&](at::Tensor& flag) { flag += elsewhere ? 1.0 : 0.0; });
    scaler.scale(w.sum()).backward();
    EXPECT_EQ(scaler.step(*opt), !elsewhere) << elsewhere;
    scaler.update();
    const double moved = (at::ones({3}) - w.detach()).abs().max().item<double>();
    EXPECT_EQ(moved > 0.0, !elsewhere) << elsewhere;
    EXPECT_EQ(scaler.current_scale(), elsewhere ? 32768.0 : 65536.0) << elsewhere;
  }
}

// On a GPU the fused kernels are CUDA's: the run ends within float32 rounding of Python's fused
// run on the CPU (TF32 off for the network's matmuls).
TEST(Optimizers, FusedAndMultiTensorKernelsOnTheGpuMatchTorchsCpuRun) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device on this machine";
  const bool tf32 = at::globalContext().allowTF32CuBLAS();
  at::globalContext().setAllowTF32CuBLAS(false);
  const auto& g = dt::test::golden("optimizers.json");
  for (const auto& c : g["cases"]) {
    const std::string name = c["name"];
    SCOPED_TRACE(name);
    if (c["kind"] != "adam" && c["kind"] != "adamw" && c["kind"] != "sgd")
      continue;  // the CPU tests cover them
    if (c["kind"] == "sgd") {
      // Momentum SGD with weight decay (lr 0.05) amplifies rounding: torch's own float32 run on
      // the CPU leaves its float64 run by at most 4.5e-7 at step 50 and 3.5e-6 at step 100, but by
      // 4.3e-3 at step 200. A GPU rounds the network's sums differently, so the comparison stops
      // at step 100, where float32 is still the tolerance.
      for (const auto kernel : {tr::SgdKernel::foreach, tr::SgdKernel::automatic}) {
        auto net = net_for(name, c10::Device(c10::kCUDA, 0));
        auto opt = make(*net, c, Kernel{.sgd = kernel});
        EXPECT_LT(run_and_compare(*net, *opt, name, "foreach", 1, 100), 1e-5);
      }
      continue;
    }
    for (const auto kernel : {tr::AdamKernel::fused, tr::AdamKernel::foreach}) {
      auto net = net_for(name, c10::Device(c10::kCUDA, 0));
      auto opt = make(*net, c, kernel);
      EXPECT_LT(run_and_compare(*net, *opt, name, variant_of(kernel), 1, 200), 1e-5);
    }
  }
  at::globalContext().setAllowTF32CuBLAS(tf32);
}
