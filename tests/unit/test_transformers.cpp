// diffusers' diffusion transformers in difftrain: DiTTransformer2DModel's,
// PixArtTransformer2DModel's and SD3Transformer2DModel's outputs and every parameter gradient
// equal diffusers' on the same save_pretrained folders (tests/reference/ref_transformers.py), the
// published DiT-XL/2, PixArt-α, SD3-medium and SD3.5-medium configurations have diffusers'
// parameter names, shapes and counts, label dropout draws
// once per call at diffusers' rate, gradient checkpointing changes no gradient, folders round-trip
// (and load in diffusers: check_cpp_models.py), and config and input mistakes are typed errors that
// name the field.
#include <unistd.h>
#include <difftrain/adapters/lora_inject.hpp>
#include <difftrain/io/remove_tree.hpp>
#include <difftrain/io/safetensors.hpp>
#include <difftrain/models/autoencoder_kl_cogvideox.hpp>
#include <difftrain/models/cogvideox_transformer_3d.hpp>
#include <difftrain/models/dit_transformer_2d.hpp>
#include <difftrain/models/pixart_transformer_2d.hpp>
#include <difftrain/models/pretrained.hpp>
#include <difftrain/models/sd3_transformer_2d.hpp>
#include <difftrain/train/precision.hpp>

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>

#include "golden.hpp"
#include "poison_units.hpp"

namespace dt = difftrain;
namespace fs = std::filesystem;
namespace models = difftrain::models;
namespace tst = difftrain::test;

namespace {

using Backend = dt::nn::attention::Sdpa<dt::nn::attention::Auto>;
using GELU = dt::nn::activation::GELU;
using GELUTanh = dt::nn::activation::GELUTanh;
using QuickGELU = dt::nn::activation::QuickGELU;
template <class Act>
using DiT = models::DiTTransformer2DModel<Backend, Act>;
template <class Act>
using PixArt = models::PixArtTransformer2DModel<Backend, Act>;

fs::path golden_transformers() { return fs::path(DIFFTRAIN_GOLDEN_DIR) / "transformers"; }

fs::path scratch(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() /
                       ("difftrain-transformers-" + name + "-" + std::to_string(::getpid()));
  dt::io::remove_tree(dir);
  fs::create_directories(dir);
  return dir;
}

double scaled_error(const at::Tensor& a, const at::Tensor& b) {
  const double scale = std::max(1.0, b.abs().max().item<double>());
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>() / scale;
}

nlohmann::json read_json(const fs::path& p) { return nlohmann::json::parse(std::ifstream(p)); }

/// A DiT folder's feed-forward activation, as diffusers names it.
std::string activation_of(const fs::path& folder) {
  return read_json(folder / "config.json").value("activation_fn", "gelu-approximate");
}

template <class Act>
void check_dit_case(const std::string& name, std::int64_t parameters) {
  SCOPED_TRACE(name);
  const auto io =
      dt::io::load_safetensors(golden_transformers() / (name + ".io.safetensors"), true);
  const auto& t = io.tensors;
  auto model = models::from_pretrained<DiT<Act>>(golden_transformers() / name);
  model->eval();
  const tst::PoisonUnits units;  // every block a unit: no parameter is used outside its block
  std::int64_t count = 0;
  for (const auto& p : model->parameters()) count += p.numel();
  EXPECT_EQ(count, parameters);
  const at::Tensor out =
      model->forward(t.at("input.sample"), t.at("input.timestep"), t.at("input.class_labels"));
  ASSERT_EQ(out.sizes(), t.at("output").sizes());
  EXPECT_LE(scaled_error(out, t.at("output")), 1e-5) << "output";
  (out * t.at("weight")).sum().backward();
  std::size_t checked = 0;
  for (const auto& p : model->named_parameters()) {
    const auto it = t.find("grad." + p.key());
    ASSERT_NE(it, t.end()) << "no reference gradient for " << p.key();
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    EXPECT_LE(scaled_error(p.value().grad(), it->second), 1e-4) << "grad of " << p.key();
    ++checked;
  }
  EXPECT_EQ(checked, model->parameters().size());
}

/// Every parameter's (and saved buffer's) name and shape equal the reference's state dict;
/// returns the parameter count.
std::int64_t compare_shapes(torch::nn::Module& m, const nlohmann::json& ref) {
  std::map<std::string, std::vector<std::int64_t>> got;
  std::int64_t count = 0;
  for (const auto& p : m.named_parameters()) {
    got[p.key()] = p.value().sizes().vec();
    count += p.value().numel();
  }
  for (const auto& b : m.named_buffers()) got[b.key()] = b.value().sizes().vec();
  std::size_t matched = 0;
  for (const auto& [k, v] : ref["shapes"].items()) {
    const auto it = got.find(k);
    if (it == got.end()) {
      ADD_FAILURE() << "missing " << k;
      continue;
    }
    EXPECT_EQ(it->second, v.get<std::vector<std::int64_t>>()) << k;
    ++matched;
  }
  EXPECT_EQ(matched, got.size()) << "difftrain has parameters diffusers does not";
  EXPECT_EQ(count, ref["parameters"].get<std::int64_t>());
  return count;
}

/// One forward and backward of `model` (through `run`) against a reference case: the output within
/// 1e-5 and every parameter's gradient within 1e-4 of the reference's scale, each parameter
/// checked. Returns the parameter count.
std::int64_t check_against_reference(torch::nn::Module& model,
                                     const std::function<at::Tensor()>& run,
                                     const std::map<std::string, at::Tensor>& t) {
  std::int64_t count = 0;
  for (const auto& p : model.parameters()) count += p.numel();
  const at::Tensor out = run();
  EXPECT_EQ(out.sizes(), t.at("output").sizes());
  if (out.sizes() != t.at("output").sizes()) return count;
  EXPECT_LE(scaled_error(out, t.at("output")), 1e-5) << "output";
  (out * t.at("weight")).sum().backward();
  std::size_t checked = 0;
  for (const auto& p : model.named_parameters()) {
    const auto it = t.find("grad." + p.key());
    if (it == t.end() || !p.value().grad().defined()) {
      ADD_FAILURE() << "no reference gradient or no gradient for " << p.key();
      continue;
    }
    EXPECT_LE(scaled_error(p.value().grad(), it->second), 1e-4) << "grad of " << p.key();
    ++checked;
  }
  EXPECT_EQ(checked, model.parameters().size());
  return count;
}

/// The gradients of a second forward and backward through `run` with checkpointed blocks equal
/// the ones already held (within `tolerance` of their scale).
void expect_checkpointing_keeps_gradients(torch::nn::Module& model,
                                          const std::function<void(bool)>& set_checkpointing,
                                          const std::function<at::Tensor()>& run,
                                          const at::Tensor& weight, double tolerance = 1e-6) {
  std::map<std::string, at::Tensor> plain;
  for (const auto& p : model.named_parameters()) plain[p.key()] = p.value().grad().clone();
  model.zero_grad();
  set_checkpointing(true);
  (run() * weight).sum().backward();
  set_checkpointing(false);
  for (const auto& p : model.named_parameters())
    EXPECT_LE(scaled_error(p.value().grad(), plain.at(p.key())), tolerance) << p.key();
}

template <class Act>
void check_pixart_case(const std::string& name, std::int64_t parameters) {
  SCOPED_TRACE(name);
  const auto io =
      dt::io::load_safetensors(golden_transformers() / (name + ".io.safetensors"), true);
  const auto& t = io.tensors;
  auto model = models::from_pretrained<PixArt<Act>>(golden_transformers() / name);
  model->train();
  const tst::PoisonUnits units;  // every block a unit: no parameter is used outside its block
  std::int64_t count = 0;
  for (const auto& p : model->parameters()) count += p.numel();
  EXPECT_EQ(count, parameters);
  models::PixArtConditions cond;
  cond.encoder_attention_mask = t.at("input.encoder_attention_mask");
  if (t.contains("input.resolution")) {
    cond.resolution = t.at("input.resolution");
    cond.aspect_ratio = t.at("input.aspect_ratio");
  }
  const at::Tensor out = model->forward(t.at("input.sample"), t.at("input.timestep"),
                                        t.at("input.encoder_hidden_states"), cond);
  ASSERT_EQ(out.sizes(), t.at("output").sizes());
  EXPECT_LE(scaled_error(out, t.at("output")), 1e-5) << "output";
  (out * t.at("weight")).sum().backward();
  std::size_t checked = 0;
  for (const auto& p : model->named_parameters()) {
    const auto it = t.find("grad." + p.key());
    ASSERT_NE(it, t.end()) << "no reference gradient for " << p.key();
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    EXPECT_LE(scaled_error(p.value().grad(), it->second), 1e-4) << "grad of " << p.key();
    ++checked;
  }
  EXPECT_EQ(checked, model->parameters().size());
}

/// A small DiT built in the test (no folder): 2 blocks of width 16 on 8×8 latents, 5 classes.
models::DiTTransformer2DConfig small_dit() {
  models::DiTTransformer2DConfig c;
  c.num_attention_heads = 2;
  c.attention_head_dim = 8;
  c.num_layers = 2;
  c.sample_size = 8;
  c.in_channels = 4;
  c.num_embeds_ada_norm = 5;
  return c;
}

template <class Error, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong error type: " << e.what();
    return {};
  }
  ADD_FAILURE() << "no error";
  return {};
}

}  // namespace

