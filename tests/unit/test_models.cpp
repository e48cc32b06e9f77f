// diffusers' UNet2DConditionModel and AutoencoderKL in difftrain: outputs and every parameter
// gradient equal diffusers' on the same save_pretrained folders (tests/reference/ref_models.py),
// full-size Stable Diffusion configurations have diffusers' parameter names and shapes, folders
// round-trip, and bad folders and configs fail with typed errors naming the file and field.
#include <unistd.h>
#include <difftrain/adapters/stable_diffusion_lora_files.hpp>
#include <difftrain/adapters/text_encoder_adapters.hpp>
#include <difftrain/adapters/unet_adapters.hpp>
#include <difftrain/adapters/weight_delta.hpp>
#include <difftrain/io/remove_tree.hpp>
#include <difftrain/io/safetensors.hpp>
#include <difftrain/models/models.hpp>

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>

#include "golden.hpp"
#include "poison_units.hpp"
#include "unet_inputs.hpp"

namespace dt = difftrain;
namespace fs = std::filesystem;
namespace models = difftrain::models;
namespace tst = difftrain::test;

namespace {

using Backend = dt::nn::attention::Sdpa<dt::nn::attention::Auto>;
using SiLU = dt::nn::activation::SiLU;
using Mish = dt::nn::activation::Mish;

fs::path golden_models() { return fs::path(DIFFTRAIN_GOLDEN_DIR) / "models"; }

[[maybe_unused]] fs::path scratch(const std::string& name) {
  const fs::path dir =
      fs::temp_directory_path() / ("difftrain-models-" + name + "-" + std::to_string(::getpid()));
  dt::io::remove_tree(dir);
  fs::create_directories(dir);
  return dir;
}

/// max |a − b| relative to the reference's scale (at least 1).
double scaled_error(const at::Tensor& a, const at::Tensor& b) {
  const double scale = std::max(1.0, b.abs().max().item<double>());
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>() / scale;
}

void expect_close(const at::Tensor& got, const at::Tensor& want, double tol,
                  const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  EXPECT_LE(scaled_error(got, want), tol) << what;
}

/// Runs a UNet case: forward on the golden inputs, backward of sum(out · w), every gradient.
template <class Act>
void check_unet_case(const std::string& name) {
  SCOPED_TRACE(name);
  const auto io = dt::io::load_safetensors(golden_models() / (name + ".io.safetensors"), true);
  const auto& t = io.tensors;
  models::LoadOptions lo;
  const auto& cases = tst::golden("models.json")["unet"];
  for (const auto& c : cases) {
    if (c["name"] == name && !c["variant"].is_null()) lo.variant = c["variant"].get<std::string>();
  }
  auto unet = models::from_pretrained<models::UNet2DConditionModel<Backend, Act>>(
      golden_models() / name, lo);
  unet->train();
  // Each down, mid and up block is a unit (stage 3): no parameter is used outside its block.
  const tst::PoisonUnits units;
  std::int64_t count = 0;
  for (const auto& p : unet->parameters()) count += p.numel();
  for (const auto& c : cases) {
    if (c["name"] == name) {
      EXPECT_EQ(count, c["parameters"].get<std::int64_t>());
    }
  }
  const models::UNetConditions cond = tst::unet_conditions(t);
  const at::Tensor out = unet->forward(t.at("input.sample"), t.at("input.timestep"),
                                       t.at("input.encoder_hidden_states"), cond);
  EXPECT_EQ(units.entered(),
            static_cast<std::int64_t>(unet->down_blocks->size() + unet->up_blocks->size()) +
                (unet->mid_block ? 1 : 0));
  expect_close(out, t.at("output"), 1e-5, "output");
  (out * t.at("weight")).sum().backward();
  std::size_t checked = 0;
  for (const auto& p : unet->named_parameters()) {
    const auto it = t.find("grad." + p.key());
    ASSERT_NE(it, t.end()) << "no reference gradient for " << p.key();
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    expect_close(p.value().grad(), it->second, 1e-4, "grad of " + p.key());
    ++checked;
  }
  EXPECT_EQ(checked, unet->parameters().size());
}

}  // namespace

TEST(Models, UNetMatchesDiffusersOnEverySweptConfig) {
  const auto& cases = tst::golden("models.json")["unet"];
  ASSERT_GE(cases.size(), 5U);
  for (const auto& c : cases) {
    const std::string name = c["name"];
    if (c["act_fn"] == "mish")
      check_unet_case<Mish>(name);
    else
      check_unet_case<SiLU>(name);
  }
}

TEST(Models, VaeMatchesDiffusersOnEverySweptConfig) {
  const auto& cases = tst::golden("models.json")["vae"];
  ASSERT_GE(cases.size(), 2U);
  for (const auto& c : cases) {
    const std::string name = c["name"];
    SCOPED_TRACE(name);
    const auto io = dt::io::load_safetensors(golden_models() / (name + ".io.safetensors"), true);
    const auto& t = io.tensors;
    auto vae = models::from_pretrained<models::AutoencoderKL<>>(golden_models() / name);
    vae->train();
    std::int64_t count = 0;
    for (const auto& p : vae->parameters()) count += p.numel();
    EXPECT_EQ(count, c["parameters"].get<std::int64_t>());
    const auto posterior = vae->encode(t.at("input.x"));
    expect_close(posterior.mean, t.at("mean"), 1e-5, "mean");
    expect_close(posterior.logvar, t.at("logvar"), 1e-5, "logvar");
    const at::Tensor decoded = vae->decode(t.at("input.z"));
    expect_close(decoded, t.at("decoded"), 1e-5, "decoded");
    const at::Tensor recon = vae->forward(t.at("input.x"));
    expect_close(recon, t.at("recon"), 1e-5, "recon");
    ((recon * t.at("loss_w")).sum() + (posterior.mean * t.at("mean_w")).sum() +
     posterior.logvar.sum() + (decoded * t.at("loss_w")).sum())
        .backward();
    for (const auto& p : vae->named_parameters())
      expect_close(p.value().grad(), t.at("grad." + p.key()), 1e-4, "grad of " + p.key());
  }
}

// diffusers' enable_tiling and enable_slicing: 40 × 28 images in 16-pixel tiles, one at a time;
// the posterior, the decoded image and every gradient equal diffusers'.
TEST(Models, TiledAndSlicedVaeMatchesDiffusers) {
  const auto& ref = tst::golden("models.json")["vae_tiled"];
  const auto io = dt::io::load_safetensors(golden_models() / "vae_tiled.io.safetensors", true);
  const auto& t = io.tensors;
  auto vae = models::from_pretrained<models::AutoencoderKL<>>(golden_models() / "vae_tiled");
  vae->train();
  vae->enable_tiling();
  vae->enable_slicing();
  ASSERT_TRUE(vae->tiling().has_value());
  EXPECT_EQ(vae->tiling()->sample_tile, ref["sample_tile"].get<std::int64_t>());
  EXPECT_EQ(vae->tiling()->latent_tile, ref["latent_tile"].get<std::int64_t>());
  const auto posterior = vae->encode(t.at("input.x"));
  expect_close(posterior.mean, t.at("mean"), 1e-5, "mean");
  expect_close(posterior.logvar, t.at("logvar"), 1e-5, "logvar");
  const at::Tensor decoded = vae->decode(t.at("input.z"));
  expect_close(decoded, t.at("decoded"), 1e-5, "decoded");
  ((decoded * t.at("decoded_w")).sum() + (posterior.mean * t.at("mean_w")).sum() +
   posterior.logvar.sum())
      .backward();
  for (const auto& p : vae->named_parameters())
    expect_close(p.value().grad(), t.at("grad." + p.key()), 1e-4, "grad of " + p.key());

  // Tiles differ from the whole (each sees only its part), and untiled is back when disabled.
  at::NoGradGuard no_grad;
  vae->disable_tiling();
  EXPECT_GT(scaled_error(vae->decode(t.at("input.z")), t.at("decoded")), 1e-3);
  // Slicing alone changes nothing but memory.
  const at::Tensor whole = vae->decode(t.at("input.z"));
  vae->enable_slicing(false);
  // (batch-size-dependent convolution kernels round differently)
  expect_close(vae->decode(t.at("input.z")), whole, 1e-5, "sliced vs whole");
  EXPECT_THROW(vae->enable_tiling({.sample_tile = 16, .latent_tile = 8, .overlap = 1.0}),
               dt::ConfigError);
  EXPECT_THROW(vae->enable_tiling({.sample_tile = 1, .latent_tile = 0, .overlap = 0.5}),
               dt::ConfigError);
}

