#include <difftrain/nn/nn.hpp>

#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/utils.h>

#include "golden.hpp"

namespace dt = difftrain;
namespace tst = difftrain::test;

namespace {

// Forward and backward of one activation through its module, as the reference did.
struct Result {
  at::Tensor out, grad;
};

Result run_activation(std::string_view name, const at::Tensor& x, const at::Tensor& w) {
  torch::nn::AnyModule module = name == "threshold"
                                    ? dt::nn::make_activation_module<dt::nn::act::Threshold>(
                                          {.threshold = 0.5, .value = -1.0})
                                    : dt::nn::make_activation(name);
  module.ptr()->to(at::kDouble);
  module.ptr()->eval();
  const at::Tensor xi = x.clone().requires_grad_(true);
  const at::Tensor y = module.forward(xi);
  const at::Tensor wi = (name == "glu" || name == "geglu") ? w.narrow(-1, 0, y.size(-1)) : w;
  (y * wi).sum().backward();
  return {y.detach(), xi.grad()};
}

}  // namespace

TEST(Activation, EveryReferenceNameIsRegistered) {
  const auto& acts = tst::golden("nn.json")["activations"];
  std::size_t checked = 0;
  for (const auto& [name, _] : acts.items()) {
    EXPECT_TRUE(dt::nn::activations.contains(name)) << name;
    ++checked;
  }
  EXPECT_EQ(checked, dt::nn::activations.names.size());
}

TEST(Activation, ForwardAndBackwardMatchTorchNn) {
  const auto& g = tst::golden("nn.json");
  const at::Tensor x = tst::tensor_from(g["x"], tst::shape_from(g["x_shape"]));
  const at::Tensor w = tst::tensor_from(g["w"], tst::shape_from(g["x_shape"]));
  for (const auto& [name, ref] : g["activations"].items()) {
    SCOPED_TRACE(name);
    const Result r = run_activation(name, x, w);
    EXPECT_EQ(r.out.sizes().vec(), tst::shape_from(ref["out_shape"]));
    EXPECT_TRUE(at::allclose(r.out.flatten(), tst::tensor_from(ref["out"]), 1e-12, 1e-14));
    EXPECT_TRUE(at::allclose(r.grad.flatten(), tst::tensor_from(ref["grad"]), 1e-12, 1e-14));
  }
}

TEST(Activation, SwishIsHardswishForFileCompatibilityAndSiluIsSeparate) {
  const at::Tensor x = at::linspace(-4, 4, 17, at::kDouble);
  EXPECT_TRUE(at::equal(dt::nn::act::Swish::forward(x, {}), at::hardswish(x)));
  EXPECT_TRUE(at::equal(dt::nn::act::SiLU::forward(x, {}), at::silu(x)));
  EXPECT_FALSE(at::allclose(dt::nn::act::Swish::forward(x, {}), dt::nn::act::SiLU::forward(x, {})));
}

TEST(Activation, PolicyOptionsReachTheCall) {
  const at::Tensor x = at::linspace(-4, 4, 17, at::kDouble);
  EXPECT_TRUE(at::equal(dt::nn::act::LeakyReLU::forward(x, {.negative_slope = 0.2}),
                        at::leaky_relu(x, 0.2)));
  EXPECT_TRUE(at::equal(dt::nn::act::GELU::forward(x, {.approximate = "tanh"}),
                        dt::nn::act::GELUTanh::forward(x, {})));
  EXPECT_TRUE(at::equal(dt::nn::act::Softmax::forward(x.reshape({17, 1}), {.dim = 0}),
                        at::softmax(x.reshape({17, 1}), 0)));
}

TEST(Activation, PReLUKeepsItsWeightInTheStateDict) {
  torch::nn::Sequential seq;
  seq->push_back(torch::nn::Linear(4, 4));
  seq->push_back(dt::nn::make_activation("prelu"));
  const auto params = seq->named_parameters();
  ASSERT_TRUE(params.contains("1.weight"));
  EXPECT_DOUBLE_EQ(params["1.weight"].item<double>(), 0.25);
}