TEST(Transformers, DiTMatchesDiffusersOnEverySweptConfig) {
  const auto& cases = tst::golden("transformers.json")["dit"];
  ASSERT_GE(cases.size(), 3U);
  for (const auto& c : cases) {
    const std::string name = c["name"];
    const auto parameters = c["parameters"].get<std::int64_t>();
    const std::string act = activation_of(golden_transformers() / name);
    if (act == "gelu" || act == "geglu")
      check_dit_case<GELU>(name, parameters);
    else if (act == "geglu-approximate")
      check_dit_case<QuickGELU>(name, parameters);
    else
      check_dit_case<GELUTanh>(name, parameters);
  }
}

TEST(Transformers, PublishedDiTConfigsHaveDiffusersParameters) {
  const auto& full = tst::golden("transformers.json")["full_size"];
  // DiT-XL/2 at 256 and 512 pixels differ only in sample_size (the position table is no
  // parameter): the 512 config is read and its shapes compared with the 256 model's.
  EXPECT_EQ(full["dit_xl_2_256"]["shapes"], full["dit_xl_2_512"]["shapes"]);
  const auto c512 =
      models::DiTTransformer2DConfig::from_json(full["dit_xl_2_512"]["config"], "DiT-XL/2-512");
  EXPECT_EQ(c512.sample_size, 64);
  const auto config =
      models::DiTTransformer2DConfig::from_json(full["dit_xl_2_256"]["config"], "DiT-XL/2-256");
  DiT<GELUTanh> model(config);
  EXPECT_EQ(compare_shapes(*model, full["dit_xl_2_256"]), 749'826'464);
  // Nothing but parameters is saved: the position table is computed, as diffusers' is not stored.
  EXPECT_TRUE(model->named_buffers().is_empty());
}

TEST(Transformers, DiTLabelDropoutIsDrawnOncePerCallAtDiffusersRate) {
  at::manual_seed(3);
  auto c = small_dit();
  c.num_layers = 3;
  DiT<GELUTanh> model(c);
  {
    at::NoGradGuard no_grad;
    for (auto& p : model->parameters()) p.add_(at::randn_like(p) * 0.1);
  }
  const std::int64_t n = 2000;
  const at::Tensor x = at::randn({1, 4, 8, 8}).expand({n, 4, 8, 8}).contiguous();
  const at::Tensor t = at::full({n}, 500);
  const at::Tensor labels = at::full({n}, 2, at::kLong);
  at::NoGradGuard no_grad;
  model->eval();
  const at::Tensor conditional =
      model->forward(x.narrow(0, 0, 1), t.narrow(0, 0, 1), labels.narrow(0, 0, 1));
  const at::Tensor null = model->forward(x.narrow(0, 0, 1), t.narrow(0, 0, 1),
                                         at::full({1}, model->null_label(), at::kLong));
  model->train();
  const at::Tensor out = model->forward(x, t, labels);
  const at::Tensor as_cond = (out - conditional).abs().flatten(1).amax(1) < 1e-5;
  const at::Tensor as_null = (out - null).abs().flatten(1).amax(1) < 1e-5;
  // Every sample is wholly conditional or wholly unconditional: one draw served every block.
  EXPECT_TRUE(at::logical_xor(as_cond, as_null).all().item<bool>());
  const double dropped = as_null.to(at::kDouble).mean().item<double>();
  EXPECT_NEAR(dropped, 0.1, 0.025);  // binomial(2000, 0.1): sd 0.0067
  model->set_class_dropout_prob(0.0);
  EXPECT_TRUE(((model->forward(x, t, labels) - conditional).abs().max() < 1e-5).item<bool>());
  EXPECT_NE(error_of<dt::ConfigError>([&] { model->set_class_dropout_prob(1.5); }).find("[0, 1]"),
            std::string::npos);
}

TEST(Transformers, DiTGradientCheckpointingGivesTheSameGradients) {
  at::manual_seed(5);
  DiT<GELUTanh> model(small_dit());
  model->set_class_dropout_prob(0.0);
  const at::Tensor x = at::randn({3, 4, 8, 8});
  const at::Tensor t = at::tensor({10, 500, 999});
  const at::Tensor labels = at::tensor({0, 4, 5}, at::kLong);
  const at::Tensor w = at::randn({3, 4, 8, 8});
  auto grads = [&] {
    model->zero_grad();
    (model->forward(x, t, labels) * w).sum().backward();
    std::map<std::string, at::Tensor> g;
    for (const auto& p : model->named_parameters()) g[p.key()] = p.value().grad().clone();
    return g;
  };
  const auto plain = grads();
  model->set_gradient_checkpointing(true);
  const auto recomputed = grads();
  for (const auto& [k, g] : plain)
    EXPECT_LE((recomputed.at(k) - g).abs().max().item<double>(), 1e-6) << k;
}

TEST(Transformers, DiTInputMistakesAreShapeErrors) {
  DiT<GELUTanh> model(small_dit());
  const at::Tensor x = at::randn({2, 4, 8, 8});
  const at::Tensor t = at::tensor({1, 2});
  const at::Tensor labels = at::tensor({0, 1}, at::kLong);
  auto shape_error = [](auto&& f) { return error_of<dt::ShapeError>(f); };
  EXPECT_NE(shape_error([&] {
              model->forward(at::randn({2, 3, 8, 8}), t, labels);
            }).find("(B, 4, H, W)"),
            std::string::npos);
  EXPECT_NE(shape_error([&] {
              model->forward(at::randn({2, 4, 8, 7}), t, labels);
            }).find("not a multiple of patch_size 2"),
            std::string::npos);
  EXPECT_NE(shape_error([&] {
              model->forward(x, at::tensor({1, 2, 3}), labels);
            }).find("timestep"),
            std::string::npos);
  EXPECT_NE(shape_error([&] { model->forward(x, t, at::Tensor()); }).find("class_labels"),
            std::string::npos);
  EXPECT_NE(shape_error([&] {
              model->forward(x, t, at::tensor({0, 6}, at::kLong));
            }).find("[0, 5]"),
            std::string::npos);
  EXPECT_NE(shape_error([&] {
              model->forward(x, t, at::tensor({0.0, 1.0}));
            }).find("integer labels"),
            std::string::npos);
  // One timestep for the batch, and a non-square latent (diffusers only runs square ones).
  EXPECT_EQ(model->forward(at::randn({2, 4, 6, 10}), at::tensor(7), labels).sizes(),
            (std::vector<std::int64_t>{2, 4, 6, 10}));
}