TEST(Models, FullSizeStableDiffusionConfigsHaveDiffusersParameters) {
  const auto& full = tst::golden("models.json")["full_size"];
  auto compare = [](torch::nn::Module& m, const nlohmann::json& ref) {
    std::map<std::string, std::vector<std::int64_t>> got, want;
    std::int64_t count = 0;
    for (const auto& p : m.named_parameters()) {
      got[p.key()] = p.value().sizes().vec();
      count += p.value().numel();
    }
    for (const auto& [k, v] : ref["shapes"].items()) want[k] = v.get<std::vector<std::int64_t>>();
    EXPECT_EQ(count, ref["parameters"].get<std::int64_t>());
    EXPECT_EQ(got.size(), want.size());
    for (const auto& [k, shape] : want) {
      const auto it = got.find(k);
      if (it == got.end()) {
        ADD_FAILURE() << "missing " << k;
        continue;
      }
      EXPECT_EQ(it->second, shape) << k;
    }
    for (const auto& [k, shape] : got) EXPECT_TRUE(want.contains(k)) << "extra " << k;
  };
  for (const char* key : {"sd15_unet", "sd21_unet"}) {
    SCOPED_TRACE(key);
    models::UNet2DConditionModel<> unet(
        models::UNet2DConditionConfig::from_json(full[key]["config"], key));
    compare(*unet, full[key]);
  }
  EXPECT_EQ(full["sd15_unet"]["parameters"].get<std::int64_t>(), 859'520'964);
  models::AutoencoderKL<> vae(
      models::AutoencoderKLConfig::from_json(full["sd_vae"]["config"], "vae"));
  compare(*vae, full["sd_vae"]);
}

