#include <difftrain/ema/ema.hpp>

#include <gtest/gtest.h>

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <set>

#include "golden.hpp"

namespace dt = difftrain;
namespace fs = std::filesystem;
namespace ema = difftrain::ema;
namespace tst = difftrain::test;

namespace {

// The reference's toy model: Linear, BatchNorm1d, ReLU, Linear with a frozen last bias.
torch::nn::Sequential make_model() {
  torch::nn::Sequential m(torch::nn::Linear(6, 12), torch::nn::BatchNorm1d(12), torch::nn::ReLU(),
                          torch::nn::Linear(12, 3));
  m->named_parameters()["3.bias"].set_requires_grad(false);
  return m;
}

// Sets every parameter and floating-point buffer of `m` from a {name: flat values} JSON object.
void assign(torch::nn::Module& m, const nlohmann::json& values) {
  const at::NoGradGuard no_grad;
  auto params = m.named_parameters(true);
  auto buffers = m.named_buffers(true);
  for (const auto& [name, v] : values.items()) {
    at::Tensor* t = params.find(name);
    if (t == nullptr) t = buffers.find(name);
    ASSERT_NE(t, nullptr) << name;
    t->copy_(tst::tensor_from(v).reshape(t->sizes()).to(t->scalar_type()));
  }
}

// Replays the golden trajectory through `update` (called once per training step).
template <class Update>
void replay(torch::nn::Module& m, Update update) {
  const auto& g = tst::golden("ema.json");
  assign(m, g["initial"]);
  for (const auto& step : g["trajectory"]) {
    assign(m, step);
    update();
  }
}

// Every expected tensor agrees to 1e-6 (absolute + relative) in fp32.
void expect_shadows(const nlohmann::json& want, auto&& shadow_of) {
  for (const auto& [name, values] : want.items()) {
    SCOPED_TRACE(name);
    const at::Tensor got = shadow_of(name).to(at::kDouble).flatten();
    const at::Tensor ref = tst::tensor_from(values);
    ASSERT_EQ(got.numel(), ref.numel());
    EXPECT_TRUE(at::allclose(got, ref, 1e-6, 1e-6)) << (got - ref).abs().max().item<double>();
  }
}

template <class Rule, class Engine>
void check_against(const std::string& result, const typename Rule::Options& options,
                   ema::Tracking tracking = {}) {
  SCOPED_TRACE(result + " with engine " + std::string(Engine::name));
  auto model = make_model();
  ema::Ema<Rule, Engine> e(*model, options, {}, tracking);
  replay(*model, [&] { e.update(); });
  e.engine().synchronize();
  expect_shadows(tst::golden("ema.json")["results"][result],
                 [&](const std::string& n) { return e.shadow(n); });
}

template <class Engine>
void check_every_rule() {
  check_against<ema::WarmupDecay, Engine>("diffusers_default", {});
  check_against<ema::WarmupDecay, Engine>("diffusers_warmup", {.decay = 0.999,
                                                               .min_decay = 0.1,
                                                               .update_after_step = 5,
                                                               .use_ema_warmup = true,
                                                               .inv_gamma = 1.0,
                                                               .power = 0.75});
  check_against<ema::WarmupDecay, Engine>("diffusers_foreach",
                                          {.decay = 0.99, .update_after_step = 3});
  check_against<ema::LitEma, Engine>("lit_ema", {.decay = 0.995});
  check_against<ema::EmaPytorch, Engine>(
      "ema_pytorch", {.beta = 0.99, .update_after_step = 20, .update_every = 3, .power = 0.75},
      {.buffers = ema::Buffers::average, .frozen = ema::Frozen::average});
  check_against<ema::Karras, Engine>("karras", {.sigma_rel = 0.15, .update_every = 2},
                                     {.frozen = ema::Frozen::average});
}

}  // namespace

static void io_write(const std::filesystem::path& path, const std::string& text) {
  std::ofstream(path) << text;
}

TEST(Ema, PerTensorEngineMatchesEveryReference) { check_every_rule<ema::PerTensor>(); }
TEST(Ema, MultiTensorEngineMatchesEveryReference) { check_every_rule<ema::MultiTensor>(); }
TEST(Ema, OffloadedEngineMatchesEveryReference) { check_every_rule<ema::Offloaded>(); }