TEST(Activation, BadInputIsTyped) {
  EXPECT_THROW(dt::nn::make_activation("swishh"), dt::ConfigError);
  EXPECT_THROW(dt::nn::act::Softmax2d::forward(at::ones({3, 4}), {}), dt::ShapeError);
  EXPECT_THROW(dt::nn::act::GEGLU::forward(at::ones({3, 5}), {}), dt::ShapeError);
  try {
    (void)dt::nn::make_activation("Relu", "hypernetwork activation_func");
    FAIL();
  } catch (const dt::ConfigError& e) {
    EXPECT_EQ(e.where(), "hypernetwork activation_func");
    EXPECT_NE(std::string(e.what()).find("did you mean 'relu'"), std::string::npos);
  }
}

TEST(Init, SeededPoliciesMatchTheReferenceDrawForDraw) {
  const auto& inits = tst::golden("nn.json")["inits"];
  for (const auto& [key, ref] : inits.items()) {
    SCOPED_TRACE(key);
    const auto slash = key.find('/');
    const std::string name = key.substr(0, slash);
    const std::string activation = key.substr(slash + 1);
    torch::manual_seed(1234);
    at::Tensor w = at::empty({16, 8});
    at::Tensor b = at::empty({16});
    dt::nn::inits.visit(name, [&](auto tag) {
      using I = typename decltype(tag)::type;
      typename I::Options o{};
      if constexpr (requires { o.nonlinearity; })
        o.nonlinearity = dt::nn::init::kaiming_nonlinearity_for(activation);
      I::apply(w, b, o);
    });
    EXPECT_TRUE(at::equal(w.to(at::kDouble).flatten(), tst::tensor_from(ref["weight"])));
    EXPECT_TRUE(at::equal(b.to(at::kDouble), tst::tensor_from(ref["bias"])));
  }
}

TEST(Init, WholeModuleFollowsTheReferenceRules) {
  torch::manual_seed(7);
  torch::nn::Sequential seq(torch::nn::Linear(4, 8), torch::nn::ReLU(),
                            torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})),
                            torch::nn::Linear(8, 4));
  dt::nn::apply_init("XavierNormal", *seq, "relu");
  const auto& ref = tst::golden("nn.json")["module_xavier_normal"];
  const auto params = seq->named_parameters();
  ASSERT_EQ(params.size(), ref.size());
  for (const auto& [key, values] : ref.items()) {
    SCOPED_TRACE(key);
    ASSERT_TRUE(params.contains(key));
    EXPECT_TRUE(
        at::equal(params[key].detach().to(at::kDouble).flatten(), tst::tensor_from(values)));
  }
  EXPECT_THROW(dt::nn::apply_init("Xavier", *seq), dt::ConfigError);
}

TEST(Init, KaimingNonlinearityFollowsTheActivation) {
  EXPECT_EQ(dt::nn::init::kaiming_nonlinearity_for("leakyrelu").index(),
            torch::nn::init::NonlinearityType(torch::kLeakyReLU).index());
  EXPECT_EQ(dt::nn::init::kaiming_nonlinearity_for("swish").index(),
            torch::nn::init::NonlinearityType(torch::kReLU).index());
}

// ---- module tensors out and back in
// --------------------------------------------------------------

#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <difftrain/nn/module_tensors.hpp>

