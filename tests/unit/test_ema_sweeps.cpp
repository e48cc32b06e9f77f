// EMA rules x engines x tracking options against diffusers, ema-pytorch and LitEma, in float64
// (tests/reference/ref_ema_sweeps.py): frozen layers of other shapes, buffers, copied and ignored
// names, the model pulled toward its EMA; and ema-pytorch's decay at every step to 20,000.
#include <difftrain/ema/ema.hpp>

#include <gtest/gtest.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include "golden.hpp"

namespace dt = difftrain;
namespace ema = difftrain::ema;
namespace tst = difftrain::test;

namespace {

const nlohmann::json& g() { return tst::golden("ema_sweeps.json"); }

torch::nn::Sequential make_model() {
  torch::nn::Sequential m(torch::nn::Linear(3, 4), torch::nn::BatchNorm1d(4),
                          torch::nn::Linear(4, 2));
  m->to(at::kDouble);
  const at::NoGradGuard no_grad;
  auto params = m->named_parameters(true);
  auto buffers = m->named_buffers(true);
  for (const auto& [name, v] : g()["initial"].items()) {
    at::Tensor* t = params.find(name);
    if (t == nullptr) t = buffers.find(name);
    EXPECT_NE(t, nullptr) << name;
    if (t != nullptr) t->copy_(tst::tensor_from(v).reshape(t->sizes()));
  }
  params["2.weight"].set_requires_grad(false);
  params["2.bias"].set_requires_grad(false);
  return m;
}

/// Step k of the trajectory: every floating-point tensor gains 0.1·sin(0.37·k + arange(numel)).
void move(torch::nn::Module& m, std::int64_t k) {
  const at::NoGradGuard no_grad;
  std::vector<at::Tensor> all;
  for (const auto& p : m.parameters(true)) all.push_back(p);
  for (const auto& b : m.buffers(true))
    if (b.is_floating_point()) all.push_back(b);
  for (at::Tensor& t : all)
    t.add_(0.1 * at::sin(0.37 * static_cast<double>(k) + at::arange(t.numel(), at::kDouble))
                     .reshape(t.sizes()));
}

void expect_tensors(const nlohmann::json& want, auto&& get, const std::string& what) {
  ASSERT_FALSE(want.empty()) << what;
  for (const auto& [name, values] : want.items()) {
    const at::Tensor got = get(name).to(at::kDouble).flatten();
    const at::Tensor ref = tst::tensor_from(values);
    ASSERT_EQ(got.numel(), ref.numel()) << what << " " << name;
    EXPECT_TRUE(at::allclose(got, ref, 1e-12, 1e-12))
        << what << " " << name << ": max |diff| " << (got - ref).abs().max().item<double>();
  }
}

template <class Rule, class Engine>
void check(const nlohmann::json& ref, const typename Rule::Options& options,
           const ema::Tracking& tracking, const std::string& what) {
  const std::string label = what + " with engine " + std::string(Engine::name);
  auto model = make_model();
  ema::Ema<Rule, Engine> e(*model, options, {}, tracking);
  const std::int64_t steps = g()["steps"].get<std::int64_t>();
  for (std::int64_t k = 0; k < steps; ++k) {
    move(*model, k);
    e.update();
  }
  e.engine().synchronize();
  expect_tensors(
      ref["shadows"], [&](const std::string& n) { return e.shadow(n); }, label);
  if (ref.contains("model")) {
    auto params = model->named_parameters(true);
    auto buffers = model->named_buffers(true);
    expect_tensors(
        ref["model"],
        [&](const std::string& n) {
          const at::Tensor* t = params.find(n);
          return t != nullptr ? *t : buffers[n];
        },
        label + " (the model)");
  }
}

template <class Engine>
void check_every_configuration() {
  const auto& d = g()["diffusers"];
  using W = ema::WarmupDecay;
  check<W, Engine>(d["default"], {}, {}, "diffusers default");
  check<W, Engine>(d["warmup"],
                   {.decay = 0.999,
                    .min_decay = 0.1,
                    .update_after_step = 5,
                    .use_ema_warmup = true,
                    .inv_gamma = 2.0,
                    .power = 0.75},
                   {}, "diffusers warmup");
  check<W, Engine>(d["warmup_small_gamma"],
                   {.decay = 0.99, .use_ema_warmup = true, .inv_gamma = 0.5, .power = 2.0 / 3.0},
                   {}, "diffusers warmup_small_gamma");
  check<W, Engine>(d["late"], {.decay = 0.95, .update_after_step = 40}, {}, "diffusers late");
  check<W, Engine>(d["foreach"], {.decay = 0.99, .update_after_step = 3}, {}, "diffusers foreach");

  const auto& p = g()["ema_pytorch"];
  using P = ema::EmaPytorch;
  const auto all = ema::Tracking::ema_pytorch();
  check<P, Engine>(p["default"], {.beta = 0.99, .update_after_step = 10, .update_every = 3}, all,
                   "ema-pytorch default");
  check<P, Engine>(
      p["every_step"],
      {.beta = 0.995, .update_after_step = 0, .update_every = 1, .inv_gamma = 2.0, .power = 0.75},
      all, "ema-pytorch every_step");
  check<P, Engine>(p["min_value"],
                   {.beta = 0.999, .update_after_step = 5, .update_every = 2, .min_value = 0.5},
                   all, "ema-pytorch min_value");
  check<P, Engine>(p["ignore"], {.beta = 0.99, .update_after_step = 10, .update_every = 1},
                   ema::Tracking::ema_pytorch({"0.bias"}, {"1."}), "ema-pytorch ignore");
  check<P, Engine>(p["no_ema"], {.beta = 0.99, .update_after_step = 4, .update_every = 2},
                   ema::Tracking::ema_pytorch({}, {}, {"0.weight", "1.running_mean"}),
                   "ema-pytorch no_ema");
  check<P, Engine>(p["foreach"], {.beta = 0.98, .update_after_step = 6, .update_every = 2},
                   ema::Tracking::ema_pytorch({}, {}, {"1.running_var"}), "ema-pytorch foreach");
  check<P, Engine>(p["frozen"], {.beta = 1.0, .update_after_step = 3, .update_every = 1}, all,
                   "ema-pytorch frozen");
  check<P, Engine>(
      p["model_copy"],
      {.beta = 0.9, .update_after_step = 5, .update_every = 2, .update_model_with_ema_every = 7},
      all, "ema-pytorch model_copy");
  check<P, Engine>(p["model_pull"],
                   {.beta = 0.9,
                    .update_after_step = 5,
                    .update_every = 1,
                    .update_model_with_ema_every = 5,
                    .update_model_with_ema_beta = 0.3},
                   ema::Tracking::ema_pytorch({"2.bias"}, {}, {"0.bias"}),
                   "ema-pytorch model_pull");

  using K = ema::Karras;
  check<K, Engine>(p["karras_sigma"], {.sigma_rel = 0.12, .update_every = 1}, all, "karras sigma");
  check<K, Engine>(p["karras_gamma_every"], {.gamma = 5.0, .update_every = 3}, all,
                   "karras gamma_every");
  check<K, Engine>(p["karras_frozen"], {.sigma_rel = 0.1, .update_every = 1, .frozen = true}, all,
                   "karras frozen");

  check<ema::LitEma, Engine>(g()["lit_ema"]["lit"], {.decay = 0.97}, {}, "LitEma");
}

}  // namespace

