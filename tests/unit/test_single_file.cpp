// Stable Diffusion single files (the web UI's, ComfyUI's and kohya's layout): the UNet, VAE and
// text encoders (SD 1.x's CLIP, SD 2.x's OpenCLIP, SDXL's two) under their original names, written
// and read back to the bit for every UNet and VAE configuration the reference scripts made (SD 1.x
// and 2.x-like UNets, SDXL's added embedding, timestep class embeddings; two- and three-level
// VAEs), in float32 and fp16, from
// `.safetensors` and pickled `.ckpt`; the UNet's EMA copies when asked; files that do not fit are
// typed errors naming the keys. tests/reference/check_cpp_single_file.py loads the file written
// here with diffusers' StableDiffusionPipeline.from_single_file (DIFFTRAIN_MODELS_OUT) and finds
// every tensor of the three models it came from.
#include <unistd.h>
#include <zlib.h>
#include <difftrain/io/remove_tree.hpp>
#include <difftrain/io/safetensors.hpp>
#include <difftrain/io/torch_file.hpp>
#include <difftrain/models/models.hpp>
#include <difftrain/models/single_file/sd3.hpp>
#include <difftrain/models/single_file/stable_diffusion.hpp>
#include <difftrain/models/single_file/stable_diffusion_configs.hpp>
#include <difftrain/nn/module_tensors.hpp>
#include <difftrain/text/clip_bpe_vocab.hpp>

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>

#include "golden.hpp"
#include "single_file_checks.hpp"

namespace dt = difftrain;
namespace fs = std::filesystem;
namespace models = difftrain::models;
namespace tst = difftrain::test;

namespace {

fs::path golden() { return fs::path(DIFFTRAIN_GOLDEN_DIR); }

fs::path scratch(const std::string& name) {
  const fs::path dir =
      fs::temp_directory_path() / ("difftrain-single-" + name + "-" + std::to_string(::getpid()));
  dt::io::remove_tree(dir);
  fs::create_directories(dir);
  return dir;
}

template <class Holder>
std::map<std::string, at::Tensor> state_of(Holder& m) {
  return dt::nn::module_tensors(*m);
}

using dt::test::error_of;
using dt::test::expect_same;

template <class Unet = models::UNet2DConditionModel<>>
struct Sd1Models {
  Unet unet{nullptr};
  models::AutoencoderKL<> vae{nullptr};
  models::CLIPTextModel<> clip{nullptr};
};

template <class Unet = models::UNet2DConditionModel<>>
Sd1Models<Unet> load(const std::string& unet, const std::string& vae) {
  models::LoadOptions lo;  // (a folder the reference scripts saved as an fp16 variant)
  if (fs::exists(golden() / "models" / unet / "diffusion_pytorch_model.fp16.safetensors"))
    lo.variant = "fp16";
  return {models::from_pretrained<Unet>(golden() / "models" / unet, lo),
          models::from_pretrained<models::AutoencoderKL<>>(golden() / "models" / vae),
          models::from_pretrained<models::CLIPTextModel<>>(golden() / "encode_prompt" /
                                                           "text_encoder")};
}

// One UNet and VAE with the CLIP encoder: written in the original layout (in `dtype`), checked for
// its names, read back and built, every tensor as it was (its `dtype` rounding).
template <class Unet = models::UNet2DConditionModel<>>
void round_trip(const std::string& unet, const std::string& vae,
                std::optional<at::ScalarType> dtype, const fs::path& dir,
                models::SingleFileFamily family = models::SingleFileFamily::sd1) {
  const bool sd2 = family == models::SingleFileFamily::sd2;
  const std::string what =
      unet + " + " + vae + (dtype ? " (fp16)" : "") + (sd2 ? " as SD 2.x" : "");
  SCOPED_TRACE(what);
  Sd1Models<Unet> m = load<Unet>(unet, vae);
  const auto tensors = models::stable_diffusion_single_file_tensors(
      m.unet, m.vae, m.clip, {.dtype = dtype, .family = family});
  // The original layout: every tensor under one of the three prefixes, one per model
  // tensor (and CLIP's position ids), the names the original code has.
  // (SD 1.x: and CLIP's position ids; SD 2.x: q, k and v fused, 6 tensors a layer in 2)
  const auto layers = static_cast<std::size_t>(m.clip->config().num_hidden_layers);
  std::size_t want = state_of(m.unet).size() + state_of(m.vae).size() + state_of(m.clip).size() +
                     (sd2 ? 0 : 1) - (sd2 ? 4 * layers : 0);
  EXPECT_EQ(tensors.size(), want);
  for (const auto& [key, t] : tensors) {
    EXPECT_TRUE(key.starts_with("model.diffusion_model.") ||
                key.starts_with("first_stage_model.") ||
                key.starts_with(sd2 ? "cond_stage_model.model."
                                    : "cond_stage_model.transformer.text_model."))
        << key;
    if (dtype && at::isFloatingType(t.scalar_type())) {
      EXPECT_EQ(t.scalar_type(), at::kHalf) << key;
    }
  }
  for (const char* key :
       {"model.diffusion_model.input_blocks.0.0.weight",
        "model.diffusion_model.time_embed.0.weight", "model.diffusion_model.out.2.weight",
        "model.diffusion_model.input_blocks.1.0.in_layers.0.weight",
        "model.diffusion_model.output_blocks.0.0.out_layers.3.weight",
        "first_stage_model.encoder.down.0.block.0.norm1.weight",
        "first_stage_model.decoder.up.0.block.0.conv1.weight"})
    EXPECT_TRUE(tensors.contains(key)) << key;
  if (sd2) {
    for (const char* key :
         {"cond_stage_model.model.ln_final.weight", "cond_stage_model.model.positional_embedding",
          "cond_stage_model.model.token_embedding.weight",
          "cond_stage_model.model.transformer.resblocks.0.mlp.c_fc.weight",
          "cond_stage_model.model.transformer.resblocks.0.attn.out_proj.bias"})
      EXPECT_TRUE(tensors.contains(key)) << key;
    const auto d = m.clip->config().hidden_size;
    EXPECT_EQ(
        tensors.at("cond_stage_model.model.transformer.resblocks.0.attn.in_proj_weight").sizes(),
        (std::vector<std::int64_t>{3 * d, d}));
  } else {
    for (const char* key : {"cond_stage_model.transformer.text_model.final_layer_norm.weight",
                            "cond_stage_model.transformer.text_model.embeddings.position_ids"})
      EXPECT_TRUE(tensors.contains(key)) << key;
  }
  if (m.vae->config().mid_block_add_attention) {  // its projections as 1x1 convolutions
    EXPECT_TRUE(tensors.contains("first_stage_model.encoder.mid.attn_1.norm.weight"));
    EXPECT_EQ(tensors.at("first_stage_model.decoder.mid.attn_1.q.weight").dim(), 4);
    EXPECT_EQ(tensors.at("first_stage_model.encoder.mid.attn_1.proj_out.weight").dim(), 4);
  }
  if (unet == "unet_sdxl_text_time_bin") {
    EXPECT_TRUE(tensors.contains("model.diffusion_model.label_emb.0.0.weight"));
  }
  // Written, read back and built: every tensor as it was (as its fp16 rounding in fp16).
  const fs::path file = dir / "model.safetensors";
  dt::io::save_safetensors(file, tensors, {{"format", "pt"}});
  const models::SingleFile f = models::read_single_file(file);
  EXPECT_EQ(f.family, family);
  auto unet2 = models::unet_from_single_file<Unet>(f, m.unet->config());
  auto vae2 = models::vae_from_single_file(f, m.vae->config());
  auto clip2 = models::clip_from_single_file(f, m.clip->config());
  expect_same(unet2, m.unet, "UNet", dtype);
  expect_same(vae2, m.vae, "VAE", dtype);
  expect_same(clip2, m.clip, "CLIP", dtype);
}

}  // namespace