TEST(Ema, MultiTensorKeepsItsGroupingUntilAParameterGetsNewMemory) {
  // The engine keeps its (device, dtype) groups between updates; parameters that get new memory
  // (a dtype change, set_data) must be seen at the next update, not the stale tensors.
  auto a = make_model();
  auto b = make_model();
  {
    at::NoGradGuard no_grad;
    for (std::size_t i = 0; i < a->parameters().size(); ++i)
      b->parameters()[i].copy_(a->parameters()[i]);
  }
  ema::Ema<ema::Constant, ema::MultiTensor> fast(*a, {.decay = 0.9});
  ema::Ema<ema::Constant, ema::PerTensor> slow(*b, {.decay = 0.9});
  auto both = [&](const std::function<void(torch::nn::Module&)>& change) {
    change(*a);
    change(*b);
    fast.update();
    slow.update();
    for (const auto& name : fast.names())
      EXPECT_TRUE(at::allclose(fast.shadow(name), slow.shadow(name), 0, 0)) << name;
  };
  auto nudge = [](torch::nn::Module& m) {
    at::NoGradGuard no_grad;
    for (auto& p : m.parameters()) p.add_(0.25);
  };
  both(nudge);
  both(nudge);                     // the cached grouping
  both([](torch::nn::Module& m) {  // new memory for every parameter
    at::NoGradGuard no_grad;
    for (auto& p : m.parameters()) p.set_data(p.detach().clone() * 2);
  });
  both([](torch::nn::Module& m) {  // a half-precision copy of the first: cast at each update
    at::NoGradGuard no_grad;
    auto p = m.parameters().front();
    p.set_data(p.detach().to(at::kHalf));
  });
  both(nudge);
}

TEST(Ema, SigmaRelToGammaMatchesEmaPytorch) {
  EXPECT_NEAR(ema::sigma_rel_to_gamma(0.15), tst::golden("ema.json")["karras_gamma"].get<double>(),
              1e-12);
  // σ_rel(γ) = sqrt((γ+1) / ((γ+2)²(γ+3))) inverts it.
  for (double s : {0.01, 0.05, 0.1, 0.28}) {
    const double g = ema::sigma_rel_to_gamma(s);
    EXPECT_NEAR(std::sqrt((g + 1) / ((g + 2) * (g + 2) * (g + 3))), s, 1e-12);
  }
  EXPECT_THROW(ema::sigma_rel_to_gamma(0.0), dt::ConfigError);
}

TEST(Ema, PostHocSynthesisMatchesEmaPytorch) {
  auto model = make_model();
  ema::PostHocEma<> post(*model,
                         {.sigma_rels = {0.05, 0.28},
                          .update_every = 1,
                          .snapshot_every = 20,
                          .snapshot_dtype = at::kFloat},
                         {.frozen = ema::Frozen::average});
  replay(*model, [&] { post.update(); });
  EXPECT_EQ(post.snapshots().size(), 2U * 10U);
  const auto& results = tst::golden("ema.json")["results"];
  const auto final_step = post.synthesize_sigma_rel(0.15);
  expect_shadows(results["post_hoc_sigma_0.15"],
                 [&](const std::string& n) { return final_step.at(n); });
  const auto at_100 = post.synthesize_sigma_rel(0.1, 100);
  expect_shadows(results["post_hoc_sigma_0.1_step_100"],
                 [&](const std::string& n) { return at_100.at(n); });
  EXPECT_THROW((void)post.synthesize(6.9, 500), dt::ConfigError);
  EXPECT_THROW((ema::PostHocEma<>(*model, {.sigma_rels = {0.1}})), dt::ConfigError);
}