TEST(EmaSweeps, PerTensorEngineMatchesEveryConfiguration) {
  check_every_configuration<ema::PerTensor>();
}
TEST(EmaSweeps, MultiTensorEngineMatchesEveryConfiguration) {
  check_every_configuration<ema::MultiTensor>();
}
TEST(EmaSweeps, OffloadedEngineMatchesEveryConfiguration) {
  check_every_configuration<ema::Offloaded>();
}

TEST(EmaSweeps, EmaPytorchDecayAtEveryStepIsExact) {
  const std::map<std::string, ema::EmaPytorch::Options> configs = {
      {"default", {.update_after_step = 100}},
      {"fast", {.update_after_step = 0, .inv_gamma = 1.0, .power = 0.75}},
      {"slow", {.update_after_step = 7, .inv_gamma = 3.0, .power = 0.7}},
      {"clamped", {.beta = 0.999, .update_after_step = 2, .power = 2.0 / 3.0, .min_value = 0.3}}};
  for (const auto& [name, options] : configs) {
    const auto& want = g()["decays"][name];
    ASSERT_EQ(want.size(), 20001U);
    ema::EmaPytorch rule(options);
    // step_ counts calls; load_state sets it the way ema-pytorch's step buffer is set.
    for (std::size_t step = 0; step < want.size(); ++step) {
      rule.load_state(
          {{"step", static_cast<std::int64_t>(step)}, {"initted", true}, {"beta", options.beta}});
      ASSERT_EQ(rule.current_decay(), want[step].get<double>()) << name << " at step " << step;
    }
  }
}

