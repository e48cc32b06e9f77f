// The trainer: parity with a diffusers-style Python loop, accumulation and chunked forward, bit-
// identical resume, damaged checkpoints, the non-finite loss guard, the gradient scaler against
// torch's, parameter groups and callbacks.
#include <gtest/gtest.h>
#include <difftrain/io/read_file.hpp>
#include <difftrain/io/remove_tree.hpp>
#include <difftrain/io/safetensors.hpp>
#include <difftrain/io/zip_archive.hpp>
#include <difftrain/nn/module_tensors.hpp>
#include <difftrain/schedule/by_name.hpp>
#include <difftrain/train/consolidate.hpp>
#include <difftrain/train/optimizer_by_name.hpp>
#include <difftrain/train/train.hpp>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <numeric>
#include <set>
#include <thread>
#include <tuple>

#include "golden.hpp"
#include "xy_batch.hpp"

namespace dt = difftrain;
namespace tr = difftrain::train;
namespace fs = std::filesystem;

namespace {

fs::path scratch(const std::string& name) {
  const fs::path dir =
      fs::temp_directory_path() / ("difftrain-train-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  return dir / name;
}

using Batch = difftrain::test::XyBatch;

// The Python reference's Net: fc1 → LayerNorm → SiLU → fc2, MSE loss. Optional dropout (for the
// resume test, so the random state matters) and a NaN trigger (for the guard).
struct NetImpl : torch::nn::Module {
  using Batch = ::Batch;
  explicit NetImpl(double dropout = 0.0, at::ScalarType dtype = at::kFloat) {
    fc1 = register_module("fc1", torch::nn::Linear(6, 16));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({16})));
    fc2 = register_module("fc2", torch::nn::Linear(16, 4));
    drop = register_module("drop", torch::nn::Dropout(dropout));
    to(dtype);
  }
  at::Tensor forward(const at::Tensor& x) { return fc2(drop(torch::silu(norm(fc1(x))))); }
  at::Tensor loss(const Batch& b) {
    at::Tensor l = torch::mse_loss(forward(b.x), b.y);
    if (nan_at_call >= 0 && calls++ == nan_at_call) l = l * std::nan("");
    switch (bad_loss) {  // a new user's mistakes, for the typed errors
      case 1:
        return (forward(b.x) - b.y).square();  // per element, not reduced
      case 2:
        return l.detach();  // detached
      case 3:
        return l.to(at::kLong);  // integer
      case 4: {                  // under a no-grad guard
        at::NoGradGuard ng;
        return torch::mse_loss(forward(b.x), b.y);
      }
      default:
        return l;
    }
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Dropout drop{nullptr};
  std::int64_t nan_at_call = -1, calls = 0;
  int bad_loss = 0;
};

struct ParityConfig : tr::DefaultConfig {
  using Schedule = dt::schedule::Cosine;
  using Ema = dt::ema::Ema<dt::ema::WarmupDecay>;
};

tr::Trainer<NetImpl, ParityConfig>::Options parity_options() {
  tr::Trainer<NetImpl, ParityConfig>::Options o;
  o.optimizer.lr = 3e-3;
  o.optimizer.weight_decay = 1e-2;
  o.schedule = {20, 200, 0.5};
  o.ema.rule.decay = 0.99;
  o.ema.rule.use_ema_warmup = true;
  o.clipping.max_norm = 0.5;
  o.accumulation_steps = 2;
  return o;
}

std::map<std::string, at::Tensor> parity_reference() {
  return dt::io::load_safetensors(fs::path(DIFFTRAIN_GOLDEN_DIR) / "trainer_parity.safetensors",
                                  true)
      .tensors;
}

void load_prefixed(torch::nn::Module& m, const std::map<std::string, at::Tensor>& t,
                   const std::string& prefix) {
  at::NoGradGuard no_grad;
  for (auto& p : m.named_parameters()) p.value().copy_(t.at(prefix + p.key()));
}

double max_diff(torch::nn::Module& m, const std::map<std::string, at::Tensor>& t,
                const std::string& prefix) {
  double d = 0;
  for (auto& p : m.named_parameters())
    d = std::max(d, (p.value() - t.at(prefix + p.key())).abs().max().item<double>());
  return d;
}

}  // namespace

TEST(Trainer, TwoHundredStepsMatchTheDiffusersStylePythonLoop) {
  const auto ref = parity_reference();
  auto net = std::make_shared<NetImpl>();
  load_prefixed(*net, ref, "init.");
  tr::Trainer<NetImpl, ParityConfig> trainer(*net, parity_options());
  ASSERT_EQ(trainer.param_groups().size(), 2U);
  EXPECT_EQ(trainer.param_groups()[0].names,
            (std::vector<std::string>{"fc1.weight", "fc2.weight"}));
  const at::Tensor xs = ref.at("xs"), ys = ref.at("ys");
  trainer.fit([&](std::int64_t s, std::int64_t m) { return Batch{xs[s][m], ys[s][m]}; }, 200);
  EXPECT_EQ(trainer.global_step(), 200);
  EXPECT_LT(max_diff(*net, ref, "final."), 1e-5);
  dt::ema::EmaScope scope(trainer.ema());
  EXPECT_LT(max_diff(*net, ref, "ema."), 1e-5);
}

TEST(Trainer, AccumulationAndChunkedForwardGiveTheFullBatchGradient) {
  at::manual_seed(3);
  struct Cfg : tr::DefaultConfig {
    using Optimizer = tr::SGD;
    using Clipping = tr::NoClipping;
  };
  auto net = std::make_shared<NetImpl>(0.0, at::kDouble);
  auto reference = std::make_shared<NetImpl>(0.0, at::kDouble);
  {
    at::NoGradGuard ng;
    for (std::size_t i = 0; i < net->parameters().size(); ++i)
      reference->parameters()[i].copy_(net->parameters()[i]);
  }
  tr::Trainer<NetImpl, Cfg>::Options o;
  o.optimizer.lr = 0.0;  // keep the weights: only the gradients are compared
  o.accumulation_steps = 2;
  o.max_batch_size = 3;  // 8 examples → chunks of 3, 3, 2
  tr::Trainer<NetImpl, Cfg> trainer(*net, o);
  const at::Tensor x = at::randn({2, 8, 6}, at::kDouble), y = at::randn({2, 8, 4}, at::kDouble);
  const tr::StepInfo info = trainer.step({Batch{x[0], y[0]}, Batch{x[1], y[1]}});
  const at::Tensor full = (torch::mse_loss(reference->forward(x[0]), y[0]) +
                           torch::mse_loss(reference->forward(x[1]), y[1])) /
                          2;
  full.backward();
  EXPECT_NEAR(info.loss, full.item<double>(), 1e-12);
  for (std::size_t i = 0; i < net->parameters().size(); ++i)
    EXPECT_TRUE(
        at::allclose(net->parameters()[i].grad(), reference->parameters()[i].grad(), 1e-12, 1e-14))
        << i;
  EXPECT_THROW((void)trainer.step({Batch{x[0], y[0]}}), dt::ShapeError);
}

namespace {
using ResumeConfig = ParityConfig;
at::Tensor data_x(std::int64_t s, std::int64_t m) {
  return at::randn({8, 6}, at::detail::createCPUGenerator(static_cast<std::uint64_t>(s * 7 + m)));
}
at::Tensor data_y(std::int64_t s, std::int64_t m) {
  return at::randn({8, 4},
                   at::detail::createCPUGenerator(static_cast<std::uint64_t>(s * 7 + m + 1000)));
}
auto source = [](std::int64_t s, std::int64_t m) { return Batch{data_x(s, m), data_y(s, m)}; };

std::vector<at::Tensor> snapshot(torch::nn::Module& m) {
  std::vector<at::Tensor> out;
  for (auto& p : m.parameters()) out.push_back(p.detach().clone());
  return out;
}
}  // namespace

TEST(Trainer, AResumedRunEndsBitIdenticalToAnUninterruptedOne) {
  auto options = parity_options();
  options.schedule = {10, 100, 0.5};
  // Uninterrupted: 100 steps.
  tr::set_seed(5);
  auto a = std::make_shared<NetImpl>(0.2);
  tr::Trainer<NetImpl, ResumeConfig> ta(*a, options);
  ta.fit(source, 100);
  const auto want = snapshot(*a);
  std::vector<at::Tensor> want_ema;
  {
    dt::ema::EmaScope scope(ta.ema());
    want_ema = snapshot(*a);
  }
  // Interrupted at 50, saved, resumed in a fresh model and trainer.
  const fs::path ckpt = scratch("resume.pt");
  {
    tr::set_seed(5);
    auto b = std::make_shared<NetImpl>(0.2);
    tr::Trainer<NetImpl, ResumeConfig> tb(*b, options);
    tb.fit(source, 50);
    tb.save_checkpoint(ckpt);
  }
  tr::set_seed(123);  // a different start: everything must come from the checkpoint
  auto c = std::make_shared<NetImpl>(0.2);
  tr::Trainer<NetImpl, ResumeConfig> tc(*c, options);
  tc.load_checkpoint(ckpt);
  EXPECT_EQ(tc.global_step(), 50);
  tc.fit(source, 100);
  const auto got = snapshot(*c);
  for (std::size_t i = 0; i < want.size(); ++i) EXPECT_TRUE(at::equal(got[i], want[i])) << i;
  {
    dt::ema::EmaScope scope(tc.ema());
    const auto got_ema = snapshot(*c);
    for (std::size_t i = 0; i < want.size(); ++i)
      EXPECT_TRUE(at::equal(got_ema[i], want_ema[i])) << i;
  }
  // The same run gives the same bytes: the checkpoint the resumed run writes at 100 is the one
  // the uninterrupted run writes (the optimizer's archive once keyed its states by memory
  // address), and so is one written again from the same state. Each of the model, optimizer and
  // EMA parts is compared too, so a difference says where it is.
  const fs::path uninterrupted = scratch("uninterrupted-100.pt"),
                 resumed = scratch("resumed-100.pt"), again = scratch("again-100.pt");
  ta.save_checkpoint(uninterrupted);
  tc.save_checkpoint(resumed);
  tc.save_checkpoint(again);
  EXPECT_EQ(tr::optimizer_state_bytes(ta.optimizer()), tr::optimizer_state_bytes(tc.optimizer()));
  EXPECT_EQ(dt::io::read_file(resumed), dt::io::read_file(again));
  EXPECT_EQ(dt::io::read_file(uninterrupted), dt::io::read_file(resumed));
}

