// Flux.1's transformer (models/flux_transformer_2d.hpp) against diffusers' FluxTransformer2DModel
// (tests/reference/ref_flux.py): four tiny configurations (double- and single-stream blocks, none
// of one kind, guidance embeddings on and off, rotary axes split several ways, another output
// width, odd latent grids, text of one token) loaded from diffusers' folders give its output and
// every gradient; checkpointed blocks give the same gradients; Flux.1 dev's and schnell's
// parameters, by name and shape, from their configs without building them; mistakes are typed.
#include <difftrain/adapters/flux_lora_files.hpp>
#include <difftrain/adapters/lora_inject.hpp>
#include <difftrain/io/remove_tree.hpp>
#include <difftrain/io/safetensors.hpp>
#include <difftrain/models/flux_transformer_2d.hpp>
#include <difftrain/models/pretrained.hpp>
#include <difftrain/models/single_file/flux.hpp>
#include <difftrain/nn/block_swap.hpp>
#include <difftrain/nn/layers/adaptable.hpp>

#include <gtest/gtest.h>

#include <ATen/Context.h>

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <string>

#include "golden.hpp"
#include "poison_units.hpp"

namespace dt = difftrain;
namespace models = difftrain::models;
namespace tst = difftrain::test;
namespace fs = std::filesystem;

namespace {

using Flux = models::FluxTransformer2DModel<>;

double scaled_error(const at::Tensor& got, const at::Tensor& want) {
  return (got - want).abs().max().item<double>() / std::max(1.0, want.abs().max().item<double>());
}

struct FluxRun {
  at::Tensor output;
  std::map<std::string, at::Tensor> grads;
};

FluxRun run_case(Flux& model, const std::map<std::string, at::Tensor>& t) {
  model->zero_grad();
  std::map<std::string, at::Tensor> in;
  for (const char* k : {"hidden_states", "encoder_hidden_states", "pooled_projections"})
    in[k] = t.at(std::string("input.") + k).clone().requires_grad_();
  const at::Tensor guidance = t.contains("input.guidance") ? t.at("input.guidance") : at::Tensor();
  const at::Tensor y = model->forward(in["hidden_states"], in["encoder_hidden_states"],
                                      in["pooled_projections"], t.at("input.timestep"),
                                      t.at("input.img_ids"), t.at("input.txt_ids"), guidance);
  (y * t.at("cotangent")).sum().backward();
  FluxRun r{y.detach(), {}};
  for (const auto& [k, v] : in) r.grads["input." + k] = v.grad();
  for (const auto& p : model->named_parameters())
    r.grads[p.key()] =
        p.value().grad().defined() ? p.value().grad().clone() : at::zeros_like(p.value());
  return r;
}

/// f() throws an E whose message mentions `mention`.
template <class E, class F>
void expect_error(F&& f, const std::string& mention) {
  try {
    f();
    ADD_FAILURE() << "accepted; expected an error mentioning '" << mention << "'";
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(mention), std::string::npos) << e.what();
  }
}

}  // namespace

TEST(Flux, MatchesDiffusersOnEverySweptConfig) {
  const auto& index = tst::golden("flux.json");
  ASSERT_EQ(index["cases"].size(), 4U);
  const fs::path root = fs::path(DIFFTRAIN_GOLDEN_DIR) / "models";
  for (const auto& c : index["cases"]) {
    const std::string name = c["name"];
    SCOPED_TRACE(name);
    const auto t = dt::io::load_safetensors(root / (name + ".io.safetensors"), true).tensors;
    auto model = models::from_pretrained<Flux>(root / name);
    model->train();
    const tst::PoisonUnits units;  // every block a unit: no parameter is used outside its block
    const FluxRun r = run_case(model, t);
    EXPECT_LE(scaled_error(r.output, t.at("output")), 1e-5);
    std::size_t grads = 0;
    for (const auto& [key, got] : r.grads) {
      const at::Tensor& want = t.at("grad." + key);
      EXPECT_LE(scaled_error(got, want), 1e-4) << key;
      ++grads;
    }
    EXPECT_EQ(grads, model->named_parameters().size() + 3);
    // The table of parameters computed from the config is the model's, in order.
    const auto table = models::flux_parameter_table(model->config());
    const auto params = model->named_parameters();
    ASSERT_EQ(table.size(), params.size());
    for (std::size_t i = 0; i < table.size(); ++i) {
      EXPECT_EQ(table[i].first, params[i].key());
      EXPECT_EQ(at::IntArrayRef(table[i].second), params[i].value().sizes()) << table[i].first;
    }
    // Checkpointed blocks: the same output and gradients.
    model->set_gradient_checkpointing(true);
    const FluxRun again = run_case(model, t);
    model->set_gradient_checkpointing(false);
    EXPECT_LE(scaled_error(again.output, r.output), 1e-6);
    for (const auto& [key, g] : again.grads)
      EXPECT_LE(scaled_error(g, r.grads.at(key)), 1e-6) << key;
  }
}