TEST(Transformers, DiTConfigMistakesAreNamed) {
  const nlohmann::json base = read_json(golden_transformers() / "dit_tiny" / "config.json");
  auto config_error = [&](const nlohmann::json& patch) {
    nlohmann::json j = base;
    j.merge_patch(patch);
    return error_of<dt::ConfigError>(
        [&] { models::DiTTransformer2DConfig::from_json(j, "dit/config.json"); });
  };
  EXPECT_NE(config_error({{"attention_head_dim", 5}}).find("multiple of 4"), std::string::npos);
  EXPECT_NE(config_error({{"norm_type", "ada_norm_single"}}).find("'norm_type'"),
            std::string::npos);
  nlohmann::json no_classes = base;  // (a merge patch would remove a null field, not set it)
  no_classes["num_embeds_ada_norm"] = nullptr;
  EXPECT_NE(error_of<dt::ConfigError>([&] {
              models::DiTTransformer2DConfig::from_json(no_classes, "dit/config.json");
            }).find("'num_embeds_ada_norm' = null"),
            std::string::npos);
  EXPECT_NE(config_error({{"activation_fn", "gelu-fast"}}).find("'activation_fn'"),
            std::string::npos);
  EXPECT_NE(config_error({{"patch_size", 16}}).find("smaller than one patch"), std::string::npos);
  EXPECT_NE(config_error({{"num_layers", 0}}).find("'num_layers'"), std::string::npos);
  EXPECT_NE(config_error({{"cross_attention_dim", 64}}).find("'cross_attention_dim'"),
            std::string::npos);
  EXPECT_NE(config_error({{"sample_sise", 8}}).find("unknown field 'sample_sise'"),
            std::string::npos);
  EXPECT_NE(config_error({{"num_layers", 2.5}}).find("integer"), std::string::npos);
  // The activation policy must be the config's.
  nlohmann::json exact = base;
  exact["activation_fn"] = "gelu";
  const auto c = models::DiTTransformer2DConfig::from_json(exact, "dit");
  EXPECT_NE(error_of<dt::ConfigError>([&] { DiT<GELUTanh> m(c); }).find("nn::activation::GELU"),
            std::string::npos);
  // A UNet folder is not a DiT, and a DiT folder whose weights are another DiT's is refused.
  const fs::path dir = scratch("config");
  fs::copy(golden_transformers() / "dit_tiny", dir / "dit");
  nlohmann::json other = base;
  other["num_layers"] = 3;
  std::ofstream(dir / "dit" / "config.json") << other.dump();
  EXPECT_NE(error_of<dt::ConfigError>([&] {
              models::from_pretrained<DiT<GELUTanh>>(dir / "dit");
            }).find("transformer_blocks."),
            std::string::npos);
  other = base;
  other["_class_name"] = "UNet2DConditionModel";
  std::ofstream(dir / "dit" / "config.json") << other.dump();
  EXPECT_NE(error_of<dt::ConfigError>([&] {
              models::from_pretrained<DiT<GELUTanh>>(dir / "dit");
            }).find("not a DiTTransformer2DModel"),
            std::string::npos);
  dt::io::remove_tree(dir);
}

TEST(Transformers, SavedDiTFolderRoundTrips) {
  const fs::path dir = scratch("roundtrip");
  auto model =
      models::from_pretrained<DiT<QuickGELU>>(golden_transformers() / "dit_patch4_quick_gelu");
  models::save_pretrained(model, dir / "dit");
  auto back = models::from_pretrained<DiT<QuickGELU>>(dir / "dit");
  const auto want = model->named_parameters();
  for (const auto& p : back->named_parameters())
    EXPECT_TRUE(at::equal(p.value(), want[p.key()])) << p.key();
  EXPECT_EQ(back->config().to_json(), model->config().to_json());
  if (const char* out = std::getenv("DIFFTRAIN_MODELS_OUT")) {
    // For check_cpp_models.py: diffusers loads the folder and must give this output.
    models::save_pretrained(model, fs::path(out) / "dit");
    at::manual_seed(11);
    std::map<std::string, at::Tensor> io{{"sample", at::randn({2, 3, 16, 16})},
                                         {"timestep", at::tensor({4, 900})},
                                         {"class_labels", at::tensor({2, 5}, at::kLong)}};
    model->eval();
    at::NoGradGuard no_grad;
    io["output"] = model->forward(io["sample"], io["timestep"], io["class_labels"]);
    dt::io::save_safetensors(fs::path(out) / "outputs_dit.safetensors", io);
  }
  dt::io::remove_tree(dir);
}

TEST(Transformers, PixArtMatchesDiffusersOnEverySweptConfig) {
  const auto& cases = tst::golden("transformers.json")["pixart"];
  ASSERT_GE(cases.size(), 3U);
  for (const auto& c : cases) {
    const std::string name = c["name"];
    const auto parameters = c["parameters"].get<std::int64_t>();
    const std::string act = activation_of(golden_transformers() / name);
    if (act == "gelu" || act == "geglu")
      check_pixart_case<GELU>(name, parameters);
    else
      check_pixart_case<GELUTanh>(name, parameters);
  }
}

TEST(Transformers, PublishedPixArtConfigsHaveDiffusersParameters) {
  const auto& full = tst::golden("transformers.json")["full_size"];
  // 1024 px (sample_size 128) has the resolution and aspect-ratio embedders; 512 px has not.
  const auto c512 = models::PixArtTransformer2DConfig::from_json(full["pixart_xl_2_512"]["config"],
                                                                 "PixArt-XL-2-512");
  EXPECT_FALSE(c512.additional_conditions());
  const auto c1024 = models::PixArtTransformer2DConfig::from_json(
      full["pixart_xl_2_1024"]["config"], "PixArt-XL-2-1024-MS");
  EXPECT_TRUE(c1024.additional_conditions());
  EXPECT_EQ(c1024.position_scale(), 2.0);
  PixArt<GELUTanh> model(c1024);
  EXPECT_EQ(compare_shapes(*model, full["pixart_xl_2_1024"]), 611'349'152);
  EXPECT_EQ(full["pixart_xl_2_512"]["parameters"].get<std::int64_t>(), 610'856'096);
}

TEST(Transformers, PixArtMistakesAreTypedErrors) {
  const fs::path folder = golden_transformers() / "pixart_conditions_legacy";
  auto model = models::from_pretrained<PixArt<GELU>>(folder);
  const at::Tensor x = at::randn({2, 4, 8, 8});
  const at::Tensor t = at::tensor({1, 2});
  const at::Tensor text = at::randn({2, 4, 10});
  models::PixArtConditions cond;
  auto shape_error = [](auto&& f) { return error_of<dt::ShapeError>(f); };
  EXPECT_NE(shape_error([&] { model->forward(x, t, text, cond); }).find("aspect_ratio"),
            std::string::npos);
  cond.resolution = at::tensor({64.0, 64.0, 64.0, 64.0}).view({2, 2});
  cond.aspect_ratio = at::ones({2, 1});
  EXPECT_EQ(model->forward(x, t, text, cond).sizes(), x.sizes());
  EXPECT_NE(shape_error([&] {
              model->forward(x, t, at::randn({2, 4, 12}), cond);
            }).find("(2, L, 10)"),
            std::string::npos);
  cond.encoder_attention_mask = at::ones({2, 5});
  EXPECT_NE(shape_error([&] { model->forward(x, t, text, cond); }).find("encoder_attention_mask"),
            std::string::npos);
  cond.encoder_attention_mask = at::Tensor();
  EXPECT_NE(shape_error([&] {
              model->forward(at::randn({2, 4, 8, 9}), t, text, cond);
            }).find("patch_size 2"),
            std::string::npos);

  const nlohmann::json base = read_json(folder / "config.json");
  auto config_error = [&](const nlohmann::json& patch) {
    nlohmann::json j = base;
    j.merge_patch(patch);
    return error_of<dt::ConfigError>(
        [&] { models::PixArtTransformer2DConfig::from_json(j, "pixart/config.json"); });
  };
  EXPECT_NE(config_error({{"attention_head_dim", 10}}).find("multiple of 3"), std::string::npos);
  EXPECT_NE(config_error({{"caption_channels", 32}}).find("'cross_attention_dim' 10"),
            std::string::npos);
  EXPECT_NE(config_error({{"norm_type", "ada_norm_zero"}}).find("'norm_type'"), std::string::npos);
  EXPECT_NE(config_error({{"attention_type", "gated"}}).find("'attention_type'"),
            std::string::npos);
  EXPECT_NE(config_error({{"sample_sise", 8}}).find("unknown field"), std::string::npos);
  // A DiT folder is not a PixArt one (diffusers' legacy class name with the other norm).
  EXPECT_NE(
      error_of<dt::ConfigError>([&] {
        models::from_pretrained<PixArt<GELU>>(golden_transformers() / "dit_learned_sigma_legacy");
      }).find("not a PixArtTransformer2DModel"),
      std::string::npos);
}

TEST(Transformers, PixArtGradientCheckpointingGivesTheSameGradients) {
  auto model = models::from_pretrained<PixArt<GELUTanh>>(golden_transformers() /
                                                         "pixart_caption_projection");
  model->train();
  at::manual_seed(9);
  const at::Tensor x = at::randn({2, 4, 8, 8});
  const at::Tensor t = at::tensor({3, 700});
  const at::Tensor text = at::randn({2, 5, 12});
  models::PixArtConditions cond;
  cond.encoder_attention_mask = at::tensor({1, 1, 0, 1, 0, 1, 1, 1, 1, 1}).view({2, 5});
  const at::Tensor w = at::randn({2, 8, 8, 8});
  auto grads = [&] {
    model->zero_grad();
    (model->forward(x, t, text, cond) * w).sum().backward();
    std::map<std::string, at::Tensor> g;
    for (const auto& p : model->named_parameters()) g[p.key()] = p.value().grad().clone();
    return g;
  };
  const auto plain = grads();
  model->set_gradient_checkpointing(true);
  const auto recomputed = grads();
  for (const auto& [k, g] : plain)
    EXPECT_LE((recomputed.at(k) - g).abs().max().item<double>(), 1e-6) << k;
}