TEST(EmaSweeps, OffloadedStagingFollowsEachListsShapes) {
  // A trainable Linear(3, 4) then a frozen Linear(4, 2): as many averaged as copied tensors, of
  // different shapes. The staging buffers used to be shared between the two lists.
  torch::nn::Sequential m(torch::nn::Linear(3, 4), torch::nn::Linear(4, 2));
  m->named_parameters()["1.weight"].set_requires_grad(false);
  m->named_parameters()["1.bias"].set_requires_grad(false);
  ema::Ema<ema::Constant, ema::Offloaded> off(*m, {.decay = 0.5});
  ema::Ema<ema::Constant, ema::PerTensor> ref(*m, {.decay = 0.5});
  for (int k = 0; k < 3; ++k) {
    move(*m, k);
    off.update();
    ref.update();
  }
  for (const auto& name : ref.names())
    EXPECT_TRUE(at::equal(off.shadow(name), ref.shadow(name))) << name;
}

TEST(EmaSweeps, CopyNamesApplyToBuffersAndIgnoredNamesAreDocumentedChoices) {
  auto model = make_model();
  // A buffer named in copy_names is copied, not averaged.
  ema::Ema<ema::Constant> e(*model, {.decay = 0.9}, {},
                            {.buffers = ema::Buffers::average, .copy_names = {"1.running_mean"}});
  move(*model, 0);
  e.update();
  EXPECT_TRUE(at::equal(e.shadow("1.running_mean"), model->named_buffers()["1.running_mean"]));
  EXPECT_FALSE(at::equal(e.shadow("1.running_var"), model->named_buffers()["1.running_var"]));
  // Ignored names: untracked by default, tracked (copied when copying) with ema-pytorch's rule.
  ema::Ema<ema::Constant> untracked(*model, {}, {}, {.ignore_names = {"0.bias"}});
  EXPECT_THROW((void)untracked.shadow("0.bias"), dt::ConfigError);
  ema::Ema<ema::EmaPytorch> kept(*model, {.update_after_step = 0, .update_every = 1}, {},
                                 ema::Tracking::ema_pytorch({"0.bias"}));
  kept.update();  // the first update copies everything, ignored names too
  move(*model, 1);
  kept.update();  // averaging leaves them alone
  EXPECT_FALSE(at::equal(kept.shadow("0.bias"), model->named_parameters()["0.bias"]));
  // Bad options are typed.
  EXPECT_THROW(ema::EmaPytorch({.update_model_with_ema_every = -1}), dt::ConfigError);
  EXPECT_THROW(ema::EmaPytorch({.update_model_with_ema_beta = 1.5}), dt::ConfigError);
}