TEST(Ema, PostHocSnapshotsInAFolderSynthesiseWhatMemorySnapshotsDo) {
  const fs::path dir =
      fs::temp_directory_path() / ("difftrain-posthoc-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  for (const auto& e : fs::directory_iterator(dir)) fs::remove(e.path());
  auto a = make_model();
  auto b = make_model();
  {
    at::NoGradGuard no_grad;
    for (std::size_t i = 0; i < a->parameters().size(); ++i)
      b->parameters()[i].copy_(a->parameters()[i]);
  }
  using Options = ema::PostHocEma<>::Options;
  const Options in_memory{.sigma_rels = {0.05, 0.28}, .snapshot_every = 20};
  Options on_disk = in_memory;
  on_disk.snapshot_dir = dir;
  ema::PostHocEma<> mem(*a, in_memory, {.frozen = ema::Frozen::average});
  {
    // Written by one object, read by a fresh one, as a resumed run reads what the run before wrote.
    ema::PostHocEma<> first(*b, on_disk, {.frozen = ema::Frozen::average});
    replay(*a, [&] { mem.update(); });
    replay(*b, [&] { first.update(); });
  }
  ema::PostHocEma<> disk(*b, on_disk, {.frozen = ema::Frozen::average});
  const auto listed = disk.snapshots();
  ASSERT_EQ(listed.size(), mem.snapshots().size());
  EXPECT_TRUE(fs::exists(dir / "0.20.pt"));
  EXPECT_TRUE(fs::exists(dir / "1.200.pt"));
  for (const auto& snap : listed) EXPECT_TRUE(snap.shadows.empty());
  for (double sigma_rel : {0.1, 0.15, 0.2}) {
    const auto want = mem.synthesize_sigma_rel(sigma_rel, 100);
    const auto got = disk.synthesize_sigma_rel(sigma_rel, 100);
    ASSERT_EQ(want.size(), got.size());
    for (const auto& [name, t] : want) EXPECT_TRUE(at::equal(t, got.at(name))) << name;
  }
  // A damaged snapshot names its file; a snapshot of a third EMA is another configuration.
  io_write(dir / "0.40.pt", "not a torch file");
  EXPECT_THROW((void)disk.synthesize_sigma_rel(0.1), dt::FormatError);
  fs::remove(dir / "0.40.pt");
  io_write(dir / "2.40.pt", "x");
  EXPECT_THROW((void)disk.snapshots(), dt::ConfigError);
  fs::remove(dir / "2.40.pt");
}

TEST(Ema, OnlyTrainableParametersAreAveragedOthersCopied) {
  auto model = make_model();
  ema::Ema<ema::Constant> e(*model, {.decay = 0.5});
  const at::Tensor frozen = model->named_parameters()["3.bias"];
  const at::Tensor weight = model->named_parameters()["0.weight"];
  const at::Tensor w0 = weight.detach().clone();
  {
    const at::NoGradGuard no_grad;
    frozen.add_(1.0);
    weight.add_(2.0);
  }
  e.update();
  EXPECT_TRUE(at::equal(e.shadow("3.bias"), frozen));               // copied
  EXPECT_TRUE(at::allclose(e.shadow("0.weight"), w0 + 1.0));        // averaged halfway
  EXPECT_THROW((void)e.shadow("1.running_mean"), dt::ConfigError);  // buffers ignored by default
}

TEST(Ema, ScopeSwapsWeightsInAndRestoresThemEvenOnException) {
  auto model = make_model();
  ema::Ema<ema::Constant> e(*model, {.decay = 0.0});
  const at::Tensor w = model->named_parameters()["0.weight"];
  {
    const at::NoGradGuard no_grad;
    w.fill_(3.0);
  }
  e.update();  // decay 0: the shadow is the current weight, 3
  {
    const at::NoGradGuard no_grad;
    w.fill_(7.0);
  }
  try {
    auto scope = e.scope();
    EXPECT_EQ(w.mean().item<double>(), 3.0);
    throw std::runtime_error("sampling failed");
  } catch (const std::runtime_error&) {
  }
  EXPECT_EQ(w.mean().item<double>(), 7.0);
  EXPECT_THROW(e.restore(), dt::ConfigError);  // nothing stored any more
}

TEST(Ema, AShareTracksItsOwnNamesAveragesItsSourcesAndRefusesWholeReads) {
  auto model = make_model();
  const at::Tensor weight = model->named_parameters()["0.weight"];
  // This rank steps 0.weight through a float64 master in another tensor; 0.bias and 3.weight
  // are another rank's.
  const at::Tensor master = weight.detach().to(at::kDouble) + 1.0;
  ema::Share share{.elsewhere = {"0.bias", "3.weight"}, .sources = {{"0.weight", master}}};
  ema::Ema<ema::Constant, ema::MultiTensor> e(*model, {.decay = 0.5}, {},
                                              {.buffers = ema::Buffers::average}, share);
  EXPECT_TRUE(e.is_share());
  const auto names = e.names();
  EXPECT_EQ(std::set<std::string>(names.begin(), names.end()),
            (std::set<std::string>{"0.weight", "1.weight", "1.bias", "1.running_mean",
                                   "1.running_var", "3.bias"}));
  EXPECT_EQ(e.shadow("0.weight").scalar_type(), at::kDouble);  // made from the master
  {
    const at::NoGradGuard no_grad;
    master.add_(2.0);
  }
  e.update();
  EXPECT_TRUE(at::allclose(e.shadow("0.weight"), master - 1.0));  // halfway toward the master
  EXPECT_FALSE(e.last_update_changed_model());
  // Whatever needs the other ranks' shadows is a ConfigError naming the way to take them.
  for (auto* call :
       {+[](decltype(e)& x) { x.copy_to(); }, +[](decltype(e)& x) { x.store(); },
        +[](decltype(e)& x) { (void)x.state(); }, +[](decltype(e)& x) { x.save("unused.pt"); }})
    try {
      call(e);
      ADD_FAILURE() << "a whole read of a share went through";
    } catch (const dt::ConfigError& err) {
      EXPECT_NE(std::string(err.what()).find("ema_weights"), std::string::npos) << err.what();
    }
  // A whole state (as a checkpoint holds it) loads: the names held elsewhere are passed over,
  // but a name no rank holds is still refused, and so is a missing own name.
  std::map<std::string, at::Tensor> whole;
  for (const auto& item : model->named_parameters()) whole.emplace(item.key(), item.value() * 0);
  for (const auto& item : model->named_buffers())
    if (item.value().is_floating_point()) whole.emplace(item.key(), item.value() * 0);
  e.load_state(e.rule().state(), whole);
  EXPECT_EQ(e.shadow("0.weight").abs().sum().item<double>(), 0.0);
  EXPECT_EQ(e.shadow("0.weight").scalar_type(), at::kDouble);
  auto stranger = whole;
  stranger.emplace("9.weight", at::zeros({1}));
  EXPECT_THROW(e.check_state(e.rule().state(), stranger), dt::FormatError);
  auto missing = whole;
  missing.erase("1.weight");
  EXPECT_THROW(e.check_state(e.rule().state(), missing), dt::FormatError);
  // Which names the tracking rules keep, on whichever rank holds them.
  EXPECT_TRUE(e.tracks_parameter("0.bias", model->named_parameters()["0.bias"]));
  EXPECT_FALSE(e.tracks_parameter("0.bias", at::zeros({2}, at::kLong)));
  // A source of the wrong shape, or for a parameter the model lacks, is refused.
  EXPECT_THROW(
      (ema::Ema<ema::Constant>(*model, {}, {}, {}, {.sources = {{"0.weight", at::zeros({2})}}})),
      dt::ShapeError);
  EXPECT_THROW((ema::Ema<ema::Constant>(*model, {}, {}, {}, {.sources = {{"9.weight", master}}})),
               dt::ConfigError);
  // A share with nothing elsewhere (one rank; sources are masters) is whole: its scope swaps
  // the EMA into the model's own tensors and puts them back.
  ema::Ema<ema::Constant> one(*model, {.decay = 0.0}, {}, {}, {.sources = {{"0.weight", master}}});
  EXPECT_FALSE(one.is_share());
  one.update();
  const at::Tensor before = weight.detach().clone();
  {
    auto scope = one.scope();
    EXPECT_TRUE(at::allclose(weight, master.to(weight.scalar_type())));
  }
  EXPECT_TRUE(at::equal(weight, before));
}

TEST(Ema, StateSavesByNameAndLoadsBack) {
  auto model = make_model();
  const ema::WarmupDecay::Options options{.decay = 0.999,
                                          .min_decay = 0.1,
                                          .update_after_step = 5,
                                          .use_ema_warmup = true,
                                          .inv_gamma = 1.0,
                                          .power = 0.75};
  ema::Ema<ema::WarmupDecay, ema::MultiTensor> a(*model, options);
  replay(*model, [&] { a.update(); });
  const auto dir = std::filesystem::temp_directory_path() / "difftrain_ema_state";
  a.save(dir / "ema.pt");
  // tests/reference/check_cpp_ema_state.py asks for a copy and loads it into diffusers' EMAModel.
  if (const char* out = std::getenv("DIFFTRAIN_EMA_STATE_OUT")) a.save(out);

  auto other = make_model();
  ema::Ema<ema::WarmupDecay, ema::MultiTensor> b(*other, {.decay = 0.5});
  b.load(dir / "ema.pt");
  EXPECT_EQ(b.rule().optimization_step(), 200);
  EXPECT_EQ(b.rule().state()["decay"], 0.999);
  for (const auto& n : a.names()) EXPECT_TRUE(at::equal(a.shadow(n), b.shadow(n))) << n;
  // The state keys are diffusers' EMAModel.state_dict() keys.
  const auto [scalars, shadows] = a.state();
  for (const char* key : {"decay", "min_decay", "optimization_step", "update_after_step",
                          "use_ema_warmup", "inv_gamma", "power"})
    EXPECT_TRUE(scalars.contains(key)) << key;
}

TEST(Ema, LoadsAStateWrittenByDiffusersInPython) {
  auto model = make_model();
  ema::Ema<ema::WarmupDecay> e(*model, {});
  e.load(std::string(DIFFTRAIN_GOLDEN_DIR) + "/ema_diffusers_state.pt");
  const auto& g = tst::golden("ema.json");
  EXPECT_EQ(e.rule().state()["optimization_step"],
            g["diffusers_warmup_state"]["optimization_step"]);
  EXPECT_EQ(e.rule().state()["min_decay"], 0.1);
  expect_shadows(g["results"]["diffusers_warmup"],
                 [&](const std::string& n) { return e.shadow(n); });
}

TEST(Ema, BadStatesAreTypedErrorsAndChangeNothing) {
  auto model = make_model();
  ema::Ema<ema::WarmupDecay> e(*model, {.decay = 0.9});
  e.update();
  auto [scalars, shadows] = e.state();
  const at::Tensor before = e.shadow("0.weight").clone();
  const auto rejects = [&](auto scalars2, auto shadows2, auto error_tag) {
    using E = typename decltype(error_tag)::type;
    EXPECT_THROW(e.load_state(scalars2, shadows2), E);
    EXPECT_TRUE(at::equal(e.shadow("0.weight"), before));
    EXPECT_EQ(e.rule().optimization_step(), 1);
  };
  auto missing = shadows;
  missing.erase("0.weight");
  rejects(scalars, missing, std::type_identity<dt::FormatError>{});
  auto extra = shadows;
  extra["4.weight"] = at::zeros({1});
  rejects(scalars, extra, std::type_identity<dt::FormatError>{});
  auto misshaped = shadows;
  misshaped["0.weight"] = at::zeros({12, 5});
  rejects(scalars, misshaped, std::type_identity<dt::ShapeError>{});
  auto bad_decay = scalars;
  bad_decay["decay"] = 1.5;
  rejects(bad_decay, shadows, std::type_identity<dt::FormatError>{});
  auto bad_type = scalars;
  bad_type["optimization_step"] = "seven";
  rejects(bad_type, shadows, std::type_identity<dt::FormatError>{});

  const auto dir = std::filesystem::temp_directory_path() / "difftrain_ema_bad";
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "garbage.pt") << "this is not a torch file";
  EXPECT_THROW(e.load(dir / "garbage.pt"), dt::FormatError);
  EXPECT_THROW(e.load(dir / "missing.pt"), dt::IoError);
  EXPECT_TRUE(at::equal(e.shadow("0.weight"), before));
}