TEST(Transformers, LoraReachesEveryAttentionAndFeedForwardProjection) {
  // diffusers' target names on both transformers: every attention projection and both
  // feed-forward Linears get a branch; the adapted model starts equal to the base and only the
  // branches learn.
  const std::vector<std::string> targets{"to_q",     "to_k",          "to_v",
                                         "to_out.0", "ff.net.0.proj", "ff.net.2"};
  {
    auto dit = models::from_pretrained<DiT<GELUTanh>>(golden_transformers() / "dit_tiny");
    dit->eval();
    const auto io =
        dt::io::load_safetensors(golden_transformers() / "dit_tiny.io.safetensors", true);
    const auto& t = io.tensors;
    const auto adapted = dt::adapters::inject_lora(*dit, {.target_modules = targets}, {.rank = 2});
    EXPECT_EQ(adapted.size(), 2U * 6U);  // two blocks
    at::Tensor out =
        dit->forward(t.at("input.sample"), t.at("input.timestep"), t.at("input.class_labels"));
    EXPECT_LE(scaled_error(out, t.at("output")), 1e-5);
    (out * t.at("weight")).sum().backward();
    std::size_t with_grad = 0;
    for (const auto& p : dit->named_parameters()) {
      const bool lora = p.key().find("lora_") != std::string::npos;
      EXPECT_EQ(p.value().requires_grad(), lora) << p.key();
      if (lora && p.value().grad().defined()) ++with_grad;
    }
    EXPECT_EQ(with_grad, 2U * adapted.size());  // A and B of each branch
    const auto peft = dt::adapters::lora_state_dict(*dit, {.prefix = "transformer."});
    EXPECT_TRUE(peft.contains("transformer.transformer_blocks.1.ff.net.0.proj.lora_A.weight"));
    EXPECT_TRUE(peft.contains("transformer.transformer_blocks.0.attn1.to_out.0.lora_B.weight"));
  }
  auto pixart = models::from_pretrained<PixArt<GELUTanh>>(golden_transformers() /
                                                          "pixart_caption_projection");
  const auto adapted = dt::adapters::inject_lora(*pixart, {.target_modules = targets}, {.rank = 2});
  EXPECT_EQ(adapted.size(), 2U * 10U);  // two blocks: attn1, attn2 (4 each) and ff (2)
}

TEST(Transformers, SD3MatchesDiffusersOnEverySweptConfig) {
  const auto& cases = tst::golden("transformers.json")["sd3"];
  ASSERT_GE(cases.size(), 3U);
  for (const auto& c : cases) {
    const std::string name = c["name"];
    SCOPED_TRACE(name);
    const auto io =
        dt::io::load_safetensors(golden_transformers() / (name + ".io.safetensors"), true);
    const auto& t = io.tensors;
    auto model = models::from_pretrained<models::SD3Transformer2DModel<Backend>>(
        golden_transformers() / name);
    model->train();
    const tst::PoisonUnits units;  // every block a unit: no parameter is used outside its block
    auto run = [&] {
      return model->forward(t.at("input.sample"), t.at("input.encoder_hidden_states"),
                            t.at("input.pooled_projections"), t.at("input.timestep"));
    };
    EXPECT_EQ(check_against_reference(*model, run, t), c["parameters"].get<std::int64_t>());
    // Checkpointed blocks give the same gradients (both streams and the conditioning pass
    // through the checkpoint).
    expect_checkpointing_keeps_gradients(
        *model, [&](bool on) { model->set_gradient_checkpointing(on); }, run, t.at("weight"));
  }
}