namespace {

/// Copies a golden folder to a scratch folder, to break it.
fs::path copy_of(const std::string& name, const std::string& as) {
  const fs::path dir = scratch(as);
  fs::copy(golden_models() / name, dir, fs::copy_options::recursive);
  return dir;
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

void write_text(const fs::path& p, const std::string& text) { std::ofstream(p) << text; }

nlohmann::json read_json(const fs::path& p) { return nlohmann::json::parse(std::ifstream(p)); }

}  // namespace

TEST(Models, GradientCheckpointingGivesTheSameGradients) {
  const auto io = dt::io::load_safetensors(golden_models() / "unet_conv_proj.io.safetensors", true);
  const auto& t = io.tensors;
  auto run = [&](bool checkpointing) {
    auto unet =
        models::from_pretrained<models::UNet2DConditionModel<>>(golden_models() / "unet_conv_proj");
    unet->train();
    unet->set_gradient_checkpointing(checkpointing);
    // Checkpointed blocks recompute inside backward: their parameters must be back by then.
    const tst::PoisonUnits units;
    const at::Tensor out = unet->forward(t.at("input.sample"), t.at("input.timestep"),
                                         t.at("input.encoder_hidden_states"));
    (out * t.at("weight")).sum().backward();
    std::map<std::string, at::Tensor> grads;
    for (const auto& p : unet->named_parameters()) grads[p.key()] = p.value().grad();
    return std::make_pair(out.detach(), grads);
  };
  const auto [plain_out, plain] = run(false);
  const auto [ckpt_out, ckpt] = run(true);
  EXPECT_TRUE(at::equal(plain_out, ckpt_out));
  for (const auto& [name, g] : plain) expect_close(ckpt.at(name), g, 1e-6, name);

  auto vae = models::from_pretrained<models::AutoencoderKL<>>(golden_models() / "vae_two_levels");
  vae->train();
  const at::Tensor x = at::randn({1, 3, 16, 16});
  vae->forward(x).square().sum().backward();
  std::map<std::string, at::Tensor> vae_plain;
  for (const auto& p : vae->named_parameters()) vae_plain[p.key()] = p.value().grad().clone();
  vae->zero_grad();
  vae->set_gradient_checkpointing(true);
  vae->forward(x).square().sum().backward();
  for (const auto& p : vae->named_parameters())
    expect_close(p.value().grad(), vae_plain.at(p.key()), 1e-6, p.key());
}

// A folder difftrain saves loads back bit for bit, sharded or not, in a variant or not; a save
// over an earlier sharded one removes the shards it no longer uses. With DIFFTRAIN_MODELS_OUT
// set, it also leaves a changed UNet and VAE (and their outputs) there for
// tests/reference/check_cpp_models.py to load in diffusers.
TEST(Models, SavedFoldersRoundTrip) {
  const fs::path dir = scratch("roundtrip");
  auto unet = models::from_pretrained<models::UNet2DConditionModel<>>(golden_models() /
                                                                      "unet_linear_3_levels");
  {
    at::NoGradGuard no_grad;
    at::manual_seed(7);
    for (auto& p : unet->parameters()) p.add_(at::randn_like(p) * 0.01);
  }
  models::SaveOptions sharded;
  sharded.max_shard_size = 200'000;
  const auto files = models::save_pretrained(unet, dir / "unet", sharded);
  EXPECT_GT(files.size(), 2U);
  EXPECT_TRUE(fs::exists(dir / "unet" / models::kWeightsIndexName));
  auto back = models::from_pretrained<models::UNet2DConditionModel<>>(dir / "unet");
  const auto want = unet->named_parameters();
  for (const auto& p : back->named_parameters())
    EXPECT_TRUE(at::equal(p.value(), want[p.key()])) << p.key();
  EXPECT_EQ(back->config().to_json(), unet->config().to_json());

  // Saved again unsharded: the shards and the index of the first save are gone.
  models::save_pretrained(unet, dir / "unet");
  std::size_t weight_files = 0;
  for (const auto& e : fs::directory_iterator(dir / "unet"))
    if (e.path().filename().string().starts_with("diffusion_pytorch_model")) ++weight_files;
  EXPECT_EQ(weight_files, 1U);
  back = models::from_pretrained<models::UNet2DConditionModel<>>(dir / "unet");
  for (const auto& p : back->named_parameters())
    EXPECT_TRUE(at::equal(p.value(), want[p.key()])) << p.key();

  // An fp16 variant beside the float32 weights: loads as the half-rounded values.
  models::SaveOptions half;
  half.variant = "fp16";
  half.dtype = at::kHalf;
  models::save_pretrained(unet, dir / "unet", half);
  EXPECT_TRUE(fs::exists(dir / "unet" / "diffusion_pytorch_model.fp16.safetensors"));
  models::LoadOptions lo;
  lo.variant = "fp16";
  back = models::from_pretrained<models::UNet2DConditionModel<>>(dir / "unet", lo);
  for (const auto& p : back->named_parameters())
    EXPECT_TRUE(at::equal(p.value(), want[p.key()].to(at::kHalf).to(at::kFloat))) << p.key();
  lo.dtype = at::kHalf;
  back = models::from_pretrained<models::UNet2DConditionModel<>>(dir / "unet", lo);
  EXPECT_EQ(back->parameters()[0].scalar_type(), at::kHalf);

  if (const char* out = std::getenv("DIFFTRAIN_MODELS_OUT")) {
    const fs::path o = out;
    const auto io =
        dt::io::load_safetensors(golden_models() / "unet_conv_proj.io.safetensors", true);
    const auto& t = io.tensors;
    auto u =
        models::from_pretrained<models::UNet2DConditionModel<>>(golden_models() / "unet_conv_proj");
    auto vae = models::from_pretrained<models::AutoencoderKL<>>(golden_models() / "vae_two_levels");
    at::NoGradGuard no_grad;
    at::manual_seed(11);
    for (auto& p : u->parameters()) p.add_(at::randn_like(p) * 0.02);
    for (auto& p : vae->parameters()) p.add_(at::randn_like(p) * 0.02);
    models::save_pretrained(u, o / "unet", sharded);
    models::save_pretrained(vae, o / "vae");
    u->eval();
    vae->eval();
    const at::Tensor x = at::randn({2, 3, 16, 16});
    dt::io::save_safetensors(o / "outputs.safetensors",
                             {{"sample", t.at("input.sample")},
                              {"timestep", t.at("input.timestep")},
                              {"encoder_hidden_states", t.at("input.encoder_hidden_states")},
                              {"unet", u->forward(t.at("input.sample"), t.at("input.timestep"),
                                                  t.at("input.encoder_hidden_states"))},
                              {"x", x},
                              {"vae_mean", vae->encode(x).mean},
                              {"vae_recon", vae->forward(x)}});
    // SDXL's layout, read from torch.save shards, written back as safetensors; its output with
    // the added conditions and an encoder attention mask.
    const auto sdxl_io =
        dt::io::load_safetensors(golden_models() / "unet_sdxl_text_time_bin.io.safetensors", true);
    const auto& s = sdxl_io.tensors;
    auto sdxl = models::from_pretrained<models::UNet2DConditionModel<>>(golden_models() /
                                                                        "unet_sdxl_text_time_bin");
    for (auto& p : sdxl->parameters()) p.add_(at::randn_like(p) * 0.02);
    models::save_pretrained(sdxl, o / "unet_sdxl");
    sdxl->eval();
    models::UNetConditions c;
    c.text_embeds = s.at("input.text_embeds");
    c.time_ids = s.at("input.time_ids");
    c.encoder_attention_mask = s.at("input.encoder_attention_mask");
    dt::io::save_safetensors(o / "outputs_sdxl.safetensors",
                             {{"unet", sdxl->forward(s.at("input.sample"), s.at("input.timestep"),
                                                     s.at("input.encoder_hidden_states"), c)}});
  }
  dt::io::remove_tree(dir);
}

TEST(Models, BadFoldersFailWithTypedErrorsAndLoadNothing) {
  using Unet = models::UNet2DConditionModel<>;
  const std::string name = "unet_linear_3_levels";  // sharded
  auto msg = error_of<dt::IoError>([&] { models::from_pretrained<Unet>(scratch("none") / "x"); });
  EXPECT_NE(msg.find("not a folder"), std::string::npos) << msg;

  fs::path d = copy_of(name, "no_config");
  fs::remove(d / "config.json");
  msg = error_of<dt::IoError>([&] { models::from_pretrained<Unet>(d); });
  EXPECT_NE(msg.find("config.json"), std::string::npos) << msg;

  d = copy_of(name, "bad_json");
  write_text(d / "config.json", "{\"in_channels\": 4,");
  msg = error_of<dt::FormatError>([&] { models::from_pretrained<Unet>(d); });
  EXPECT_NE(msg.find("config.json"), std::string::npos) << msg;

  d = copy_of("unet_conv_proj", "no_weights");
  fs::remove(d / models::kWeightsName);
  msg = error_of<dt::IoError>([&] { models::from_pretrained<Unet>(d); });
  EXPECT_NE(msg.find("diffusion_pytorch_model.safetensors"), std::string::npos) << msg;
  write_text(d / "diffusion_pytorch_model.bin", "x");  // read as torch.save's, and refused
  msg = error_of<dt::FormatError>([&] { models::from_pretrained<Unet>(d); });
  EXPECT_NE(msg.find("diffusion_pytorch_model.bin"), std::string::npos) << msg;

  // torch.save shards: one missing, one cut short, one holding a tensor of the wrong shape.
  const std::string bin = "unet_sdxl_text_time_bin";
  d = copy_of(bin, "bin_missing_shard");
  fs::remove(d / "diffusion_pytorch_model-00002-of-00003.bin");
  msg = error_of<dt::IoError>([&] { models::from_pretrained<Unet>(d); });
  EXPECT_NE(msg.find("00002-of-00003.bin"), std::string::npos) << msg;
  d = copy_of(bin, "bin_truncated_shard");
  const fs::path bin_shard = d / "diffusion_pytorch_model-00001-of-00003.bin";
  fs::resize_file(bin_shard, fs::file_size(bin_shard) / 2);
  msg = error_of<dt::FormatError>([&] { models::from_pretrained<Unet>(d); });
  EXPECT_NE(msg.find("00001-of-00003.bin"), std::string::npos) << msg;

  d = copy_of("unet_timestep_classes", "variant_only");
  msg = error_of<dt::IoError>(
      [&] { models::from_pretrained<models::UNet2DConditionModel<Backend, Mish>>(d); });
  EXPECT_NE(msg.find("variant \"fp16\""), std::string::npos) << msg;  // exists, not asked for

  d = copy_of(name, "missing_shard");
  fs::remove(d / "diffusion_pytorch_model-00002-of-00005.safetensors");
  msg = error_of<dt::IoError>([&] { models::from_pretrained<Unet>(d); });
  EXPECT_NE(msg.find("00002-of-00005"), std::string::npos) << msg;

  d = copy_of(name, "truncated_shard");
  const fs::path shard = d / "diffusion_pytorch_model-00003-of-00005.safetensors";
  fs::resize_file(shard, fs::file_size(shard) - 100);
  msg = error_of<dt::FormatError>([&] { models::from_pretrained<Unet>(d); });
  EXPECT_NE(msg.find("00003-of-00005"), std::string::npos) << msg;

  d = copy_of(name, "index_lies");
  auto index = read_json(d / models::kWeightsIndexName);
  const std::string moved = index["weight_map"].begin().key();
  index["weight_map"][moved] = "diffusion_pytorch_model-00005-of-00005.safetensors";
  write_text(d / models::kWeightsIndexName, index.dump());
  msg = error_of<dt::FormatError>([&] { models::from_pretrained<Unet>(d); });
  EXPECT_NE(msg.find(moved), std::string::npos) << msg;

  // Tensors that do not fit: each named, and the model left as it was.
  auto unet = models::from_pretrained<Unet>(golden_models() / name);
  std::map<std::string, at::Tensor> before;
  for (const auto& p : unet->named_parameters()) before[p.key()] = p.value().clone();
  auto weights = models::read_model_weights(golden_models() / name);
  auto broken = weights;
  broken["conv_in.weight"] = at::zeros({1, 2, 3, 3});     // shape
  broken["conv_out.bias"] = at::zeros({4}, at::kInt);     // dtype
  broken.erase("time_embedding.linear_1.weight");         // missing
  broken["down_blocks.0.extra.weight"] = at::zeros({2});  // unexpected
  for (auto& [k, v] : broken) (void)k, v = v.clone();
  broken["conv_in.bias"] = at::full_like(weights.at("conv_in.bias"), 7.0);  // would change
  msg = error_of<dt::FormatError>([&] { models::load_weights(*unet, broken, "test"); });
  for (const char* needle :
       {"conv_in.weight", "conv_out.bias", "Int", "missing 'time_embedding.linear_1.weight'",
        "unexpected 'down_blocks.0.extra.weight'"})
    EXPECT_NE(msg.find(needle), std::string::npos) << needle << " in " << msg;
  for (const auto& p : unet->named_parameters())
    EXPECT_TRUE(at::equal(p.value(), before.at(p.key()))) << p.key() << " changed";

  d = copy_of("vae_two_levels", "wrong_class");
  msg = error_of<dt::ConfigError>([&] { models::from_pretrained<Unet>(d); });
  EXPECT_NE(msg.find("AutoencoderKL"), std::string::npos) << msg;
  dt::io::remove_tree(fs::temp_directory_path() /
                      ("difftrain-models-none-" + std::to_string(::getpid())));
}

// Every config mistake is a ConfigError naming the field.
TEST(Models, ConfigMistakesAreNamed) {
  const nlohmann::json base = read_json(golden_models() / "unet_conv_proj" / "config.json");
  const std::vector<std::pair<nlohmann::json, std::string>> cases = {
      {{{"flux_capacitor", 1}}, "unknown field 'flux_capacitor'"},
      {{{"dual_cross_attention", true}}, "dual_cross_attention"},
      {{{"attention_type", "gated"}}, "attention_type"},
      {{{"time_embedding_type", "fourier"}}, "time_embedding_type"},
      {{{"addition_embed_type", "text"}}, "addition_embed_type"},
      {{{"addition_embed_type", "text_time"}, {"projection_class_embeddings_input_dim", 40}},
       "addition_time_embed_dim"},
      {{{"addition_embed_type", "text_time"}, {"addition_time_embed_dim", 4}},
       "projection_class_embeddings_input_dim"},
      {{{"num_attention_heads", 4}}, "num_attention_heads"},
      {{{"cross_attention_norm", "group_norm"}}, "cross_attention_norm"},
      {{{"down_block_types", {"SimpleCrossAttnDownBlock2D", "DownBlock2D"}}},
       "SimpleCrossAttnDownBlock2D"},
      {{{"up_block_types", {"UpBlock2D", "AttnUpBlock2D"}}}, "AttnUpBlock2D"},
      {{{"mid_block_type", "UNetMidBlock2DSimpleCrossAttn"}}, "mid_block_type"},
      {{{"up_block_types", {"UpBlock2D"}}}, "up_block_types"},
      {{{"layers_per_block", {1, 1, 1}}}, "layers_per_block"},
      {{{"layers_per_block", "two"}}, "layers_per_block"},
      {{{"layers_per_block", 2.5}}, "layers_per_block"},
      {{{"attention_head_dim", {3, 4}}}, "attention_head_dim"},
      {{{"norm_num_groups", 7}}, "norm_num_groups"},
      {{{"norm_num_groups", nullptr}}, "norm_num_groups"},
      {{{"act_fn", "swishy"}}, "act_fn"},
      {{{"act_fn", "mish"}}, "Mish"},  // the config's activation is not the policy's
      {{{"resnet_time_scale_shift", "spatial"}}, "resnet_time_scale_shift"},
      {{{"class_embed_type", "projection"}}, "projection_class_embeddings_input_dim"},
      {{{"class_embed_type", "text"}}, "class_embed_type"},
      {{{"encoder_hid_dim_type", "image_proj"}, {"encoder_hid_dim", 8}}, "encoder_hid_dim_type"},
      {{{"conv_in_kernel", 2}}, "conv_in_kernel"},
      {{{"transformer_layers_per_block", {{1, 2}, {1}}}}, "transformer_layers_per_block"},
      {{{"block_out_channels", {32}}}, "block_out_channels"},
  };
  for (const auto& [patch, needle] : cases) {
    nlohmann::json j = base;
    j.merge_patch(patch);
    if (patch.contains("norm_num_groups") && patch["norm_num_groups"].is_null())
      j["norm_num_groups"] = nullptr;  // merge_patch deletes on null
    const std::string msg = error_of<dt::ConfigError>([&] {
      models::UNet2DConditionModel<> unet(models::UNet2DConditionConfig::from_json(j, "cfg.json"),
                                          "cfg.json");
    });
    EXPECT_NE(msg.find(needle), std::string::npos) << patch.dump() << " → " << msg;
    EXPECT_NE(msg.find("cfg.json"), std::string::npos) << msg;
  }
  const nlohmann::json vae = read_json(golden_models() / "vae_two_levels" / "config.json");
  for (const auto& [patch, needle] : std::vector<std::pair<nlohmann::json, std::string>>{
           {{{"down_block_types", {"DownEncoderBlock2D", "AttnDownEncoderBlock2D"}}},
            "AttnDownEncoderBlock2D"},
           {{{"up_block_types", {"UpDecoderBlock2D"}}}, "up_block_types"},
           {{{"scaling_factor", 0.0}}, "scaling_factor"},
           {{{"latent_channels", "4"}}, "latent_channels"},
           {{{"use_tiling", true}}, "use_tiling"}}) {
    nlohmann::json j = vae;
    j.merge_patch(patch);
    const std::string msg = error_of<dt::ConfigError>(
        [&] { models::AutoencoderKL<> m(models::AutoencoderKLConfig::from_json(j, "vae.json")); });
    EXPECT_NE(msg.find(needle), std::string::npos) << patch.dump() << " → " << msg;
  }
}

// Every size a config states is range-checked when it is read, before a parameter exists: zero,
// negative and absurd values of every integer field are ConfigErrors naming the field and value
// (norm_num_groups 0 once divided by zero; 2^40 channels, 10,000 blocks or a million layers once
// allocated gigabytes before failing).
TEST(Models, EveryConfigSizeIsRangeCheckedBeforeAnythingIsBuilt) {
  const std::int64_t huge = std::int64_t{1} << 40;
  struct Case {
    std::string field;
    std::vector<std::int64_t> bad;
  };
  const nlohmann::json unet = read_json(golden_models() / "unet_conv_proj" / "config.json");
  const std::vector<Case> unet_fields = {
      {"in_channels", {0, -3, huge}},
      {"out_channels", {0, -3, huge}},
      {"norm_num_groups", {0, -1, huge}},
      {"block_out_channels", {0, -32, huge}},
      {"layers_per_block", {-1, 1'000'000, huge}},
      {"transformer_layers_per_block", {0, -1, 1'000'000}},
      {"cross_attention_dim", {0, -8, huge}},
      {"attention_head_dim", {0, -2, huge}},
      {"conv_in_kernel", {-3, 1025}},
      {"conv_out_kernel", {-3, 1025}},
      {"time_embedding_dim", {0, -1, huge}},
      {"time_cond_proj_dim", {0, -1, huge}},
      {"num_class_embeds", {0, -1, huge}},
      {"encoder_hid_dim", {0, -1, huge}},
  };
  std::size_t checked = 0;
  for (const auto& [field, values] : unet_fields)
    for (const std::int64_t v : values) {
      nlohmann::json j = unet;
      // A per-block list gets the value in its last entry, a scalar field the value itself.
      if (j.contains(field) && j[field].is_array())
        j[field].back() = v;
      else
        j[field] = v;
      const std::string msg = error_of<dt::ConfigError>(
          [&] { (void)models::UNet2DConditionConfig::from_json(j, "cfg.json"); });
      EXPECT_NE(msg.find("'" + field + "'"), std::string::npos)
          << field << "=" << v << " → " << msg;
      EXPECT_NE(msg.find(std::to_string(v)), std::string::npos)
          << field << "=" << v << " → " << msg;
      EXPECT_NE(msg.find("cfg.json"), std::string::npos) << msg;
      ++checked;
    }
  // 10,000 blocks, every list consistent: refused by count, not after building them.
  {
    nlohmann::json j = unet;
    const std::size_t n = 10'000;
    j["down_block_types"] = std::vector<std::string>(n, "DownBlock2D");
    j["up_block_types"] = std::vector<std::string>(n, "UpBlock2D");
    j["block_out_channels"] = std::vector<std::int64_t>(n, 1280);
    j["attention_head_dim"] = 8;
    j["layers_per_block"] = 1;
    const std::string msg = error_of<dt::ConfigError>(
        [&] { (void)models::UNet2DConditionConfig::from_json(j, "cfg.json"); });
    EXPECT_NE(msg.find("'down_block_types' = 10000"), std::string::npos) << msg;
  }
  const nlohmann::json vae = read_json(golden_models() / "vae_two_levels" / "config.json");
  const std::vector<Case> vae_fields = {
      {"in_channels", {0, -3, huge}},        {"out_channels", {0, -3, huge}},
      {"latent_channels", {0, -4, huge}},    {"norm_num_groups", {0, -1, huge}},
      {"block_out_channels", {0, -1, huge}}, {"layers_per_block", {0, -1, 1'000'000}},
  };
  for (const auto& [field, values] : vae_fields)
    for (const std::int64_t v : values) {
      nlohmann::json j = vae;
      if (j[field].is_array())
        j[field].back() = v;
      else
        j[field] = v;
      const std::string msg = error_of<dt::ConfigError>(
          [&] { (void)models::AutoencoderKLConfig::from_json(j, "vae.json"); });
      EXPECT_NE(msg.find("'" + field + "'"), std::string::npos)
          << field << "=" << v << " → " << msg;
      EXPECT_NE(msg.find(std::to_string(v)), std::string::npos)
          << field << "=" << v << " → " << msg;
      ++checked;
    }
  EXPECT_EQ(checked, 58u);
}

// A config that describes another model than its weights (more blocks, wider blocks, more layers,
// other latent channels) is refused by comparing names and shapes with what the config implies,
// before the model is built — the message is the signature's, not the strict loader's.
TEST(Models, ConfigsThatDescribeOtherWeightsAreRefusedBeforeTheBuild) {
  using Unet = models::UNet2DConditionModel<>;
  const std::string name = "unet_conv_proj";
  const nlohmann::json base = read_json(golden_models() / name / "config.json");
  const auto n = base["down_block_types"].size();
  std::vector<nlohmann::json> patches;
  {
    nlohmann::json j = base;  // one block more
    j["down_block_types"].push_back("DownBlock2D");
    j["up_block_types"].insert(j["up_block_types"].begin(), "UpBlock2D");
    j["block_out_channels"].push_back(j["block_out_channels"].back());
    for (const char* f : {"layers_per_block", "attention_head_dim", "cross_attention_dim",
                          "only_cross_attention", "transformer_layers_per_block"})
      if (j.contains(f) && j[f].is_array()) j[f].push_back(j[f].back());
    patches.push_back(j);
  }
  {
    nlohmann::json j = base;  // twice as wide
    for (auto& c : j["block_out_channels"]) c = c.get<std::int64_t>() * 2;
    patches.push_back(j);
  }
  {
    nlohmann::json j = base;  // a layer more per block
    const std::int64_t layers = j["layers_per_block"].is_array()
                                    ? j["layers_per_block"][0].get<std::int64_t>()
                                    : j.value("layers_per_block", std::int64_t{2});
    j["layers_per_block"] = layers + 1;
    patches.push_back(j);
  }
  {
    nlohmann::json j = base;  // other input channels
    j["in_channels"] = j.value("in_channels", std::int64_t{4}) + 1;
    patches.push_back(j);
  }
  {
    nlohmann::json j = base;  // a class table of 2^24 rows (4.4 GB) the weights do not hold
    j["num_class_embeds"] = std::int64_t{1} << 24;
    patches.push_back(j);
  }
  ASSERT_GE(n, 1u);
  for (std::size_t i = 0; i < patches.size(); ++i) {
    const fs::path d = copy_of(name, "signature_" + std::to_string(i));
    write_text(d / "config.json", patches[i].dump());
    const std::string msg = error_of<dt::ConfigError>([&] { models::from_pretrained<Unet>(d); });
    EXPECT_NE(msg.find("describe different models"), std::string::npos) << i << ": " << msg;
    EXPECT_NE(msg.find("config.json"), std::string::npos) << msg;
  }
  // The VAE: more latent channels, a layer more, a block more.
  const nlohmann::json vae = read_json(golden_models() / "vae_two_levels" / "config.json");
  std::vector<nlohmann::json> vae_patches(3, vae);
  vae_patches[0]["latent_channels"] = vae.value("latent_channels", std::int64_t{4}) + 4;
  vae_patches[1]["layers_per_block"] = vae.value("layers_per_block", std::int64_t{1}) + 1;
  vae_patches[2]["down_block_types"].push_back("DownEncoderBlock2D");
  vae_patches[2]["up_block_types"].push_back("UpDecoderBlock2D");
  vae_patches[2]["block_out_channels"].push_back(vae["block_out_channels"].back());
  for (std::size_t i = 0; i < vae_patches.size(); ++i) {
    const fs::path d = copy_of("vae_two_levels", "vae_signature_" + std::to_string(i));
    write_text(d / "config.json", vae_patches[i].dump());
    const std::string msg =
        error_of<dt::ConfigError>([&] { models::from_pretrained<models::AutoencoderKL<>>(d); });
    EXPECT_NE(msg.find("describe different models"), std::string::npos) << i << ": " << msg;
  }
  // Every golden folder's own config agrees with its weights.
  for (const auto& c : tst::golden("models.json")["unet"]) {
    const fs::path folder = golden_models() / c["name"].get<std::string>();
    std::optional<std::string> variant;
    if (!c["variant"].is_null()) variant = c["variant"].get<std::string>();
    const auto config =
        models::UNet2DConditionConfig::from_json(read_json(folder / "config.json"), "config.json");
    EXPECT_NO_THROW(models::check_weight_signature(
        config.weight_signature(), models::read_model_weights(folder, variant), "config.json"))
        << folder;
  }
}

TEST(Models, WrongInputsAreShapeErrors) {
  auto unet = models::from_pretrained<models::UNet2DConditionModel<>>(golden_models() /
                                                                      "unet_linear_3_levels");
  const at::Tensor x = at::randn({2, 4, 8, 8}), ctx = at::randn({2, 3, 24});
  const at::Tensor labels = at::tensor({1, 2});
  models::UNetConditions cond;
  cond.class_labels = labels;
  EXPECT_THROW(unet->forward(at::randn({2, 3, 8, 8}), at::tensor({1, 2}), ctx, cond),
               dt::ShapeError);
  EXPECT_THROW(unet->forward(x, at::tensor({1, 2, 3}), ctx, cond), dt::ShapeError);
  EXPECT_THROW(unet->forward(x, at::tensor({1, 2}), {}, cond), dt::ShapeError);
  auto msg = error_of<dt::ShapeError>([&] { unet->forward(x, at::tensor({1, 2}), ctx); });
  EXPECT_NE(msg.find("class_labels"), std::string::npos) << msg;
  cond.class_labels = at::tensor({1, 10});
  msg = error_of<dt::ShapeError>([&] { unet->forward(x, at::tensor({1, 2}), ctx, cond); });
  EXPECT_NE(msg.find("[0, 10)"), std::string::npos) << msg;
  // The same check where labels for a GPU are made (forward checks only labels on the CPU).
  msg = error_of<dt::ShapeError>([&] { unet->check_class_labels(at::tensor({-1, 3})); });
  EXPECT_NE(msg.find("got -1 to 3"), std::string::npos) << msg;
  EXPECT_NO_THROW(unet->check_class_labels(at::tensor({0, 9})));
  // A scalar timestep is broadcast over the batch, as diffusers does.
  cond.class_labels = labels;
  EXPECT_EQ(unet->forward(x, at::tensor(5), ctx, cond).sizes(), x.sizes());
  // An encoder attention mask must match the context's tokens; bool and float masks agree.
  cond.encoder_attention_mask = at::ones({2, 4});
  msg = error_of<dt::ShapeError>([&] { unet->forward(x, at::tensor({1, 2}), ctx, cond); });
  EXPECT_NE(msg.find("encoder_attention_mask"), std::string::npos) << msg;
  {
    at::NoGradGuard no_grad;
    unet->eval();
    cond.encoder_attention_mask = at::tensor({1.0F, 0.0F, 1.0F, 1.0F, 1.0F, 0.0F}).view({2, 3});
    const at::Tensor masked = unet->forward(x, at::tensor({1, 2}), ctx, cond);
    cond.encoder_attention_mask = cond.encoder_attention_mask.to(at::kBool);
    expect_close(unet->forward(x, at::tensor({1, 2}), ctx, cond), masked, 1e-6, "bool mask");
    // Here a masked token still matters: the first level only cross-attends, and its attn1, as
    // diffusers', takes no encoder mask.
    at::Tensor other = ctx.clone();
    other.index_put_({0, 1}, at::randn({24}));
    EXPECT_GT(scaled_error(unet->forward(x, at::tensor({1, 2}), other, cond), masked), 1e-4);
    unet->train();
  }
  // SDXL's added conditions are required where the config has them, and checked.
  auto sdxl = models::from_pretrained<models::UNet2DConditionModel<>>(golden_models() /
                                                                      "unet_sdxl_text_time_bin");
  const at::Tensor ctx32 = at::randn({2, 5, 32});
  msg = error_of<dt::ShapeError>([&] { sdxl->forward(x, at::tensor({1, 2}), ctx32); });
  EXPECT_NE(msg.find("text_embeds"), std::string::npos) << msg;
  models::UNetConditions added;
  added.text_embeds = at::randn({2, 16});
  added.time_ids = at::randn({2, 5});  // 16 + 5 · 8 ≠ 64
  msg = error_of<dt::ShapeError>([&] { sdxl->forward(x, at::tensor({1, 2}), ctx32, added); });
  EXPECT_NE(msg.find("projection_class_embeddings_input_dim 64"), std::string::npos) << msg;
  {
    // Where every attention to the context takes the mask, a masked token's content is ignored.
    at::NoGradGuard no_grad;
    sdxl->eval();
    added.time_ids = at::randn({2, 6});
    added.encoder_attention_mask = at::tensor({1, 0, 1, 1, 1, 1, 1, 1, 0, 1}).view({2, 5});
    const at::Tensor masked = sdxl->forward(x, at::tensor({1, 2}), ctx32, added);
    at::Tensor other = ctx32.clone();
    other.index_put_({0, 1}, at::randn({32}));
    other.index_put_({1, 3}, at::randn({32}));
    expect_close(sdxl->forward(x, at::tensor({1, 2}), other, added), masked, 1e-6, "masked tokens");
  }
  auto vae = models::from_pretrained<models::AutoencoderKL<>>(golden_models() / "vae_two_levels");
  EXPECT_THROW(vae->encode(at::randn({1, 4, 16, 16})), dt::ShapeError);
  EXPECT_THROW(vae->decode(at::randn({1, 3, 4, 4})), dt::ShapeError);
  // Latents as the training scripts make them, and back.
  const at::Tensor images = at::randn({1, 3, 16, 16});
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  const at::Tensor latents = vae->encode_latents(images, gen);
  EXPECT_EQ(latents.sizes(), (std::vector<std::int64_t>{1, 4, 8, 8}));
  EXPECT_EQ(vae->decode_latents(latents).sizes(), images.sizes());
}

// kohya's block_dims: the block of each UNet module as networks/lora.py's get_block_index numbers
// it (down 1-11, mid 12, up 13-24, -1 elsewhere), and a LoRA whose rank and alpha follow the
// block (a rank of 0 leaves the block out); the PEFT file says the ranks and alphas per module.
TEST(Models, UNetLoraRanksFollowKohyasBlockDims) {
  namespace ad = difftrain::adapters;
  const std::vector<std::pair<std::string, int>> blocks = {
      {"down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q", 1},
      {"down_blocks.0.attentions.1.proj_in", 2},
      {"down_blocks.0.resnets.1.conv1", 2},
      {"down_blocks.0.downsamplers.0.conv", 3},
      {"down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k", 4},
      {"down_blocks.2.attentions.1.transformer_blocks.0.ff.net.2", 8},
      {"down_blocks.3.resnets.1.conv2", 11},
      {"mid_block.attentions.0.transformer_blocks.0.attn2.to_v", 12},
      {"mid_block.resnets.1.conv1", 12},
      {"up_blocks.0.resnets.2.conv2", 15},
      {"up_blocks.1.attentions.2.proj_out", 18},
      {"up_blocks.2.upsamplers.0.conv", 21},
      {"up_blocks.3.attentions.2.transformer_blocks.0.attn1.to_out.0", 24},
      {"up_blocks.12.attentions.10.proj_out", 13 + 36 + 10},
      {"conv_in", -1},
      {"time_embedding.linear_1", -1}};
  for (const auto& [name, want] : blocks) EXPECT_EQ(ad::kohya_block_index(name), want) << name;

  auto unet =
      models::from_pretrained<models::UNet2DConditionModel<>>(golden_models() / "unet_conv_proj");
  ad::BlockDims dims;
  dims.alpha = 2.0;
  for (std::size_t b = 0; b < ad::BlockDims::kCount; ++b) {
    dims.dims.push_back(static_cast<std::int64_t>(b + 1));  // a rank of its own per block
    dims.alphas.push_back(0.5 * static_cast<double>(b + 1));
  }
  dims.validate();
  const auto adapted = ad::inject_lora(*unet, ad::unet_lora_targets(),
                                       [&](const std::string& m) { return dims.of(m); });
  std::size_t left_out = 0, matched = 0;
  for (const auto& item : unet->named_modules("", false)) {
    const std::string& name = item.key();
    const bool target = name.ends_with(".to_q") || name.ends_with(".to_k") ||
                        name.ends_with(".to_v") || name.ends_with(".to_out.0");
    if (!target) continue;
    ++matched;
    const int b = ad::kohya_block_index(name);
    const auto at = static_cast<std::size_t>(b < 0 ? 24 : b);
    const bool has = std::find(adapted.begin(), adapted.end(), name) != adapted.end();
    EXPECT_EQ(has, dims.dims[at] != 0) << name;
    if (!has) {
      ++left_out;
      continue;
    }
    const auto* host = dynamic_cast<ad::LoraHost*>(item.value().get());
    ASSERT_NE(host, nullptr);
    EXPECT_EQ(host->lora_options().rank, dims.dims[at]) << name;
    EXPECT_EQ(host->lora_options().alpha.value_or(0.0), dims.alphas[at]) << name;
  }
  EXPECT_GT(adapted.size(), 0U);
  EXPECT_EQ(adapted.size() + left_out, matched);
  // The ranks and alphas per module in the PEFT file's adapter metadata.
  nlohmann::json meta = nlohmann::json::object();
  ad::add_peft_adapter_metadata(meta, *unet, "unet");
  std::set<std::int64_t> ranks;
  for (const auto& name : adapted) {
    const auto* host = dynamic_cast<ad::LoraHost*>(unet->named_modules("", false)[name].get());
    ranks.insert(host->lora_options().rank);
  }
  EXPECT_GT(ranks.size(), 1U);
  EXPECT_FALSE(meta["unet.rank_pattern"].empty());
  EXPECT_FALSE(meta["unet.alpha_pattern"].empty());
  // A block of rank 0 has no branch.
  auto other =
      models::from_pretrained<models::UNet2DConditionModel<>>(golden_models() / "unet_conv_proj");
  ad::BlockDims without = dims;
  without.dims[static_cast<std::size_t>(ad::kohya_block_index(adapted.front()))] = 0;
  const auto fewer = ad::inject_lora(*other, ad::unet_lora_targets(),
                                     [&](const std::string& m) { return without.of(m); });
  EXPECT_LT(fewer.size(), adapted.size());
  for (const auto& name : fewer)
    EXPECT_NE(ad::kohya_block_index(name), ad::kohya_block_index(adapted.front())) << name;
  // Mistakes: a count other than 25, a negative rank.
  ad::BlockDims bad;
  bad.dims = {4, 4};
  EXPECT_THROW(bad.validate(), dt::ConfigError);
  bad.dims.assign(25, 4);
  bad.dims[3] = -1;
  EXPECT_THROW(bad.validate(), dt::ConfigError);
  bad.dims[3] = 4;
  bad.alphas = {1.0};
  EXPECT_THROW(bad.validate(), dt::ConfigError);
}

// LoRA on every attention projection of a diffusers UNet, trained a few steps; its PEFT and kohya
// files load back into a fresh UNet and give the same output. With DIFFTRAIN_MODELS_OUT set, the
// files and the adapted output go there for check_cpp_models.py to apply in diffusers.
TEST(Models, UNetLoraTrainsAndItsFilesLoadBack) {
  namespace ad = difftrain::adapters;
  const auto io = dt::io::load_safetensors(golden_models() / "unet_conv_proj.io.safetensors", true);
  const auto& t = io.tensors;
  auto unet =
      models::from_pretrained<models::UNet2DConditionModel<>>(golden_models() / "unet_conv_proj");
  const auto adapted = ad::inject_lora(*unet, ad::unet_lora_targets(), {.rank = 4, .alpha = 8.0});
  // 2 transformers of one block each in the conv_proj config: attn1 and attn2, 4 projections each.
  std::size_t blocks = 0;
  for (const auto& [name, tr] : unet->transformers()) blocks += tr->blocks().size();
  EXPECT_EQ(adapted.size(), blocks * 8);
  std::vector<at::Tensor> trainable;
  for (const auto& p : unet->parameters())
    if (p.requires_grad()) trainable.push_back(p);
  EXPECT_EQ(trainable.size(), adapted.size() * 2);
  torch::optim::AdamW opt(trainable, torch::optim::AdamWOptions(1e-2));
  const at::Tensor target = at::randn(t.at("input.sample").sizes(), at::kFloat);
  double first = 0, last = 0;
  for (int step = 0; step < 8; ++step) {
    opt.zero_grad();
    const at::Tensor loss = (unet->forward(t.at("input.sample"), t.at("input.timestep"),
                                           t.at("input.encoder_hidden_states")) -
                             target)
                                .square()
                                .mean();
    loss.backward();
    opt.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  EXPECT_LT(last, first);
  unet->eval();
  at::NoGradGuard no_grad;
  const at::Tensor out = unet->forward(t.at("input.sample"), t.at("input.timestep"),
                                       t.at("input.encoder_hidden_states"));
  const auto peft = ad::lora_state_dict(*unet, ad::unet_lora_keys(ad::LoraLayout::peft));
  const auto kohya = ad::lora_state_dict(*unet, ad::unet_lora_keys(ad::LoraLayout::kohya));
  EXPECT_TRUE(peft.contains(
      "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_out.0.lora_A.weight"));
  EXPECT_TRUE(kohya.contains(
      "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn2_to_k.lora_up.weight"));
  for (const auto* file : {&peft, &kohya}) {
    auto fresh =
        models::from_pretrained<models::UNet2DConditionModel<>>(golden_models() / "unet_conv_proj");
    fresh->eval();
    const auto layout = file == &peft ? ad::LoraLayout::peft : ad::LoraLayout::kohya;
    ad::load_lora_state_dict(*fresh, *file, ad::unet_lora_keys(layout), {.rank = 4, .alpha = 8.0});
    expect_close(fresh->forward(t.at("input.sample"), t.at("input.timestep"),
                                t.at("input.encoder_hidden_states")),
                 out, 1e-6, file == &peft ? "peft" : "kohya");
  }
}

// The LoRA files a Stable Diffusion run writes, over a sweep of rank and alpha (alpha above,
// below and equal to the rank, and a UNet whose self- and cross-attention branches differ in
// both, PEFT's rank_pattern / alpha_pattern), with SD 1.x's and SDXL's text encoders: the PEFT
// file's adapter metadata gives every branch its alpha back, and both files load into fresh
// models as the trained ones. tests/reference/check_cpp_models.py loads every case with
// diffusers' own load_lora_weights (DIFFTRAIN_MODELS_OUT) and compares the outputs.
TEST(Models, UNetLoraFilesAtEveryScale) {
  namespace ad = difftrain::adapters;
  using Unet = models::UNet2DConditionModel<>;
  using Clip = models::CLIPTextModel<Backend>;
  const auto io = dt::io::load_safetensors(golden_models() / "unet_conv_proj.io.safetensors", true);
  const auto& t = io.tensors;
  const fs::path encoders = fs::path(DIFFTRAIN_GOLDEN_DIR) / "text_encoders";
  struct Case {
    std::string name;
    std::int64_t rank, alpha_rank;  // attn1's rank, attn2's rank
    double alpha, alpha2;           // attn1's alpha, attn2's alpha (and the text encoders')
    bool sdxl;
  };
  const std::vector<Case> cases{
      {"r4_a8", 4, 4, 8.0, 8.0, false}, {"r4_a2", 4, 4, 2.0, 2.0, false},
      {"r2_a2", 2, 2, 2.0, 2.0, false}, {"r8_a1.5", 8, 8, 1.5, 1.5, false},
      {"mixed", 2, 4, 6.0, 1.0, false}, {"xl_r2_a5", 2, 2, 5.0, 5.0, true}};
  const at::Tensor ids = at::arange(3, 19, at::kLong).view({2, 8});
  const char* out_env = std::getenv("DIFFTRAIN_MODELS_OUT");
  nlohmann::json listing = nlohmann::json::array();
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    at::manual_seed(11);
    auto unet = models::from_pretrained<Unet>(golden_models() / "unet_conv_proj");
    auto te = models::from_pretrained<Clip>(encoders / "tiny_quick_gelu");
    auto te2 = models::from_pretrained<Clip>(encoders / "tiny_gelu_projection");
    (void)ad::inject_lora(*unet, {{"attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0"}, {}},
                          {.rank = c.rank, .alpha = c.alpha});
    (void)ad::inject_lora(*unet, {{"attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0"}, {}},
                          {.rank = c.alpha_rank, .alpha = c.alpha2});
    (void)ad::inject_lora(*te, ad::text_encoder_lora_targets(),
                          {.rank = c.rank, .alpha = c.alpha2});
    if (c.sdxl)
      (void)ad::inject_lora(*te2, ad::text_encoder_lora_targets(),
                            {.rank = c.rank, .alpha = c.alpha});
    {
      at::NoGradGuard no_grad;  // B starts at zero: give every branch an effect
      for (torch::nn::Module* m :
           {static_cast<torch::nn::Module*>(unet.get()), static_cast<torch::nn::Module*>(te.get()),
            static_cast<torch::nn::Module*>(te2.get())})
        for (const auto& [name, h] : ad::lora_layers(*m)) h->lora_b().normal_(0.0, 0.3);
    }
    const ad::StableDiffusionLoraModules modules{.unet = unet.get(),
                                                 .text_encoder = te.get(),
                                                 .text_encoder_2 = c.sdxl ? te2.get() : nullptr,
                                                 .sdxl = c.sdxl};
    auto run = [&](Unet& u, Clip& e, Clip& e2) {
      u->eval();
      e->eval();
      e2->eval();
      at::NoGradGuard no_grad;
      std::map<std::string, at::Tensor> o{
          {"unet", u->forward(t.at("input.sample"), t.at("input.timestep"),
                              t.at("input.encoder_hidden_states"))},
          {"text_encoder", e->forward(ids, std::nullopt, false).last_hidden_state}};
      if (c.sdxl) o["text_encoder_2"] = e2->forward(ids, std::nullopt, false).last_hidden_state;
      return o;
    };
    const auto want = run(unet, te, te2);
    const fs::path dir =
        out_env ? fs::path(out_env) / ("lora_" + c.name) : scratch("lora-" + c.name);
    fs::create_directories(dir);
    const auto files = ad::save_stable_diffusion_lora_files(dir, modules, {{"base_model", "tiny"}});
    const auto peft = dt::io::load_safetensors(files.peft, true);
    const auto kohya = dt::io::load_safetensors(files.kohya, true);
    // The metadata names every component and gives each branch its own alpha back.
    for (const auto& [module, h] : ad::lora_layers(*unet)) {
      const auto o = ad::peft_lora_defaults(peft.metadata, "unet", module, h->lora_options().rank);
      ASSERT_TRUE(o.alpha.has_value()) << module;
      EXPECT_EQ(*o.alpha, *h->lora_options().alpha) << module;
    }
    for (const char* component : {"text_encoder", "text_encoder_2"}) {
      const bool present =
          peft.metadata.at("lora_adapter_metadata").find(std::string("\"") + component + ".r\"") !=
          std::string::npos;
      EXPECT_EQ(present, std::string(component) == "text_encoder" || c.sdxl) << component;
    }
    // Both files into fresh models: the trained outputs.
    for (const auto layout : {ad::LoraLayout::peft, ad::LoraLayout::kohya}) {
      const bool is_peft = layout == ad::LoraLayout::peft;
      const auto& file = is_peft ? peft : kohya;
      auto u = models::from_pretrained<Unet>(golden_models() / "unet_conv_proj");
      auto e = models::from_pretrained<Clip>(encoders / "tiny_quick_gelu");
      auto e2 = models::from_pretrained<Clip>(encoders / "tiny_gelu_projection");
      auto load = [&](const std::string& component, torch::nn::Module& m,
                      const ad::LoraKeyOptions& keys) {
        std::map<std::string, at::Tensor> part;
        for (const auto& [k, v] : file.tensors)
          if (k.starts_with(keys.prefix)) part[k] = v;
        if (!is_peft) {
          (void)ad::load_lora_state_dict(m, part, keys);  // alpha from each module's tensor
          return;
        }
        // PEFT: each module's alpha from the metadata, as diffusers reads it.
        std::map<std::string, std::map<std::string, at::Tensor>> by_module;
        for (const auto& [k, v] : part) {
          const std::string module =
              k.substr(keys.prefix.size(), k.rfind(".lora_") - keys.prefix.size());
          by_module[module][k] = v;
        }
        for (const auto& [module, tensors] : by_module)
          (void)ad::load_lora_state_dict(m, tensors, keys,
                                         ad::peft_lora_defaults(file.metadata, component, module,
                                                                tensors.begin()->second.size(0)));
      };
      load("unet", *u, ad::unet_lora_keys(layout));
      using Slot = ad::TextEncoderSlot;
      load("text_encoder", *e,
           ad::text_encoder_lora_keys(layout, c.sdxl ? Slot::first : Slot::single));
      if (c.sdxl) load("text_encoder_2", *e2, ad::text_encoder_lora_keys(layout, Slot::second));
      const auto got = run(u, e, e2);
      for (const auto& [name, w] : want)
        expect_close(got.at(name), w, 1e-6, name + (is_peft ? " peft" : " kohya"));
    }
    if (out_env) {
      std::map<std::string, at::Tensor> outs = want;
      outs["input_ids"] = ids;
      dt::io::save_safetensors(dir / "outputs.safetensors", outs);
      listing.push_back({{"name", "lora_" + c.name}, {"sdxl", c.sdxl}});
    } else {
      dt::io::remove_tree(dir);
    }
  }
  if (out_env) {
    const std::string text = listing.dump();
    std::ofstream(fs::path(out_env) / "lora_cases.json") << text;
  }
}

// LoHa and LoKr on a diffusers UNet's attention projections (the factors made non-zero), in
// LyCORIS' layout (lora_unet_…, what the web UI's and ComfyUI's LyCORIS readers take) and PEFT's:
// both read back into a fresh UNet as the trained one. tests/reference/check_cpp_models.py
// applies the LyCORIS file with lycoris-lora's kohya loader and the PEFT file with PEFT's
// LoHaConfig / LoKrConfig on diffusers' UNet (DIFFTRAIN_MODELS_OUT) and compares the outputs.
TEST(Models, UNetLohaAndLokrFilesReadBackAndApplyElsewhere) {
  namespace ad = difftrain::adapters;
  using Unet = models::UNet2DConditionModel<>;
  const auto io = dt::io::load_safetensors(golden_models() / "unet_conv_proj.io.safetensors", true);
  const auto& t = io.tensors;
  const char* out_env = std::getenv("DIFFTRAIN_MODELS_OUT");
  struct Case {
    std::string name;
    ad::DeltaOptions o;
  };
  const std::vector<Case> cases{
      {"loha", {.kind = ad::DeltaKind::loha, .rank = 4, .alpha = 2.0}},
      {"lokr", {.kind = ad::DeltaKind::lokr, .rank = 4, .alpha = 8.0}},
      {"lokr_both",
       {.kind = ad::DeltaKind::lokr, .rank = 2, .alpha = 1.0, .decompose_both = true}}};
  nlohmann::json listing = nlohmann::json::array();
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    at::manual_seed(5);
    auto unet = models::from_pretrained<Unet>(golden_models() / "unet_conv_proj");
    const auto adapted = ad::inject_weight_delta(*unet, ad::unet_lora_targets(), c.o);
    EXPECT_FALSE(adapted.empty());
    {
      const at::NoGradGuard no_grad;
      for (auto& p : unet->named_parameters())
        if (p.key().find(".adapter.") != std::string::npos) p.value().normal_(0.0, 0.3);
    }
    auto run = [&](Unet& u) {
      u->eval();
      const at::NoGradGuard no_grad;
      return u->forward(t.at("input.sample"), t.at("input.timestep"),
                        t.at("input.encoder_hidden_states"));
    };
    const at::Tensor want = run(unet);
    const ad::LoraKeyOptions lycoris{ad::LoraLayout::kohya, "lora_unet_"}, peft{};
    const auto lycoris_sd = ad::weight_delta_state_dict(*unet, lycoris);
    const auto peft_sd = ad::weight_delta_state_dict(*unet, peft);
    for (const auto* keys : {&lycoris, &peft}) {
      auto back = models::from_pretrained<Unet>(golden_models() / "unet_conv_proj");
      (void)ad::load_weight_delta_state_dict(
          *back, keys == &peft ? peft_sd : lycoris_sd, *keys, [&](const std::string&) {
            return std::optional<std::pair<std::int64_t, double>>({c.o.rank, *c.o.alpha});
          });
      EXPECT_LT((run(back) - want).abs().max().item<double>(), 1e-5)
          << (keys == &peft ? "PEFT" : "LyCORIS");
    }
    if (out_env != nullptr) {
      const fs::path dir = fs::path(out_env) / ("delta_" + c.name);
      fs::create_directories(dir);
      dt::io::save_safetensors(dir / "lycoris.safetensors", lycoris_sd);
      dt::io::save_safetensors(dir / "peft.safetensors", peft_sd);
      dt::io::save_safetensors(dir / "output.safetensors", {{"unet", want}});
      listing.push_back({{"name", c.name},
                         {"kind", c.o.kind == ad::DeltaKind::loha ? "loha" : "lokr"},
                         {"rank", c.o.rank},
                         {"alpha", *c.o.alpha},
                         {"decompose_both", c.o.decompose_both}});
    }
  }
  if (out_env != nullptr) {
    std::ofstream f(fs::path(out_env) / "delta_cases.json");
    f << listing.dump(1);
  }
}