namespace {

TEST(ModuleTensors, RoundTripAndStrictChecksThatCopyNothingOnFailure) {
  torch::nn::Sequential a(torch::nn::Linear(3, 2), torch::nn::BatchNorm1d(2));
  torch::nn::Sequential b(torch::nn::Linear(3, 2), torch::nn::BatchNorm1d(2));
  auto ta = difftrain::nn::module_tensors(*a);
  EXPECT_EQ(ta.size(), 7u);  // weight, bias, BN weight, bias, running mean, var, count
  EXPECT_EQ(difftrain::nn::module_tensors(*a, /*buffers=*/false).size(), 4u);
  difftrain::nn::load_module_tensors(*b, ta, "a");
  for (const auto& [name, t] : difftrain::nn::module_tensors(*b))
    EXPECT_TRUE(at::equal(t, ta.at(name))) << name;

  const at::Tensor before = b->named_parameters()["0.weight"].clone();
  auto expect = [&](std::map<std::string, at::Tensor> t, const std::string& needle) {
    try {
      difftrain::nn::load_module_tensors(*b, t, "file.pt");
      ADD_FAILURE() << "expected a FormatError with " << needle;
    } catch (const difftrain::FormatError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_TRUE(at::equal(b->named_parameters()["0.weight"], before));  // nothing copied
  };
  auto zeros = ta;
  for (auto& [name, t] : zeros) t = at::zeros_like(t);
  auto extra = zeros;
  extra["2.weight"] = at::zeros({1});
  expect(extra, "has '2.weight'");
  auto missing = zeros;
  missing.erase("1.running_var");
  expect(missing, "lacks '1.running_var'");
  auto wrong = zeros;
  wrong["0.weight"] = at::zeros({2, 4});
  expect(wrong, "'0.weight' has shape [2, 4], the module's is [2, 3]");
}

}  // namespace

// Building for loading: no value drawn (the generator does not move), everything else as usual,
// only on this thread and only in the scope.
#include <torch/nn/modules/conv.h>
#include <difftrain/nn/init/without_random_init.hpp>

#include <thread>

TEST(Init, WithoutRandomInitDrawsNothingAndLeavesEverythingElse) {
  namespace init = difftrain::nn::init;
  auto generator_state = [] { return at::detail::getDefaultCPUGenerator().get_state(); };
  torch::manual_seed(3);
  const torch::Tensor seeded = generator_state();
  {
    const init::WithoutRandomInit undrawn;
    torch::nn::Linear lin(64, 32);
    torch::nn::Conv2d conv(torch::nn::Conv2dOptions(8, 16, 3));
    torch::nn::LayerNorm norm(torch::nn::LayerNormOptions({32}));
    EXPECT_TRUE(torch::equal(norm->weight, torch::ones({32})));  // fills still fill
    EXPECT_TRUE(torch::equal(norm->bias, torch::zeros({32})));
    EXPECT_TRUE(torch::equal(torch::arange(3) * 2 + 1, torch::tensor({1, 3, 5})));
    torch::Tensor x = torch::full({5}, 7.0);
    x.uniform_(-1, 1);  // left as it was
    EXPECT_TRUE(torch::equal(x, torch::full({5}, 7.0)));
    x.normal_(0, 1);
    EXPECT_TRUE(torch::equal(x, torch::full({5}, 7.0)));
    {
      const init::WithoutRandomInit nested;
      torch::nn::Linear inner(4, 4);
    }
    x.uniform_(-1, 1);  // the outer scope still holds after the inner one ends
    EXPECT_TRUE(torch::equal(x, torch::full({5}, 7.0)));
    EXPECT_TRUE(torch::equal(generator_state(), seeded));  // nothing drawn
    // Another thread draws as usual while this one is in the scope.
    bool drawn_elsewhere = false;
    std::thread other([&] {
      torch::Tensor y = torch::full({64}, 7.0);
      y.uniform_(-1, 1);
      drawn_elsewhere = (y.abs() < 1).all().item<bool>();
    });
    other.join();
    EXPECT_TRUE(drawn_elsewhere);
    EXPECT_EQ(lin->weight.sizes(), (std::vector<std::int64_t>{32, 64}));
    EXPECT_EQ(conv->weight.sizes(), (std::vector<std::int64_t>{16, 8, 3, 3}));
  }
  torch::Tensor z = torch::full({64}, 7.0);
  z.uniform_(-1, 1);  // after the scope: drawn
  EXPECT_TRUE((z.abs() < 1).all().item<bool>());
  // And without the scope a layer's construction draws (the generator moves).
  torch::manual_seed(3);
  torch::nn::Linear drawn(64, 32);
  EXPECT_FALSE(torch::equal(generator_state(), seeded));
}