// Lion as a trainer's optimizer policy: its moments go into the checkpoint, the learning-rate
// schedule sets its groups' rates, and a run resumed at step 20 ends with the weights of the one
// that was not interrupted.
TEST(Trainer, LionResumesBitIdentically) {
  struct LionConfig : tr::DefaultConfig {
    using Optimizer = tr::Lion;
    using Schedule = dt::schedule::Cosine;
  };
  tr::Trainer<NetImpl, LionConfig>::Options o;
  o.optimizer.lr = 3e-4;
  o.optimizer.weight_decay = 0.1;
  o.schedule = {5, 40, 0.5};
  tr::set_seed(8);
  auto a = std::make_shared<NetImpl>(0.2);
  tr::Trainer<NetImpl, LionConfig> ta(*a, o);
  ta.fit(source, 40);
  const auto want = snapshot(*a);
  EXPECT_NE(ta.optimizer().param_groups()[0].options().get_lr(), 3e-4);  // scheduled
  const fs::path ckpt = scratch("lion.pt");
  {
    tr::set_seed(8);
    auto b = std::make_shared<NetImpl>(0.2);
    tr::Trainer<NetImpl, LionConfig> tb(*b, o);
    tb.fit(source, 20);
    tb.save_checkpoint(ckpt);
  }
  tr::set_seed(99);
  auto c = std::make_shared<NetImpl>(0.2);
  tr::Trainer<NetImpl, LionConfig> tc(*c, o);
  tc.load_checkpoint(ckpt);
  tc.fit(source, 40);
  const auto got = snapshot(*c);
  for (std::size_t i = 0; i < want.size(); ++i) EXPECT_TRUE(at::equal(got[i], want[i])) << i;
  EXPECT_EQ(tr::optimizer_state_bytes(ta.optimizer()), tr::optimizer_state_bytes(tc.optimizer()));
}

// Every optimizer a program names at run time (OptimizerByName, kohya's names and settings):
// 40 steps equal 20, a checkpoint, a fresh trainer and 20 more, to the bit; a schedule-free run
// that showed its evaluation weights before the checkpoint too (the checkpoint holds the
// training weights, as the run that goes on takes them back). A checkpoint records the chosen
// optimizer: another one refuses it.
TEST(Trainer, EveryOptimizerChosenByNameResumesBitIdentically) {
  struct ByNameConfig : tr::DefaultConfig {
    using Optimizer = tr::OptimizerByName;
    using Schedule = dt::schedule::Cosine;
  };
  using T = tr::Trainer<NetImpl, ByNameConfig>;
  const std::vector<std::pair<std::string, std::vector<std::string>>> sweep = {
      {"AdamW", {}},
      {"adamw8bit", {"min_8bit_size=16"}},
      {"SGDNesterov", {"momentum=0.8"}},
      {"Lion", {"betas=0.95,0.98", "weight_decay=0.1"}},
      {"Prodigy", {"d_coef=0.5", "use_bias_correction=True"}},
      {"Adafactor", {"relative_step=False", "scale_parameter=False", "beta1=0.9"}},
      {"transformers.optimization.Adafactor", {}},
      {"came_pytorch.CAME", {"betas=(0.9, 0.99, 0.999)"}},
      {"AdamWScheduleFree", {"warmup_steps=5"}}};
  int index = 0;
  for (const auto& [type, args] : sweep) {
    SCOPED_TRACE(type);
    T::Options o;
    o.optimizer.type = type;
    o.optimizer.args = args;
    o.optimizer.lr = type == "Prodigy" ? 1.0 : 3e-3;
    o.schedule = {5, 40, 0.5};
    tr::set_seed(8);
    auto a = std::make_shared<NetImpl>(0.2);
    T ta(*a, o);
    ta.fit(source, 40);
    const auto want = snapshot(*a);
    const fs::path ckpt = scratch("by_name_" + std::to_string(index++) + ".pt");
    {
      tr::set_seed(8);
      auto b = std::make_shared<NetImpl>(0.2);
      T tb(*b, o);
      tb.fit(source, 20);
      const auto training = snapshot(*b);
      tb.use_evaluation_weights();
      const auto shown = snapshot(*b);
      bool moved = false;
      for (std::size_t i = 0; i < shown.size(); ++i) moved |= !at::equal(shown[i], training[i]);
      EXPECT_EQ(moved, type == "AdamWScheduleFree");  // only schedule-free has other weights
      tb.save_checkpoint(ckpt);
    }
    tr::set_seed(99);
    auto c = std::make_shared<NetImpl>(0.2);
    T tc(*c, o);
    tc.load_checkpoint(ckpt);
    tc.fit(source, 40);
    const auto got = snapshot(*c);
    if (type != "AdamWScheduleFree") {
      for (std::size_t i = 0; i < want.size(); ++i) EXPECT_TRUE(at::equal(got[i], want[i])) << i;
    } else {  // the run that showed x took y back through x, as the resumed one did
      for (std::size_t i = 0; i < want.size(); ++i)
        EXPECT_LT((got[i] - want[i]).abs().max().item<double>(), 1e-5) << i;
    }
    T::Options other = o;
    other.optimizer.type = type == "AdamW" ? "Lion" : "AdamW";
    other.optimizer.args.clear();
    auto d = std::make_shared<NetImpl>(0.2);
    T td(*d, other);
    EXPECT_THROW(td.load_checkpoint(ckpt), dt::ConfigError);
  }
  // Names and settings the optimizer does not have, and values that are not what they need.
  auto net = std::make_shared<NetImpl>(0.2);
  auto refused = [&](const std::string& type, std::vector<std::string> args,
                     const std::string& says) {
    T::Options o;
    o.optimizer.type = type;
    o.optimizer.args = std::move(args);
    try {
      T t(*net, o);
      ADD_FAILURE() << type << " was accepted";
    } catch (const dt::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  refused("AdamW9bit", {}, "'AdamW9bit' is not an optimizer difftrain has");
  refused("Lion", {"d_coef=2"}, "'d_coef' is not a setting of Lion (it takes: betas, ");
  refused("Prodigy", {"d_coef=two"}, "'two' is not a number");
  refused("Prodigy", {"use_bias_correction=1"}, "is not True or False");
  refused("CAME", {"betas=0.9,0.99"}, "is not a tuple of 3 numbers");
  refused("AdamW", {"weight_decay"}, "'weight_decay' is not key=value");
  refused("AdamW8bit", {"min_8bit_size=1.5"}, "is not a whole number");
}

TEST(Consolidate, AOneProcessCheckpointBecomesOneFileOrAFolderTrainedOrEma) {
  tr::set_seed(6);
  auto net = std::make_shared<NetImpl>();
  tr::Trainer<NetImpl, ResumeConfig> t(*net, parity_options());
  t.fit(source, 6);
  const fs::path ckpt = scratch("consolidate.pt");
  t.save_checkpoint(ckpt);
  const auto trained = dt::nn::module_tensors(*net, /*buffers=*/true);
  std::map<std::string, at::Tensor> ema_weights;
  {
    const auto scope = t.ema_weights();  // one process: the EMA's swap
    ema_weights = dt::nn::module_tensors(*net, true);
    for (auto& [name, v] : ema_weights) v = v.clone();
  }
  for (const bool ema : {false, true}) {
    const fs::path out = scratch(ema ? "ema.safetensors" : "trained.safetensors");
    const auto report = tr::consolidate_checkpoint(ckpt, out, {.ema = ema});
    EXPECT_EQ(report.step, 6);
    EXPECT_FALSE(report.sharded);
    const auto got = dt::io::load_safetensors(out, true);
    const auto& want = ema ? ema_weights : trained;
    ASSERT_EQ(got.tensors.size(), want.size());
    for (const auto& [name, v] : want) EXPECT_TRUE(at::equal(got.tensors.at(name), v)) << name;
    EXPECT_EQ(got.metadata.at("step"), "6");
  }
  EXPECT_FALSE(at::equal(ema_weights.at("fc1.weight"), trained.at("fc1.weight")));
  // A model folder of one layer: its tensors without the prefix, and the config given.
  const fs::path folder = scratch("fc1");
  tr::consolidate_to_folder(ckpt, folder, {{"_class_name", "Linear"}}, {.prefix = "fc1."});
  const auto layer = dt::io::load_safetensors(folder / "diffusion_pytorch_model.safetensors", true);
  EXPECT_EQ(layer.tensors.size(), 2U);
  EXPECT_TRUE(at::equal(layer.tensors.at("weight"), trained.at("fc1.weight")));
  EXPECT_EQ(layer.metadata.at("format"), "pt");
  const auto text = dt::io::read_file(folder / "config.json");
  EXPECT_EQ(nlohmann::json::parse(text.begin(), text.end())["_class_name"], "Linear");
  // Mistakes: a prefix nothing has, a config that is not an object, the EMA of a checkpoint
  // without one, a file that is no checkpoint. Nothing is written.
  EXPECT_THROW(tr::consolidate_checkpoint(ckpt, scratch("x.safetensors"), {.prefix = "nope."}),
               dt::ConfigError);
  EXPECT_THROW(tr::consolidate_to_folder(ckpt, scratch("x"), nlohmann::json::array()),
               dt::ConfigError);
  struct NoEma : ResumeConfig {
    using Ema = tr::NoEma;
  };
  auto plain = std::make_shared<NetImpl>();
  tr::Trainer<NetImpl, NoEma>::Options po;
  po.schedule = {1, 10, 0.5};
  tr::Trainer<NetImpl, NoEma> tp(*plain, po);
  const fs::path no_ema = scratch("no_ema.pt");
  tp.save_checkpoint(no_ema);
  EXPECT_THROW(tr::consolidate_checkpoint(no_ema, scratch("x.safetensors"), {.ema = true}),
               dt::ConfigError);
  EXPECT_THROW(tr::consolidate_checkpoint(folder / "diffusion_pytorch_model.safetensors",
                                          scratch("x.safetensors")),
               dt::FormatError);
  EXPECT_FALSE(fs::exists(scratch("x.safetensors")));
}

TEST(Trainer, DamagedFutureOrMismatchedCheckpointsAreTypedErrorsAndChangeNothing) {
  const fs::path dir = scratch("ckpts");
  (void)dt::io::remove_tree(dir);
  auto net = std::make_shared<NetImpl>();
  using T = tr::Trainer<NetImpl, ResumeConfig>;
  T trainer(*net, parity_options());
  tr::CheckpointEvery saver({dir, 10, 2});
  trainer.fit(source, 10);
  saver.save(trainer);
  trainer.fit(source, 20);
  saver.save(trainer);
  trainer.fit(source, 30);
  saver.save(trainer);
  auto listed = tr::CheckpointEvery::list(dir);
  ASSERT_EQ(listed.size(), 2U);  // keeps the last 2
  EXPECT_EQ(listed.front().first, 20);

  // Truncate the newest: a FormatError; the previous one still loads.
  {
    const auto bytes = dt::io::read_file(listed.back().second);
    std::ofstream(listed.back().second, std::ios::binary | std::ios::trunc)
        .write(bytes.data(), static_cast<std::streamsize>(bytes.size() / 2));
  }
  auto fresh = std::make_shared<NetImpl>();
  T other(*fresh, parity_options());
  const auto before = snapshot(*fresh);
  EXPECT_THROW(other.load_checkpoint(listed.back().second), dt::FormatError);
  const auto after = snapshot(*fresh);
  for (std::size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(at::equal(before[i], after[i]));
  std::vector<std::string> skipped;
  const auto used = tr::resume_latest(other, dir, &skipped);
  ASSERT_TRUE(used.has_value());
  EXPECT_EQ(*used, listed.front().second);
  EXPECT_EQ(skipped.size(), 1U);
  EXPECT_EQ(other.global_step(), 20);

  // A version from the future.
  c10::IValue state = trainer.state();
  state.toGenericDict().insert_or_assign("version", std::int64_t{99});
  dt::io::save_torch_file(scratch("future.pt"), state);
  try {
    other.load_checkpoint(scratch("future.pt"));
    ADD_FAILURE() << "loaded a checkpoint from the future";
  } catch (const dt::FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("format version 99, newer than"), std::string::npos);
  }
  // consolidate reads the same header with the same checks.
  try {
    tr::consolidate_checkpoint(scratch("future.pt"), scratch("future.safetensors"));
    ADD_FAILURE() << "consolidated a checkpoint from the future";
  } catch (const dt::FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("format version 99, newer than"), std::string::npos);
  }
  EXPECT_FALSE(std::filesystem::exists(scratch("future.safetensors")));
  // A version no difftrain wrote, and a file of another kind.
  state.toGenericDict().insert_or_assign("version", std::int64_t{0});
  dt::io::save_torch_file(scratch("zero.pt"), state);
  EXPECT_THROW(other.load_checkpoint(scratch("zero.pt")), dt::FormatError);
  state.toGenericDict().insert_or_assign("version", std::int64_t{1});
  state.toGenericDict().insert_or_assign("format", std::string("difftrain.optimizer_shard"));
  dt::io::save_torch_file(scratch("other_kind.pt"), state);
  for (const auto& read : std::vector<std::function<void()>>{
           [&] { other.load_checkpoint(scratch("other_kind.pt")); },
           [&] {
             tr::consolidate_checkpoint(scratch("other_kind.pt"), scratch("o.safetensors"));
           }}) {
    try {
      read();
      ADD_FAILURE() << "read an optimizer shard as a checkpoint";
    } catch (const dt::FormatError& e) {
      EXPECT_NE(std::string(e.what()).find("is not a difftrain checkpoint (format "
                                           "'difftrain.optimizer_shard')"),
                std::string::npos)
          << e.what();
    }
  }
  // A trainer configured differently.
  auto o = parity_options();
  o.accumulation_steps = 3;
  T different(*fresh, o);
  try {
    different.load_checkpoint(listed.front().second);
    ADD_FAILURE() << "loaded a checkpoint of another configuration";
  } catch (const dt::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("accumulation_steps = 2, this trainer has 3"),
              std::string::npos);
  }
}