TEST(SingleFile, Sd1ComponentsRoundTripUnderTheOriginalNames) {
  const fs::path dir = scratch("roundtrip");
  for (const std::string vae : {"vae_two_levels", "vae_three_levels_plain"})
    for (const auto dtype : {std::optional<at::ScalarType>{}, std::optional{at::kHalf}}) {
      for (const std::string unet :
           {"unet_conv_proj", "unet_linear_3_levels", "unet_sdxl_text_time_bin"})
        round_trip(unet, vae, dtype, dir);
      // SD 2.x's layout: linear projections, OpenCLIP's text tower.
      round_trip("unet_linear_3_levels", vae, dtype, dir, models::SingleFileFamily::sd2);
    }
  // A pickled checkpoint (the .ckpt of the original trainers: a state_dict beside other entries)
  // reads the same, and the UNet's EMA copies stand in for it when asked.
  Sd1Models<> m = load("unet_conv_proj", "vae_two_levels");
  auto tensors = models::stable_diffusion_single_file_tensors(m.unet, m.vae, m.clip);
  auto state = dt::io::torch_dict();
  for (const auto& [key, t] : tensors) state.insert(key, t);
  std::map<std::string, at::Tensor> ema;
  for (const auto& [key, t] : tensors)
    if (key.starts_with("model.diffusion_model.")) {
      std::string flat = "model_ema.";
      for (const char ch : key.substr(6))
        if (ch != '.') flat += ch;
      ema[key] = t + 1.0;
      state.insert(flat, ema[key]);
    }
  auto root = dt::io::torch_dict();
  root.insert("state_dict", state);
  root.insert("global_step", std::int64_t{470000});
  dt::io::save_torch_file(dir / "model.ckpt", root);
  const auto ckpt = models::read_single_file(dir / "model.ckpt");
  auto from_ckpt = models::unet_from_single_file(ckpt, m.unet->config());
  expect_same(from_ckpt, m.unet, "UNet from .ckpt");
  const auto with_ema = models::read_single_file(dir / "model.ckpt", /*use_ema=*/true);
  auto ema_unet = models::unet_from_single_file(with_ema, m.unet->config());
  for (const auto& p : ema_unet->named_parameters(true))
    EXPECT_TRUE(at::equal(p.value(), ema.at("model.diffusion_model." +
                                            models::ldm_unet_name(p.key(), m.unet->config()))))
        << p.key();
  EXPECT_NE(error_of<dt::ConfigError>([&] {
              (void)models::read_single_file(dir / "model.safetensors", true);
            }).find("no EMA weights"),
            std::string::npos);
  // For tests/reference/check_cpp_single_file.py: diffusers' from_single_file reads these.
  if (const char* out_env = std::getenv("DIFFTRAIN_MODELS_OUT")) {
    const fs::path out(out_env);
    fs::create_directories(out);
    models::save_stable_diffusion_single_file(out / "sd1_single.safetensors", m.unet, m.vae,
                                              m.clip);
    models::save_stable_diffusion_single_file(out / "sd1_single_fp16.safetensors", m.unet, m.vae,
                                              m.clip, {.dtype = at::kHalf});
    models::save_stable_diffusion_single_file(
        out / "sd2_single.safetensors", m.unet, m.vae, m.clip,
        {.dtype = std::nullopt, .family = models::SingleFileFamily::sd2});
  }
  dt::io::remove_tree(dir);
}