TEST(Ema, BadOptionsAreConfigErrors) {
  auto model = make_model();
  EXPECT_THROW((ema::Ema<ema::WarmupDecay>(*model, {.decay = 1.5})), dt::ConfigError);
  EXPECT_THROW((ema::Ema<ema::EmaPytorch>(*model, {.update_every = 0})), dt::ConfigError);
  EXPECT_THROW((ema::Ema<ema::LitEma>(*model, {.decay = -0.1})), dt::ConfigError);
}

// The rule chosen by name decays exactly as the static rule of that name with the same options,
// for every rule, and its state round-trips; mistakes are ConfigErrors naming the key.
TEST(Ema, RuleByNameIsTheStaticRuleOfThatName) {
  auto same = [](auto a, auto b, const std::string& what) {
    for (int i = 0; i < 400; ++i) {
      const ema::Action x = a.next(), y = b.next();
      ASSERT_EQ(static_cast<int>(x.kind), static_cast<int>(y.kind)) << what << " at " << i;
      ASSERT_EQ(x.decay, y.decay) << what << " at " << i;
      ASSERT_EQ(x.copy_first, y.copy_first) << what << " at " << i;
      ASSERT_EQ(x.update_model, y.update_model) << what << " at " << i;
    }
    EXPECT_EQ(a.state(), b.state()) << what;
  };
  using J = nlohmann::json;
  auto by = [](const J& j) { return ema::RuleByName(ema::RuleByName::from_json(j)); };
  same(by({{"rule", "constant"}, {"decay", 0.99}}), ema::Constant({.decay = 0.99}), "constant");
  same(by({{"rule", "warmup_decay"},
           {"decay", 0.999},
           {"use_ema_warmup", true},
           {"power", 0.75},
           {"update_after_step", 5}}),
       ema::WarmupDecay(
           {.decay = 0.999, .update_after_step = 5, .use_ema_warmup = true, .power = 0.75}),
       "warmup_decay");
  same(by({{"rule", "lit_ema"}, {"decay", 0.995}}), ema::LitEma({.decay = 0.995}), "lit_ema");
  same(
      by({{"rule", "ema_pytorch"}, {"beta", 0.99}, {"update_after_step", 10}, {"update_every", 3}}),
      ema::EmaPytorch({.beta = 0.99, .update_after_step = 10, .update_every = 3}), "ema_pytorch");
  same(by({{"rule", "karras"}, {"update_every", 7}}), ema::Karras({.update_every = 7}), "karras");
  same(by({{"rule", "warmup_decay"}}), ema::WarmupDecay({}), "defaults");

  // State round trip through the by-name rule, and a resume with another rule refused by name.
  auto a = by({{"rule", "warmup_decay"}, {"decay", 0.999}});
  for (int i = 0; i < 17; ++i) (void)a.next();
  auto b = by({{"rule", "warmup_decay"}, {"decay", 0.999}});
  b.load_state(a.state());
  EXPECT_EQ(a.next().decay, b.next().decay);
  EXPECT_EQ(b.chosen(), "warmup_decay");
  auto c = by({{"rule", "lit_ema"}});
  EXPECT_THROW(c.load_state(a.state()), dt::FormatError);

  auto message = [&](const J& j) -> std::string {
    try {
      (void)by(j);
    } catch (const dt::ConfigError& e) {
      return e.what();
    }
    ADD_FAILURE() << "accepted " << j.dump();
    return {};
  };
  EXPECT_NE(message({{"rule", "polyak"}}).find("unknown EMA rule \"polyak\""), std::string::npos);
  EXPECT_NE(message({{"rule", "warmup_decay"}, {"decay_rate", 0.9}}).find("decay_rate"),
            std::string::npos);
  // A counter is state, not a setting.
  EXPECT_NE(message({{"rule", "warmup_decay"}, {"optimization_step", 9}}).find("optimization_step"),
            std::string::npos);
  EXPECT_NE(message({{"rule", "warmup_decay"}, {"update_after_step", 2.5}}).find("an integer"),
            std::string::npos);
  EXPECT_NE(message({{"rule", "constant"}, {"decay", 1.5}}).find("decay"), std::string::npos);
  EXPECT_NE(message({{"rule", "karras"}, {"update_every", "often"}}).find("update_every"),
            std::string::npos);
  EXPECT_NE(message({{"rule", 3}}).find("rule"), std::string::npos);

  // In an Ema over a model: the same shadows as the static rule.
  torch::nn::Linear m1(4, 3), m2(4, 3);
  {
    at::NoGradGuard g;
    for (std::size_t i = 0; i < m1->parameters().size(); ++i)
      m2->parameters()[i].copy_(m1->parameters()[i]);
  }
  ema::Ema<ema::RuleByName> e1(
      *m1, ema::RuleByName::from_json({{"rule", "warmup_decay"}, {"decay", 0.9}}));
  ema::Ema<ema::WarmupDecay> e2(*m2, {.decay = 0.9});
  for (int i = 0; i < 20; ++i) {
    at::NoGradGuard g;
    for (auto* m : {&m1, &m2})
      for (auto& p : (*m)->parameters()) p.add_(0.01 * (i + 1));
    e1.update();
    e2.update();
  }
  const auto [rule1, shadows1] = e1.state();
  const auto [rule2, shadows2] = e2.state();
  EXPECT_EQ(rule1, rule2);
  ASSERT_EQ(shadows1.size(), shadows2.size());
  for (const auto& [name, t] : shadows1) EXPECT_TRUE(at::equal(t, shadows2.at(name))) << name;
}