TEST(Trainer, EveryKindOfCheckpointDamageIsTypedChangesNothingAndResumeFallsBack) {
  using T = tr::Trainer<NetImpl, ResumeConfig>;
  auto net = std::make_shared<NetImpl>();
  T trainer(*net, parity_options());
  trainer.fit(source, 10);
  const c10::IValue good = trainer.state();
  // Each damage applied to a copy of a good state (or to its file).
  auto with_json = [&](const std::function<void(nlohmann::json&)>& edit) {
    c10::IValue st = trainer.state();
    auto d = st.toGenericDict();
    auto js = nlohmann::json::parse(d.at("json").toStringRef());
    edit(js);
    d.insert_or_assign("json", js.dump());
    return st;
  };
  auto with_entry = [&](const std::string& key, c10::IValue v) {
    c10::IValue st = trainer.state();
    st.toGenericDict().insert_or_assign(key, std::move(v));
    return st;
  };
  std::string opt_bytes = dt::train::trainer_detail::tensor_bytes(
      good.toGenericDict().at("optimizer").toTensor(), "optimizer");
  std::string cut = opt_bytes.substr(0, opt_bytes.size() / 2);
  std::string inner = opt_bytes;  // the inner archive with its pickle bytes scrambled
  for (std::size_t i = inner.size() / 3; i < inner.size() / 3 + 40 && i < inner.size(); ++i)
    inner[i] = static_cast<char>(inner[i] ^ 0x5a);
  const std::vector<std::pair<std::string, c10::IValue>> damaged = {
      {"no scheduler", with_json([](auto& j) { j.erase("scheduler"); })},
      {"no scaler", with_json([](auto& j) { j.erase("scaler"); })},
      {"no ema", with_json([](auto& j) { j.erase("ema"); })},
      {"no fingerprint", with_json([](auto& j) { j.erase("fingerprint"); })},
      {"json an array", with_json([](auto& j) {
         j = nlohmann::json::array({1, 2});
       })},
      {"scaler scale a string", with_json([](auto& j) { j["scaler"]["scale"] = "big"; })},
      {"skipped count a string", with_json([](auto& j) { j["skipped_nonfinite"] = "x"; })},
      {"scheduler without last_epoch",
       with_json([](auto& j) { j["scheduler"].erase("last_epoch"); })},
      {"json not json", with_entry("json", std::string("{\"fingerprint\": "))},
      {"json a number", with_entry("json", std::int64_t{3})},
      {"optimizer cut", with_entry("optimizer", dt::train::trainer_detail::bytes_tensor(cut))},
      {"optimizer scrambled",
       with_entry("optimizer", dt::train::trainer_detail::bytes_tensor(inner))},
      {"optimizer a string", with_entry("optimizer", std::string("adam"))},
      {"no model",
       [&] {
         c10::IValue st = trainer.state();
         (void)st.toGenericDict().erase("model");
         return st;
       }()},
      {"rng a list", with_entry("rng_cpu", dt::io::torch_list())},
      // Parts that disagree about how far the run is.
      {"step far ahead of its parts", with_entry("step", std::int64_t{1} << 62)},
      {"scheduler behind the step", with_json([](auto& j) { j["scheduler"]["last_epoch"] = 3; })},
      {"ema ahead of the step", with_json([](auto& j) { j["ema"]["optimization_step"] = 1000; })},
      {"negative skip count", with_json([](auto& j) { j["skipped_overflow"] = -2; })},
  };
  // A fresh folder per case (libtorch exports its own std::filesystem::remove_all, which crashes
  // on a folder with files in it when it is the one the dynamic linker picks).
  int case_index = 0;
  for (const auto& [what, state] : damaged) {
    const fs::path dir = scratch("damage-" + std::to_string(case_index++));
    auto fresh = std::make_shared<NetImpl>();
    T other(*fresh, parity_options());
    dt::io::save_torch_file(dir / "checkpoint-10.pt", good);
    dt::io::save_torch_file(dir / "checkpoint-20.pt", state);
    const auto before = snapshot(*fresh);
    const auto opt_before = other.optimizer().state().size();
    try {
      other.load_checkpoint(dir / "checkpoint-20.pt");
      ADD_FAILURE() << what << ": loaded";
    } catch (const dt::FormatError& e) {
      EXPECT_NE(std::string(e.what()).find("checkpoint-20.pt"), std::string::npos)
          << what << ": " << e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << what << ": not a FormatError: " << e.what();
    }
    const auto after = snapshot(*fresh);
    for (std::size_t i = 0; i < before.size(); ++i)
      EXPECT_TRUE(at::equal(before[i], after[i])) << what;
    EXPECT_EQ(other.global_step(), 0) << what;
    EXPECT_EQ(other.optimizer().state().size(), opt_before) << what;
    std::vector<std::string> skipped;
    const auto used = tr::resume_latest(other, dir, &skipped);
    ASSERT_TRUE(used.has_value()) << what;
    EXPECT_EQ(used->filename(), "checkpoint-10.pt") << what;
    EXPECT_EQ(skipped.size(), 1U) << what;
    EXPECT_EQ(other.global_step(), 10) << what;
  }
  // On disk: a bit flipped in a weight (the record's CRC-32 catches it), a folder where the
  // newest checkpoint should be, and a name whose step does not fit in 64 bits.
  const fs::path dir = scratch("damage-on-disk");
  dt::io::save_torch_file(dir / "checkpoint-10.pt", good);
  dt::io::save_torch_file(dir / "checkpoint-30.pt", good);
  std::vector<char> bytes = dt::io::read_file(dir / "checkpoint-30.pt");
  {
    const dt::io::ZipArchive zip({bytes.data(), bytes.size()}, "checkpoint-30.pt");
    const auto at = zip.records().at("data/0").data_offset + 2;
    bytes[at] = static_cast<char>(bytes[at] ^ 0x10);
  }
  dt::io::write_file_atomic(dir / "checkpoint-30.pt", bytes);
  fs::create_directories(dir / "checkpoint-40.pt");
  std::ofstream(dir / "checkpoint-99999999999999999999999.pt") << "stray";
  auto fresh = std::make_shared<NetImpl>();
  T other(*fresh, parity_options());
  EXPECT_THROW(other.load_checkpoint(dir / "checkpoint-40.pt"), dt::IoError);
  EXPECT_THROW(other.load_checkpoint(dir / "checkpoint-30.pt"), dt::FormatError);
  std::vector<std::string> skipped;
  const auto used = tr::resume_latest(other, dir, &skipped);
  ASSERT_TRUE(used.has_value());
  EXPECT_EQ(used->filename(), "checkpoint-10.pt");
  ASSERT_EQ(skipped.size(), 2U);
  EXPECT_NE(skipped[0].find("is a folder"), std::string::npos) << skipped[0];
  EXPECT_EQ(other.global_step(), 10);
}

