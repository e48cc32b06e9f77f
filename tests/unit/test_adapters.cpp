// LoRA: layer numerics and gradients against PEFT's rule (tests/reference/ref_lora.py), merge and
// unmerge, injection by name, freezing, the PEFT and kohya file layouts, the SAT key mapping.
#include <difftrain/adapters/adapters.hpp>
#include <difftrain/core/python_strings.hpp>
#include <difftrain/io/safetensors.hpp>
#include <difftrain/models/models.hpp>
#include <difftrain/nn/blocks/cross_attention.hpp>
#include <difftrain/nn/blocks/transformer_block.hpp>
#include <difftrain/train/optimizer.hpp>

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

namespace dt = difftrain;
namespace ad = difftrain::adapters;
namespace fs = std::filesystem;

namespace {

std::map<std::string, at::Tensor> golden_lora(const std::string& name) {
  return dt::io::load_safetensors(
             fs::path(DIFFTRAIN_GOLDEN_DIR) / ("lora_" + name + ".safetensors"), true)
      .tensors;
}

template <class Layer>
void check_against_reference(Layer& layer, const std::map<std::string, at::Tensor>& r,
                             const ad::LoraOptions& o) {
  layer->to(at::kDouble);
  layer->attach_lora(o);
  {
    at::NoGradGuard no_grad;
    layer->weight.copy_(r.at("w.weight"));
    layer->bias.copy_(r.at("w.bias"));
    layer->lora_A->weight.copy_(r.at("w.lora_A.weight"));
    layer->lora_B->weight.copy_(r.at("w.lora_B.weight"));
  }
  const at::Tensor x = r.at("in.x").clone().requires_grad_(true);
  const at::Tensor y = layer->forward(x);
  EXPECT_TRUE(at::allclose(y, r.at("out.y"), 1e-10, 1e-12));
  (y * r.at("in.probe")).sum().backward();
  EXPECT_TRUE(at::allclose(layer->lora_A->weight.grad(), r.at("grad.lora_A.weight"), 1e-10, 1e-12));
  EXPECT_TRUE(at::allclose(layer->lora_B->weight.grad(), r.at("grad.lora_B.weight"), 1e-10, 1e-12));
  EXPECT_TRUE(at::allclose(x.grad(), r.at("grad.x"), 1e-10, 1e-12));
  // Merged: the base weight holds W + scale·B·A and the output is unchanged; unmerge restores W.
  layer->merge();
  EXPECT_TRUE(layer->merged());
  EXPECT_TRUE(at::allclose(layer->weight, r.at("out.merged"), 1e-10, 1e-12));
  {
    at::NoGradGuard no_grad;
    EXPECT_TRUE(at::allclose(layer->forward(r.at("in.x")), r.at("out.y"), 1e-10, 1e-12));
  }
  layer->unmerge();
  EXPECT_TRUE(at::allclose(layer->weight, r.at("w.weight"), 1e-12, 1e-14));
}

TEST(Lora, LinearMatchesPeftRuleForwardBackwardAndMerge) {
  const auto r = golden_lora("linear");
  ad::AdaptableLinear layer(12, 10);
  check_against_reference(layer, r, {.rank = 4, .alpha = 16.0});
}

TEST(Lora, ConvMatchesPeftRuleForwardBackwardAndMerge) {
  const auto r = golden_lora("conv");
  ad::AdaptableConv2d layer(torch::nn::Conv2dOptions(6, 8, 3).stride(2).padding(1));
  check_against_reference(layer, r, {.rank = 3, .alpha = 6.0});
}

TEST(Lora, ANewBranchStartsAsTheIdentity) {
  ad::AdaptableLinear layer(8, 6);
  const at::Tensor x = at::randn({4, 8});
  const at::Tensor before = layer->forward(x).detach();
  layer->attach_lora({.rank = 2});
  EXPECT_TRUE(at::equal(layer->forward(x), before));
  EXPECT_GT(layer->lora_A->weight.abs().sum().item<double>(), 0.0);  // Kaiming-uniform A
  EXPECT_EQ(layer->lora_B->weight.abs().sum().item<double>(), 0.0);  // zero B
  EXPECT_THROW(layer->attach_lora({.rank = 2}), dt::ConfigError);
  EXPECT_THROW(ad::AdaptableLinear(3, 3)->merge(), dt::ConfigError);
  EXPECT_THROW(ad::AdaptableLinear(3, 3)->attach_lora({.rank = 0}), dt::ConfigError);
  layer->detach_lora();
  EXPECT_FALSE(layer->has_lora());
  EXPECT_EQ(layer->named_parameters().size(), 2u);
}

dt::nn::blocks::BasicTransformerBlock<> block() {
  return dt::nn::blocks::BasicTransformerBlock<>(dt::nn::blocks::TransformerBlockOptions{
      .dim = 16, .n_heads = 2, .d_head = 8, .context_dim = 12});
}

TEST(Lora, InjectionByNameFreezesEverythingElse) {
  auto b = block();
  const auto names = ad::inject_lora(*b, {.target_modules = {"to_q", "to_k", "to_v", "to_out.0"}},
                                     {.rank = 4, .alpha = 8.0});
  EXPECT_EQ(names,
            (std::vector<std::string>{"attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                                      "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0"}));
  std::int64_t trainable = 0;
  for (const auto& p : b->named_parameters()) {
    EXPECT_EQ(p.value().requires_grad(), p.key().find(".lora_") != std::string::npos) << p.key();
    trainable += p.value().requires_grad() ? 1 : 0;
  }
  EXPECT_EQ(trainable, 16);
  const auto groups = dt::train::make_param_groups(*b, {});
  std::size_t in_groups = 0;
  for (const auto& g : groups) in_groups += g.params.size();
  EXPECT_EQ(in_groups, 16u);  // the optimizer sees only the adapters
  // A regex, matched against the whole name.
  auto c = block();
  EXPECT_EQ(ad::inject_lora(*c, {.target_regex = "attn2\\.to_(q|v)"}, {.rank = 2}).size(), 2u);
}

TEST(Lora, InjectionErrorsNameTheProblem) {
  auto b = block();
  EXPECT_THROW(ad::inject_lora(*b, {.target_modules = {"to_nothing"}}, {}), dt::ConfigError);
  try {
    ad::inject_lora(*b, {.target_modules = {"norm1"}}, {});
    FAIL() << "a LayerNorm cannot carry LoRA";
  } catch (const dt::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("'norm1'"), std::string::npos) << e.what();
  }
  EXPECT_THROW(ad::inject_lora(*b, {.target_regex = "("}, {}), dt::ConfigError);
  EXPECT_THROW(ad::inject_lora(*b, {}, {}), dt::ConfigError);
}

at::Tensor run(dt::nn::blocks::BasicTransformerBlock<>& b, const at::Tensor& x,
               const at::Tensor& c) {
  at::NoGradGuard no_grad;
  b->eval();
  return b->forward(x, c);
}

void randomize_lora(torch::nn::Module& m) {
  at::NoGradGuard no_grad;
  for (auto& p : m.named_parameters())
    if (p.key().find("lora_") != std::string::npos) p.value().normal_(0, 0.2);
}

TEST(Lora, PeftAndKohyaFilesRoundTrip) {
  torch::manual_seed(4);
  auto b = block();
  ad::inject_lora(*b, {.target_modules = {"to_q", "to_k", "to_v", "to_out.0"}},
                  {.rank = 4, .alpha = 2.0});
  randomize_lora(*b);
  const at::Tensor x = at::randn({2, 5, 16}), c = at::randn({2, 3, 12});
  const at::Tensor want = run(b, x, c);
  const fs::path dir = fs::temp_directory_path() / "difftrain_lora_test";
  fs::create_directories(dir);
  for (const auto layout : {ad::LoraLayout::peft, ad::LoraLayout::kohya}) {
    const bool peft = layout == ad::LoraLayout::peft;
    const ad::LoraKeyOptions k{.layout = layout, .prefix = peft ? "unet." : "lora_unet_"};
    const auto sd = ad::lora_state_dict(*b, k);
    if (peft) {
      EXPECT_EQ(sd.size(), 16u);
      ASSERT_TRUE(sd.contains("unet.attn1.to_out.0.lora_A.weight"));
      EXPECT_EQ(sd.at("unet.attn1.to_q.lora_B.weight").sizes(), (at::IntArrayRef{16, 4}));
    } else {
      EXPECT_EQ(sd.size(), 24u);
      ASSERT_TRUE(sd.contains("lora_unet_attn2_to_v.lora_down.weight"));
      EXPECT_EQ(sd.at("lora_unet_attn1_to_q.alpha").item<double>(), 2.0);
    }
    const fs::path file = dir / (peft ? "peft.safetensors" : "kohya.safetensors");
    dt::io::save_safetensors(file, sd);
    // A fresh block with the same base weights: loading attaches the branches.
    auto fresh = block();
    {
      at::NoGradGuard no_grad;
      auto src = b->named_parameters();
      for (auto& p : fresh->named_parameters()) p.value().copy_(src[p.key()]);
    }
    const auto loaded = ad::load_lora_state_dict(
        *fresh, dt::io::load_safetensors(file, true).tensors, k, {.alpha = 2.0});
    EXPECT_EQ(loaded.size(), 8u);
    EXPECT_TRUE(at::allclose(run(fresh, x, c), want, 1e-6, 1e-6)) << (peft ? "peft" : "kohya");
  }
  // Merging gives the same output at the base layer's cost; unmerging goes back.
  for (const auto& [name, h] : ad::lora_layers(*b)) h->merge();
  EXPECT_TRUE(at::allclose(run(b, x, c), want, 1e-5, 1e-5));
  for (const auto& [name, h] : ad::lora_layers(*b)) h->unmerge();
  EXPECT_TRUE(at::allclose(run(b, x, c), want, 1e-6, 1e-6));
  // (fs::remove_all would bind to a copy inside libtorch that crashes; remove file by file.)
  fs::remove(dir / "peft.safetensors");
  fs::remove(dir / "kohya.safetensors");
  fs::remove(dir);
}

TEST(Lora, HostileFilesAreTypedErrors) {
  auto b = block();
  const ad::LoraKeyOptions peft{.prefix = "unet."};
  const at::Tensor a = at::zeros({4, 16}), bb = at::zeros({16, 4});
  auto load = [&](std::map<std::string, at::Tensor> t, const ad::LoraKeyOptions& k) {
    auto fresh = block();
    return ad::load_lora_state_dict(*fresh, t, k);
  };
  EXPECT_THROW(
      load({{"unet.attn9.to_q.lora_A.weight", a}, {"unet.attn9.to_q.lora_B.weight", bb}}, peft),
      dt::ConfigError);
  EXPECT_THROW(load({{"unet.attn1.to_q.lora_A.weight", a}}, peft), dt::FormatError);
  EXPECT_THROW(load({{"unet.attn1.to_q.lora_A.weight", a},
                     {"unet.attn1.to_q.lora_B.weight", at::zeros({16, 3})}},
                    peft),
               dt::FormatError);
  EXPECT_THROW(load({{"unet.attn1.to_q.lora_A.weight", at::zeros({4, 15})},
                     {"unet.attn1.to_q.lora_B.weight", bb}},
                    peft),
               dt::ConfigError);
  EXPECT_THROW(load({{"unet.attn1.to_q.weight", a}}, peft), dt::FormatError);
  EXPECT_THROW(load({{"lora_unet_attn1_to_q.alpha", at::ones({2})},
                     {"lora_unet_attn1_to_q.lora_down.weight", a},
                     {"lora_unet_attn1_to_q.lora_up.weight", bb}},
                    {.layout = ad::LoraLayout::kohya, .prefix = "lora_unet_"}),
               dt::FormatError);
}

TEST(Lora, SatKeysMapToDiffusers) {
  EXPECT_EQ(ad::sat_to_diffusers_lora_key(
                "model.diffusion_model.transformer.layers.3.attention.query_key_value.matrix_A.1"),
            "transformer.transformer_blocks.3.attn1.to_k.lora_A.weight");
  EXPECT_EQ(ad::sat_to_diffusers_lora_key(
                "model.diffusion_model.transformer.layers.0.attention.dense.matrix_B.0"),
            "transformer.transformer_blocks.0.attn1.to_out.0.lora_B.weight");
  EXPECT_EQ(
      ad::sat_to_diffusers_lora_key("transformer.layers.12.attention.query_key_value.matrix_B.2"),
      "transformer.transformer_blocks.12.attn1.to_v.lora_B.weight");
  EXPECT_EQ(ad::sat_to_diffusers_lora_key(
                "model.diffusion_model.transformer.layers.0.mlp.dense_h_to_4h.weight"),
            std::nullopt);
}

}  // namespace

// ---- hypernetworks ---------------------------------------------------------------------------

namespace {

struct HnCase {
  std::map<std::string, at::Tensor> t;
  nlohmann::json meta;
};

HnCase hn_case(const std::string& name) {
  auto f = dt::io::load_safetensors(
      fs::path(DIFFTRAIN_GOLDEN_DIR) / ("hypernetwork_" + name + ".safetensors"), true);
  return {f.tensors, nlohmann::json::parse(f.metadata.at("case"))};
}

ad::HypernetworkOptions options_of(const nlohmann::json& m) {
  ad::HypernetworkOptions o;
  o.layer_structure = m["layer_structure"].get<std::vector<double>>();
  o.activation_func = m["activation_func"].get<std::string>();
  o.add_layer_norm = m["add_layer_norm"].get<bool>();
  o.activate_output = m["activate_output"].get<bool>();
  o.dropout_structure = m["dropout_structure"].get<std::vector<double>>();
  return o;
}

// LoHa and LoKr against PEFT's LoHaConfig / LoKrConfig adapters (random factors) on a Linear, a
// 3×3 and a 1×1 convolution, over ranks, alphas, LoKr factors and decompose_both
// (tests/reference/ref_weight_delta.py): the adapted outputs and ΔW equal PEFT's; ΔW equals
// lycoris-lora's from the same tensors (whose LoKr of two whole factors applies at scale 1, so the
// LyCORIS file carries W1 pre-scaled); both file layouts read back to the same outputs; damaged
// files are FormatErrors naming the key.
struct DeltaNetImpl : torch::nn::Module {
  DeltaNetImpl() {
    lin = register_module("lin", dt::nn::AdaptableLinear(24, 36));
    conv = register_module("conv",
                           dt::nn::AdaptableConv2d(torch::nn::Conv2dOptions(8, 12, 3).padding(1)));
    point = register_module("point", dt::nn::AdaptableConv2d(torch::nn::Conv2dOptions(12, 16, 1)));
  }
  at::Tensor run(const std::string& m, const at::Tensor& x) {
    if (m == "lin") return lin->forward(x);
    return m == "conv" ? conv->forward(x) : point->forward(x);
  }
  dt::nn::AdaptableLinear lin{nullptr};
  dt::nn::AdaptableConv2d conv{nullptr}, point{nullptr};
};
TORCH_MODULE(DeltaNet);

TEST(WeightDelta, LohaAndLokrMatchPeftAndLycorisOnEverySweptSetting) {
  const auto g =
      dt::io::load_safetensors(fs::path(DIFFTRAIN_GOLDEN_DIR) / "weight_delta.safetensors", true)
          .tensors;
  std::ifstream meta_file(fs::path(DIFFTRAIN_GOLDEN_DIR) / "weight_delta.json");
  const auto meta = nlohmann::json::parse(meta_file);
  int cases = 0;
  for (const auto& c : meta["cases"]) {
    const std::string name = c["name"];
    SCOPED_TRACE(name);
    ++cases;
    ad::DeltaOptions o{.kind = c["kind"] == "loha" ? ad::DeltaKind::loha : ad::DeltaKind::lokr,
                       .rank = c["rank"].get<std::int64_t>(),
                       .alpha = c["alpha"].get<double>(),
                       .factor = c["factor"].get<std::int64_t>(),
                       .decompose_both = c["decompose_both"].get<bool>()};
    auto fill_base = [&](DeltaNet& net) {
      const at::NoGradGuard no_grad;
      for (auto& p : net->named_parameters())
        if (p.key().find(".adapter.") == std::string::npos)
          p.value().copy_(g.at(name + "." + p.key()));
    };
    DeltaNet net;
    fill_base(net);
    const auto adapted =
        ad::inject_weight_delta(*net, {.target_modules = {"lin", "conv", "point"}}, o);
    ASSERT_EQ(adapted.size(), 3U);
    {
      const at::NoGradGuard no_grad;
      for (auto& p : net->named_parameters()) {
        if (p.key().find(".adapter.") == std::string::npos) continue;
        const std::string key = name + "." + dt::python_replace(p.key(), ".adapter.", ".");
        ASSERT_TRUE(g.contains(key)) << key << ": PEFT made another split";
        ASSERT_EQ(p.value().sizes(), g.at(key).sizes()) << key;
        p.value().copy_(g.at(key));
      }
    }
    std::size_t peft_tensors = 0;
    for (const auto& [k, t] : g)
      if (k.starts_with(name + ".") &&
          ((k.find(".hada_") != std::string::npos) || (k.find(".lokr_") != std::string::npos)))
        ++peft_tensors;
    EXPECT_EQ(ad::weight_delta_state_dict(*net).size(), peft_tensors);  // the same split as PEFT
    std::map<std::string, at::Tensor> outputs;
    for (const char* m : {"lin", "conv", "point"}) {
      SCOPED_TRACE(m);
      const std::string base = name + "." + m;
      const at::NoGradGuard no_grad;
      const at::Tensor y = net->run(m, g.at(base + ".x"));
      outputs[m] = y;
      EXPECT_LT((y - g.at(base + ".y")).abs().max().item<double>(), 1e-5);
      auto* layer = ad::delta_of(*net->named_modules("", false)[m]);
      const at::Tensor w = net->named_parameters()[std::string(m) + ".weight"];
      const at::Tensor delta = layer->delta_weight(w);
      EXPECT_LT((delta - g.at(base + ".delta")).abs().max().item<double>(), 1e-6);
      // LyCORIS applies a LoKr of two whole factors at scale 1.
      const bool whole = g.contains(base + ".lokr_w1") && g.contains(base + ".lokr_w2");
      const at::Tensor lycoris = g.at(base + ".lycoris_delta") * (whole ? o.scale() : 1.0);
      EXPECT_LT((delta - lycoris).abs().max().item<double>(), 1e-6);
    }
    // Both layouts read back: PEFT's with its rank and alpha (the adapter metadata), LyCORIS'
    // with its alpha keys; a LyCORIS reader's product of the file's whole factors is ΔW.
    for (const auto layout : {ad::LoraLayout::peft, ad::LoraLayout::kohya}) {
      const ad::LoraKeyOptions keys{layout, layout == ad::LoraLayout::peft ? "" : "lora_unet_"};
      const auto sd = ad::weight_delta_state_dict(*net, keys);
      DeltaNet back;
      fill_base(back);
      const auto loaded =
          ad::load_weight_delta_state_dict(*back, sd, keys, [&](const std::string&) {
            return std::optional<std::pair<std::int64_t, double>>({o.rank, *o.alpha});
          });
      EXPECT_EQ(loaded.size(), 3U);
      const at::NoGradGuard no_grad;
      for (const char* m : {"lin", "conv", "point"})
        EXPECT_LT(
            (back->run(m, g.at(name + "." + m + ".x")) - outputs[m]).abs().max().item<double>(),
            1e-6)
            << m << (layout == ad::LoraLayout::peft ? " (PEFT)" : " (LyCORIS)");
      if (layout == ad::LoraLayout::kohya && sd.contains("lora_unet_lin.lokr_w2") &&
          sd.contains("lora_unet_lin.lokr_w1")) {
        const at::Tensor scale1 =
            at::kron(sd.at("lora_unet_lin.lokr_w1"), sd.at("lora_unet_lin.lokr_w2"));
        EXPECT_LT((scale1 - g.at(name + ".lin.delta")).abs().max().item<double>(), 1e-6);
        EXPECT_EQ(sd.at("lora_unet_lin.alpha").item<double>(), static_cast<double>(o.rank));
      }
    }
  }
  EXPECT_EQ(cases, 9);
  // A new adapter changes nothing; damaged files are named.
  DeltaNet fresh;
  const at::Tensor x = at::randn({3, 24});
  const at::Tensor before = fresh->lin->forward(x);
  for (const auto kind : {ad::DeltaKind::loha, ad::DeltaKind::lokr}) {
    DeltaNet n;
    {
      const at::NoGradGuard no_grad;
      for (auto& p : n->named_parameters()) p.value().copy_(fresh->named_parameters()[p.key()]);
    }
    ad::inject_weight_delta(*n, {.target_modules = {"lin"}}, ad::DeltaOptions{.kind = kind});
    EXPECT_TRUE(at::allclose(n->lin->forward(x), before));
    auto sd = ad::weight_delta_state_dict(*n);
    DeltaNet other;
    auto bad = sd;
    bad["nowhere.hada_w1_a"] = at::zeros({2, 2});
    EXPECT_THROW(ad::load_weight_delta_state_dict(*other, bad), dt::FormatError);
    DeltaNet other2;
    bad = sd;
    bad.begin()->second = at::zeros({1, 1});
    EXPECT_THROW(ad::load_weight_delta_state_dict(*other2, bad), dt::FormatError);
    DeltaNet other3;
    bad = sd;
    bad.erase(bad.begin());
    EXPECT_THROW(ad::load_weight_delta_state_dict(*other3, bad), dt::FormatError);
  }
  EXPECT_THROW(
      ad::inject_weight_delta(*fresh, {.target_modules = {"lin"}}, ad::DeltaOptions{.rank = 0}),
      dt::ConfigError);
}

// DoRA against PEFT's `use_dora` (per output row) and lycoris-lora's weight_decompose (both
// axes) with random A, B and magnitude (tests/reference/ref_dora.py): outputs, the gradients of
// A, B, the magnitude and the input, PEFT's merged weight; both file layouts read back; a
// per-input-column DoRA refuses PEFT's layout; a damaged dora_scale is a FormatError.
TEST(Dora, MatchesPeftAndLycorisOnEverySweptSetting) {
  const auto g =
      dt::io::load_safetensors(fs::path(DIFFTRAIN_GOLDEN_DIR) / "dora.safetensors", true).tensors;
  std::ifstream meta_file(fs::path(DIFFTRAIN_GOLDEN_DIR) / "dora.json");
  const auto meta = nlohmann::json::parse(meta_file);
  const std::vector<std::string> modules{"lin", "conv", "point"};
  int cases = 0;
  for (const auto& c : meta["cases"]) {
    const std::string name = c["name"];
    SCOPED_TRACE(name);
    ++cases;
    const bool out_axis = c["axis"] == "output";
    const ad::LoraOptions o{.rank = c["rank"].get<std::int64_t>(),
                            .alpha = c["alpha"].get<double>(),
                            .use_dora = true,
                            .dora_axis = out_axis ? ad::DoraAxis::output : ad::DoraAxis::input};
    auto fill = [&](DeltaNet& net, bool adapter) {
      const at::NoGradGuard no_grad;
      for (const auto& m : modules) {
        auto* layer = dynamic_cast<ad::LoraHost*>(net->named_modules("", false)[m].get());
        const auto params = net->named_parameters();
        params[m + ".weight"].copy_(g.at(name + "." + m + ".weight"));
        params[m + ".bias"].copy_(g.at(name + "." + m + ".bias"));
        if (!adapter) continue;
        layer->lora_a().copy_(g.at(name + "." + m + ".lora_A"));
        layer->lora_b().copy_(g.at(name + "." + m + ".lora_B"));
        ASSERT_EQ(layer->lora_magnitude().sizes(), g.at(name + "." + m + ".magnitude").sizes());
        layer->lora_magnitude().copy_(g.at(name + "." + m + ".magnitude"));
      }
    };
    DeltaNet net;
    fill(net, false);
    {  // a new DoRA branch changes nothing
      DeltaNet plain;
      fill(plain, false);
      ad::inject_lora(*net, {.target_modules = modules}, o);
      const at::NoGradGuard no_grad;
      for (const auto& m : modules) {
        const at::Tensor x = g.at(name + "." + m + ".x");
        EXPECT_LT((net->run(m, x) - plain->run(m, x)).abs().max().item<double>(), 1e-5) << m;
      }
    }
    fill(net, true);
    std::map<std::string, at::Tensor> outputs;
    for (const auto& m : modules) {
      SCOPED_TRACE(m);
      const std::string key = name + "." + m;
      auto* layer = dynamic_cast<ad::LoraHost*>(net->named_modules("", false)[m].get());
      const at::Tensor x = g.at(key + ".x").clone().requires_grad_();
      const at::Tensor y = net->run(m, x);
      outputs[m] = y.detach();
      const double scale = g.at(key + ".y").abs().max().item<double>();
      EXPECT_LT((y - g.at(key + ".y")).abs().max().item<double>(), 1e-5 * scale);
      if (out_axis) {
        EXPECT_LT((y - g.at(key + ".lycoris_y")).abs().max().item<double>(), 1e-5 * scale);
      }
      net->zero_grad();
      (y * g.at(key + ".cotangent")).sum().backward();
      for (const auto& [what, grad] : std::vector<std::pair<std::string, at::Tensor>>{
               {"grad_A", layer->lora_a().grad()},
               {"grad_B", layer->lora_b().grad()},
               {"grad_magnitude", layer->lora_magnitude().grad()},
               {"grad_x", x.grad()}}) {
        const at::Tensor want = g.at(key + "." + what);
        ASSERT_TRUE(grad.defined()) << what;
        EXPECT_LT((grad - want).abs().max().item<double>(),
                  1e-4 * std::max(1.0, want.abs().max().item<double>()))
            << what;
      }
      if (out_axis) {  // PEFT's merge, and back
        auto params = net->named_parameters();
        const at::Tensor before = params[m + ".weight"].detach().clone();
        layer->merge();
        EXPECT_LT((params[m + ".weight"] - g.at(key + ".merged")).abs().max().item<double>(), 1e-5);
        const at::NoGradGuard no_grad;
        EXPECT_LT((net->run(m, g.at(key + ".x")) - outputs[m]).abs().max().item<double>(),
                  1e-5 * scale);
        layer->unmerge();
        EXPECT_LT((params[m + ".weight"] - before).abs().max().item<double>(), 1e-6);
      }
    }
    for (const auto layout : {ad::LoraLayout::peft, ad::LoraLayout::kohya}) {
      const ad::LoraKeyOptions keys{layout, layout == ad::LoraLayout::peft ? "" : "lora_unet_"};
      if (layout == ad::LoraLayout::peft && !out_axis) {
        EXPECT_THROW((void)ad::lora_state_dict(*net, keys), dt::ConfigError);
        nlohmann::json j;
        EXPECT_THROW(ad::add_peft_adapter_metadata(j, *net, "unet"), dt::ConfigError);
        continue;
      }
      const auto sd = ad::lora_state_dict(*net, keys);
      if (layout == ad::LoraLayout::peft) {  // PEFT's shapes
        EXPECT_EQ(sd.at("lin.lora_magnitude_vector").sizes(), (at::IntArrayRef{36}));
        EXPECT_EQ(sd.at("conv.lora_magnitude_vector").sizes(), (at::IntArrayRef{1, 12, 1, 1}));
        nlohmann::json j;
        ad::add_peft_adapter_metadata(j, *net, "unet");
        EXPECT_TRUE(j["unet.use_dora"].get<bool>());
        // transformers' adapter loader's form (`.lora_magnitude_vector.weight`) reads back too.
        const ad::LoraKeyOptions as_weight{layout, "", /*magnitude_as_weight=*/true};
        const auto sd_w = ad::lora_state_dict(*net, as_weight);
        EXPECT_TRUE(sd_w.contains("lin.lora_magnitude_vector.weight"));
        DeltaNet back_w;
        fill(back_w, false);
        (void)ad::load_lora_state_dict(*back_w, sd_w, keys, {.alpha = o.alpha});
        const at::NoGradGuard no_grad;
        EXPECT_LT(
            (back_w->run("lin", g.at(name + ".lin.x")) - outputs["lin"]).abs().max().item<double>(),
            1e-5);
      } else {  // LyCORIS'
        EXPECT_EQ(sd.at("lora_unet_lin.dora_scale").sizes(),
                  out_axis ? (at::IntArrayRef{36, 1}) : (at::IntArrayRef{1, 24}));
      }
      DeltaNet back;
      fill(back, false);
      EXPECT_EQ(ad::load_lora_state_dict(*back, sd, keys, {.alpha = o.alpha}).size(), 3U);
      const at::NoGradGuard no_grad;
      for (const auto& m : modules)
        EXPECT_LT(
            (back->run(m, g.at(name + "." + m + ".x")) - outputs[m]).abs().max().item<double>(),
            1e-5)
            << m << (layout == ad::LoraLayout::peft ? " (PEFT)" : " (kohya)");
      auto bad = sd;
      const std::string mkey =
          layout == ad::LoraLayout::peft ? "lin.lora_magnitude_vector" : "lora_unet_lin.dora_scale";
      bad[mkey] = at::ones({5, 5});
      DeltaNet other;
      try {
        (void)ad::load_lora_state_dict(*other, bad, keys);
        ADD_FAILURE() << "a damaged magnitude loaded";
      } catch (const dt::FormatError& e) {
        EXPECT_NE(std::string(e.what()).find("lin"), std::string::npos) << e.what();
      }
    }
  }
  EXPECT_EQ(cases, 7);
  // A per-input-column DoRA takes no dropout.
  DeltaNet n;
  EXPECT_THROW(
      ad::inject_lora(*n, {.target_modules = {"lin"}},
                      {.dropout = 0.1, .use_dora = true, .dora_axis = ad::DoraAxis::input}),
      dt::ConfigError);
}

TEST(Hypernetwork, ModulesMatchTheWebUiStructureAndNumbers) {
  for (const std::string name : {"relu", "deep", "swish"}) {
    const auto c = hn_case(name);
    ad::HypernetworkModule m(c.meta["dim"].get<std::int64_t>(), options_of(c.meta));
    std::map<std::string, at::Tensor> sd;
    for (const auto& [k, v] : c.t)
      if (k.rfind("w.", 0) == 0) sd[k.substr(2)] = v;
    m->load(sd, name);  // every key of the web UI's module, no more, no fewer
    EXPECT_EQ(m->named_parameters().size(), sd.size()) << name;
    m->eval();
    m->multiplier = 0.7;
    EXPECT_TRUE(at::allclose(m->forward(c.t.at("in.x")), c.t.at("out.eval"), 1e-5, 1e-6)) << name;
    // Training ignores the multiplier (dropout layers are off in the reference's train pass).
    m->train();
    for (auto& child : m->linear->children())
      if (auto* d = dynamic_cast<torch::nn::DropoutImpl*>(child.get())) d->options.p(0.0);
    EXPECT_TRUE(at::allclose(m->forward(c.t.at("in.x")), c.t.at("out.train"), 1e-5, 1e-6)) << name;
  }
}

TEST(Hypernetwork, DropoutStructureAndValidationFollowTheWebUi) {
  EXPECT_EQ(ad::parse_dropout_structure({1, 2, 1}, false, true), (std::vector<double>{0, 0, 0}));
  EXPECT_EQ(ad::parse_dropout_structure({1, 2, 1}, true, false), (std::vector<double>{0, 0, 0}));
  EXPECT_EQ(ad::parse_dropout_structure({1, 2, 2, 1}, true, false),
            (std::vector<double>{0, 0.3, 0, 0}));
  EXPECT_EQ(ad::parse_dropout_structure({1, 2, 2, 1}, true, true),
            (std::vector<double>{0, 0.3, 0.3, 0}));
  auto err = [](ad::HypernetworkOptions o) -> std::string {
    try {
      ad::HypernetworkModule m(8, o);
    } catch (const dt::ConfigError& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(err({.layer_structure = {2, 2, 1}}).find("should start with size 1"),
            std::string::npos);
  EXPECT_NE(err({.layer_structure = {1, 2, 2}}).find("should end with size 1"), std::string::npos);
  EXPECT_NE(err({.activation_func = "bogus"}).find("unsupported activation function: bogus"),
            std::string::npos);
  EXPECT_NE(err({.weight_init = "Uniform"}).find("Key Uniform is not defined"), std::string::npos);
  // Normal init: weights ~ N(0, 0.01), biases 0; a new module is nearly the identity.
  ad::HypernetworkModule m(
      64, ad::HypernetworkOptions{.layer_structure = {1, 2, 1}, .activation_func = "relu"});
  const at::Tensor w = m->named_parameters()["linear.0.weight"];
  EXPECT_NEAR(w.std().item<double>(), 0.01, 0.001);
  EXPECT_EQ(m->named_parameters()["linear.0.bias"].abs().sum().item<double>(), 0.0);
  EXPECT_TRUE(m->named_parameters().contains("linear.2.weight"));  // Linear, ReLU, Linear
}

TEST(Hypernetwork, ReadsTheWebUiFileAndRoundTripsItsLayout) {
  const auto h = ad::Hypernetwork::load(fs::path(DIFFTRAIN_GOLDEN_DIR) / "hypernetwork_webui.pt");
  EXPECT_EQ(h.name, "webui-hn");
  EXPECT_EQ(h.step, 321);
  EXPECT_EQ(h.options.activation_func, "leakyrelu");
  EXPECT_EQ(h.options.weight_init, "XavierNormal");
  EXPECT_TRUE(h.options.add_layer_norm);
  EXPECT_EQ(h.sd_checkpoint_name, "v1-5-pruned");
  EXPECT_EQ(h.optional_info, "made in Python");
  EXPECT_EQ(h.options.layer_structure, (std::vector<double>{1, 1.5, 2, 1}));
  ASSERT_EQ(h.layers.size(), 2u);
  const auto check = dt::io::load_safetensors(
      fs::path(DIFFTRAIN_GOLDEN_DIR) / "hypernetwork_webui_check.safetensors", true);
  const at::Tensor ctx = check.tensors.at("in.context");
  const auto [k, v] = h.apply(ctx, ctx);
  EXPECT_TRUE(at::allclose(v, check.tensors.at("out.v"), 1e-5, 1e-6));
  EXPECT_FALSE(at::equal(k, ctx));
  // A width without modules passes the context through.
  const at::Tensor other = at::randn({1, 2, 5});
  EXPECT_TRUE(at::equal(h.apply(other, other).first, other));
  // Our file reads back the same.
  const fs::path file = fs::temp_directory_path() / "difftrain_hn_roundtrip.pt";
  h.save(file);
  const auto again = ad::Hypernetwork::load(file);
  fs::remove(file);
  EXPECT_EQ(again.name, h.name);
  EXPECT_EQ(again.options.dropout_structure, h.options.dropout_structure);
  EXPECT_TRUE(at::equal(again.apply(ctx, ctx).second, v));
}

TEST(Hypernetwork, FilesThatDoNotFitTheStructureAreFormatErrors) {
  // The reference folder's synthetic file names layers linear.0 / linear.1, which a relu structure
  // with dropout ([Linear, ReLU, Dropout, Linear]) does not have.
  try {
    (void)ad::Hypernetwork::load(fs::path(DIFFTRAIN_GOLDEN_DIR) / "webui_hypernetwork.pt");
    FAIL() << "expected a FormatError";
  } catch (const dt::FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("'linear.1."), std::string::npos) << e.what();
  }
}

TEST(Hypernetwork, DrivesCrossAttentionThroughTheContextHook) {
  dt::nn::blocks::CrossAttention<> attn(dt::nn::blocks::CrossAttentionOptions{16, 12, 2, 8, 0.0});
  ad::Hypernetwork h("hn", {12}, {.layer_structure = {1, 2, 1}, .activation_func = "relu"});
  {
    at::NoGradGuard no_grad;
    for (auto& p : h.weights()) p.normal_(0, 0.3);
  }
  const at::Tensor x = at::randn({2, 4, 16}), c = at::randn({2, 3, 12});
  at::NoGradGuard no_grad;
  dt::nn::blocks::AttentionCall call;
  call.context = c;
  const at::Tensor plain = attn->forward(x, call);
  attn->set_context_hook([&h](const at::Tensor& ctx) { return h.apply(ctx, ctx); });
  const at::Tensor hooked = attn->forward(x, call);
  EXPECT_FALSE(at::allclose(plain, hooked));
  h.set_multiplier(0.0);  // multiplier 0 in eval mode: the identity, as without the hook
  EXPECT_TRUE(at::allclose(attn->forward(x, call), plain, 1e-6, 1e-6));
}

}  // namespace

// ---- textual-inversion embeddings -------------------------------------------------------------

namespace {

const nlohmann::json& embedding_golden() {
  static const nlohmann::json j = [] {
    std::ifstream in(fs::path(DIFFTRAIN_GOLDEN_DIR) / "embedding.json");
    return nlohmann::json::parse(in);
  }();
  return j;
}

fs::path gold(const std::string& f) { return fs::path(DIFFTRAIN_GOLDEN_DIR) / f; }

TEST(Embedding, ReadsTheWebUiFileWithItsMetadataAndChecksum) {
  const auto e = ad::load_embedding(gold("embedding_webui.pt"));
  ASSERT_TRUE(e);
  EXPECT_EQ(e->name, "my-style");
  EXPECT_EQ(e->step, 2500);
  EXPECT_EQ(e->sd_checkpoint, "7460a6fa");
  EXPECT_EQ(e->sd_checkpoint_name, "sd-v1-4");
  EXPECT_EQ(e->vectors(), 4);
  EXPECT_EQ(e->shape(), 32);
  EXPECT_EQ(e->checksum(), embedding_golden()["checksums"]["webui"].get<std::string>());
}

TEST(Embedding, ChecksumMatchesTheWebUiOnEdgeCases) {
  ad::Embedding e;
  e.vec = at::tensor(embedding_golden()["negative"].get<std::vector<float>>()).view({1, -1});
  EXPECT_EQ(e.checksum(), embedding_golden()["checksums"]["negative"].get<std::string>());
  e.vec = dt::io::load_torch_file(gold("embedding_large_vec.pt")).tensor();
  EXPECT_EQ(e.checksum(), embedding_golden()["checksums"]["large"].get<std::string>());
}

TEST(Embedding, ReadsDiffusersConceptsAndSdxlPairs) {
  const auto c = ad::load_embedding(gold("embedding_concept.bin"));
  ASSERT_TRUE(c);
  EXPECT_EQ(c->name, "embedding_concept");  // the file's stem, as the web UI names it
  EXPECT_EQ(c->vectors(), 1);               // a 1-D vector becomes one row
  EXPECT_EQ(c->checksum(), embedding_golden()["checksums"]["concept"].get<std::string>());
  const auto x = ad::load_embedding(gold("embedding_sdxl.safetensors"));
  ASSERT_TRUE(x);
  EXPECT_TRUE(x->is_sdxl());
  EXPECT_EQ(x->vectors(), 2);
  EXPECT_EQ(x->shape(), 40);  // clip_g 24 + clip_l 16
}

TEST(Embedding, SavesTheWebUiLayoutAndPngCarriersThatReadBack) {
  auto e = *ad::load_embedding(gold("embedding_webui.pt"));
  const fs::path dir = fs::temp_directory_path();
  const fs::path pt = dir / "difftrain_emb_roundtrip.pt", png = dir / "difftrain_emb_roundtrip.png";
  e.save(pt);
  const auto again = ad::load_embedding(pt);
  ASSERT_TRUE(again);
  EXPECT_TRUE(at::equal(again->vec, e.vec));
  EXPECT_EQ(again->name, "my-style");
  EXPECT_EQ(again->checksum(), e.checksum());
  const auto root = dt::io::load_torch_file(pt);
  EXPECT_EQ(root.at("string_to_token").at("*").integer(), 265);
  // In a PNG (both carriers), under another file name: the payload's name wins.
  dt::io::write_embedded_data(png, dt::io::RgbImage(64, 64, 40), e.state());
  const auto from_png = ad::load_embedding(png);
  ASSERT_TRUE(from_png);
  EXPECT_EQ(from_png->name, "my-style");
  EXPECT_TRUE(at::allclose(from_png->vec, e.vec));
  // A plain picture is a preview, not an embedding.
  dt::io::write_png(png, dt::io::RgbImage(8, 8, 40));
  EXPECT_FALSE(ad::load_embedding(png));
  fs::remove(pt);
  fs::remove(png);
}

TEST(Embedding, UnidentifiableFilesAreTypedErrorsThatSayWhy) {
  auto expect_format = [](const c10::IValue& v, const std::string& needle) {
    try {
      (void)ad::embedding_from_data(dt::io::TorchValue(v, "emb.pt"), "x");
      ADD_FAILURE() << "expected a FormatError mentioning " << needle;
    } catch (const dt::FormatError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  auto two = dt::io::torch_dict();
  two.insert("a", at::zeros({1, 4}));
  two.insert("b", at::zeros({1, 4}));
  expect_format(two, "multiple terms");
  auto params = dt::io::torch_dict();
  auto inner = dt::io::torch_dict();
  inner.insert("*", at::zeros({1, 4}));
  inner.insert("+", at::zeros({1, 4}));
  params.insert("string_to_param", inner);
  expect_format(params, "multiple terms");
  auto strings = dt::io::torch_dict();
  strings.insert("name", std::string("x"));
  expect_format(strings, "Couldn't identify");
  auto ints = dt::io::torch_dict();
  ints.insert("<tok>", at::zeros({1, 4}, at::kLong));
  expect_format(ints, "not floating point");
  expect_format(c10::IValue(std::int64_t{3}), "not an embedding dict");
  EXPECT_THROW((void)ad::load_embedding("emb.txt"), dt::ConfigError);
}

}  // namespace

// DoRA with kohya's LoCon on a UNet (the attention projections, and every resnet's and
// resampler's layers: 3×3 convolutions at the convolution rank, the rest at the linear one), A, B
// and the magnitudes random: both files read back to the same output; check_cpp_models.py has
// diffusers' LoRA loader apply the PEFT file and lycoris-lora's parser the kohya file to diffusers'
// UNet, each giving difftrain's output.
TEST(Models, UNetLoraDoraAndLoconFilesApplyInDiffusersAndLycoris) {
  using Unet = dt::models::UNet2DConditionModel<>;
  const fs::path models = fs::path(DIFFTRAIN_GOLDEN_DIR) / "models";
  const auto& t = dt::io::load_safetensors(models / "unet_conv_proj.io.safetensors", true).tensors;
  at::manual_seed(9);
  auto unet = dt::models::from_pretrained<Unet>(models / "unet_conv_proj");
  const ad::LoraOptions attn{.rank = 4, .alpha = 2.0, .use_dora = true};
  auto adapted = ad::inject_lora(*unet, ad::unet_lora_targets(), attn);
  const auto conv =
      ad::inject_lora(*unet, ad::unet_conv_lora_targets(),
                      [&](const std::string& m) -> std::optional<ad::LoraOptions> {
                        if (ad::kohya_conv_3x3(m))
                          return ad::LoraOptions{.rank = 2, .alpha = 1.0, .use_dora = true};
                        return attn;
                      });
  EXPECT_GT(conv.size(), 10U);
  EXPECT_TRUE(std::any_of(conv.begin(), conv.end(),
                          [](const std::string& m) { return m.ends_with("conv_shortcut"); }));
  {
    const at::NoGradGuard no_grad;
    for (auto& p : unet->named_parameters())
      if (p.key().find("lora_A") != std::string::npos ||
          p.key().find("lora_B") != std::string::npos)
        p.value().normal_(0.0, 0.2);
      else if (p.key().ends_with("lora_magnitude_vector"))
        p.value().mul_(at::rand_like(p.value()) + 0.5);
  }
  auto run = [&](Unet& u) {
    u->eval();
    const at::NoGradGuard no_grad;
    return u->forward(t.at("input.sample"), t.at("input.timestep"),
                      t.at("input.encoder_hidden_states"));
  };
  const at::Tensor want = run(unet);
  const ad::LoraKeyOptions peft{ad::LoraLayout::peft, "unet."},
      kohya{ad::LoraLayout::kohya, "lora_unet_"};
  const auto peft_sd = ad::lora_state_dict(*unet, peft),
             kohya_sd = ad::lora_state_dict(*unet, kohya);
  for (const auto* keys : {&peft, &kohya}) {
    auto back = dt::models::from_pretrained<Unet>(models / "unet_conv_proj");
    (void)ad::load_lora_state_dict(*back, keys == &peft ? peft_sd : kohya_sd, *keys);
    // PEFT's layout keeps no alpha: the file's metadata gives it (diffusers' loader reads it).
    if (keys == &peft)
      for (const auto& [name, h] : ad::lora_layers(*back)) {
        const auto o =
            ad::peft_lora_defaults(ad::stable_diffusion_peft_metadata({.unet = unet.get()}), "unet",
                                   name, h->lora_options().rank);
        auto opts = h->lora_options();
        opts.alpha = o.alpha;
        const at::Tensor a = h->lora_a().detach().clone(), b = h->lora_b().detach().clone(),
                         m = h->lora_magnitude().detach().clone();
        h->detach_lora();
        h->attach_lora(opts);
        const at::NoGradGuard no_grad;
        h->lora_a().copy_(a);
        h->lora_b().copy_(b);
        h->lora_magnitude().copy_(m);
      }
    EXPECT_LT((run(back) - want).abs().max().item<double>(), 1e-5)
        << (keys == &peft ? "PEFT" : "kohya");
  }
  if (const char* out_env = std::getenv("DIFFTRAIN_MODELS_OUT")) {
    const fs::path dir = fs::path(out_env) / "dora_locon";
    fs::create_directories(dir);
    dt::io::save_safetensors(dir / "pytorch_lora_weights.safetensors", peft_sd,
                             ad::stable_diffusion_peft_metadata({.unet = unet.get()}));
    dt::io::save_safetensors(dir / "lora_kohya.safetensors", kohya_sd);
    dt::io::save_safetensors(dir / "output.safetensors", {{"unet", want}});
  }
}