TEST(Transformers, PublishedSD3ConfigsHaveDiffusersParameters) {
  // SD3-medium (2,028,328,000 parameters) and SD3.5-medium (2,243,171,520, qk RMS norm, 13
  // dual-attention blocks): their first blocks and the context-pre-only last one, by name and
  // shape (the reference cut both to three blocks).
  const auto& full = tst::golden("transformers.json")["full_size"];
  EXPECT_EQ(full["sd3_medium"]["full_parameters"].get<std::int64_t>(), 2'028'328'000);
  EXPECT_EQ(full["sd35_medium"]["full_parameters"].get<std::int64_t>(), 2'243'171'520);
  for (const char* key : {"sd3_medium", "sd35_medium"}) {
    SCOPED_TRACE(key);
    models::SD3Transformer2DModel<> model(
        models::SD3Transformer2DConfig::from_json(full[key]["config"], key));
    compare_shapes(*model, full[key]);
  }
}

TEST(Transformers, SD3MistakesAreTypedErrors) {
  const fs::path folder = golden_transformers() / "sd35_qk_norm_dual";
  auto model = models::from_pretrained<models::SD3Transformer2DModel<>>(folder);
  const at::Tensor x = at::randn({2, 4, 6, 6}), text = at::randn({2, 3, 6}),
                   pooled = at::randn({2, 5}), t = at::tensor({1.0, 500.0});
  auto shape_error = [](auto&& f) { return error_of<dt::ShapeError>(f); };
  EXPECT_EQ(model->forward(x, text, pooled, t).sizes(), (std::vector<std::int64_t>{2, 8, 6, 6}));
  EXPECT_NE(shape_error([&] {
              model->forward(at::randn({2, 4, 22, 6}), text, pooled, t);
            }).find("pos_embed_max_size 10"),
            std::string::npos);
  EXPECT_NE(shape_error([&] {
              model->forward(x, at::randn({2, 3, 7}), pooled, t);
            }).find("(2, L, 6)"),
            std::string::npos);
  EXPECT_NE(shape_error([&] {
              model->forward(x, text, at::randn({2, 4}), t);
            }).find("pooled_projections"),
            std::string::npos);
  const nlohmann::json base = read_json(folder / "config.json");
  auto config_error = [&](const nlohmann::json& patch) {
    nlohmann::json j = base;
    j.merge_patch(patch);
    return error_of<dt::ConfigError>(
        [&] { models::SD3Transformer2DConfig::from_json(j, "sd3/config.json"); });
  };
  EXPECT_NE(config_error({{"qk_norm", "layer_norm"}}).find("'qk_norm'"), std::string::npos);
  EXPECT_NE(config_error({{"dual_attention_layers", {0, 3}}}).find("dual_attention_layers"),
            std::string::npos);
  EXPECT_NE(config_error({{"caption_projection_dim", 8}}).find("'caption_projection_dim' 8"),
            std::string::npos);
  EXPECT_NE(config_error({{"pos_embed_max_siz", 8}}).find("unknown field"), std::string::npos);
  // A position table larger than the saved one (4096² positions: 4 GB) is refused by the weights'
  // shapes before it is allocated.
  for (const std::int64_t size : {11, 4096, 8192}) {
    const fs::path d = fs::temp_directory_path() / ("difftrain-sd3-pos-" + std::to_string(size) +
                                                    "-" + std::to_string(::getpid()));
    dt::io::remove_tree(d);
    fs::copy(folder, d);
    nlohmann::json j = base;
    j["pos_embed_max_size"] = size;
    std::ofstream(d / "config.json") << j.dump();
    const auto t0 = std::chrono::steady_clock::now();
    const std::string msg = error_of<dt::ConfigError>(
        [&] { models::from_pretrained<models::SD3Transformer2DModel<>>(d); });
    EXPECT_NE(msg.find("pos_embed.pos_embed"), std::string::npos) << msg;
    EXPECT_NE(msg.find("describe different models"), std::string::npos) << msg;
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 20.0);
    dt::io::remove_tree(d);
  }
  // Its LoRA targets (diffusers' SD3 script): both streams' projections.
  const auto adapted = dt::adapters::inject_lora(
      *model,
      {.target_modules = {"attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj",
                          "attn.to_add_out", "attn.to_k", "attn.to_out.0", "attn.to_q",
                          "attn.to_v"}},
      {.rank = 2});
  // Three blocks: 8 projections each, but the last (context-pre-only) has no to_add_out; the
  // dual blocks' attn2 does not match "attn.".
  EXPECT_EQ(adapted.size(), 3U * 8U - 1U);
}

namespace {
using CogVideoX = models::CogVideoXTransformer3DModel<Backend, GELUTanh>;
using CogVideoXGELU = models::CogVideoXTransformer3DModel<Backend, GELU>;

/// Runs one CogVideoX golden case with the model type its activation needs.
template <class Model>
void check_cogvideox_case(const nlohmann::json& c) {
  const std::string name = c["name"];
  SCOPED_TRACE(name);
  const auto io =
      dt::io::load_safetensors(golden_transformers() / (name + ".io.safetensors"), true);
  const auto& t = io.tensors;
  auto model = models::from_pretrained<Model>(golden_transformers() / name);
  model->train();
  const tst::PoisonUnits units;  // every block a unit: no parameter is used outside its block
  models::CogVideoXConditions cond;
  if (t.contains("input.ofs")) cond.ofs = t.at("input.ofs");
  if (t.contains("input.rotary_cos")) {
    // The tables the model computes for itself are the ones diffusers' pipeline passes.
    const auto& x = t.at("input.hidden_states");
    const std::int64_t p = model->config().patch_size;
    const auto [cos, sin] = model->rotary_embedding(x.size(1), x.size(3) / p, x.size(4) / p);
    EXPECT_LE((cos - t.at("input.rotary_cos")).abs().max().template item<double>(), 1e-6);
    EXPECT_LE((sin - t.at("input.rotary_sin")).abs().max().template item<double>(), 1e-6);
  }
  auto run = [&] {
    return model->forward(t.at("input.hidden_states"), t.at("input.encoder_hidden_states"),
                          t.at("input.timestep"), cond);
  };
  EXPECT_EQ(check_against_reference(*model, run, t), c["parameters"].get<std::int64_t>());
  expect_checkpointing_keeps_gradients(
      *model, [&](bool on) { model->set_gradient_checkpointing(on); }, run, t.at("weight"));
}
}  // namespace

TEST(Transformers, CogVideoXMatchesDiffusersOnEverySweptConfig) {
  const auto& cases = tst::golden("transformers.json")["cogvideox"];
  ASSERT_GE(cases.size(), 5U);
  for (const auto& c : cases) {
    const std::string activation =
        read_json(golden_transformers() / c["name"].get<std::string>() / "config.json")
            .value("activation_fn", "gelu-approximate");
    if (activation == "gelu" || activation == "geglu")
      check_cogvideox_case<CogVideoXGELU>(c);
    else
      check_cogvideox_case<CogVideoX>(c);
  }
}

TEST(Transformers, PublishedCogVideoXConfigsHaveDiffusersParameters) {
  // Their first block by name and shape; the full counts are diffusers'.
  const auto& full = tst::golden("transformers.json")["full_size"];
  EXPECT_EQ(full["cogvideox_2b"]["full_parameters"].get<std::int64_t>(), 1'693'783'872);
  EXPECT_EQ(full["cogvideox_5b"]["full_parameters"].get<std::int64_t>(), 5'570'283'072);
  EXPECT_EQ(full["cogvideox_5b_i2v"]["full_parameters"].get<std::int64_t>(), 5'570'479'680);
  EXPECT_EQ(full["cogvideox15_5b"]["full_parameters"].get<std::int64_t>(), 5'570'676'352);
  EXPECT_EQ(full["cogvideox15_5b_i2v"]["full_parameters"].get<std::int64_t>(), 5'571'594'880);
  for (const char* key : {"cogvideox_2b", "cogvideox_5b", "cogvideox_5b_i2v", "cogvideox15_5b",
                          "cogvideox15_5b_i2v"}) {
    SCOPED_TRACE(key);
    const auto config = models::CogVideoXTransformer3DConfig::from_json(full[key]["config"], key);
    ASSERT_EQ(config.num_layers, 1);
    CogVideoX model(config);
    compare_shapes(*model, full[key]);
  }
}

TEST(Transformers, CogVideoXMistakesAreTypedErrors) {
  auto sincos = models::from_pretrained<CogVideoX>(golden_transformers() / "cogvideox_sincos");
  auto rotary15 = models::from_pretrained<CogVideoX>(golden_transformers() / "cogvideox15_ofs");
  auto learned =
      models::from_pretrained<CogVideoX>(golden_transformers() / "cogvideox_rotary_learned");
  const at::Tensor t = at::tensor({3, 500});
  auto shape_error = [](auto&& f) { return error_of<dt::ShapeError>(f); };
  // The fixed table covers exactly max_text_seq_length text tokens.
  EXPECT_NE(shape_error([&] {
              sincos->forward(at::randn({2, 3, 4, 6, 8}), at::randn({2, 4, 10}), t);
            }).find("max_text_seq_length = 5"),
            std::string::npos);
  EXPECT_NE(shape_error([&] {
              sincos->forward(at::randn({2, 4, 3, 6, 8}), at::randn({2, 5, 10}), t);
            }).find("(B, F, 4, H, W)"),
            std::string::npos);
  EXPECT_NE(shape_error([&] {
              sincos->forward(at::randn({2, 3, 4, 5, 8}), at::randn({2, 5, 10}), t);
            }).find("not a multiple"),
            std::string::npos);
  // CogVideoX 1.5: frames in pairs, the ofs required, grids within the base grid.
  models::CogVideoXConditions ofs;
  ofs.ofs = at::tensor({2.0});
  const at::Tensor text15 = at::randn({2, 3, 7});
  EXPECT_EQ(rotary15->forward(at::randn({2, 2, 3, 4, 6}), text15, t, ofs).sizes(),
            (std::vector<std::int64_t>{2, 2, 6, 4, 6}));
  EXPECT_NE(shape_error([&] {
              rotary15->forward(at::randn({2, 3, 3, 4, 6}), text15, t, ofs);
            }).find("pad the latent frames"),
            std::string::npos);
  EXPECT_NE(shape_error([&] {
              rotary15->forward(at::randn({2, 2, 3, 4, 6}), text15, t);
            }).find("ofs"),
            std::string::npos);
  EXPECT_NE(shape_error([&] {
              rotary15->forward(at::randn({2, 2, 3, 8, 6}), text15, t, ofs);
            }).find("larger than the configured 3x4"),
            std::string::npos);
  models::CogVideoXConditions wrong_tables = ofs;
  wrong_tables.rotary_cos = wrong_tables.rotary_sin = at::zeros({5, 16});
  EXPECT_NE(shape_error([&] {
              rotary15->forward(at::randn({2, 2, 3, 4, 6}), text15, t, wrong_tables);
            }).find("rotary tables"),
            std::string::npos);
  // The learned table holds one size.
  EXPECT_NE(shape_error([&] {
              learned->forward(at::randn({2, 2, 6, 6, 4}), at::randn({2, 4, 5}), t);
            }).find("learned position table"),
            std::string::npos);
  const nlohmann::json base = read_json(golden_transformers() / "cogvideox_rotary" / "config.json");
  auto config_error = [&](const nlohmann::json& patch) {
    nlohmann::json j = base;
    j.merge_patch(patch);
    return error_of<dt::ConfigError>(
        [&] { models::CogVideoXTransformer3DConfig::from_json(j, "transformer/config.json"); });
  };
  EXPECT_NE(config_error({{"use_rotary_positional_embeddings", false},
                          {"use_learned_positional_embeddings", true}})
                .find("diffusers refuses the pair"),
            std::string::npos);
  EXPECT_NE(config_error({{"patch_size_t", 2}, {"use_rotary_positional_embeddings", false}})
                .find("'patch_size_t'"),
            std::string::npos);
  EXPECT_NE(config_error({{"attention_head_dim", 24}}).find("multiple of 16"), std::string::npos);
  EXPECT_NE(config_error({{"timestep_activation_fn", "gelu"}}).find("timestep_activation_fn"),
            std::string::npos);
  EXPECT_NE(config_error({{"ofs_embed_dim", 7}}).find("'ofs_embed_dim' 7"), std::string::npos);
  nlohmann::json null_out = base;
  null_out["out_channels"] = nullptr;  // (a merge patch would remove the key)
  EXPECT_NE(error_of<dt::ConfigError>([&] {
              models::CogVideoXTransformer3DConfig::from_json(null_out, "transformer/config.json");
            }).find("'out_channels' = null"),
            std::string::npos);
  EXPECT_NE(config_error({{"use_rotary_embeddings", true}}).find("unknown field"),
            std::string::npos);
  // A config whose activation needs another policy names it.
  EXPECT_NE(error_of<dt::ConfigError>([&] {
              models::from_pretrained<CogVideoX>(golden_transformers() / "cogvideox_rotary");
            }).find("nn::activation::GELU"),
            std::string::npos);
}

TEST(Transformers, CogVideoXLoraAndSavedFoldersRoundTrip) {
  // LoRA on diffusers' CogVideoX targets (its training script's to_q, to_k, to_v, to_out.0).
  auto model =
      models::from_pretrained<CogVideoX>(golden_transformers() / "cogvideox_rotary_learned");
  const auto adapted = dt::adapters::inject_lora(
      *model, {.target_modules = {"to_k", "to_out.0", "to_q", "to_v"}}, {.rank = 4});
  EXPECT_EQ(adapted.size(), 2U * 4U);
  // The learned table is a saved buffer: it survives a save and a load.
  auto plain =
      models::from_pretrained<CogVideoX>(golden_transformers() / "cogvideox_rotary_learned");
  const fs::path dir = scratch("cogvideox");
  models::save_pretrained(plain, dir / "transformer");
  auto back = models::from_pretrained<CogVideoX>(dir / "transformer");
  const auto want = plain->named_parameters();
  for (const auto& p : back->named_parameters())
    EXPECT_TRUE(at::equal(p.value(), want[p.key()])) << p.key();
  EXPECT_TRUE(at::equal(back->patch_embed->pos_embedding, plain->patch_embed->pos_embedding));
  EXPECT_EQ(back->config().to_json(), plain->config().to_json());
  if (const char* out = std::getenv("DIFFTRAIN_MODELS_OUT")) {
    // For check_cpp_models.py: diffusers loads the folder and must give this output.
    models::save_pretrained(plain, fs::path(out) / "cogvideox");
    at::manual_seed(12);
    std::map<std::string, at::Tensor> io{{"hidden_states", at::randn({2, 2, 6, 4, 4})},
                                         {"encoder_hidden_states", at::randn({2, 4, 5})},
                                         {"timestep", at::tensor({4, 900})}};
    const auto [cos, sin] = plain->rotary_embedding(2, 2, 2);
    io["rotary_cos"] = cos;
    io["rotary_sin"] = sin;
    plain->eval();
    at::NoGradGuard no_grad;
    io["output"] = plain->forward(io["hidden_states"], io["encoder_hidden_states"], io["timestep"]);
    dt::io::save_safetensors(fs::path(out) / "outputs_cogvideox.safetensors", io);
  }
  dt::io::remove_tree(dir);
}

// CogVideoX 1.0's fixed position table is diffusers' float64 table (float32 positions, float64
// frequencies): equal to the bit in float64, and its float32 rounding in a float32 model.
TEST(Transformers, CogVideoXSincosTableIsDiffusersFloat64Table) {
  const auto tables =
      dt::io::load_safetensors(golden_transformers() / "cogvideox_sincos_tables.safetensors", true)
          .tensors;
  ASSERT_EQ(tables.size(), 2U);
  for (const auto& [name, want] : tables) {
    SCOPED_TRACE(name);
    std::int64_t dim = 0, frames = 0, h = 0, w = 0;
    double ss = 0, ts = 0;
    ASSERT_EQ(
        std::sscanf(name.c_str(), "table_%ld_%ld_%ld_%ld_%lf_%lf", &dim, &frames, &h, &w, &ss, &ts),
        6);
    const at::Tensor got = models::sincos_3d_pos_embed(dim, frames, h, w, ss, ts);
    ASSERT_EQ(got.scalar_type(), at::kDouble);
    ASSERT_EQ(got.sizes(), want.sizes());
    EXPECT_LE((got - want).abs().max().item<double>(), 1e-14);
  }
}

namespace {
/// Gives every LoRA branch of `model` non-zero weights (B starts at zero).
void perturb_lora(torch::nn::Module& model) {
  at::NoGradGuard no_grad;
  for (const auto& [name, h] : dt::adapters::lora_layers(model)) h->lora_b().normal_(0.0, 0.2);
}

/// Writes `model`'s branches as a diffusers LoRA file (PEFT keys under "transformer.", the adapter
/// metadata) and loads it into `fresh` as a reader of that file does: the same output.
template <class Model, class Run>
void expect_lora_file_round_trip(Model& model, Model& fresh, const fs::path& file, Run run) {
  const auto keys = dt::adapters::LoraKeyOptions{dt::adapters::LoraLayout::peft, "transformer."};
  nlohmann::json adapter;
  dt::adapters::add_peft_adapter_metadata(adapter, *model, "transformer");
  dt::io::save_safetensors(file, dt::adapters::lora_state_dict(*model, keys),
                           dt::adapters::lora_file_metadata(adapter));
  const auto read = dt::io::load_safetensors(file, true);
  // Every branch here has one rank and alpha: read them as diffusers does.
  const std::int64_t rank = read.tensors.begin()->second.size(0);
  const auto defaults = dt::adapters::peft_lora_defaults(
      read.metadata, "transformer", dt::adapters::lora_layers(*model).front().first, rank);
  EXPECT_EQ(defaults.alpha, 6.0);
  (void)dt::adapters::load_lora_state_dict(*fresh, read.tensors, keys, defaults);
  at::NoGradGuard no_grad;
  model->eval();
  fresh->eval();
  EXPECT_TRUE(at::allclose(run(model), run(fresh), 1e-6, 1e-6));
}
}  // namespace

TEST(Transformers, TransformerLoraFilesCarryTheirScaleAndSatKeys) {
  // SD3: diffusers' SD3 targets on both streams, rank 2 with alpha 6 (scale 3: a reader that took
  // alpha = rank would apply a third of it).
  const fs::path dir = scratch("lora-files");
  const std::vector<std::string> sd3_targets{
      "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
      "attn.to_k",       "attn.to_out.0",   "attn.to_q",       "attn.to_v"};
  using SD3 = models::SD3Transformer2DModel<Backend>;
  auto sd3 = models::from_pretrained<SD3>(golden_transformers() / "sd3_tiny");
  auto sd3_fresh = models::from_pretrained<SD3>(golden_transformers() / "sd3_tiny");
  (void)dt::adapters::inject_lora(*sd3, {.target_modules = sd3_targets}, {.rank = 2, .alpha = 6.0});
  perturb_lora(*sd3);
  at::manual_seed(13);
  std::map<std::string, at::Tensor> sd3_io{{"sample", at::randn({2, 4, 8, 8})},
                                           {"encoder_hidden_states", at::randn({2, 5, 12})},
                                           {"pooled_projections", at::randn({2, 10})},
                                           {"timestep", at::tensor({30.0, 700.0})}};
  auto run_sd3 = [&](SD3& m) {
    return m->forward(sd3_io["sample"], sd3_io["encoder_hidden_states"],
                      sd3_io["pooled_projections"], sd3_io["timestep"]);
  };
  expect_lora_file_round_trip(sd3, sd3_fresh, dir / "sd3_lora.safetensors", run_sd3);

  // CogVideoX: its LoRA targets, the same file form, and SAT's keys both ways.
  auto cog = models::from_pretrained<CogVideoX>(golden_transformers() / "cogvideox_sincos");
  auto cog_fresh = models::from_pretrained<CogVideoX>(golden_transformers() / "cogvideox_sincos");
  (void)dt::adapters::inject_lora(*cog, {.target_modules = {"to_k", "to_out.0", "to_q", "to_v"}},
                                  {.rank = 2, .alpha = 6.0});
  perturb_lora(*cog);
  std::map<std::string, at::Tensor> cog_io{{"hidden_states", at::randn({2, 3, 4, 6, 8})},
                                           {"encoder_hidden_states", at::randn({2, 5, 10})},
                                           {"timestep", at::tensor({30, 700})}};
  auto run_cog = [&](CogVideoX& m) {
    return m->forward(cog_io["hidden_states"], cog_io["encoder_hidden_states"], cog_io["timestep"]);
  };
  expect_lora_file_round_trip(cog, cog_fresh, dir / "cogvideox_lora.safetensors", run_cog);
  const auto diffusers_keys =
      dt::adapters::lora_state_dict(*cog, {dt::adapters::LoraLayout::peft, "transformer."});
  const auto sat = dt::adapters::diffusers_to_sat_lora(diffusers_keys);
  EXPECT_EQ(sat.size(), diffusers_keys.size());
  EXPECT_TRUE(sat.contains(
      "model.diffusion_model.transformer.layers.1.attention.query_key_value.matrix_B.2"));
  EXPECT_TRUE(
      sat.contains("model.diffusion_model.transformer.layers.0.attention.dense.matrix_A.0"));
  const auto back = dt::adapters::sat_to_diffusers_lora(sat);
  ASSERT_EQ(back.size(), diffusers_keys.size());
  for (const auto& [k, v] : diffusers_keys) EXPECT_TRUE(at::equal(back.at(k), v)) << k;
  // A branch SAT does not have (the feed-forward) has no SAT key; an unknown SAT key is named.
  EXPECT_NE(error_of<dt::ConfigError>([&] {
              (void)dt::adapters::diffusers_to_sat_lora(
                  {{"transformer.transformer_blocks.0.ff.net.2.lora_A.weight", at::zeros({1})}});
            }).find("ff.net.2"),
            std::string::npos);
  EXPECT_NE(error_of<dt::ConfigError>([&] {
              (void)dt::adapters::sat_to_diffusers_lora(
                  {{"model.diffusion_model.mixins.pos_embed.freqs_cos", at::zeros({1})}});
            }).find("freqs_cos"),
            std::string::npos);

  if (const char* out = std::getenv("DIFFTRAIN_MODELS_OUT")) {
    // For check_cpp_models.py: diffusers' load_lora_weights reads both files onto its own
    // transformers and must give these outputs.
    const fs::path o(out);
    fs::copy_file(dir / "sd3_lora.safetensors", o / "sd3_lora.safetensors",
                  fs::copy_options::overwrite_existing);
    fs::copy_file(dir / "cogvideox_lora.safetensors", o / "cogvideox_lora.safetensors",
                  fs::copy_options::overwrite_existing);
    at::NoGradGuard no_grad;
    sd3_io["output"] = run_sd3(sd3);
    cog_io["output"] = run_cog(cog);
    dt::io::save_safetensors(o / "outputs_sd3_lora.safetensors", sd3_io);
    dt::io::save_safetensors(o / "outputs_cogvideox_lora.safetensors", cog_io);
  }
  dt::io::remove_tree(dir);
}

TEST(Transformers, QkNormedTransformersRunUnderBf16Autocast) {
  // SD3.5's RMS and CogVideoX's layer norms give float32 queries and keys under autocast beside
  // bf16 values: the attention takes them in the autocast dtype, as autocast does for diffusers'
  // SDPA call, and the output stays near float32's.
  at::NoGradGuard no_grad;
  {
    const auto t =
        dt::io::load_safetensors(golden_transformers() / "sd35_qk_norm_dual.io.safetensors", true)
            .tensors;
    auto sd3 = models::from_pretrained<models::SD3Transformer2DModel<Backend>>(
        golden_transformers() / "sd35_qk_norm_dual");
    at::Tensor out;
    {
      dt::train::AutocastGuard autocast(c10::kCPU, at::kBFloat16);
      out = sd3->forward(t.at("input.sample"), t.at("input.encoder_hidden_states"),
                         t.at("input.pooled_projections"), t.at("input.timestep"));
    }
    EXPECT_LE(scaled_error(out.to(at::kFloat), t.at("output")), 5e-2) << "SD3 under bf16";
  }
  const auto t = dt::io::load_safetensors(
                     golden_transformers() / "cogvideox_rotary_learned.io.safetensors", true)
                     .tensors;
  auto cog = models::from_pretrained<CogVideoX>(golden_transformers() / "cogvideox_rotary_learned");
  at::Tensor out;
  {
    dt::train::AutocastGuard autocast(c10::kCPU, at::kBFloat16);
    out = cog->forward(t.at("input.hidden_states"), t.at("input.encoder_hidden_states"),
                       t.at("input.timestep"));
  }
  EXPECT_LE(scaled_error(out.to(at::kFloat), t.at("output")), 5e-2) << "CogVideoX under bf16";
}

// ---- AutoencoderKLCogVideoX
// ----------------------------------------------------------------------

namespace {
template <class Act>
using CogVae = models::AutoencoderKLCogVideoX<Act>;

fs::path golden_cogvideox_vae() { return fs::path(DIFFTRAIN_GOLDEN_DIR) / "cogvideox_vae"; }

template <class Act>
void check_cogvideox_vae_case(const nlohmann::json& c) {
  const std::string name = c["name"].get<std::string>();
  SCOPED_TRACE(name);
  const auto t =
      dt::io::load_safetensors(golden_cogvideox_vae() / (name + ".io.safetensors"), true).tensors;
  auto model = models::from_pretrained<CogVae<Act>>(golden_cogvideox_vae() / name);
  model->train();
  if (!c["frame_batches"].is_null())
    model->set_frame_batches(
        {c["frame_batches"][0].get<std::int64_t>(), c["frame_batches"][1].get<std::int64_t>()});
  const at::Tensor x = t.at("input.sample");
  {
    at::NoGradGuard no_grad;
    const auto posterior = model->encode(x);
    const at::Tensor moments = at::cat({posterior.mean, posterior.logvar}, 1);
    ASSERT_EQ(moments.sizes(), t.at("moments").sizes());
    EXPECT_LE(scaled_error(moments, t.at("moments")), 1e-5) << "moments";
    EXPECT_EQ(model->latent_frames(x.size(2)), moments.size(2));
  }
  auto run = [&] { return model->forward(x); };
  EXPECT_EQ(check_against_reference(*model, run, t), c["parameters"].get<std::int64_t>());
  // Checkpointed resnets (their carried frames packed through the checkpoint) change nothing but
  // the order float sums are taken in (deep convolutions: 1e-5 of the gradients' scale).
  expect_checkpointing_keeps_gradients(
      *model, [&](bool on) { model->set_gradient_checkpointing(on); }, run, t.at("weight"), 1e-5);
}
}  // namespace

TEST(CogVideoXVae, MatchesDiffusersOnEverySweptConfig) {
  const auto& cases = tst::golden("cogvideox_vae.json")["cases"];
  ASSERT_GE(cases.size(), 5U);
  for (const auto& c : cases) {
    const auto act =
        read_json(golden_cogvideox_vae() / c["name"].get<std::string>() / "config.json")
            .value("act_fn", "silu");
    if (act == "mish")
      check_cogvideox_vae_case<dt::nn::activation::Mish>(c);
    else
      check_cogvideox_vae_case<dt::nn::activation::SiLU>(c);
  }
}

TEST(CogVideoXVae, TiledEncodeAndDecodeMatchDiffusers) {
  const auto& c = tst::golden("cogvideox_vae.json")["tiled"];
  const auto t =
      dt::io::load_safetensors(golden_cogvideox_vae() / "tiled.io.safetensors", true).tensors;
  auto model =
      models::from_pretrained<CogVae<dt::nn::activation::SiLU>>(golden_cogvideox_vae() / "tiled");
  model->eval();
  model->set_frame_batches({4, 2});
  model->enable_tiling();  // the config's sample size halved, diffusers' overlaps
  EXPECT_EQ(model->tiling()->sample_height, c["tile_sample_min_height"].get<std::int64_t>());
  EXPECT_EQ(model->tiling()->sample_width, c["tile_sample_min_width"].get<std::int64_t>());
  at::NoGradGuard no_grad;
  const auto posterior = model->encode(t.at("input.sample"));
  const at::Tensor moments = at::cat({posterior.mean, posterior.logvar}, 1);
  ASSERT_EQ(moments.sizes(), t.at("moments").sizes());
  EXPECT_LE(scaled_error(moments, t.at("moments")), 1e-5);
  const at::Tensor video = model->decode(t.at("input.latents"));
  ASSERT_EQ(video.sizes(), t.at("decoded").sizes());
  EXPECT_LE(scaled_error(video, t.at("decoded")), 1e-5);
  // Slicing runs one video at a time and gives the same result.
  model->enable_slicing();
  const at::Tensor two = at::cat({t.at("input.latents"), t.at("input.latents")});
  const at::Tensor sliced = model->decode(two);
  EXPECT_LE(scaled_error(sliced.narrow(0, 1, 1), t.at("decoded")), 1e-6);
  // Without tiling the result differs (each tile saw only its part; diffusers' crops can even
  // change the size), as in diffusers.
  model->disable_tiling();
  const at::Tensor whole = model->decode(t.at("input.latents"));
  const std::int64_t h = std::min(whole.size(3), video.size(3));
  const std::int64_t w = std::min(whole.size(4), video.size(4));
  EXPECT_GT(
      scaled_error(whole.narrow(3, 0, h).narrow(4, 0, w), video.narrow(3, 0, h).narrow(4, 0, w)),
      1e-3);
}

TEST(CogVideoXVae, PublishedConfigHasDiffusersParameters) {
  const auto& ref = tst::golden("cogvideox_vae.json")["published"];
  EXPECT_EQ(ref["parameters"].get<std::int64_t>(), 215'583'907);
  const auto config = models::AutoencoderKLCogVideoXConfig::from_json(ref["config"], "vae");
  CogVae<dt::nn::activation::SiLU> model(config);
  compare_shapes(*model, ref);
  // diffusers' default config is this one: the struct's defaults equal it.
  EXPECT_EQ(models::AutoencoderKLCogVideoXConfig{}.to_json().dump(),
            models::AutoencoderKLCogVideoXConfig::from_json(ref["config"], "vae").to_json().dump());
  // 49 frames (CogVideoX's videos) give 13 latent frames in diffusers' 8-frame batches.
  EXPECT_EQ(model->latent_frames(49), 13);
  EXPECT_EQ(model->spatial_downscale(), 8);
}

TEST(CogVideoXVae, SafeConvolutionChunksGiveTheSameResult) {
  // diffusers splits 3-D convolutions over 2 GiB into frame chunks overlapping by kernel − 1;
  // with a tiny limit the chunked result equals the plain one.
  torch::nn::Conv3d conv(torch::nn::Conv3dOptions(3, 4, 3).padding({0, 1, 1}));
  const at::Tensor x = at::randn({2, 3, 11, 5, 6});
  const at::Tensor plain = conv->forward(x);
  const at::Tensor chunked = models::cogvideox_vae_detail::safe_conv3d(*conv, x, 1e-6);
  ASSERT_EQ(chunked.sizes(), plain.sizes());
  EXPECT_LE((chunked - plain).abs().max().item<double>(), 1e-5);
}

TEST(CogVideoXVae, MistakesAreTypedErrors) {
  const fs::path folder = golden_cogvideox_vae() / "two_levels_odd_frames";
  auto model = models::from_pretrained<CogVae<dt::nn::activation::SiLU>>(folder);
  auto shape_error = [](auto&& f) { return error_of<dt::ShapeError>(f); };
  EXPECT_NE(shape_error([&] {
              model->encode(at::randn({1, 3, 8, 8}));
            }).find("(B, 3, frames"),
            std::string::npos);
  EXPECT_NE(shape_error([&] {
              model->encode(at::randn({1, 4, 2, 8, 8}));
            }).find("(B, 3, frames"),
            std::string::npos);
  EXPECT_NE(shape_error([&] {
              model->decode(at::randn({1, 3, 2, 4, 4}));
            }).find("(B, 4, frames"),
            std::string::npos);
  EXPECT_NE(shape_error([&] {
              model->decode(at::randn({1, 4, 0, 4, 4}));
            }).find("empty"),
            std::string::npos);
  EXPECT_NE(error_of<dt::ConfigError>([&] {
              model->set_frame_batches({0, 2});
            }).find("at least"),
            std::string::npos);
  EXPECT_NE(error_of<dt::ConfigError>([&] {
              model->enable_tiling({.sample_height = 1, .sample_width = 8});
            }).find("do not advance"),
            std::string::npos);
  const nlohmann::json base = read_json(folder / "config.json");
  auto config_error = [&](const nlohmann::json& patch) {
    nlohmann::json j = base;
    j.merge_patch(patch);
    return error_of<dt::ConfigError>(
        [&] { models::AutoencoderKLCogVideoXConfig::from_json(j, "vae/config.json"); });
  };
  EXPECT_NE(config_error({{"temporal_compression_ratio", 3}}).find("power of two"),
            std::string::npos);
  EXPECT_NE(config_error({{"temporal_compression_ratio", 4}}).find("needs 3 blocks"),
            std::string::npos);
  EXPECT_NE(config_error({{"down_block_types", {"DownEncoderBlock2D", "CogVideoXDownBlock3D"}}})
                .find("DownEncoderBlock2D"),
            std::string::npos);
  EXPECT_NE(config_error({{"use_quant_conv", true}}).find("use_quant_conv"), std::string::npos);
  EXPECT_NE(config_error({{"norm_eps", 0}}).find("norm_eps"), std::string::npos);
  EXPECT_NE(config_error({{"sample_heigth", 8}}).find("unknown field"), std::string::npos);
  // A config for another activation than the type's, and a weight file of another shape.
  nlohmann::json mish = base;
  mish["act_fn"] = "mish";
  EXPECT_NE(error_of<dt::ConfigError>([&] {
              CogVae<dt::nn::activation::SiLU>(
                  models::AutoencoderKLCogVideoXConfig::from_json(mish, "vae"));
            }).find("act_fn"),
            std::string::npos);
  const fs::path copy = scratch("cogvae");
  fs::copy(folder, copy, fs::copy_options::recursive);
  nlohmann::json wider = base;
  wider["block_out_channels"] = {8, 24};
  std::ofstream(copy / "config.json") << wider.dump();
  EXPECT_THROW(models::from_pretrained<CogVae<dt::nn::activation::SiLU>>(copy), dt::Error);
  dt::io::remove_tree(copy);
}

TEST(CogVideoXVae, SavedFolderRoundTripsAndLatentsScale) {
  const fs::path folder = golden_cogvideox_vae() / "small_batches_even_frames";
  auto model = models::from_pretrained<CogVae<dt::nn::activation::SiLU>>(folder);
  model->eval();
  const fs::path out = scratch("cogvae-save");
  models::save_pretrained(model, out / "vae");
  auto again = models::from_pretrained<CogVae<dt::nn::activation::SiLU>>(out / "vae");
  again->eval();
  at::NoGradGuard no_grad;
  const at::Tensor x = at::randn({1, 3, 5, 8, 8});
  EXPECT_TRUE(at::equal(model->forward(x), again->forward(x)));
  // encode_latents scales a posterior sample by scaling_factor (0.7 here); decode_latents undoes
  // it before decoding; image latents follow invert_scale_latents.
  at::Generator g1 = at::detail::createCPUGenerator(3), g2 = at::detail::createCPUGenerator(3);
  const at::Tensor z = model->encode_latents(x, g1);
  EXPECT_TRUE(at::allclose(z, model->encode(x).sample(g2) * 0.7));
  EXPECT_TRUE(at::allclose(model->decode_latents(z), model->decode(z / 0.7)));
  EXPECT_TRUE(at::allclose(model->image_latents_scaled(z), z * 0.7));
  if (const char* dir = std::getenv("DIFFTRAIN_MODELS_OUT")) {
    // For check_cpp_models.py: diffusers loads difftrain's folder (weights moved off the
    // reference's) and must give these moments and this reconstruction (9 frames: two 8-frame
    // batches' worth, so the carried frames matter).
    for (const auto& p : model->parameters()) p.add_(at::randn_like(p) * 0.01);
    models::save_pretrained(model, fs::path(dir) / "cogvideox_vae");
    std::map<std::string, at::Tensor> io{{"x", at::randn({1, 3, 9, 8, 8})}};
    io["mean"] = model->encode(io["x"]).mean;
    io["recon"] = model->forward(io["x"]);
    dt::io::save_safetensors(fs::path(dir) / "outputs_cogvideox_vae.safetensors", io);
  }
  dt::io::remove_tree(out);
}

TEST(Units, InUnitTellsTheOneListenerWhatTheBlockReturned) {
  struct Recorder final : dt::nn::UnitListener {
    std::vector<std::size_t> outputs;
    std::int64_t entered = 0;
    void enter(const torch::nn::Module& /*unit*/) override { ++entered; }
    void leave(const torch::nn::Module& /*unit*/, const std::vector<at::Tensor>& o) override {
      outputs.push_back(o.size());
    }
  } recorder, other;
  torch::nn::Linear block(2, 2);
  const at::Tensor x = at::ones({1, 2});
  // Without a listener the block just runs.
  EXPECT_TRUE(at::equal(dt::nn::in_unit(*block, [&] { return x * 2; }), x * 2));
  ASSERT_TRUE(dt::nn::listen_to_units(&recorder));
  EXPECT_FALSE(dt::nn::listen_to_units(&other)) << "one listener per process";
  // Every defined tensor of a pair, vector or tuple is an output; the result passes through.
  const auto pair = dt::nn::in_unit(*block, [&] {
    return std::make_pair(x, std::vector<at::Tensor>{x + 1, at::Tensor(), x + 2});
  });
  EXPECT_TRUE(at::equal(pair.second[2], x + 2));
  (void)dt::nn::in_unit(*block, [&] { return std::make_tuple(x, x, x); });
  EXPECT_THROW(
      (void)dt::nn::in_unit(*block, [&]() -> at::Tensor { throw std::runtime_error("!"); }),
      std::runtime_error);
  dt::nn::stop_listening_to_units(&other);  // not the listener: changes nothing
  (void)dt::nn::in_unit(*block, [&] { return x; });
  dt::nn::stop_listening_to_units(&recorder);
  (void)dt::nn::in_unit(*block, [&] { return x; });
  EXPECT_EQ(recorder.entered, 4);
  EXPECT_EQ(recorder.outputs, (std::vector<std::size_t>{3, 3, 0, 1}))
      << "a block that threw leaves with no outputs";
  ASSERT_TRUE(dt::nn::listen_to_units(&other));  // free again
  dt::nn::stop_listening_to_units(&other);
}

TEST(Units, TheDiTRunsEveryBlockAsAUnitAndItsFirstAgainForTheFinalModulation) {
  DiT<GELUTanh> model(small_dit());
  model->set_class_dropout_prob(0.0);
  const at::Tensor x = at::randn({2, 4, 8, 8});
  const at::Tensor t = at::tensor({10, 500});
  const at::Tensor labels = at::tensor({0, 4}, at::kLong);
  const at::Tensor plain = model->forward(x, t, labels);
  const tst::PoisonUnits units;
  const at::Tensor poisoned = model->forward(x, t, labels);
  EXPECT_EQ(units.entered(), 3);  // two blocks, and the first again
  EXPECT_TRUE(at::allclose(plain, poisoned, 1e-6, 1e-6));
}