TEST(Trainer, ALossThatCannotTrainIsATypedErrorAtModelLossAndChangesNothing) {
  auto net = std::make_shared<NetImpl>();
  tr::Trainer<NetImpl, ParityConfig> trainer(*net, parity_options());
  trainer.fit(source, 2);
  const auto before = snapshot(*net);
  struct Case {
    int bad;
    const char* kind;
    const char* says;
  };
  for (const Case& c : {Case{1, "difftrain::ShapeError", "must be a scalar"},
                        Case{2, "difftrain::ConfigError", "does not lead back"},
                        Case{3, "difftrain::DeviceError", "floating-point"},
                        Case{4, "difftrain::ConfigError", "does not lead back"}}) {
    SCOPED_TRACE(c.says);
    net->bad_loss = c.bad;
    try {
      (void)trainer.step({source(2, 0), source(2, 1)});
      ADD_FAILURE() << "no error for bad_loss " << c.bad;
    } catch (const dt::Error& e) {
      EXPECT_EQ(e.kind(), c.kind) << e.what();
      EXPECT_EQ(e.where(), "Model::loss") << e.what();
      EXPECT_NE(e.message().find(c.says), std::string::npos) << e.what();
    }
    EXPECT_EQ(trainer.global_step(), 2);
    const auto after = snapshot(*net);
    for (std::size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(at::equal(before[i], after[i]));
  }
  net->bad_loss = 0;  // the same trainer goes on once the model is fixed
  EXPECT_TRUE(trainer.step({source(2, 0), source(2, 1)}).stepped);
  EXPECT_EQ(trainer.global_step(), 3);
}

TEST(Trainer, ANonFiniteLossStopsOrSkipsAndNeverReachesTheWeights) {
  // The losses are read once, after the step's backward passes: a NaN in any micro-batch, the
  // first or the last, must still keep the step away from the weights, the optimizer's state and
  // the step count, and leave no gradient behind.
  for (tr::NanPolicy policy : {tr::NanPolicy::stop, tr::NanPolicy::skip}) {
    for (std::int64_t bad_micro : {0, 1}) {
      SCOPED_TRACE("policy " + std::to_string(static_cast<int>(policy)) + ", micro-batch " +
                   std::to_string(bad_micro));
      auto net = std::make_shared<NetImpl>();
      auto o = parity_options();
      o.on_nan = policy;
      tr::Trainer<NetImpl, ResumeConfig> trainer(*net, o);
      trainer.fit(source, 3);
      const auto before = snapshot(*net);
      const std::string optimizer_before = tr::optimizer_state_bytes(trainer.optimizer());
      net->nan_at_call = net->calls + bad_micro;
      if (policy == tr::NanPolicy::stop) {
        try {
          trainer.fit(source, 4);
          ADD_FAILURE() << "a NaN loss did not stop the run";
        } catch (const dt::NumericError& e) {
          EXPECT_NE(std::string(e.what()).find("loss is nan"), std::string::npos) << e.what();
          EXPECT_NE(std::string(e.what()).find("Trainer step 4"), std::string::npos) << e.what();
        }
      } else {
        const tr::StepInfo info = trainer.step({source(3, 0), source(3, 1)});
        EXPECT_FALSE(info.stepped);
        EXPECT_TRUE(std::isnan(info.loss));
        EXPECT_EQ(trainer.skipped_nonfinite(), 1);
      }
      EXPECT_EQ(trainer.global_step(), 3);
      EXPECT_EQ(tr::optimizer_state_bytes(trainer.optimizer()), optimizer_before);
      for (const auto& p : net->parameters()) EXPECT_FALSE(p.grad().defined());
      const auto after = snapshot(*net);
      for (std::size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(at::equal(before[i], after[i]));
      if (policy == tr::NanPolicy::skip) {  // and the next step trains on finite losses again
        const tr::StepInfo next = trainer.step({source(3, 0), source(3, 1)});
        EXPECT_TRUE(next.stepped);
        EXPECT_TRUE(std::isfinite(next.loss));
        EXPECT_EQ(trainer.global_step(), 4);
      }
    }
  }
  // Non-finite weights are never saved.
  auto net = std::make_shared<NetImpl>();
  tr::Trainer<NetImpl, ResumeConfig> trainer(*net, parity_options());
  {
    at::NoGradGuard ng;
    net->fc1->weight[0][0] = std::nan("");
  }
  EXPECT_THROW(trainer.save_checkpoint(scratch("nan.pt")), dt::NumericError);
  EXPECT_FALSE(fs::exists(scratch("nan.pt")));
}

TEST(GradScaler, ScaleHistoryEqualsTorchGradScalerOnARunThatOverflows) {
  const auto& g = dt::test::golden("gradscaler.json");
  torch::nn::Linear lin(4, 4);
  {
    at::NoGradGuard ng;
    lin->weight.copy_(dt::test::tensor_from(g["w0"], {4, 4}).to(at::kFloat));
    lin->bias.copy_(dt::test::tensor_from(g["b0"]).to(at::kFloat));
  }
  torch::optim::SGD opt(lin->parameters(), torch::optim::SGDOptions(0.1));
  tr::GradScaler::Options so;
  so.init_scale = std::ldexp(1.0, 126);
  so.growth_interval = 3;
  tr::GradScaler scaler(so);
  const at::Tensor x = at::ones({2, 4});
  for (std::size_t i = 0; i < g["history"].size(); ++i) {
    opt.zero_grad();
    const at::Tensor loss = lin->forward(x).pow(2).mean() * 100;
    scaler.scale(loss).backward();
    const bool stepped = scaler.step(opt);
    scaler.update();
    EXPECT_EQ(stepped, g["stepped"][i].get<bool>()) << i;
    EXPECT_EQ(scaler.current_scale(), g["history"][i].get<double>()) << i;
  }
  EXPECT_TRUE(at::allclose(lin->weight.flatten(), dt::test::tensor_from(g["w"]).to(at::kFloat),
                           1e-6, 1e-7));
  const nlohmann::json s = scaler.state();
  tr::GradScaler back;
  back.load_state(s);
  EXPECT_EQ(back.current_scale(), scaler.current_scale());
  EXPECT_EQ(back.state(), s);
}

TEST(ParamGroups, RulesByNameGetTheirOwnLrAndNoDecayGroupsSplitOff) {
  NetImpl net;
  tr::GroupingOptions o;
  o.rules.push_back({"fc2\\.", 1e-5, std::nullopt});
  const auto groups = tr::make_param_groups(net, o);
  ASSERT_EQ(groups.size(), 4U);
  EXPECT_EQ(groups[0].label, "rule 0");
  EXPECT_EQ(groups[0].names, (std::vector<std::string>{"fc2.weight"}));
  EXPECT_EQ(groups[1].names, (std::vector<std::string>{"fc2.bias"}));
  EXPECT_EQ(groups[1].weight_decay, 0.0);
  EXPECT_EQ(groups[2].names, (std::vector<std::string>{"fc1.weight"}));
  EXPECT_EQ(groups[3].names, (std::vector<std::string>{"fc1.bias", "norm.weight", "norm.bias"}));
  auto opt = tr::AdamW::make(groups, {});
  EXPECT_DOUBLE_EQ(opt->param_groups()[0].options().get_lr(), 1e-5);
  EXPECT_DOUBLE_EQ(opt->param_groups()[2].options().get_lr(), 1e-4);
  EXPECT_DOUBLE_EQ(
      static_cast<torch::optim::AdamWOptions&>(opt->param_groups()[3].options()).weight_decay(),
      0.0);
  o.rules.push_back({"decoder\\.", std::nullopt, std::nullopt});
  EXPECT_THROW((void)tr::make_param_groups(net, o), dt::ConfigError);
  net.fc1->weight.set_requires_grad(false);
  tr::GroupingOptions plain;
  plain.decay_groups = false;
  const auto frozen = tr::make_param_groups(net, plain);
  ASSERT_EQ(frozen.size(), 1U);
  EXPECT_EQ(frozen[0].names.size(), 5U);  // fc1.weight left out
}

// Every setting of every optimizer policy, and of a group rule, against the values torch refuses
// (or would take silently: a NaN, an infinity): a ConfigError naming the policy and the option,
// before any optimizer exists. The values torch accepts still build one.
TEST(OptimizerOptions, EveryBadSettingIsAConfigErrorNamingIt) {
  NetImpl net;
  const auto groups = tr::make_param_groups(net, {});
  const double nan = std::nan(""), inf = std::numeric_limits<double>::infinity();
  auto expect_refused = [](const std::function<void()>& make, const std::string& option,
                           double value) {
    try {
      make();
      ADD_FAILURE() << option << " = " << value << " was accepted";
    } catch (const dt::ConfigError& e) {
      EXPECT_EQ(e.where(), option) << e.what();
      EXPECT_NE(std::string(e.what()).find("must be"), std::string::npos) << e.what();
    }
  };
  std::size_t refused = 0;
  // A field of an Adam-family policy: lr, eps, weight_decay >= 0; betas in [0, 1).
  auto adam_family = [&]<class P>(P, const std::string& name) {
    using O = typename P::Options;
    const std::vector<std::pair<std::string, double O::*>> nonneg = {
        {"lr", &O::lr}, {"eps", &O::eps}, {"weight_decay", &O::weight_decay}};
    const std::vector<std::pair<std::string, double O::*>> betas = {{"beta1", &O::beta1},
                                                                    {"beta2", &O::beta2}};
    for (const auto& [field, member] : nonneg)
      for (double bad : {-1e-3, -inf, nan, inf}) {
        O o;
        o.*member = bad;
        expect_refused([&] { (void)P::make(groups, o); }, name + " options: " + field, bad);
        ++refused;
      }
    for (const auto& [field, member] : betas)
      for (double bad : {-0.1, 1.0, 1.5, nan, inf}) {
        O o;
        o.*member = bad;
        expect_refused([&] { (void)P::make(groups, o); }, name + " options: " + field, bad);
        ++refused;
      }
    for (double good : {0.0, 1e-12, 0.5}) {
      O o;
      o.lr = good;
      o.beta1 = good;
      o.eps = good;
      o.weight_decay = good;
      EXPECT_NO_THROW((void)P::make(groups, o)) << name << " " << good;
    }
  };
  adam_family(tr::AdamW{}, "AdamW");
  adam_family(tr::Adam{}, "Adam");
  using S = tr::SGD::Options;
  const std::vector<std::pair<std::string, double S::*>> sgd = {
      {"lr", &S::lr}, {"momentum", &S::momentum}, {"weight_decay", &S::weight_decay}};
  for (const auto& [field, member] : sgd)
    for (double bad : {-1e-3, nan, inf}) {
      S o;
      o.*member = bad;
      expect_refused([&] { (void)tr::SGD::make(groups, o); }, "SGD options: " + field, bad);
      ++refused;
    }
  for (double bad : {nan, -inf}) {
    S o;
    o.dampening = bad;
    expect_refused([&] { (void)tr::SGD::make(groups, o); }, "SGD options: dampening", bad);
    ++refused;
  }
  {
    S o;
    o.nesterov = true;  // torch: "Nesterov momentum requires a momentum and zero dampening"
    EXPECT_THROW((void)tr::SGD::make(groups, o), dt::ConfigError);
    o.momentum = 0.9;
    EXPECT_NO_THROW((void)tr::SGD::make(groups, o));
  }
  // A group rule's own lr and weight decay.
  for (double bad : {-1e-3, nan, inf}) {
    tr::GroupingOptions g;
    g.rules.push_back({"fc2\\.", bad, std::nullopt});
    expect_refused([&] { (void)tr::make_param_groups(net, g); },
                   "parameter group rule 0 ('fc2\\.') lr", bad);
    g.rules[0] = {"fc2\\.", std::nullopt, bad};
    expect_refused([&] { (void)tr::make_param_groups(net, g); },
                   "parameter group rule 0 ('fc2\\.') weight_decay", bad);
    refused += 2;
  }
  EXPECT_EQ(refused, 2U * (12 + 10) + 9 + 2 + 6);
  // Through the trainer: the error comes before training, naming the option.
  tr::Trainer<NetImpl>::Options o;
  o.optimizer.lr = -1e-3;
  EXPECT_THROW(tr::Trainer<NetImpl>(net, o), dt::ConfigError);
}

// With a rule group (its own, smaller LR) first in the optimizer, the logs show the default
// group's LR, which is the run's LR, not the rule's.
TEST(Callbacks, LogsShowTheDefaultGroupsLrNotTheFirstRules) {
  const fs::path dir = scratch("shown-lr");
  struct LogConfig : tr::DefaultConfig {
    using Callbacks = std::tuple<tr::CsvLossLog>;
  };
  NetImpl net;
  tr::Trainer<NetImpl, LogConfig>::Options o;
  o.optimizer.lr = 3e-4;
  o.groups.rules.push_back({"fc2\\.", 1e-6, std::nullopt});
  tr::Trainer<NetImpl, LogConfig> t(net, o, {tr::CsvLossLog({dir / "loss.csv", 0, 1})});
  ASSERT_EQ(t.param_groups().front().label, "rule 0");
  const auto info = t.step({{at::randn({4, 6}), at::randn({4, 4})}});
  EXPECT_DOUBLE_EQ(info.lr.front(), 1e-6);
  EXPECT_DOUBLE_EQ(tr::shown_lr(t, info), 3e-4);
  std::get<tr::CsvLossLog>(t.callbacks()).on_train_end(t);
  std::ifstream in(dir / "loss.csv");
  std::string header, row;
  std::getline(in, header);
  std::getline(in, row);
  EXPECT_DOUBLE_EQ(std::stod(row.substr(row.rfind(',') + 1)), 3e-4) << row;
  tr::ProgressBar bar({.total_steps = 10, .every = 1, .force = false});
  EXPECT_NE(bar.line(info, tr::shown_lr(t, info)).find("lr 0.0003"), std::string::npos);
}

TEST(Callbacks, PruningTakesASetsShardsAndWeightsFilesAndLeftOversWithIt) {
  const fs::path dir = scratch("prune");
  dt::io::remove_tree(dir);
  fs::create_directories(dir);
  const auto touch = [&](const std::string& name) { std::ofstream(dir / name) << "x"; };
  for (const std::string step : {"2", "4"}) {
    touch("checkpoint-" + step + ".pt");
    for (const std::string r : {"0", "1"}) {
      touch("checkpoint-" + step + ".pt.shard-" + r + "-of-2");
      touch("checkpoint-" + step + ".pt.shard-" + r + "-of-2.safetensors");
    }
  }
  touch("checkpoint-3.pt.shard-1-of-2.safetensors");      // a save that stopped halfway
  touch("checkpoint-9.pt.shard-0-of-2.safetensors");      // newer than any set: left alone
  touch("checkpoint-4.pt.shard-0-of-2.safetensors.tmp");  // not a file of a set
  auto net = std::make_shared<NetImpl>();
  auto o = parity_options();
  tr::Trainer<NetImpl, ResumeConfig> t(*net, o);
  t.fit(source, 6);
  tr::CheckpointEvery({.dir = dir, .every = 100, .keep_last = 2}).save(t);
  std::set<std::string> left;
  for (const auto& e : fs::directory_iterator(dir)) left.insert(e.path().filename().string());
  EXPECT_EQ(left, (std::set<std::string>{
                      "checkpoint-4.pt", "checkpoint-4.pt.shard-0-of-2",
                      "checkpoint-4.pt.shard-1-of-2", "checkpoint-4.pt.shard-0-of-2.safetensors",
                      "checkpoint-4.pt.shard-1-of-2.safetensors",
                      "checkpoint-4.pt.shard-0-of-2.safetensors.tmp", "checkpoint-6.pt",
                      "checkpoint-9.pt.shard-0-of-2.safetensors"}));
}

TEST(Callbacks, StartingAgainRemovesEveryFileOfEverySet) {
  const fs::path dir = scratch("remove_all");
  dt::io::remove_tree(dir);
  fs::create_directories(dir);
  const auto touch = [&](const std::string& name) { std::ofstream(dir / name) << "x"; };
  for (const std::string name : {"checkpoint-2.pt", "checkpoint-2.pt.shard-0-of-3",
                                 "checkpoint-2.pt.shard-2-of-3.safetensors",
                                 "checkpoint-7.pt.shard-1-of-2", "checkpoint-10.pt"})
    touch(name);
  touch("notes.txt");            // not the library's
  touch("checkpoint-2.pt.tmp");  // not a file of a set
  EXPECT_EQ(tr::CheckpointEvery::remove_all(dir), 5U);
  std::set<std::string> left;
  for (const auto& e : fs::directory_iterator(dir)) left.insert(e.path().filename().string());
  EXPECT_EQ(left, (std::set<std::string>{"checkpoint-2.pt.tmp", "notes.txt"}));
  EXPECT_EQ(tr::CheckpointEvery::remove_all(dir / "missing"), 0U);
}

// A checkpoint of other parameter groups is refused in one short sentence naming the first
// difference, never the whole list of names (a UNet's was one 19 KB line).
TEST(Trainer, OtherParameterGroupsAreNamedByTheirFirstDifference) {
  namespace td = tr::trainer_detail;
  auto group = [](const std::string& label, int n, int renamed = -1) {
    nlohmann::json names = nlohmann::json::array();
    for (int i = 0; i < n; ++i)
      names.push_back("down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.weight." +
                      std::to_string(i == renamed ? 1000 + i : i));
    return nlohmann::json{{"label", label}, {"names", names}};
  };
  const nlohmann::json now = {group("default", 400), group("text", 3)};
  struct Case {
    nlohmann::json saved;
    std::string says;
  };
  for (const auto& [saved, says] : std::vector<Case>{
           {nlohmann::json{group("default", 400)}, "1 parameter groups, this trainer has 2"},
           {nlohmann::json{group("default", 400), group("lora", 3)},
            "group 1 = \"lora\", this trainer's is 'text'"},
           {nlohmann::json{group("default", 400, 17), group("text", 3)},
            "group 'default' holding \"down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q."
            "weight.1017\" as parameter 17"},
           {nlohmann::json{group("default", 401), group("text", 3)},
            "group 'default' of 401 parameters (first extra: "},
           {nlohmann::json{group("default", 399), group("text", 3)},
            "group 'default' of 399 parameters (first missing: "},
           {nlohmann::json("not a list"), "param_groups = \"not a list\""}}) {
    const std::string text = td::group_difference(saved, now);
    EXPECT_NE(text.find(says), std::string::npos) << text;
    EXPECT_LT(text.size(), 400U) << text;
  }
}

TEST(Callbacks, LogStatisticsCheckpointsAndEarlyStop) {
  const fs::path dir = scratch("callbacks");
  (void)dt::io::remove_tree(dir);
  struct Cfg : ParityConfig {
    using Callbacks = std::tuple<tr::CsvLossLog, tr::LossStatistics, tr::CheckpointEvery,
                                 tr::EarlyStop, tr::ProgressBar>;
  };
  auto net = std::make_shared<NetImpl>();
  auto o = parity_options();
  using T = tr::Trainer<NetImpl, Cfg>;
  T::Options to;
  to.optimizer = o.optimizer;
  to.schedule = o.schedule;
  to.ema = o.ema;
  to.clipping = o.clipping;
  to.accumulation_steps = 2;
  T trainer(*net, to,
            {tr::CsvLossLog({dir / "loss.csv", 4, 1}), tr::LossStatistics(),
             tr::CheckpointEvery({dir, 5, 2}), tr::EarlyStop({3, 10.0}), tr::ProgressBar()});
  trainer.fit(source, 50);
  // The loss never improves by 10, so the run stops after 3 steps without improvement.
  EXPECT_EQ(std::get<tr::EarlyStop>(trainer.callbacks()).stopped_at(), 4);
  EXPECT_EQ(trainer.global_step(), 4);
  std::ifstream csv(dir / "loss.csv");
  std::string header, line;
  std::getline(csv, header);
  EXPECT_EQ(header, "step,epoch,epoch_step,loss,learn_rate");
  int rows = 0;
  while (std::getline(csv, line)) ++rows;
  EXPECT_EQ(rows, 4);
  const auto& stats = std::get<tr::LossStatistics>(trainer.callbacks());
  EXPECT_EQ(stats.count(), 4U);
  EXPECT_TRUE(std::isfinite(stats.standard_error()));
  EXPECT_TRUE(tr::CheckpointEvery::list(dir).empty());  // step 5 never came
  tr::StepInfo s;
  s.step = 4;
  s.loss = 0.5;
  s.lr = {1e-3};
  const auto& bar = std::get<tr::ProgressBar>(trainer.callbacks());
  EXPECT_NE(bar.line(s).find("train 4 "), std::string::npos) << bar.line(s);
  EXPECT_NE(bar.line(s).find("loss 0.50000 (mean "), std::string::npos) << bar.line(s);
  EXPECT_NE(bar.line(s).find("  lr 0.001"), std::string::npos) << bar.line(s);
}

// The profile covers exactly the asked window, names the trainer's phases with the operators
// inside them (self time below total time, every phase called once per step), and its Chrome
// trace holds the same ranges.
TEST(Callbacks, StepProfileNamesThePhasesOfTheProfiledStepsOnly) {
  const fs::path dir = scratch("profile");
  (void)dt::io::remove_tree(dir);
  fs::create_directories(dir);
  struct Cfg : ParityConfig {
    using Callbacks = std::tuple<tr::StepProfile>;
  };
  using T = tr::Trainer<NetImpl, Cfg>;
  auto net = std::make_shared<NetImpl>();
  auto o = parity_options();
  T::Options to;
  to.optimizer = o.optimizer;
  to.schedule = o.schedule;
  to.ema = o.ema;
  to.clipping = o.clipping;
  T trainer(*net, to, {tr::StepProfile({.after_step = 2, .steps = 3, .trace = dir / "t.json"})});
  const auto& profile = std::get<tr::StepProfile>(trainer.callbacks());
  trainer.fit(source, 8);
  ASSERT_TRUE(profile.done());
  EXPECT_EQ(profile.profiled_steps(), 3);
  EXPECT_GT(profile.wall_ms(), 0.0);
  std::map<std::string, tr::ProfileRow> rows;
  double self_sum = 0.0;
  for (const auto& r : profile.rows()) {
    rows[r.name] = r;
    self_sum += r.self_ms;
    EXPECT_LE(r.self_ms, r.total_ms + 1e-9) << r.name;
  }
  for (const char* phase :
       {"difftrain::data", "difftrain::forward", "difftrain::backward", "difftrain::clip",
        "difftrain::optimizer_step", "difftrain::ema_update"}) {
    ASSERT_TRUE(rows.count(phase)) << phase << "\n" << profile.table();
    EXPECT_EQ(rows[phase].calls, 3) << phase;
  }
  // The forward's operators are inside it: its own time is a part of its total.
  EXPECT_LT(rows["difftrain::forward"].self_ms, rows["difftrain::forward"].total_ms);
  EXPECT_GE(rows["aten::addmm"].calls, 3 * 2) << profile.table();  // two Linear layers
  EXPECT_LE(self_sum, profile.wall_ms() * 1.05);  // one thread's time cannot exceed the wall
  EXPECT_NE(profile.table(5).find("| difftrain::"), std::string::npos) << profile.table(5);
  const std::string phases = profile.phase_table();
  for (const char* phase : {"| difftrain::forward |", "| difftrain::ema_update |", "| (between"})
    EXPECT_NE(phases.find(phase), std::string::npos) << phase << "\n" << phases;
  EXPECT_EQ(phases.find("| aten::"), std::string::npos) << phases;
  std::ifstream in(dir / "t.json");
  const std::string trace((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(trace.find("difftrain::backward"), std::string::npos);
  EXPECT_THROW(tr::StepProfile({.after_step = 0, .steps = 0, .trace = {}}), dt::ConfigError);
  // A run that ends inside its window reports the steps it took.
  auto net2 = std::make_shared<NetImpl>();
  T short_run(*net2, to, {tr::StepProfile({.after_step = 1, .steps = 10, .trace = {}})});
  short_run.fit(source, 4);
  EXPECT_TRUE(std::get<tr::StepProfile>(short_run.callbacks()).done());
  EXPECT_EQ(std::get<tr::StepProfile>(short_run.callbacks()).profiled_steps(), 3);
}

TEST(Callbacks, AResumedRunsLossLogHoldsEveryStepOnce) {
  const fs::path dir = scratch("log-resume");
  (void)dt::io::remove_tree(dir);
  struct Cfg : ParityConfig {
    using Callbacks = std::tuple<tr::CsvLossLog, tr::CheckpointEvery>;
  };
  using T = tr::Trainer<NetImpl, Cfg>;
  auto run = [&](std::int64_t until, bool resume) {
    auto net = std::make_shared<NetImpl>();
    T::Options to;
    to.schedule = parity_options().schedule;
    T t(*net, to, {tr::CsvLossLog({dir / "loss.csv", 4, 1}), tr::CheckpointEvery({dir, 5, 2})});
    if (resume) {
      EXPECT_TRUE(tr::resume_latest(t, dir).has_value());
    }
    t.fit(source, until);
  };
  run(8, false);  // killed after step 8: the log has rows 1-8, the checkpoint is at step 5
  run(12, true);  // rows 6-8 are written again, once
  std::ifstream csv(dir / "loss.csv");
  std::string line;
  std::getline(csv, line);
  std::vector<std::int64_t> steps;
  while (std::getline(csv, line)) steps.push_back(std::stoll(line.substr(0, line.find(','))));
  std::vector<std::int64_t> want(12);
  std::iota(want.begin(), want.end(), 1);
  EXPECT_EQ(steps, want);
}

TEST(Trainer, Bf16AutocastTrainsAndSamplesSeeTheEmaWeights) {
  std::vector<at::Tensor> seen;
  auto sample = [&seen](auto& t) { seen.push_back(t.model().fc1->weight.detach().clone()); };
  struct Cfg : ParityConfig {
    using Precision = tr::AutocastBf16;
    using Callbacks = std::tuple<tr::SampleEvery<decltype(sample)>>;
  };
  auto net = std::make_shared<NetImpl>();
  tr::Trainer<NetImpl, Cfg>::Options o;
  o.optimizer.lr = 1e-3;
  o.schedule = {2, 10, 0.5};
  o.ema.rule.decay = 0.5;
  o.accumulation_steps = 2;
  tr::Trainer<NetImpl, Cfg> trainer(*net, o, {tr::SampleEvery<decltype(sample)>(2, sample)});
  const tr::StepInfo first = trainer.step({source(0, 0), source(0, 1)});
  EXPECT_TRUE(std::isfinite(first.loss));
  trainer.fit(source, 4);
  ASSERT_EQ(seen.size(), 2U);  // steps 2 and 4
  const auto [scalars, shadows] = trainer.ema().state();
  EXPECT_TRUE(at::equal(seen.back(), shadows.at("fc1.weight")));
  EXPECT_FALSE(
      at::equal(seen.back(), net->fc1->weight));  // the live weights are back after sampling
  EXPECT_EQ(net->fc1->weight.scalar_type(), at::kFloat);  // autocast never changes the parameters
}

TEST(MultiTrainer, EachModelTrainsOnItsOwnAndOneCheckpointHoldsThemAll) {
  using M = tr::MultiTrainer<NetImpl, ResumeConfig>;
  tr::set_seed(8);
  auto a = std::make_shared<NetImpl>(), b = std::make_shared<NetImpl>();
  auto solo = std::make_shared<NetImpl>();
  {
    at::NoGradGuard ng;
    for (std::size_t i = 0; i < a->parameters().size(); ++i)
      solo->parameters()[i].copy_(b->parameters()[i]);
  }
  auto oa = parity_options(), ob = parity_options();
  ob.optimizer.lr = 1e-3;  // each model its own settings
  M multi({a.get(), b.get()}, {oa, ob});
  tr::Trainer<NetImpl, ResumeConfig> single(*solo, ob);
  // Interleaved: model 0 three steps, model 1 five; model 1 must end as if trained alone.
  for (std::int64_t s = 0; s < 5; ++s) {
    if (s < 3) multi.step(0, {source(100 + s, 0), source(100 + s, 1)});
    multi.step(1, {source(s, 0), source(s, 1)});
    single.step({source(s, 0), source(s, 1)});
  }
  EXPECT_EQ(multi.steps_taken(0), 3);
  EXPECT_EQ(multi.steps_taken(1), 5);
  for (std::size_t i = 0; i < b->parameters().size(); ++i)
    EXPECT_TRUE(at::equal(b->parameters()[i], solo->parameters()[i])) << i;
  EXPECT_THROW((void)multi.steps_taken(2), dt::ConfigError);

  // Sampling sees every model's EMA weights; the live ones come back after.
  const at::Tensor live = a->fc1->weight.detach().clone();
  const auto shadow = multi.at(0).ema().state().second.at("fc1.weight");
  multi.with_ema_weights([&] { EXPECT_TRUE(at::equal(a->fc1->weight, shadow)); });
  EXPECT_TRUE(at::equal(a->fc1->weight, live));

  const fs::path path = scratch("multi.pt");
  multi.save_checkpoint(path);
  auto c = std::make_shared<NetImpl>(), d = std::make_shared<NetImpl>();
  M back({c.get(), d.get()}, {oa, ob});
  back.load_checkpoint(path);
  EXPECT_EQ(back.steps_taken(0), 3);
  EXPECT_EQ(back.steps_taken(1), 5);
  EXPECT_TRUE(at::equal(d->fc2->weight, b->fc2->weight));
  // A checkpoint of a different setup changes nothing, not even the first model.
  auto e = std::make_shared<NetImpl>(), f = std::make_shared<NetImpl>();
  auto other = ob;
  other.accumulation_steps = 3;
  M mismatched({e.get(), f.get()}, {oa, other});
  const at::Tensor before = e->fc1->weight.detach().clone();
  EXPECT_THROW(mismatched.load_checkpoint(path), dt::ConfigError);
  EXPECT_TRUE(at::equal(e->fc1->weight, before));
}

TEST(Clipping, ScheduledLimitsFollowTheStepStringAndCastTrainingParamsCastsOnlyTrainables) {
  tr::ScheduledClip::Options o;
  o.limits = "0.1:3, 2.0";
  tr::ScheduledClip clip(o);
  EXPECT_DOUBLE_EQ(clip.limit_at(0), 0.1);
  EXPECT_DOUBLE_EQ(clip.limit_at(2), 0.1);
  EXPECT_DOUBLE_EQ(clip.limit_at(3), 2.0);
  const at::Tensor p = at::zeros({4}).requires_grad_();
  p.mutable_grad() = at::full({4}, 3.0);
  const double norm = clip.apply({p}, 0);
  EXPECT_DOUBLE_EQ(norm, 6.0);
  EXPECT_NEAR(p.grad().norm().item<double>(), 0.1, 1e-6);
  o.mode = tr::ScheduledClip::Mode::value;
  tr::ScheduledClip by_value(o);
  p.mutable_grad() = at::full({4}, 3.0);
  (void)by_value.apply({p}, 5);
  EXPECT_TRUE(at::equal(p.grad(), at::full({4}, 2.0)));
  o.limits = "0.1:x";
  EXPECT_THROW(tr::ScheduledClip{o}, dt::ConfigError);

  NetImpl net(0.0, at::kHalf);
  net.fc2->weight.set_requires_grad(false);
  tr::cast_training_params(net);
  EXPECT_EQ(net.fc1->weight.scalar_type(), at::kFloat);
  EXPECT_EQ(net.fc2->weight.scalar_type(), at::kHalf);  // frozen: left as it was
}

// fit past the schedule's horizon is refused before any step, naming the option; up to it is fine.
TEST(Trainer, FitPastTheSchedulesHorizonIsAConfigError) {
  struct CosineConfig : tr::DefaultConfig {
    using Schedule = dt::schedule::Cosine;
  };
  NetImpl net;
  tr::Trainer<NetImpl, CosineConfig>::Options o;
  o.schedule.num_warmup_steps = 2;
  o.schedule.num_training_steps = 5;
  tr::Trainer<NetImpl, CosineConfig> t(net, o);
  auto source = [](std::int64_t, std::int64_t) {
    return Batch{at::randn({4, 6}), at::randn({4, 4})};
  };
  try {
    t.fit(source, 6);
    ADD_FAILURE() << "fit past num_training_steps was accepted";
  } catch (const dt::ConfigError& e) {
    EXPECT_EQ(e.where(), "Trainer options: schedule.num_training_steps");
    EXPECT_NE(std::string(e.what()).find("until step 6"), std::string::npos) << e.what();
  }
  EXPECT_EQ(t.global_step(), 0);
  t.fit(source, 5);
  EXPECT_EQ(t.global_step(), 5);
}

// A checkpoint written with other settings than the trainer loading it: each kind of setting
// (base LR, schedule options, optimizer settings, EMA options) is refused by name and leaves the
// trainer as it was, or, when take_on_resume lists it, the resumed run trains on with the new one.
TEST(Trainer, ResumingWithChangedSettingsIsRefusedByNameOrTakesThemOnRequest) {
  struct EmaConfig : tr::DefaultConfig {
    using Schedule = dt::schedule::Cosine;
    using Ema = dt::ema::Ema<dt::ema::WarmupDecay>;
  };
  using T = tr::Trainer<NetImpl, EmaConfig>;
  auto options = [] {
    T::Options o;
    o.optimizer.lr = 1e-3;
    o.schedule.num_warmup_steps = 2;
    o.schedule.num_training_steps = 20;
    o.ema.rule.decay = 0.99;
    return o;
  };
  auto source = [](std::int64_t s, std::int64_t) {
    at::Generator g = at::make_generator<at::CPUGeneratorImpl>(static_cast<std::uint64_t>(s));
    return Batch{at::randn({4, 6}, g), at::randn({4, 4}, g)};
  };
  const fs::path ckpt = scratch("changed-settings.pt");
  {
    NetImpl net;
    T a(net, options());
    a.fit(source, 3);
    a.save_checkpoint(ckpt);
  }
  struct Change {
    std::string name;
    std::function<void(T::Options&)> change;
    std::string expect;  // in the refusal
    std::function<void(T::Options&)> take;
    std::function<void(T&)> check;  // after a resume that takes it
  };
  const std::vector<Change> changes = {
      {"lr", [](T::Options& o) { o.optimizer.lr = 2e-3; }, "lr of group 'default'",
       [](T::Options& o) { o.take_on_resume.lr = true; },
       [](T& t) {
         EXPECT_DOUBLE_EQ(t.scheduler().base_lrs().front(), 2e-3);
         const dt::schedule::Cosine c({2, 20, 0.5});
         EXPECT_DOUBLE_EQ(t.scheduler().last_lr().front(), c.lr(t.scheduler().last_step(), 2e-3));
       }},
      {"schedule", [](T::Options& o) { o.schedule.num_training_steps = 40; },
       "a schedule whose LR curve", [](T::Options& o) { o.take_on_resume.schedule = true; },
       [](T& t) {
         const dt::schedule::Cosine c({2, 40, 0.5});
         EXPECT_DOUBLE_EQ(t.scheduler().last_lr().front(), c.lr(t.scheduler().last_step(), 1e-3));
       }},
      {"optimizer", [](T::Options& o) { o.optimizer.weight_decay = 0.1; },
       "optimizer weight_decay in group 'default'",
       [](T::Options& o) { o.take_on_resume.optimizer = true; },
       [](T& t) {
         const auto& g = t.optimizer().param_groups().front().options();
         EXPECT_DOUBLE_EQ(static_cast<const torch::optim::AdamWOptions&>(g).weight_decay(), 0.1);
         EXPECT_DOUBLE_EQ(g.get_lr(), t.scheduler().last_lr().front());
       }},
      {"clipping", [](T::Options& o) { o.clipping.max_norm = 0.5; },
       "a clipping policy whose effect", [](T::Options& o) { o.take_on_resume.clipping = true; },
       [](T& /*t*/) {}},
      {"ema", [](T::Options& o) { o.ema.rule.decay = 0.5; }, "EMA decay",
       [](T::Options& o) { o.take_on_resume.ema = true; },
       [](T& t) {
         EXPECT_DOUBLE_EQ(t.ema().rule().state()["decay"].get<double>(), 0.5);
         EXPECT_EQ(t.ema().rule().state()["optimization_step"].get<std::int64_t>(), 3);
       }},
  };
  for (const auto& c : changes) {
    SCOPED_TRACE(c.name);
    NetImpl net;
    T::Options o = options();
    c.change(o);
    T t(net, o);
    const at::Tensor before = net.fc1->weight.detach().clone();
    try {
      t.load_checkpoint(ckpt);
      ADD_FAILURE() << "a checkpoint with another " << c.name << " was taken";
    } catch (const dt::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(c.expect), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("take_on_resume." + c.name), std::string::npos)
          << e.what();
    }
    EXPECT_EQ(t.global_step(), 0);
    EXPECT_TRUE(at::equal(net.fc1->weight, before));
    // Taken on request.
    NetImpl net2;
    T::Options o2 = options();
    c.change(o2);
    c.take(o2);
    T t2(net2, o2);
    t2.load_checkpoint(ckpt);
    EXPECT_EQ(t2.global_step(), 3);
    c.check(t2);
    t2.fit(source, 5);  // and trains on
    EXPECT_EQ(t2.global_step(), 5);
  }
  // Unchanged settings load as before.
  NetImpl net;
  T same(net, options());
  same.load_checkpoint(ckpt);
  EXPECT_EQ(same.global_step(), 3);
}

// A trainer whose schedule is chosen at run time trains with the numbers of the static one, is
// held to the chosen schedule's horizon, and a checkpoint of another chosen schedule is refused.
TEST(Trainer, AScheduleChosenByNameTrainsAsTheStaticOne) {
  struct Static : tr::DefaultConfig {
    using Schedule = dt::schedule::Cosine;
  };
  struct Chosen : tr::DefaultConfig {
    using Schedule = dt::schedule::ByName;
  };
  auto source = [](std::int64_t s, std::int64_t) {
    at::Generator g = at::make_generator<at::CPUGeneratorImpl>(static_cast<std::uint64_t>(s));
    return Batch{at::randn({4, 6}, g), at::randn({4, 4}, g)};
  };
  at::manual_seed(3);
  NetImpl a;
  at::manual_seed(3);
  NetImpl b;
  tr::Trainer<NetImpl, Static>::Options sa;
  sa.schedule = {.num_warmup_steps = 3, .num_training_steps = 12};
  tr::Trainer<NetImpl, Chosen>::Options sb;
  sb.schedule = dt::schedule::ByName::from_json(nlohmann::json::parse(
      R"({"lr_scheduler": "cosine", "num_warmup_steps": 3, "num_training_steps": 12})"));
  tr::Trainer<NetImpl, Static> ta(a, sa);
  tr::Trainer<NetImpl, Chosen> tb(b, sb);
  for (std::int64_t s = 0; s < 12; ++s) {
    const auto ia = ta.step({source(s, 0)});
    const auto ib = tb.step({source(s, 0)});
    EXPECT_EQ(ia.lr, ib.lr) << s;
  }
  EXPECT_TRUE(at::equal(a.fc1->weight, b.fc1->weight));
  EXPECT_THROW(tb.fit(source, 13), dt::ConfigError);  // past the chosen schedule's horizon
  const fs::path ckpt = scratch("by-name.pt");
  tb.save_checkpoint(ckpt);
  NetImpl c;
  tr::Trainer<NetImpl, Chosen>::Options sc;
  sc.schedule.lr_scheduler = "linear";
  sc.schedule.args = sb.schedule.args;
  tr::Trainer<NetImpl, Chosen> tc(c, sc);
  try {
    tc.load_checkpoint(ckpt);
    ADD_FAILURE() << "a checkpoint of another chosen schedule was taken";
  } catch (const dt::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("take_on_resume.schedule"), std::string::npos) << e.what();
  }
}

// The precision chosen by name trains exactly as the static policy of that name; its fingerprint
// names the chosen precision, so checkpoints move between the two; an unknown name is refused.
// fp16 without clipping: the scaler checks the scaled gradients and hands the scale to the fused
// AdamW kernel instead of unscaling them first. The run, overflows and skipped steps included,
// is bit for bit the run that unscales first (clipping at a norm no gradient reaches multiplies
// by exactly 1), and the gradients after a step are the true ones either way (the kernel writes
// them back unscaled).
TEST(Trainer, Fp16WithoutClippingHandsTheScaleToTheFusedKernel) {
  auto run = [](auto tag) {
    using Cfg = typename decltype(tag)::type;
    tr::set_seed(5);
    auto net = std::make_shared<NetImpl>();
    typename tr::Trainer<NetImpl, Cfg>::Options o;
    o.optimizer.lr = 1e-3;
    o.schedule = {2, 40, 0.5};
    o.scaler.init_scale = std::ldexp(1.0, 125);  // the first steps overflow and back off
    o.scaler.growth_interval = 4;
    o.scaler.hand_scale = tr::HandScale::always;  // the CPU default unscales first
    if constexpr (requires { o.clipping.max_norm; }) o.clipping.max_norm = 1e30;
    tr::Trainer<NetImpl, Cfg> trainer(*net, o);
    std::vector<at::Tensor> grads;  // after the last step, as a callback would see them
    trainer.fit(source, 30);
    const auto& left = trainer.scaler().scale_left_in_grads();
    for (const auto& p : net->parameters())
      grads.push_back(left ? p.grad() / *left : p.grad().clone());
    std::vector<at::Tensor> params;
    for (const auto& p : net->parameters()) params.push_back(p.detach().clone());
    return std::make_tuple(params, grads, trainer.skipped_overflow(),
                           trainer.scaler().current_scale(), left.has_value());
  };
  struct Handed : ParityConfig {
    using Precision = tr::AutocastFp16;
    using Clipping = tr::NoClipping;
  };
  struct Unscaled : ParityConfig {
    using Precision = tr::AutocastFp16;
  };
  const auto [hp, hg, hskips, hscale, hleft] = run(std::type_identity<Handed>{});
  const auto [up, ug, uskips, uscale, uleft] = run(std::type_identity<Unscaled>{});
  EXPECT_FALSE(hleft);
  EXPECT_FALSE(uleft);
  EXPECT_GT(hskips, 0);
  EXPECT_EQ(hskips, uskips);
  EXPECT_EQ(hscale, uscale);
  ASSERT_EQ(hp.size(), up.size());
  for (std::size_t i = 0; i < hp.size(); ++i) {
    EXPECT_TRUE(at::equal(hp[i], up[i])) << "parameter " << i;
    EXPECT_TRUE(at::allclose(hg[i], ug[i], 0, 0)) << "gradient " << i;
  }
}

TEST(Trainer, PrecisionByNameIsTheStaticPolicyOfThatName) {
  auto run = [](auto tag, const std::string& choice) {
    using Cfg = typename decltype(tag)::type;
    tr::set_seed(21);
    auto net = std::make_shared<NetImpl>();
    typename tr::Trainer<NetImpl, Cfg>::Options o;
    o.optimizer.lr = 1e-3;
    o.schedule = {2, 10, 0.5};
    o.ema.rule.decay = 0.5;
    if constexpr (requires { o.precision.mixed_precision; }) o.precision.mixed_precision = choice;
    tr::Trainer<NetImpl, Cfg> trainer(*net, o);
    trainer.fit(source, 3);
    std::vector<at::Tensor> out;
    for (const auto& p : net->parameters()) out.push_back(p.detach().clone());
    return std::make_tuple(out, trainer.fingerprint()["precision"].template get<std::string>(),
                           trainer.scaler().enabled());
  };
  struct Bf16 : ParityConfig {
    using Precision = tr::AutocastBf16;
  };
  struct Fp16 : ParityConfig {
    using Precision = tr::AutocastFp16;
  };
  struct ByName : ParityConfig {
    using Precision = tr::PrecisionByName;
  };
  for (const auto& [choice, want_name] : std::vector<std::pair<std::string, std::string>>{
           {"no", "fp32"}, {"fp32", "fp32"}, {"bf16", "bf16"}, {"fp16", "fp16"}}) {
    SCOPED_TRACE(choice);
    const auto [by_params, by_name, by_scaled] = run(std::type_identity<ByName>{}, choice);
    const auto [st_params, st_name, st_scaled] =
        want_name == "bf16"   ? run(std::type_identity<Bf16>{}, "")
        : want_name == "fp16" ? run(std::type_identity<Fp16>{}, "")
                              : run(std::type_identity<ParityConfig>{}, "");
    EXPECT_EQ(by_name, want_name);
    EXPECT_EQ(st_name, want_name);
    EXPECT_EQ(by_scaled, st_scaled);
    ASSERT_EQ(by_params.size(), st_params.size());
    for (std::size_t i = 0; i < by_params.size(); ++i)
      EXPECT_TRUE(at::equal(by_params[i], st_params[i])) << i;
  }
  auto net = std::make_shared<NetImpl>();
  tr::Trainer<NetImpl, ByName>::Options o;
  o.precision.mixed_precision = "fp8";
  try {
    tr::Trainer<NetImpl, ByName> t(*net, o);
    ADD_FAILURE() << "fp8 accepted";
  } catch (const dt::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("mixed_precision"), std::string::npos) << e.what();
  }
}

// ---- threads on a shared machine
// -----------------------------------------------------------------

// threads_for leaves out the cores other processes keep busy (from 60 % use on), never going
// below one; cpu_load sees a core this process keeps busy while it samples.
TEST(Threads, ThreadsForASharedMachineLeaveBusyCoresOut) {
  const std::vector<std::tuple<int, double, int>> cases = {
      {2, 0.0, 2}, {2, 0.5, 2},   {2, 0.6, 1},   {2, 1.0, 1}, {2, 2.0, 1},
      {2, 5.0, 1}, {16, 3.3, 13}, {16, 0.2, 16}, {1, 0.0, 1}, {8, 7.9, 1}};
  for (const auto& [cores, busy, want] : cases)
    EXPECT_EQ(tr::threads_for({.cores = cores, .busy_elsewhere = busy}), want)
        << cores << " cores, " << busy << " busy";

  const tr::CpuLoad idle = tr::cpu_load(std::chrono::milliseconds(50));
  EXPECT_GE(idle.cores, 1);
  EXPECT_GE(idle.busy_elsewhere, 0.0);
  EXPECT_LE(idle.busy_elsewhere, idle.cores + 0.01);
  std::atomic<bool> stop{false};
  std::thread spinner([&] {
    volatile std::uint64_t x = 0;
    while (!stop.load(std::memory_order_relaxed)) x = x + 1;
  });
  const tr::CpuLoad busy = tr::cpu_load(std::chrono::milliseconds(300));
  stop = true;
  spinner.join();
  EXPECT_GE(busy.busy_elsewhere, 0.5) << "a spinning thread should show as a busy core";
  EXPECT_LE(busy.busy_elsewhere, busy.cores + 0.01);
}