TEST(Flux, PublishedConfigsHaveDiffusersParameters) {
  const auto& tables = tst::golden("flux.json")["tables"];
  const std::map<std::string, std::int64_t> totals{{"dev", 11'901'408'320},
                                                   {"schnell", 11'891'178'560}};
  for (const auto& [label, total] : totals) {
    SCOPED_TRACE(label);
    const auto& want = tables[label];
    const auto config = models::FluxTransformer2DConfig::from_json(want["config"], label);
    const auto table = models::flux_parameter_table(config);
    ASSERT_EQ(table.size(), want["parameters"].size());
    std::int64_t count = 0;
    for (std::size_t i = 0; i < table.size(); ++i) {
      EXPECT_EQ(table[i].first, want["parameters"][i][0].get<std::string>());
      EXPECT_EQ(table[i].second, want["parameters"][i][1].get<std::vector<std::int64_t>>())
          << table[i].first;
      count += std::accumulate(table[i].second.begin(), table[i].second.end(), std::int64_t{1},
                               std::multiplies<>());
    }
    EXPECT_EQ(count, total);
  }
}

TEST(Flux, MistakesAreTypedErrors) {
  models::FluxTransformer2DConfig c;
  c.num_layers = 1;
  c.num_single_layers = 1;
  c.attention_head_dim = 8;
  c.num_attention_heads = 2;
  c.in_channels = 4;
  c.joint_attention_dim = 6;
  c.pooled_projection_dim = 5;
  c.axes_dims_rope = {2, 2, 4};
  auto bad = c;
  bad.axes_dims_rope = {2, 2, 2};
  EXPECT_THROW(Flux{bad}, dt::ConfigError);  // the axes must fill the head
  bad = c;
  bad.axes_dims_rope = {3, 1, 4};
  EXPECT_THROW(Flux{bad}, dt::ConfigError);  // odd axes
  bad = c;
  bad.patch_size = 2;
  EXPECT_THROW(Flux{bad}, dt::ConfigError);
  EXPECT_THROW(models::FluxTransformer2DConfig::from_json({{"num_layer", 2}}, "config.json"),
               dt::ConfigError);  // a misspelt field
  Flux model(c);
  const at::Tensor x = at::randn({2, 6, 4}), text = at::randn({2, 3, 6}),
                   pooled = at::randn({2, 5});
  const at::Tensor ts = at::rand({2}), img = at::zeros({6, 3}), txt = at::zeros({3, 3});
  EXPECT_NO_THROW((void)model->forward(x, text, pooled, ts, img, txt));
  EXPECT_THROW((void)model->forward(x, text, pooled, ts, img, txt, at::ones({2})),
               dt::ShapeError);  // no guidance embedding
  EXPECT_THROW((void)model->forward(at::randn({2, 6, 5}), text, pooled, ts, img, txt),
               dt::ShapeError);
  EXPECT_THROW((void)model->forward(x, at::randn({2, 3, 7}), pooled, ts, img, txt), dt::ShapeError);
  EXPECT_THROW((void)model->forward(x, text, pooled, ts, at::zeros({5, 3}), txt), dt::ShapeError);
  EXPECT_THROW((void)model->forward(x, text, pooled, ts, img, at::zeros({3, 2})), dt::ShapeError);
  auto guided = c;
  guided.guidance_embeds = true;
  Flux with_guidance(guided);
  EXPECT_THROW((void)with_guidance->forward(x, text, pooled, ts, img, txt), dt::ShapeError);
}

TEST(Flux, PipelinePiecesMatchFluxPipeline) {
  const auto t =
      dt::io::load_safetensors(fs::path(DIFFTRAIN_GOLDEN_DIR) / "flux_pipeline.safetensors", true)
          .tensors;
  for (int k = 0; k < 3; ++k) {
    const std::string p = "pack." + std::to_string(k) + ".";
    const at::Tensor lat = t.at(p + "latents");
    const at::Tensor packed = models::flux_pack_latents(lat);
    EXPECT_TRUE(at::equal(packed, t.at(p + "packed"))) << k;
    EXPECT_TRUE(at::equal(models::flux_unpack_latents(packed, lat.size(2) * 8, lat.size(3) * 8, 8),
                          t.at(p + "unpacked")))
        << k;
    EXPECT_TRUE(at::equal(models::flux_latent_image_ids(lat.size(2) / 2, lat.size(3) / 2),
                          t.at("ids." + std::to_string(k))))
        << k;
  }
  const auto& index = tst::golden("flux.json");
  for (const auto& m : index["mu"])
    EXPECT_NEAR(models::flux_calculate_shift(m[0].get<std::int64_t>()), m[1].get<double>(), 1e-12);
  for (const auto& m : index["mu_custom"])
    EXPECT_NEAR(models::flux_calculate_shift(m[0].get<std::int64_t>(), 128, 2048, 0.3, 1.5),
                m[1].get<double>(), 1e-12);
  EXPECT_THROW((void)models::flux_pack_latents(at::zeros({1, 4, 3, 4})), dt::ShapeError);
  EXPECT_THROW((void)models::flux_unpack_latents(at::zeros({1, 5, 16}), 32, 32, 8), dt::ShapeError);
}

// kohya's --fp8_base as a library option (nn::store_frozen_weights_fp8): a frozen base weight in
// float8 e4m3 with a per-tensor scale, one byte a value (half of bf16's), dequantised per layer;
// the LoRA branch attached after stays in the compute dtype and alone trains; merging and a
// trainable weight are refused. On a Flux model with LoRA the output stays within a few percent
// of float32's (the figure docs/models.md states).
TEST(Flux, Fp8BaseWeightsDequantisePerLayerAndKeepAdaptersTraining) {
  namespace nn = difftrain::nn;
  at::manual_seed(4);
  nn::AdaptableLinear lin(64, 48);
  const at::Tensor w32 = lin->weight.detach().clone();
  const at::Tensor x = at::randn({5, 64});
  const at::Tensor y32 = lin->forward(x).detach();
  EXPECT_THROW(lin->store_weight_fp8(at::kFloat), dt::ConfigError);  // it trains
  lin->weight.set_requires_grad(false);
  lin->store_weight_fp8(at::kFloat);
  EXPECT_EQ(lin->weight.scalar_type(), at::kFloat8_e4m3fn);
  EXPECT_EQ(lin->weight.nbytes(), static_cast<std::size_t>(w32.numel()));  // bf16 would be 2×
  const double scale = w32.abs().max().item<double>() / 448.0;
  EXPECT_NEAR(lin->scale_weight.item<double>(), scale, 1e-7 * scale);  // kept in float32
  EXPECT_TRUE(at::equal(lin->base_weight(),
                        (w32 / scale).to(at::kFloat8_e4m3fn).to(at::kFloat) * lin->scale_weight));
  const double err = scaled_error(lin->forward(x), y32);
  EXPECT_GT(err, 0.0);
  EXPECT_LT(err, 0.05);
  lin->attach_lora({.rank = 4, .alpha = 4.0});
  EXPECT_EQ(lin->lora_A->weight.scalar_type(), at::kFloat);
  {
    const at::NoGradGuard no_grad;
    lin->lora_B->weight.normal_(0.0, 0.1);
  }
  lin->forward(x).sum().backward();
  EXPECT_TRUE(lin->lora_A->weight.grad().defined());
  EXPECT_FALSE(lin->weight.grad().defined());
  EXPECT_THROW(lin->merge(), dt::ConfigError);

  models::FluxTransformer2DConfig c;
  c.num_layers = 1;
  c.num_single_layers = 1;
  c.attention_head_dim = 16;
  c.num_attention_heads = 2;
  c.in_channels = 8;
  c.joint_attention_dim = 12;
  c.pooled_projection_dim = 10;
  c.axes_dims_rope = {4, 6, 6};
  Flux model(c);
  for (auto& p : model->parameters()) p.set_requires_grad(false);
  const at::Tensor h = at::randn({2, 6, 8}), text = at::randn({2, 3, 12}),
                   pooled = at::randn({2, 10});
  const at::Tensor ts = at::rand({2}), img = models::flux_latent_image_ids(2, 3),
                   txt = at::zeros({3, 3});
  const at::Tensor full = model->forward(h, text, pooled, ts, img, txt).detach();
  const nn::Fp8Storage stored = nn::store_frozen_weights_fp8(*model, at::kFloat);
  EXPECT_GT(stored.layers, 20U);
  EXPECT_LE(stored.bytes_after * 4,
            stored.bytes_before + 4 * 4 * static_cast<std::int64_t>(stored.layers));
  const at::Tensor fp8 = model->forward(h, text, pooled, ts, img, txt);
  const double model_err = scaled_error(fp8, full);
  EXPECT_LT(model_err, 0.05) << "fp8 base against float32";
  std::printf("fp8 base: %zu layers, weight bytes %.3f of float32's, output error %.4f of scale\n",
              stored.layers,
              static_cast<double>(stored.bytes_after) / static_cast<double>(stored.bytes_before),
              model_err);
}

// A Flux LoRA in diffusers' layout (PEFT keys with the adapter metadata) and in kohya's Flux
// layout (BFL's names, fused qkv and linear1 as block-diagonal branches): on diffusers' targets
// (the single blocks' proj_mlp then has none: zeros in linear1), and on every block layer kohya
// names (modulations, proj_mlp, the single blocks' proj_out). Fusing keeps ΔW exactly; a branch
// kohya cannot name and unequal ranks within a fused module are refused. check_cpp_models.py has
// diffusers load both files and give difftrain's output.
TEST(Flux, LoraFilesInDiffusersAndKohyasLayouts) {
  namespace ad = difftrain::adapters;
  const fs::path root = fs::path(DIFFTRAIN_GOLDEN_DIR) / "models";
  const ad::LoraTargets every_block{
      {},
      R"(.*(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)|)"
      R"(ff(_context)?\.net\.(0\.proj|2)|proj_mlp|single_transformer_blocks\.\d+\.proj_out|)"
      R"(norm1(_context)?\.linear|norm\.linear))"};
  struct Case {
    std::string label, model;
    std::int64_t doubles, singles;
    ad::LoraTargets targets;
    bool
        kohya_in_diffusers;  // diffusers' kohya converter assumes Flux.1's full single-block widths
  };
  const std::vector<Case> cases{{"targets", "flux_0", 1, 1, ad::flux_lora_targets(), false},
                                {"all_blocks", "flux_0", 1, 1, every_block, false},
                                {"double_blocks", "flux_1", 2, 0, every_block, true}};
  const char* out_env = std::getenv("DIFFTRAIN_MODELS_OUT");
  for (const auto& c : cases) {
    SCOPED_TRACE(c.label);
    const auto t = dt::io::load_safetensors(root / (c.model + ".io.safetensors"), true).tensors;
    at::manual_seed(12);
    auto model = models::from_pretrained<Flux>(root / c.model);
    const auto adapted = ad::inject_lora(*model, c.targets, {.rank = 2, .alpha = 3.0});
    {
      const at::NoGradGuard no_grad;
      for (const auto& [name, h] : ad::lora_layers(*model)) h->lora_b().normal_(0.0, 0.2);
    }
    model->eval();
    const at::NoGradGuard no_grad;
    const at::Tensor want =
        model->forward(t.at("input.hidden_states"), t.at("input.encoder_hidden_states"),
                       t.at("input.pooled_projections"), t.at("input.timestep"),
                       t.at("input.img_ids"), t.at("input.txt_ids"),
                       t.contains("input.guidance") ? t.at("input.guidance") : at::Tensor());
    const auto kohya = ad::flux_kohya_lora_state_dict(*model, c.doubles, c.singles);
    // Fusing keeps ΔW: the file's scale·up·down equals the separate branches' ΔW stacked.
    auto fused_delta = [&](const std::string& key, const std::string& block,
                           const std::vector<std::string>& modules) {
      const at::Tensor& down = kohya.at(key + ".lora_down.weight");
      const double scale =
          kohya.at(key + ".alpha").item<double>() / static_cast<double>(down.size(0));
      std::vector<at::Tensor> parts;
      for (const auto& m : modules)
        parts.push_back(
            dynamic_cast<dt::nn::LoraHost*>(model->named_modules("", false)[block + m].get())
                ->delta_weight());
      EXPECT_EQ(down.size(0), 2 * static_cast<std::int64_t>(modules.size()));
      return (kohya.at(key + ".lora_up.weight").mm(down) * scale - at::cat(parts))
          .abs()
          .max()
          .item<double>();
    };
    if (c.label != "targets") {
      EXPECT_LT(fused_delta("lora_unet_double_blocks_0_img_attn_qkv", "transformer_blocks.0.",
                            {"attn.to_q", "attn.to_k", "attn.to_v"}),
                1e-6);
      if (c.singles > 0) {
        EXPECT_LT(fused_delta("lora_unet_single_blocks_0_linear1", "single_transformer_blocks.0.",
                              {"attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"}),
                  1e-6);
      }
    } else {  // proj_mlp has no branch on diffusers' targets: zeros beside q, k and v
      EXPECT_EQ(kohya.at("lora_unet_single_blocks_0_linear1.lora_down.weight").size(0), 8);
    }
    if (out_env != nullptr) {
      const fs::path dir = fs::path(out_env) / ("flux_lora_" + c.label);
      fs::create_directories(dir);
      nlohmann::json meta;
      ad::add_peft_adapter_metadata(meta, *model, "transformer");
      dt::io::save_safetensors(dir / "pytorch_lora_weights.safetensors",
                               ad::lora_state_dict(*model, {ad::LoraLayout::peft, "transformer."}),
                               ad::lora_file_metadata(meta));
      dt::io::save_safetensors(dir / "lora_kohya.safetensors", kohya);
      dt::io::save_safetensors(dir / "output.safetensors", {{"transformer", want}});
      std::ofstream(dir / "case.json") << nlohmann::json{
          {"model", c.model},
          {"kohya_in_diffusers",
           c.kohya_in_diffusers}}.dump();
    }
  }
  // Refused: a branch kohya's layout has no name for, unequal ranks inside a fused module.
  auto model = models::from_pretrained<Flux>(root / "flux_0");
  (void)ad::inject_lora(*model, {{"x_embedder"}, {}}, {.rank = 2});
  EXPECT_THROW((void)ad::flux_kohya_lora_state_dict(*model, 1, 1), dt::ConfigError);
  auto uneven = models::from_pretrained<Flux>(root / "flux_0");
  (void)ad::inject_lora(*uneven, {{"attn.to_q"}, {}}, {.rank = 2});
  (void)ad::inject_lora(*uneven, {{"attn.to_k"}, {}}, {.rank = 3});
  EXPECT_THROW((void)ad::flux_kohya_lora_state_dict(*uneven, 1, 1), dt::ConfigError);
}

// Block swapping (nn/block_swap.hpp, kohya's --blocks_to_swap): the frozen weights of the last
// blocks live on the host and come in only while their block runs, in forward and in backward,
// with and without gradient checkpointing; outputs and every gradient equal the unswapped run's
// to the bit, at most two swapped blocks are on the device at once, and destroying the swap puts
// every weight back as it was.
namespace {
void check_block_swap(const at::Device device) {
  namespace nn = difftrain::nn;
  namespace ad = difftrain::adapters;
  at::manual_seed(11);
  models::FluxTransformer2DConfig c;
  c.num_layers = 4;
  c.num_single_layers = 6;
  c.attention_head_dim = 8;
  c.num_attention_heads = 2;
  c.in_channels = 8;
  c.joint_attention_dim = 12;
  c.pooled_projection_dim = 10;
  c.axes_dims_rope = {2, 2, 4};
  c.guidance_embeds = true;
  Flux model(c);
  model->to(device);
  for (auto& p : model->parameters()) p.set_requires_grad(false);
  ad::inject_lora(*model, ad::flux_lora_targets(), nn::LoraOptions{.rank = 2});
  {
    const at::NoGradGuard no_grad;
    for (auto& p : model->named_parameters())
      if (p.key().find("lora_B") != std::string::npos) p.value().normal_(0.0, 0.05);
  }
  std::map<std::string, at::Tensor> before;
  for (const auto& p : model->named_parameters()) before[p.key()] = p.value().detach().clone();
  const auto on = at::TensorOptions().device(device);
  const at::Tensor h = at::randn({2, 6, 8}, on), text = at::randn({2, 3, 12}, on),
                   pooled = at::randn({2, 10}, on), ts = at::rand({2}, on),
                   g = at::full({2}, 3.5, on), img = models::flux_latent_image_ids(2, 3).to(device),
                   txt = at::zeros({3, 3}, on);
  auto step = [&] {
    model->zero_grad();
    const at::Tensor x = h.clone().requires_grad_();
    const at::Tensor y = model->forward(x, text, pooled, ts, img, txt, g);
    y.square().mean().backward();
    FluxRun r{y.detach(), {{"input", x.grad()}}};
    for (const auto& p : model->named_parameters())
      if (p.value().requires_grad()) r.grads[p.key()] = p.value().grad().clone();
    return r;
  };
  for (const bool checkpointing : {false, true}) {
    SCOPED_TRACE(checkpointing ? "checkpointed" : "plain");
    model->set_gradient_checkpointing(checkpointing);
    model->train();
    const FluxRun want = step();
    EXPECT_FALSE(want.grads.size() < 20);
    {
      // From host memory (as a program reads a model too large for the device): the swapped
      // blocks never whole on the device, the rest placed after.
      model->to(at::kCPU);
      const auto swap =
          models::flux_block_swap(model, 4, {.device = device});  // 2 double, 4 single blocks
      model->to(device);
      ASSERT_TRUE(swap);
      EXPECT_EQ(swap->stats().blocks, 6);
      // Swapped out from the start: the last double block's weights hold no memory.
      const at::Tensor w =
          model->transformer_blocks->ptr(3)->named_parameters()["attn.to_q.weight"];
      EXPECT_EQ(w.storage().nbytes(), 0U);
      for (int twice = 0; twice < 2; ++twice) {
        const FluxRun got = step();
        EXPECT_TRUE(at::equal(got.output, want.output));
        for (const auto& [k, v] : want.grads) EXPECT_TRUE(at::equal(got.grads.at(k), v)) << k;
      }
      const nn::BlockSwapStats& st = swap->stats();
      EXPECT_LE(st.peak_resident_bytes, 2 * st.largest_block_bytes);
      EXPECT_GE(st.copies, 2 * 2 * 6 - 1);  // each block in for forward and backward, twice
      EXPECT_GT(st.prefetched, 0);
      EXPECT_LE(st.resident_bytes, st.largest_block_bytes);
      {  // a no-grad forward leaves nothing resident behind it but what it began with
        const at::NoGradGuard no_grad;
        model->eval();
        const at::Tensor y = model->forward(h, text, pooled, ts, img, txt, g);
        EXPECT_TRUE(y.isfinite().all().item<bool>());
        model->train();
        EXPECT_LE(swap->stats().resident_bytes, st.largest_block_bytes);
      }
      {  // a checkpoint reads and resumes swapped tensors through their host copies
        const std::string key = "transformer_blocks.3.attn.to_q.weight";
        EXPECT_EQ(w.storage().nbytes(), 0U);
        EXPECT_TRUE(at::equal(nn::readable(w).to(device), before.at(key)));
        nn::assign_tensor(w, before.at(key) * 2);
        EXPECT_EQ(w.storage().nbytes(), 0U);
        {
          const auto whole = swap->whole();
          EXPECT_TRUE(at::equal(w, before.at(key) * 2));
          nn::assign_tensor(w, before.at(key));  // resident: both copies
        }
        EXPECT_TRUE(at::equal(nn::readable(w).to(device), before.at(key)));
      }
      {  // every weight readable inside a Whole scope (saving)
        const auto whole = swap->whole();
        EXPECT_EQ(swap->stats().resident_bytes, st.host_bytes);
        for (const auto& p : model->named_parameters())
          EXPECT_TRUE(at::equal(p.value(), before.at(p.key()))) << p.key();
      }
      EXPECT_THROW(models::flux_block_swap(model, 2), dt::ConfigError);  // one per process
    }
    for (const auto& p : model->named_parameters())
      EXPECT_TRUE(at::equal(p.value(), before.at(p.key()))) << p.key();
  }
}
}  // namespace

TEST(Flux, BlockSwapKeepsResultsToTheBitAndTwoBlocksResident) {
  namespace nn = difftrain::nn;
  check_block_swap(at::kCPU);
  // kohya's split and bounds: Flux.1's 19 + 38 blocks allow 35.
  EXPECT_EQ(nn::split_blocks_to_swap(35, 19, 38, "--blocks_to_swap").double_blocks, 17);
  EXPECT_EQ(nn::split_blocks_to_swap(35, 19, 38, "--blocks_to_swap").single_blocks, 36);
  expect_error<dt::ConfigError>([] { nn::split_blocks_to_swap(36, 19, 38, "--blocks_to_swap"); },
                                "at most 35");
  // A block whose every parameter trains has nothing to keep on the host.
  models::FluxTransformer2DConfig c;
  c.num_layers = 4;
  c.num_single_layers = 6;
  c.attention_head_dim = 8;
  c.num_attention_heads = 2;
  c.in_channels = 8;
  c.joint_attention_dim = 12;
  c.pooled_projection_dim = 10;
  c.axes_dims_rope = {2, 2, 4};
  Flux model(c);
  for (auto& p : model->parameters()) p.set_requires_grad(false);
  expect_error<dt::ConfigError>([&] { models::flux_block_swap(model, 5); }, "at most 4");
  expect_error<dt::ConfigError>([&] { models::flux_block_swap(model, -1); }, "negative");
  for (auto& p : model->single_transformer_blocks->ptr(5)->parameters()) p.set_requires_grad(true);
  expect_error<dt::ConfigError>([&] { models::flux_block_swap(model, 1); },
                                "every parameter trains");
}

// On a CUDA device the copies run on a side stream ahead of use (gpu-check.sh runs it).
TEST(Flux, BlockSwapOnCudaCopiesAheadOnASideStream) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  // Bit-equality needs kernels that are deterministic run to run (no atomics in attention's
  // backward): PyTorch's deterministic mode for the comparison.
  ::setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", 0);
  const bool was = at::globalContext().deterministicAlgorithms();
  at::globalContext().setDeterministicAlgorithms(true, false);
  check_block_swap(at::Device(at::kCUDA, 0));
  at::globalContext().setDeterministicAlgorithms(was, false);
}

// Flux single files (models/single_file/flux.hpp): a model written in Black Forest Labs' layout
// and read back, bare and under ComfyUI's prefix, is the same model; a file's config told from
// its keys is the model's; a missing, extra or misshapen tensor and adapters are typed errors.
// (check_cpp_models.py has diffusers' own converter read the file.)
TEST(Flux, SingleFilesInBlackForestLabsLayoutRoundTrip) {
  namespace ad = difftrain::adapters;
  at::manual_seed(5);
  models::FluxTransformer2DConfig c;  // heads of 128: the rotary axes are told from the keys
  c.num_layers = 2;
  c.num_single_layers = 1;
  c.attention_head_dim = 128;
  c.num_attention_heads = 1;
  c.in_channels = 8;
  c.joint_attention_dim = 12;
  c.pooled_projection_dim = 10;
  c.guidance_embeds = true;
  Flux model(c);
  {
    const at::NoGradGuard no_grad;
    for (auto& p : model->parameters()) p.normal_();
  }
  const auto tensors = models::flux_single_file_tensors(*model);
  EXPECT_EQ(tensors.at("double_blocks.1.img_attn.qkv.weight").sizes(),
            (at::IntArrayRef{3 * 128, 128}));
  EXPECT_EQ(tensors.at("single_blocks.0.linear1.weight").size(0), 3 * 128 + 4 * 128);
  // final_layer.adaLN_modulation keeps shift before scale.
  EXPECT_TRUE(at::equal(tensors.at("final_layer.adaLN_modulation.1.weight").narrow(0, 0, 128),
                        model->norm_out->named_parameters()["linear.weight"].narrow(0, 128, 128)));
  const fs::path dir =
      fs::temp_directory_path() / ("difftrain-flux-file-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  std::map<std::string, at::Tensor> comfy;
  for (const auto& [k, v] : tensors) comfy["model.diffusion_model." + k] = v;
  comfy["first_stage_model.decoder.conv_in.weight"] = at::zeros({2, 2});  // ComfyUI's VAE beside
  dt::io::save_safetensors(dir / "bfl.safetensors", tensors);
  dt::io::save_safetensors(dir / "comfy.safetensors", comfy);
  const auto told = models::FluxTransformer2DConfig::from_json(
      models::flux_transformer_config_from_single_file(
          models::read_flux_single_file(dir / "bfl.safetensors")),
      "told");
  EXPECT_EQ(told.num_layers, 2);
  EXPECT_EQ(told.num_single_layers, 1);
  EXPECT_EQ(told.num_attention_heads, 1);
  EXPECT_EQ(told.joint_attention_dim, 12);
  EXPECT_EQ(told.pooled_projection_dim, 10);
  EXPECT_TRUE(told.guidance_embeds);
  EXPECT_EQ(told.axes_dims_rope, (std::vector<std::int64_t>{16, 56, 56}));
  for (const char* name : {"bfl.safetensors", "comfy.safetensors"}) {
    SCOPED_TRACE(name);
    std::map<std::string, at::Tensor> leftovers;
    const auto read = models::read_flux_single_file(dir / name, &leftovers);
    EXPECT_EQ(leftovers.size(), std::string(name) == "comfy.safetensors" ? 1U : 0U);
    auto back = models::flux_transformer_from_single_file(read, told);
    auto want = model->named_parameters();
    for (const auto& p : back->named_parameters())
      EXPECT_TRUE(at::equal(p.value(), want[p.key()])) << p.key();
  }
  // Mistakes, each named.
  auto broken = tensors;
  broken.erase("double_blocks.1.txt_mlp.2.bias");
  expect_error<dt::FormatError>([&] { (void)models::flux_transformer_from_single_file(broken, c); },
                                "double_blocks.1.txt_mlp.2.bias");
  broken = tensors;
  broken["double_blocks.2.img_mod.lin.weight"] = at::zeros({6, 128});
  expect_error<dt::FormatError>([&] { (void)models::flux_transformer_from_single_file(broken, c); },
                                "double_blocks.2.img_mod.lin.weight");
  broken = tensors;
  broken["img_in.weight"] = at::zeros({128, 9});
  expect_error<dt::ConfigError>([&] { (void)models::flux_transformer_from_single_file(broken, c); },
                                "img_in.weight");
  dt::io::save_safetensors(dir / "other.safetensors", {{"conv.weight", at::zeros({2})}});
  expect_error<dt::FormatError>(
      [&] { (void)models::read_flux_single_file(dir / "other.safetensors"); },
      "no Flux transformer");
  ad::inject_lora(*model, ad::flux_lora_targets(), difftrain::nn::LoraOptions{.rank = 2});
  expect_error<dt::ConfigError>([&] { (void)models::flux_single_file_tensors(*model); }, "adapter");
  dt::io::remove_tree(dir);
}