// SDXL: the UNet with its added embedding, the VAE, CLIP ViT-L under conditioner.embedders.0 and
// OpenCLIP ViT-bigG's tower under conditioner.embedders.1 (q, k, v fused; the projection
// transposed), in float32 and fp16, read back to the bit. What the file holds beyond the models
// (the schedule's buffers, OpenCLIP's logit_scale) is left over after all four are built, and a
// file written with it kept holds every key the read one had, as it was.
TEST(SingleFile, SdxlComponentsRoundTripUnderTheOriginalNames) {
  const fs::path dir = scratch("sdxl");
  Sd1Models<> m = load("unet_sdxl_text_time_bin", "vae_two_levels");
  auto clip_2 = models::from_pretrained<models::CLIPTextModel<>>(golden() / "encode_prompt" /
                                                                 "text_encoder_2");
  ASSERT_TRUE(clip_2->config().with_projection);
  const auto& c2 = clip_2->config();
  for (const auto dtype : {std::optional<at::ScalarType>{}, std::optional{at::kHalf}}) {
    SCOPED_TRACE(dtype ? "fp16" : "float32");
    const auto tensors = models::stable_diffusion_xl_single_file_tensors(
        m.unet, m.vae, m.clip, clip_2, {.dtype = dtype, .family = models::SingleFileFamily::sdxl});
    // CLIP's position ids are added; OpenCLIP's q, k and v weights and biases are 2 tensors a
    // layer where transformers has 6.
    EXPECT_EQ(tensors.size(), state_of(m.unet).size() + state_of(m.vae).size() +
                                  state_of(m.clip).size() + 1 + state_of(clip_2).size() -
                                  4 * static_cast<std::size_t>(c2.num_hidden_layers));
    for (const auto& [key, t] : tensors)
      EXPECT_TRUE(key.starts_with("model.diffusion_model.") ||
                  key.starts_with("first_stage_model.") ||
                  key.starts_with("conditioner.embedders.0.transformer.text_model.") ||
                  key.starts_with("conditioner.embedders.1.model."))
          << key;
    for (const char* key :
         {"model.diffusion_model.label_emb.0.0.weight", "model.diffusion_model.label_emb.0.2.bias",
          "conditioner.embedders.0.transformer.text_model.embeddings.position_ids",
          "conditioner.embedders.1.model.positional_embedding",
          "conditioner.embedders.1.model.ln_final.weight",
          "conditioner.embedders.1.model.transformer.resblocks.0.attn.in_proj_bias"})
      EXPECT_TRUE(tensors.contains(key)) << key;
    // OpenCLIP multiplies by its projection from the right: [width, projection].
    EXPECT_EQ(tensors.at("conditioner.embedders.1.model.text_projection").sizes(),
              (std::vector<std::int64_t>{c2.hidden_size, c2.projection_dim}));
    dt::io::save_safetensors(dir / "xl.safetensors", tensors, {{"format", "pt"}});
    const models::SingleFile f = models::read_single_file(dir / "xl.safetensors");
    EXPECT_EQ(f.family, models::SingleFileFamily::sdxl);
    auto unet = models::unet_from_single_file(f, m.unet->config());
    auto vae = models::vae_from_single_file(f, m.vae->config());
    auto clip = models::clip_from_single_file(f, m.clip->config());
    auto clip2 = models::clip_2_from_single_file(f, clip_2->config());
    expect_same(unet, m.unet, "UNet", dtype);
    expect_same(vae, m.vae, "VAE", dtype);
    expect_same(clip, m.clip, "CLIP ViT-L", dtype);
    expect_same(clip2, clip_2, "OpenCLIP ViT-bigG", dtype);
    // Everything was taken but CLIP's position ids (a buffer transformers makes itself).
    const auto left = models::single_file_leftovers(f);
    ASSERT_EQ(left.size(), 1U);
    EXPECT_EQ(left.begin()->first,
              "conditioner.embedders.0.transformer.text_model.embeddings.position_ids");
  }
  // A file with what the original trainers keep beside the models: left over, and kept.
  auto tensors = models::stable_diffusion_xl_single_file_tensors(m.unet, m.vae, m.clip, clip_2);
  const std::map<std::string, at::Tensor> extra = {
      {"alphas_cumprod", at::linspace(1.0, 0.01, 1000)},
      {"conditioner.embedders.1.model.logit_scale", at::full({}, 4.6052)}};
  for (const auto& [key, t] : extra) tensors[key] = t;
  dt::io::save_safetensors(dir / "xl_extra.safetensors", tensors);
  const models::SingleFile f = models::read_single_file(dir / "xl_extra.safetensors");
  auto unet = models::unet_from_single_file(f, m.unet->config());
  auto vae = models::vae_from_single_file(f, m.vae->config());
  auto clip = models::clip_from_single_file(f, m.clip->config());
  auto clip2 = models::clip_2_from_single_file(f, clip_2->config());
  auto left = models::single_file_leftovers(f);
  EXPECT_EQ(left.size(), 3U);  // and CLIP's position ids
  for (const auto& [key, t] : extra) EXPECT_TRUE(left.contains(key)) << key;
  // A model tensor of a kept name wins: the fine-tuned weights are what is written.
  left["model.diffusion_model.out.2.bias"] =
      at::zeros_like(tensors.at("model.diffusion_model.out.2.bias")) + 7;
  const auto again = models::stable_diffusion_xl_single_file_tensors(
      unet, vae, clip, clip2,
      {.dtype = std::nullopt, .family = models::SingleFileFamily::sdxl, .keep = left});
  ASSERT_EQ(again.size(), tensors.size());
  for (const auto& [key, t] : tensors) {
    ASSERT_TRUE(again.contains(key)) << key;
    EXPECT_TRUE(at::equal(again.at(key), t)) << key;
  }
  // The second encoder is SDXL's alone, and must have its projection.
  Sd1Models<> sd1 = load("unet_conv_proj", "vae_two_levels");
  models::save_stable_diffusion_single_file(dir / "sd1.safetensors", sd1.unet, sd1.vae, sd1.clip);
  const auto sd1_file = models::read_single_file(dir / "sd1.safetensors");
  std::string msg = error_of<dt::ConfigError>(
      [&] { (void)models::clip_2_from_single_file(sd1_file, clip_2->config()); });
  EXPECT_NE(msg.find("no second text encoder"), std::string::npos) << msg;
  msg = error_of<dt::ConfigError>([&] {
    (void)models::stable_diffusion_xl_single_file_tensors(m.unet, m.vae, m.clip, m.clip);
  });
  EXPECT_NE(msg.find("CLIPTextModelWithProjection"), std::string::npos) << msg;
  msg = error_of<dt::ConfigError>([&] {
    (void)models::stable_diffusion_single_file_tensors(
        m.unet, m.vae, m.clip, {.dtype = std::nullopt, .family = models::SingleFileFamily::sdxl});
  });
  EXPECT_NE(msg.find("both text encoders"), std::string::npos) << msg;
  // A file missing half of OpenCLIP's fused q, k, v is named.
  auto half = models::stable_diffusion_xl_single_file_tensors(m.unet, m.vae, m.clip, clip_2);
  const std::string in_proj =
      "conditioner.embedders.1.model.transformer.resblocks.1.attn.in_proj_weight";
  half[in_proj] = half[in_proj].narrow(0, 0, c2.hidden_size * 2).clone();
  dt::io::save_safetensors(dir / "half.safetensors", half);
  const auto half_file = models::read_single_file(dir / "half.safetensors");
  msg = error_of<dt::FormatError>(
      [&] { (void)models::clip_2_from_single_file(half_file, clip_2->config()); });
  EXPECT_NE(msg.find("resblocks.1.attn.in_proj_weight' is not q, k and v"), std::string::npos)
      << msg;
  if (const char* out_env = std::getenv("DIFFTRAIN_MODELS_OUT")) {
    fs::create_directories(out_env);
    models::save_stable_diffusion_xl_single_file(fs::path(out_env) / "sdxl_single.safetensors",
                                                 m.unet, m.vae, m.clip, clip_2);
  }
  dt::io::remove_tree(dir);
}