// The web UI's hypernetwork on every attention layer of the UNet: the output changes, gradients
// reach the hypernetwork, and detaching restores the plain UNet.
TEST(Models, HypernetworkHooksEveryUNetAttentionLayer) {
  namespace ad = difftrain::adapters;
  const auto io = dt::io::load_safetensors(golden_models() / "unet_conv_proj.io.safetensors", true);
  const auto& t = io.tensors;
  auto unet =
      models::from_pretrained<models::UNet2DConditionModel<>>(golden_models() / "unet_conv_proj");
  unet->eval();
  auto run = [&] {
    return unet->forward(t.at("input.sample"), t.at("input.timestep"),
                         t.at("input.encoder_hidden_states"));
  };
  const at::Tensor plain = run().detach();
  ad::HypernetworkOptions ho;
  ho.activation_func = "relu";
  // The widths its modules act on: the blocks' channels (self-attention: 32 in the outer
  // blocks, 64 in the mid block) and the text width (cross-attention: 32).
  EXPECT_EQ(ad::hypernetwork_context_widths(*unet), (std::set<std::int64_t>{32, 64}));
  ad::Hypernetwork hn("test", {32, 64}, ho);
  hn.train();
  std::size_t blocks = 0;
  for (const auto& [name, tr] : unet->transformers()) blocks += tr->blocks().size();
  EXPECT_EQ(ad::attach_hypernetwork(*unet, hn), blocks * 2);
  const at::Tensor hooked = run();
  EXPECT_GT((hooked - plain).abs().max().item<double>(), 1e-4);
  hooked.square().sum().backward();
  for (const auto& w : hn.weights()) {
    ASSERT_TRUE(w.grad().defined());
    EXPECT_GT(w.grad().abs().sum().item<double>(), 0.0);
  }
  ad::detach_hypernetwork(*unet);
  EXPECT_TRUE(at::equal(run().detach(), plain));
}