TEST(SingleFile, FilesThatDoNotFitAreTypedErrorsNamingTheKeys) {
  const fs::path dir = scratch("hostile");
  Sd1Models<> m = load("unet_conv_proj", "vae_two_levels");
  const auto good = models::stable_diffusion_single_file_tensors(m.unet, m.vae, m.clip);
  auto read = [&](std::map<std::string, at::Tensor> t) {
    dt::io::save_safetensors(dir / "f.safetensors", t);
    return models::read_single_file(dir / "f.safetensors");
  };
  const std::string conv = "model.diffusion_model.input_blocks.1.0.in_layers.2.weight";
  {
    auto t = good;
    t.erase(conv);
    const auto f = read(t);
    const std::string msg = error_of<dt::FormatError>(
        [&] { (void)models::unet_from_single_file(f, m.unet->config()); });
    EXPECT_NE(msg.find("lacks 1 tensor(s) of the UNet: '" + conv + "'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("down_blocks.0.resnets.0.conv1.weight"), std::string::npos) << msg;
  }
  {
    auto t = good;
    t[conv] = at::zeros({3, 3, 3, 3});
    const auto f = read(t);
    const std::string msg = error_of<dt::FormatError>(
        [&] { (void)models::unet_from_single_file(f, m.unet->config()); });
    EXPECT_NE(msg.find("down_blocks.0.resnets.0.conv1.weight' has shape [3, 3, 3, 3]"),
              std::string::npos)
        << msg;
  }
  {
    auto t = good;
    t["model.diffusion_model.input_blocks.99.0.in_layers.0.weight"] = at::zeros({2});
    const auto f = read(t);
    const std::string msg = error_of<dt::FormatError>(
        [&] { (void)models::unet_from_single_file(f, m.unet->config()); });
    EXPECT_NE(msg.find("input_blocks.99.0.in_layers.0.weight"), std::string::npos) << msg;
    EXPECT_NE(msg.find("no place"), std::string::npos) << msg;
  }
  {
    // A file of no family names the closest and what it lacks.
    std::map<std::string, at::Tensor> t = {
        {"model.diffusion_model.input_blocks.0.0.weight", at::zeros({1})},
        {"something.else", at::zeros({1})}};
    const std::string msg = error_of<dt::FormatError>([&] { (void)read(t); });
    EXPECT_NE(msg.find("comes closest to"), std::string::npos) << msg;
    EXPECT_NE(msg.find("lacks"), std::string::npos) << msg;
  }
  {
    // SDXL and SD3 files are told by their keys; SD3's are refused by name.
    auto t = good;
    t["model.diffusion_model.label_emb.0.0.weight"] = at::zeros({4});
    t["conditioner.embedders.1.model.ln_final.weight"] = at::zeros({4});
    EXPECT_EQ(read(t).family, models::SingleFileFamily::sdxl);
    auto sd3 = good;
    sd3["model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight"] = at::zeros({4});
    sd3["model.diffusion_model.x_embedder.proj.weight"] = at::zeros({4});
    const auto f = read(sd3);
    EXPECT_EQ(f.family, models::SingleFileFamily::sd3);
    const std::string msg = error_of<dt::ConfigError>(
        [&] { (void)models::unet_from_single_file(f, m.unet->config()); });
    EXPECT_NE(msg.find("Stable Diffusion 3 file"), std::string::npos) << msg;
  }
  {
    // SD 2.x: OpenCLIP's 24th layer (SD 2.x reads the penultimate) and its projection are not
    // the text encoder's, as in diffusers; a fused in_proj of the wrong height is named.
    auto t = models::stable_diffusion_single_file_tensors(
        m.unet, m.vae, m.clip, {.dtype = std::nullopt, .family = models::SingleFileFamily::sd2});
    const auto layers = m.clip->config().num_hidden_layers;
    const std::string last =
        "cond_stage_model.model.transformer.resblocks." + std::to_string(layers);
    t[last + ".ln_1.weight"] = at::zeros({4});
    t["cond_stage_model.model.text_projection"] = at::zeros({4, 4});
    t["cond_stage_model.model.logit_scale"] = at::zeros({});
    auto clip2 = models::clip_from_single_file(read(t), m.clip->config());
    expect_same(clip2, m.clip, "CLIP with OpenCLIP's extra layer");
    t["cond_stage_model.model.transformer.resblocks.0.attn.in_proj_weight"] = at::zeros({5, 4});
    const auto f = read(t);
    const std::string msg = error_of<dt::FormatError>(
        [&] { (void)models::clip_from_single_file(f, m.clip->config()); });
    EXPECT_NE(msg.find("resblocks.0.attn.in_proj_weight' is not q, k and v"), std::string::npos)
        << msg;
  }
  {
    // A UNet config larger than the file's model: its tensors are missing, named.
    nlohmann::json j = m.unet->config().to_json();
    j["layers_per_block"] = m.unet->config().layers_per_block[0] + 1;
    auto c = models::UNet2DConditionConfig::from_json(j, "config.json");
    const auto f = read(good);
    const std::string msg =
        error_of<dt::FormatError>([&] { (void)models::unet_from_single_file(f, c); });
    EXPECT_NE(msg.find("lacks"), std::string::npos) << msg;
  }
  {
    // A UNet with a layer the original layout has no place for (a text projection,
    // encoder_hid_proj) is refused by that layer's name, not written without it.
    auto odd = load<models::UNet2DConditionModel<dt::nn::attention::Sdpa<dt::nn::attention::Auto>,
                                                 dt::nn::activation::Mish>>("unet_timestep_classes",
                                                                            "vae_two_levels");
    const std::string msg = error_of<dt::ConfigError>(
        [&] { (void)models::stable_diffusion_single_file_tensors(odd.unet, odd.vae, odd.clip); });
    EXPECT_NE(msg.find("encoder_hid_proj.weight: has no place in the original UNet layout"),
              std::string::npos)
        << msg;
  }
  // Hostile pickled checkpoints (the kept fuzz corpus' torch files as a .ckpt): a pickle that
  // calls a Python global, and one whose shared references expand past the bound, are refused
  // before anything runs or grows.
  for (const auto& [name, why] :
       {std::pair{"python_global", "calls the Python global '__builtin__ print'"},
        std::pair{"dag_dicts", "expands to more than 4194304 values"}}) {
    fs::copy_file(fs::path(DIFFTRAIN_FUZZ_CORPUS_DIR) / "torch_file" / name, dir / "bad.ckpt",
                  fs::copy_options::overwrite_existing);
    const std::string msg =
        error_of<dt::FormatError>([&] { (void)models::read_single_file(dir / "bad.ckpt"); });
    EXPECT_NE(msg.find(why), std::string::npos) << name << ": " << msg;
  }
  // Not a file of tensors at all.
  std::ofstream(dir / "junk.safetensors") << "not a safetensors file";
  const std::string junk =
      error_of<dt::FormatError>([&] { (void)models::read_single_file(dir / "junk.safetensors"); });
  EXPECT_NE(junk, "accepted");
  EXPECT_EQ(junk.find("wrong error type"), std::string::npos) << junk;
  dt::io::remove_tree(dir);
}

// The full-size Stable Diffusion 1.5 and 2.1 UNets and their VAE (diffusers' parameter lists, from
// the reference scripts): every tensor has one original name, the blocks are numbered as the
// original checkpoints number them, and names the published checkpoints hold are among them.
// check_cpp_single_file.py runs diffusers' own converters (convert_ldm_unet_checkpoint,
// convert_ldm_vae_checkpoint) on these names and gets every diffusers tensor back.
TEST(SingleFile, FullSizeNamesAreThePublishedLayouts) {
  const auto& full = tst::golden("models.json")["full_size"];
  nlohmann::json out;
  for (const std::string key : {"sd15_unet", "sd21_unet", "sdxl_unet"}) {
    SCOPED_TRACE(key);
    const bool xl = key == "sdxl_unet";
    const auto c = models::UNet2DConditionConfig::from_json(full[key]["config"], key);
    std::set<std::string> names;
    std::set<std::int64_t> input, middle, output;
    for (const auto& [name, shape] : full[key]["shapes"].items()) {
      const std::string ldm = models::ldm_unet_name(name, c);
      EXPECT_TRUE(names.insert(ldm).second) << ldm;
      out[key]["names"][name] = ldm;
      for (auto [prefix, set] :
           {std::pair{"input_blocks.", &input}, std::pair{"middle_block.", &middle},
            std::pair{"output_blocks.", &output}})
        if (ldm.starts_with(prefix))
          set->insert(std::stoll(ldm.substr(std::string_view(prefix).size())));
    }
    // SD 1.5 and 2.1: 686 tensors in 12 input and 12 output blocks; SDXL: 1,680 in 9 and 9.
    EXPECT_EQ(names.size(), xl ? 1680U : 686U);
    EXPECT_EQ(input.size(), xl ? 9U : 12U);
    EXPECT_EQ(*input.rbegin(), xl ? 8 : 11);
    EXPECT_EQ(middle, (std::set<std::int64_t>{0, 1, 2}));
    EXPECT_EQ(output.size(), xl ? 9U : 12U);
    const std::vector<std::string> published =
        xl ? std::vector<std::string>{"time_embed.0.weight",
                                      "label_emb.0.0.weight",
                                      "label_emb.0.2.bias",
                                      "input_blocks.3.0.op.weight",
                                      "input_blocks.4.1.transformer_blocks.1.attn1.to_q.weight",
                                      "input_blocks.4.0.skip_connection.weight",
                                      "input_blocks.8.1.transformer_blocks.9.ff.net.2.weight",
                                      "middle_block.1.transformer_blocks.9.attn2.to_k.weight",
                                      "output_blocks.2.2.conv.weight",
                                      "output_blocks.5.2.conv.weight",
                                      "output_blocks.0.1.transformer_blocks.9.norm3.weight",
                                      "output_blocks.8.0.skip_connection.weight",
                                      "out.2.bias"}
           : std::vector<std::string>{"time_embed.0.weight",
                                      "input_blocks.0.0.weight",
                                      "input_blocks.1.0.in_layers.0.weight",
                                      "input_blocks.1.1.transformer_blocks.0.attn1.to_q.weight",
                                      "input_blocks.1.1.transformer_blocks.0.ff.net.0.proj.weight",
                                      "input_blocks.3.0.op.weight",
                                      "input_blocks.4.0.skip_connection.weight",
                                      "input_blocks.11.0.emb_layers.1.weight",
                                      "middle_block.1.proj_in.weight",
                                      "middle_block.2.out_layers.3.weight",
                                      "output_blocks.2.1.conv.weight",
                                      "output_blocks.5.2.conv.weight",
                                      "output_blocks.8.2.conv.weight",
                                      "output_blocks.11.1.transformer_blocks.0.attn2.to_k.weight",
                                      "output_blocks.0.0.skip_connection.weight",
                                      "out.0.weight",
                                      "out.2.bias"};
    for (const auto& name : published) EXPECT_TRUE(names.contains(name)) << name;
    out[key]["config"] = full[key]["config"];
    out[key]["shapes"] = full[key]["shapes"];
  }
  // SD3 medium's and SD 3.5 medium's MMDiT at full width (their first blocks and the last,
  // context-pre-only one, as the reference builds them): every tensor one original name, the
  // q, k and v of each stream one qkv of three times the rows.
  const auto& transformers = tst::golden("transformers.json")["full_size"];
  for (const std::string key : {"sd3_medium", "sd35_medium"}) {
    SCOPED_TRACE(key);
    const auto c = models::SD3Transformer2DConfig::from_json(transformers[key]["config"], key);
    std::map<std::string, std::vector<std::int64_t>> original;
    for (const auto& [name, shape] : transformers[key]["shapes"].items()) {
      const models::OriginalPlace place = models::sd3_original_place(name, c.num_layers);
      auto s = shape.get<std::vector<std::int64_t>>();
      if (place.third >= 0) {
        s[0] *= 3;
        auto& fused = original[place.name];
        EXPECT_TRUE(fused.empty() || fused == s) << place.name;
        fused = s;
      } else {
        EXPECT_TRUE(original.emplace(place.name, s).second) << place.name;
      }
    }
    for (const char* name :
         {"pos_embed", "x_embedder.proj.weight", "t_embedder.mlp.0.weight", "y_embedder.mlp.2.bias",
          "context_embedder.weight", "joint_blocks.0.x_block.attn.qkv.weight",
          "joint_blocks.0.context_block.adaLN_modulation.1.weight",
          "joint_blocks.2.context_block.attn.qkv.bias", "final_layer.adaLN_modulation.1.weight",
          "final_layer.linear.bias"})
      EXPECT_TRUE(original.contains(name)) << name;
    EXPECT_FALSE(original.contains("joint_blocks.2.context_block.mlp.fc1.weight"));
    // (SD3 medium: 24 blocks; the count of the published file's MMDiT keys follows from the
    // per-block count, as docs/models.md states it.)
    nlohmann::json& o = out[key];
    o["config"] = transformers[key]["config"];
    o["shapes"] = transformers[key]["shapes"];
    for (const auto& [name, shape] : original) o["original"][name] = shape;
  }
  const auto vc = models::AutoencoderKLConfig::from_json(full["sd_vae"]["config"], "vae");
  std::set<std::string> vae;
  for (const auto& [name, shape] : full["sd_vae"]["shapes"].items()) {
    const std::string ldm = models::ldm_vae_name(name, vc);
    EXPECT_TRUE(vae.insert(ldm).second) << ldm;
    out["sd_vae"]["names"][name] = ldm;
  }
  EXPECT_EQ(vae.size(), 248U);
  for (const char* published :
       {"encoder.conv_in.weight", "encoder.down.0.block.1.conv2.weight",
        "encoder.down.0.downsample.conv.weight", "encoder.down.1.block.0.nin_shortcut.weight",
        "encoder.mid.attn_1.q.weight", "encoder.mid.attn_1.proj_out.bias",
        "encoder.mid.block_2.norm2.weight", "encoder.norm_out.weight",
        "decoder.up.0.block.2.conv1.weight", "decoder.up.3.upsample.conv.weight",
        "decoder.up.1.block.0.nin_shortcut.weight", "decoder.mid.attn_1.norm.weight",
        "quant_conv.weight", "post_quant_conv.bias"})
    EXPECT_TRUE(vae.contains(published)) << published;
  EXPECT_FALSE(vae.contains("decoder.up.0.upsample.conv.weight"));  // the lowest has none
  out["sd_vae"]["config"] = full["sd_vae"]["config"];
  out["sd_vae"]["shapes"] = full["sd_vae"]["shapes"];
  if (const char* out_env = std::getenv("DIFFTRAIN_MODELS_OUT")) {
    fs::create_directories(out_env);
    std::ofstream(fs::path(out_env) / "ldm_names.json") << out.dump();
  }
}

namespace {

at::Tensor meta(const std::vector<std::int64_t>& shape) {
  return at::empty(shape, at::TensorOptions().device(at::kMeta));
}

// A CLIP text encoder's tensors (transformers' names and shapes) under `prefix`, or in OpenCLIP's
// layout (q, k, v fused; the projection transposed), as meta tensors: the full-size encoders'
// published shapes without their gigabytes.
void add_clip(std::map<std::string, at::Tensor>& t, const std::string& prefix, bool openclip,
              std::int64_t width, std::int64_t layers, std::int64_t mlp, std::int64_t projection) {
  std::map<std::string, std::vector<std::int64_t>> hf = {
      {"text_model.embeddings.token_embedding.weight", {49408, width}},
      {"text_model.embeddings.position_embedding.weight", {77, width}},
      {"text_model.final_layer_norm.weight", {width}},
      {"text_model.final_layer_norm.bias", {width}}};
  if (projection > 0) hf["text_projection.weight"] = {projection, width};
  for (std::int64_t l = 0; l < layers; ++l) {
    const std::string b = "text_model.encoder.layers." + std::to_string(l) + ".";
    for (const char* proj : {"q_proj", "k_proj", "v_proj", "out_proj"}) {
      hf[b + "self_attn." + proj + ".weight"] = {width, width};
      hf[b + "self_attn." + proj + ".bias"] = {width};
    }
    for (const char* norm : {"layer_norm1", "layer_norm2"}) {
      hf[b + norm + ".weight"] = {width};
      hf[b + norm + ".bias"] = {width};
    }
    hf[b + "mlp.fc1.weight"] = {mlp, width};
    hf[b + "mlp.fc1.bias"] = {mlp};
    hf[b + "mlp.fc2.weight"] = {width, mlp};
    hf[b + "mlp.fc2.bias"] = {width};
  }
  for (auto [name, shape] : hf) {
    if (!openclip) {
      t[prefix + name] = meta(shape);
      continue;
    }
    const models::OriginalPlace place = models::openclip_place(name);
    if (place.third >= 0) shape[0] *= 3;
    if (place.transposed) std::swap(shape[0], shape[1]);
    t[prefix + place.name] = meta(shape);
  }
}

models::SingleFile file_of(std::map<std::string, at::Tensor> tensors, const std::string& where) {
  models::SingleFile f;
  f.where = where;
  f.tensors = std::move(tensors);
  f.family = models::single_file_family(f.tensors, where);
  return f;
}

}  // namespace

// A single file without its config folder: the UNet's, VAE's and text encoders' configs are told
// from the keys and shapes. The full-size SD 1.5, 2.1 and XL UNets, the SD VAE and the published
// text encoders (CLIP ViT-L, OpenCLIP ViT-H and ViT-bigG) give their published configs; every tiny
// model the reference scripts made, written as a single file, is built from the told config and
// takes every tensor of the file (heads aside: shapes cannot tell them, and the families' rule
// gives tiny widths one).
TEST(SingleFile, ConfigsAreToldFromTheKeysAndShapes) {
  const auto& full = tst::golden("models.json")["full_size"];
  const auto vc = models::AutoencoderKLConfig::from_json(full["sd_vae"]["config"], "vae");
  for (const char* key : {"sd15_unet", "sd21_unet"}) {
    SCOPED_TRACE(key);
    const bool sd2 = std::string(key) == "sd21_unet";
    const auto c = models::UNet2DConditionConfig::from_json(full[key]["config"], key);
    std::map<std::string, at::Tensor> t;
    for (const auto& [name, shape] : full[key]["shapes"].items())
      t["model.diffusion_model." + models::ldm_unet_name(name, c)] =
          meta(shape.get<std::vector<std::int64_t>>());
    for (const auto& [name, shape] : full["sd_vae"]["shapes"].items()) {
      auto s = shape.get<std::vector<std::int64_t>>();
      if (models::ldm_vae_conv_as_linear(name)) s.insert(s.end(), {1, 1});
      t["first_stage_model." + models::ldm_vae_name(name, vc)] = meta(s);
    }
    if (sd2)
      add_clip(t, "cond_stage_model.model.", true, 1024, 24, 4096, 1024);
    else
      add_clip(t, "cond_stage_model.transformer.", false, 768, 12, 3072, 0);
    const auto f = file_of(t, key);
    EXPECT_EQ(f.family, sd2 ? models::SingleFileFamily::sd2 : models::SingleFileFamily::sd1);
    const auto told =
        models::UNet2DConditionConfig::from_json(models::unet_config_from_single_file(f), key);
    EXPECT_EQ(told.to_json(), c.to_json()) << told.to_json().dump() << "\n" << c.to_json().dump();
    const auto vae =
        models::AutoencoderKLConfig::from_json(models::vae_config_from_single_file(f), key);
    EXPECT_EQ(vae.block_out_channels, vc.block_out_channels);
    EXPECT_EQ(vae.layers_per_block, vc.layers_per_block);
    EXPECT_EQ(vae.latent_channels, vc.latent_channels);
    EXPECT_EQ(vae.mid_block_add_attention, vc.mid_block_add_attention);
    EXPECT_DOUBLE_EQ(vae.scaling_factor, 0.18215);
    const auto clip =
        models::CLIPTextConfig::from_json(models::clip_config_from_single_file(f), key);
    // The published text_encoder/config.json of each.
    EXPECT_EQ(clip.hidden_size, sd2 ? 1024 : 768);
    EXPECT_EQ(clip.num_hidden_layers, sd2 ? 23 : 12);  // SD 2.x reads the penultimate layer
    EXPECT_EQ(clip.num_attention_heads, sd2 ? 16 : 12);
    EXPECT_EQ(clip.intermediate_size, sd2 ? 4096 : 3072);
    EXPECT_EQ(clip.hidden_act, sd2 ? "gelu" : "quick_gelu");
    EXPECT_EQ(clip.projection_dim, sd2 ? 512 : 768);
    EXPECT_FALSE(clip.with_projection);
    EXPECT_EQ(clip.max_position_embeddings, 77);
    EXPECT_EQ(clip.vocab_size, 49408);
  }
  {
    // SDXL base: the full-size UNet (its added embedding's time-id width from the pooled text's),
    // CLIP ViT-L and OpenCLIP ViT-bigG with its projection.
    const auto c = models::UNet2DConditionConfig::from_json(full["sdxl_unet"]["config"], "sdxl");
    std::map<std::string, at::Tensor> t;
    for (const auto& [name, shape] : full["sdxl_unet"]["shapes"].items())
      t["model.diffusion_model." + models::ldm_unet_name(name, c)] =
          meta(shape.get<std::vector<std::int64_t>>());
    add_clip(t, "conditioner.embedders.0.transformer.", false, 768, 12, 3072, 0);
    add_clip(t, "conditioner.embedders.1.model.", true, 1280, 32, 5120, 1280);
    const auto f = file_of(t, "sdxl");
    EXPECT_EQ(f.family, models::SingleFileFamily::sdxl);
    const auto told =
        models::UNet2DConditionConfig::from_json(models::unet_config_from_single_file(f), "sdxl");
    EXPECT_EQ(told.to_json(), c.to_json()) << told.to_json().dump() << "\n" << c.to_json().dump();
    const auto te1 =
        models::CLIPTextConfig::from_json(models::clip_config_from_single_file(f, 0), "te1");
    const auto te2 =
        models::CLIPTextConfig::from_json(models::clip_config_from_single_file(f, 1), "te2");
    EXPECT_EQ(te1.hidden_size, 768);
    EXPECT_EQ(te1.num_hidden_layers, 12);
    EXPECT_TRUE(te2.with_projection);
    EXPECT_EQ(te2.hidden_size, 1280);
    EXPECT_EQ(te2.num_hidden_layers, 32);
    EXPECT_EQ(te2.num_attention_heads, 20);
    EXPECT_EQ(te2.intermediate_size, 5120);
    EXPECT_EQ(te2.projection_dim, 1280);
    EXPECT_EQ(te2.hidden_act, "gelu");
  }
  // Tiny models as single files: built from the told configs (with the reference configs' heads),
  // they take every tensor and hold the same values.
  const fs::path dir = scratch("told");
  // SDXL's second encoder projects to what the UNet's added embedding takes beside six time ids
  // (the reference SDXL UNet: 64 = 16 + 6 x 8).
  nlohmann::json c2 = models::read_model_config(golden() / "encode_prompt" / "text_encoder_2");
  c2["projection_dim"] = 16;
  torch::manual_seed(0);
  models::CLIPTextModel<> clip_2(models::CLIPTextConfig::from_json(c2, "te2"), "te2");
  for (const std::string unet_name :
       {"unet_conv_proj", "unet_linear_3_levels", "unet_sdxl_text_time_bin"})
    for (const std::string vae_name : {"vae_two_levels", "vae_three_levels_plain"})
      for (const auto family : {models::SingleFileFamily::sd1, models::SingleFileFamily::sd2,
                                models::SingleFileFamily::sdxl}) {
        const bool xl = family == models::SingleFileFamily::sdxl;
        if (xl != (unet_name == "unet_sdxl_text_time_bin")) continue;
        SCOPED_TRACE(unet_name + " + " + vae_name + " as " +
                     std::string(models::single_file_family_name(family)));
        Sd1Models<> m = load(unet_name, vae_name);
        const auto tensors =
            xl ? models::stable_diffusion_xl_single_file_tensors(m.unet, m.vae, m.clip, clip_2)
               : models::stable_diffusion_single_file_tensors(
                     m.unet, m.vae, m.clip, {.dtype = std::nullopt, .family = family});
        dt::io::save_safetensors(dir / "m.safetensors", tensors);
        const auto f = models::read_single_file(dir / "m.safetensors");
        nlohmann::json uj = models::unet_config_from_single_file(f);
        uj["attention_head_dim"] = m.unet->config().attention_head_dim;
        uj["norm_num_groups"] = m.unet->config().norm_num_groups;
        const auto uc = models::UNet2DConditionConfig::from_json(uj, "told");
        for (const auto& field :
             {"in_channels", "out_channels", "down_block_types", "up_block_types",
              "block_out_channels", "layers_per_block", "cross_attention_dim",
              "use_linear_projection", "transformer_layers_per_block", "addition_embed_type",
              "addition_time_embed_dim", "projection_class_embeddings_input_dim",
              "num_class_embeds"})
          EXPECT_EQ(uc.to_json().value(field, nlohmann::json()),
                    m.unet->config().to_json().value(field, nlohmann::json()))
              << field;
        auto unet = models::unet_from_single_file(f, uc);
        expect_same(unet, m.unet, "UNet");
        nlohmann::json vj = models::vae_config_from_single_file(f);
        vj["norm_num_groups"] = m.vae->config().norm_num_groups;
        auto vae =
            models::vae_from_single_file(f, models::AutoencoderKLConfig::from_json(vj, "told"));
        expect_same(vae, m.vae, "VAE");
        nlohmann::json cj = models::clip_config_from_single_file(f);
        cj["num_attention_heads"] = m.clip->config().num_attention_heads;
        if (family == models::SingleFileFamily::sd2)  // the file holds the layers it was given
          cj["num_hidden_layers"] = m.clip->config().num_hidden_layers;
        auto clip = models::clip_from_single_file(f, models::CLIPTextConfig::from_json(cj, "told"));
        expect_same(clip, m.clip, "text encoder");
        if (xl) {
          nlohmann::json t2 = models::clip_config_from_single_file(f, 1);
          t2["num_attention_heads"] = clip_2->config().num_attention_heads;
          auto te2 =
              models::clip_2_from_single_file(f, models::CLIPTextConfig::from_json(t2, "told"));
          expect_same(te2, clip_2, "second text encoder");
        }
      }
  // A file whose UNet has no middle-block attention is no Stable Diffusion UNet: named.
  Sd1Models<> m = load("unet_conv_proj", "vae_two_levels");
  auto t = models::stable_diffusion_single_file_tensors(m.unet, m.vae, m.clip);
  for (auto it = t.begin(); it != t.end();)
    it = it->first.starts_with("model.diffusion_model.middle_block.1.") ? t.erase(it)
                                                                        : std::next(it);
  dt::io::save_safetensors(dir / "no_mid.safetensors", t);
  const auto no_mid = models::read_single_file(dir / "no_mid.safetensors");
  const std::string msg =
      error_of<dt::FormatError>([&] { (void)models::unet_config_from_single_file(no_mid); });
  EXPECT_NE(msg.find("middle_block.1.proj_in.weight"), std::string::npos) << msg;
  dt::io::remove_tree(dir);
}

// CLIP's tokenizer from OpenAI's merges file alone (open_clip's bpe_simple_vocab_16e6.txt.gz; here
// the reference's merges, gzipped as that file is): every swept string gets transformers' ids, as
// SD 1.x's tokenizer (padding with <|endoftext|>) and SD 2.x's (padding with "!"). A file of too
// few merges or a malformed line is a FormatError naming it.
TEST(SingleFile, ClipTokenizerFromTheBpeMergesFile) {
  const fs::path dir = scratch("bpe");
  std::ifstream in(golden() / "clip_tokenizer" / "sd15" / "merges.txt", std::ios::binary);
  const std::string merges((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  gzFile gz = gzopen((dir / "bpe_simple_vocab_16e6.txt.gz").c_str(), "wb");
  ASSERT_NE(gz, nullptr);
  ASSERT_EQ(gzwrite(gz, merges.data(), static_cast<unsigned>(merges.size())),
            static_cast<int>(merges.size()));
  gzclose(gz);
  const auto& g = tst::golden("clip_tokenizer.json");
  const auto strings = g["strings"].get<std::vector<std::string>>();
  for (const auto& [variant, pad] : {std::pair{"sd15", "<|endoftext|>"}, std::pair{"sd2", "!"}}) {
    SCOPED_TRACE(variant);
    const auto tok =
        dt::text::clip_tokenizer_from_bpe_merges(dir / "bpe_simple_vocab_16e6.txt.gz", pad);
    const auto& want = g["variants"][variant];
    EXPECT_EQ(tok.pad_token_id(), want["pad_token_id"].get<std::int64_t>());
    EXPECT_EQ(tok.model_max_length(), 77);
    const auto& ids = want["ids"];  // (SD 2.x's: of the first 3,000 strings)
    ASSERT_EQ(ids.size(), want["count"].get<std::size_t>());
    std::size_t differ = 0;
    std::string first;
    for (std::size_t i = 0; i < ids.size(); ++i) {
      const auto got = tok.encode(strings[i]);
      if (got == ids[i].get<std::vector<std::int64_t>>()) continue;
      if (differ++ == 0)
        first =
            "'" + strings[i] + "': " + c10::str(at::IntArrayRef(got)) + " against " + ids[i].dump();
    }
    EXPECT_EQ(differ, 0U) << "of " << ids.size() << "; the first: " << first;
  }
  // Plain text reads the same; too few merges and a line of three parts are named.
  std::ofstream(dir / "plain.txt", std::ios::binary) << merges;
  EXPECT_EQ(dt::text::clip_tokenizer_from_bpe_merges(dir / "plain.txt").encode(strings[0]),
            g["variants"]["sd15"]["ids"][0].get<std::vector<std::int64_t>>());
  std::ofstream(dir / "short.txt", std::ios::binary) << merges.substr(0, merges.size() / 2);
  std::string msg = error_of<dt::FormatError>(
      [&] { (void)dt::text::clip_tokenizer_from_bpe_merges(dir / "short.txt"); });
  EXPECT_NE(msg.find("merges; CLIP's vocabulary is built from 48894"), std::string::npos) << msg;
  std::string bad = merges;
  bad.insert(bad.find('\n', bad.find('\n') + 1), " extra");
  std::ofstream(dir / "bad.txt", std::ios::binary) << bad;
  msg = error_of<dt::FormatError>(
      [&] { (void)dt::text::clip_tokenizer_from_bpe_merges(dir / "bad.txt"); });
  EXPECT_NE(msg.find("line 2 is not a merge of two symbols"), std::string::npos) << msg;
  dt::io::remove_tree(dir);
}
