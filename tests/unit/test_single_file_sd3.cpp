// Stable Diffusion 3 / 3.5 single files: the MMDiT under its original names (q, k and v in one
// qkv tensor, the last block's and the final modulation with shift before scale), the VAE, CLIP-L,
// CLIP-G and T5 under text_encoders.*, written and read back to the bit for each reference
// transformer (SD3's, a one-block one, SD 3.5's with RMS q/k norms and dual attention), in float32
// and bf16; the transformer's config told from the keys; hostile files named.
// tests/reference/check_cpp_single_file.py runs diffusers' own converter on the written file.
#include <unistd.h>
#include <difftrain/io/remove_tree.hpp>
#include <difftrain/io/safetensors.hpp>
#include <difftrain/models/models.hpp>
#include <difftrain/models/single_file/sd3.hpp>
#include <difftrain/nn/module_tensors.hpp>

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>

#include <difftrain/io/torch_file.hpp>
#include <difftrain/models/single_file/cogvideox_sat.hpp>
#include "golden.hpp"
#include "single_file_checks.hpp"

namespace dt = difftrain;
namespace fs = std::filesystem;
namespace models = difftrain::models;

namespace {

fs::path golden() { return fs::path(DIFFTRAIN_GOLDEN_DIR); }

fs::path scratch(const std::string& name) {
  const fs::path dir =
      fs::temp_directory_path() / ("difftrain-sd3-" + name + "-" + std::to_string(::getpid()));
  dt::io::remove_tree(dir);
  fs::create_directories(dir);
  return dir;
}

using dt::test::error_of;
using dt::test::expect_same;

struct Sd3Models {
  models::SD3Transformer2DModel<> mmdit{nullptr};
  models::AutoencoderKL<> vae{nullptr};
  models::CLIPTextModel<> clip_l{nullptr}, clip_g{nullptr};
  models::T5EncoderModel<> t5{nullptr};
};

Sd3Models load(const std::string& transformer) {
  const fs::path enc = golden() / "sd3_encode_prompt";
  return {models::from_pretrained<models::SD3Transformer2DModel<>>(golden() / "transformers" /
                                                                   transformer),
          models::from_pretrained<models::AutoencoderKL<>>(golden() / "models" / "vae_two_levels"),
          models::from_pretrained<models::CLIPTextModel<>>(enc / "text_encoder"),
          models::from_pretrained<models::CLIPTextModel<>>(enc / "text_encoder_2"),
          models::from_pretrained<models::T5EncoderModel<>>(enc / "text_encoder_3")};
}

}  // namespace

TEST(SingleFileSd3, ModelsRoundTripUnderTheOriginalNames) {
  const fs::path dir = scratch("roundtrip");
  for (const std::string name : {"sd3_tiny", "sd3_single_block", "sd35_qk_norm_dual"})
    for (const auto dtype : {std::optional<at::ScalarType>{}, std::optional{at::kBFloat16}}) {
      SCOPED_TRACE(name + (dtype ? " (bf16)" : ""));
      Sd3Models m = load(name);
      const auto& c = m.mmdit->config();
      const auto tensors = models::stable_diffusion_3_single_file_tensors(
          m.mmdit, m.vae, &m.clip_l, &m.clip_g, &m.t5,
          {.dtype = dtype, .family = models::SingleFileFamily::sd3});
      // q, k and v (and the context's) are one tensor in the original: 4 tensors a block fewer
      // per fused triple (weights and biases).
      std::size_t fused = 4 * static_cast<std::size_t>(c.num_layers);
      for (const auto i : c.dual_attention_layers) {
        (void)i;
        fused += 2;
      }
      EXPECT_EQ(tensors.size(), dt::nn::module_tensors(*m.mmdit).size() - 2 * fused +
                                    dt::nn::module_tensors(*m.vae).size() +
                                    dt::nn::module_tensors(*m.clip_l).size() +
                                    dt::nn::module_tensors(*m.clip_g).size() +
                                    dt::nn::module_tensors(*m.t5).size());
      const std::string last = "model.diffusion_model.joint_blocks." +
                               std::to_string(c.num_layers - 1) + ".context_block.";
      for (const std::string& key :
           {std::string("model.diffusion_model.pos_embed"),
            std::string("model.diffusion_model.x_embedder.proj.weight"),
            std::string("model.diffusion_model.t_embedder.mlp.0.weight"),
            std::string("model.diffusion_model.y_embedder.mlp.2.bias"),
            std::string("model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight"),
            std::string("model.diffusion_model.joint_blocks.0.context_block.attn.qkv.bias"),
            std::string("model.diffusion_model.final_layer.adaLN_modulation.1.weight"),
            last + "adaLN_modulation.1.weight",
            std::string("text_encoders.clip_l.transformer."
                        "text_model.final_layer_norm.weight"),
            std::string("text_encoders.clip_g.transformer.text_projection.weight"),
            std::string("text_encoders.t5xxl.transformer.shared.weight"),
            std::string("first_stage_model.encoder.conv_in.weight")})
        EXPECT_TRUE(tensors.contains(key)) << key;
      // The last block's context side projects nothing after attention (diffusers'
      // context_pre_only): no proj, no MLP.
      EXPECT_FALSE(tensors.contains(last + "attn.proj.weight"));
      EXPECT_FALSE(tensors.contains(last + "mlp.fc1.weight"));
      // Shift before scale in the original's final modulation.
      const at::Tensor norm_out = dt::nn::module_tensors(*m.mmdit).at("norm_out.linear.weight");
      const auto d = norm_out.size(0) / 2;
      at::Tensor written =
          tensors.at("model.diffusion_model.final_layer.adaLN_modulation.1.weight");
      if (dtype) written = written.to(at::kFloat);
      const at::Tensor expect_shift =
          dtype ? norm_out.narrow(0, d, d).to(*dtype).to(at::kFloat) : norm_out.narrow(0, d, d);
      EXPECT_TRUE(at::equal(written.narrow(0, 0, d), expect_shift));
      if (!c.dual_attention_layers.empty()) {
        EXPECT_TRUE(tensors.contains("model.diffusion_model.joint_blocks." +
                                     std::to_string(c.dual_attention_layers[0]) +
                                     ".x_block.attn2.qkv.weight"));
      }
      if (c.qk_norm) {
        EXPECT_TRUE(
            tensors.contains("model.diffusion_model.joint_blocks.0.x_block.attn.ln_q.weight"));
      }
      dt::io::save_safetensors(dir / "sd3.safetensors", tensors, {{"format", "pt"}});
      const auto f = models::read_single_file(dir / "sd3.safetensors");
      EXPECT_EQ(f.family, models::SingleFileFamily::sd3);
      auto mmdit = models::sd3_transformer_from_single_file(f, c);
      auto vae = models::vae_from_single_file(f, m.vae->config());
      auto clip_l = models::sd3_clip_from_single_file(f, m.clip_l->config(), 0);
      auto clip_g = models::sd3_clip_from_single_file(f, m.clip_g->config(), 1);
      auto t5 = models::sd3_t5_from_single_file(f, m.t5->config());
      expect_same(mmdit, m.mmdit, "MMDiT", dtype);
      expect_same(vae, m.vae, "VAE", dtype);
      expect_same(clip_l, m.clip_l, "CLIP-L", dtype);
      expect_same(clip_g, m.clip_g, "CLIP-G", dtype);
      expect_same(t5, m.t5, "T5", dtype);
      EXPECT_TRUE(models::single_file_leftovers(f).empty());
      // The config told from the keys is the reference's (its heads aside when they are not 64
      // wide, which only test models have).
      nlohmann::json told = models::sd3_transformer_config_from_single_file(f);
      const nlohmann::json want = c.to_json();
      for (const char* field : {"patch_size", "in_channels", "num_layers", "joint_attention_dim",
                                "caption_projection_dim", "pooled_projection_dim",
                                "pos_embed_max_size", "dual_attention_layers", "qk_norm"})
        EXPECT_EQ(told.value(field, nlohmann::json()), want.value(field, nlohmann::json()))
            << field;
      EXPECT_EQ(told["out_channels"].get<std::int64_t>(), c.out());
      told["attention_head_dim"] = c.attention_head_dim;
      told["num_attention_heads"] = c.num_attention_heads;
      told["sample_size"] = c.sample_size;
      auto from_told = models::sd3_transformer_from_single_file(
          f, models::SD3Transformer2DConfig::from_json(told, "told"));
      expect_same(from_told, m.mmdit, "MMDiT from the told config", dtype);
      // The text encoders' configs told from the keys: every size the reference's (heads and
      // activations are the conventions of the published encoders, which test models do not
      // keep), and the encoders built from them hold the file's tensors.
      for (int index : {0, 1}) {
        auto& want_clip = index == 0 ? m.clip_l : m.clip_g;
        nlohmann::json tc = models::sd3_clip_config_from_single_file(f, index);
        const nlohmann::json wc = want_clip->config().to_json();
        for (const char* field : {"vocab_size", "hidden_size", "max_position_embeddings",
                                  "num_hidden_layers", "intermediate_size", "projection_dim"})
          EXPECT_EQ(tc.value(field, nlohmann::json()), wc.value(field, nlohmann::json()))
              << "CLIP " << index << ": " << field;
        tc["num_attention_heads"] = wc["num_attention_heads"];
        tc["hidden_act"] = wc["hidden_act"];
        auto told_clip = models::sd3_clip_from_single_file(
            f, models::CLIPTextConfig::from_json(tc, "told"), index);
        expect_same(told_clip, want_clip, "CLIP from the told config", dtype);
      }
      nlohmann::json t5c = models::sd3_t5_config_from_single_file(f);
      const nlohmann::json want_t5 = m.t5->config().to_json();
      for (const char* field : {"vocab_size", "d_model", "d_ff", "num_layers",
                                "relative_attention_num_buckets", "feed_forward_proj"})
        EXPECT_EQ(t5c.value(field, nlohmann::json()), want_t5.value(field, nlohmann::json()))
            << "T5: " << field;
      t5c["num_heads"] = want_t5["num_heads"];
      t5c["d_kv"] = want_t5["d_kv"];
      auto told_t5 =
          models::sd3_t5_from_single_file(f, models::T5EncoderConfig::from_json(t5c, "told"));
      expect_same(told_t5, m.t5, "T5 from the told config", dtype);
      if (const char* out_env = std::getenv("DIFFTRAIN_MODELS_OUT"); out_env && !dtype) {
        fs::create_directories(out_env);
        dt::io::save_safetensors(fs::path(out_env) / (name + "_single.safetensors"), tensors,
                                 {{"format", "pt"}});
      }
    }
  dt::io::remove_tree(dir);
}

TEST(SingleFileSd3, FilesThatDoNotFitAreTypedErrors) {
  const fs::path dir = scratch("hostile");
  Sd3Models m = load("sd3_tiny");
  const auto& c = m.mmdit->config();
  const auto good = models::stable_diffusion_3_single_file_tensors(
      m.mmdit, m.vae, &m.clip_l, &m.clip_g, static_cast<models::T5EncoderModel<>*>(nullptr));
  auto read = [&](std::map<std::string, at::Tensor> t) {
    dt::io::save_safetensors(dir / "f.safetensors", t);
    return models::read_single_file(dir / "f.safetensors");
  };
  {
    // A qkv of the wrong height.
    auto t = good;
    t["model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight"] = at::zeros({5, 4});
    const auto f = read(t);
    const std::string msg =
        error_of<dt::FormatError>([&] { (void)models::sd3_transformer_from_single_file(f, c); });
    EXPECT_NE(msg.find("joint_blocks.0.x_block.attn.qkv.weight' is not q, k and v"),
              std::string::npos)
        << msg;
  }
  {
    // A missing block output, named with its diffusers name.
    auto t = good;
    t.erase("model.diffusion_model.joint_blocks.0.x_block.mlp.fc2.weight");
    const auto f = read(t);
    const std::string msg =
        error_of<dt::FormatError>([&] { (void)models::sd3_transformer_from_single_file(f, c); });
    EXPECT_NE(msg.find("transformer_blocks.0.ff.net.2.weight"), std::string::npos) << msg;
  }
  {
    // A modulation of odd height where halves are swapped.
    auto t = good;
    t["model.diffusion_model.final_layer.adaLN_modulation.1.bias"] = at::zeros({3});
    const auto f = read(t);
    const std::string msg =
        error_of<dt::FormatError>([&] { (void)models::sd3_transformer_from_single_file(f, c); });
    EXPECT_NE(msg.find("not two halves of modulation"), std::string::npos) << msg;
  }
  {
    // A file without T5 (as Stability ships one) reads without it; asking for T5 names it.
    const auto f = read(good);
    const std::string msg = error_of<dt::FormatError>(
        [&] { (void)models::sd3_t5_from_single_file(f, m.t5->config()); });
    EXPECT_NE(msg.find("text_encoders.t5xxl.transformer.shared.weight"), std::string::npos) << msg;
    // CLIP-L without its projection gets the identity, as diffusers gives it (its projection as
    // wide as its hidden states, as SD3's CLIP-L has it); where the widths differ, no identity
    // can stand in, and the error says so.
    auto t = good;
    t.erase("text_encoders.clip_l.transformer.text_projection.weight");
    const auto no_projection = read(t);
    const std::string why = error_of<dt::FormatError>(
        [&] { (void)models::sd3_clip_from_single_file(no_projection, m.clip_l->config(), 0); });
    EXPECT_NE(why.find("no identity can stand in"), std::string::npos) << why;
    nlohmann::json square = m.clip_l->config().to_json();
    const auto d = m.clip_l->config().hidden_size;
    square["projection_dim"] = d;
    auto clip_l = models::sd3_clip_from_single_file(
        no_projection, models::CLIPTextConfig::from_json(square, "CLIP-L"), 0);
    EXPECT_TRUE(
        at::equal(dt::nn::module_tensors(*clip_l).at("text_projection.weight"), at::eye(d)));
  }
  {
    // An SD 1.x reader on an SD3 file, and the SD3 reader on another family, say which is which.
    const auto f = read(good);
    std::string msg = error_of<dt::ConfigError>(
        [&] { (void)models::unet_from_single_file(f, models::UNet2DConditionConfig{}); });
    EXPECT_NE(msg.find("Stable Diffusion 3 file"), std::string::npos) << msg;
  }
  dt::io::remove_tree(dir);
}

// SD3 medium's published text encoders at full size (meta tensors of their shapes, the keys the
// told configs read): CLIP-L, CLIP-G and T5-XXL give their published configs.
TEST(SingleFileSd3, PublishedTextEncodersGiveTheirConfigs) {
  const auto meta = [](std::vector<std::int64_t> shape) {
    return at::empty(shape, at::TensorOptions().device(at::kMeta));
  };
  models::SingleFile f;
  f.where = "sd3_medium";
  f.family = models::SingleFileFamily::sd3;
  auto& t = f.tensors;
  const auto clip = [&](const std::string& prefix, std::int64_t width, std::int64_t layers,
                        std::int64_t mlp, bool projection) {
    t[prefix + "text_model.embeddings.token_embedding.weight"] = meta({49408, width});
    t[prefix + "text_model.embeddings.position_embedding.weight"] = meta({77, width});
    for (std::int64_t l = 0; l < layers; ++l)
      t[prefix + "text_model.encoder.layers." + std::to_string(l) + ".mlp.fc1.weight"] =
          meta({mlp, width});
    if (projection) t[prefix + "text_projection.weight"] = meta({width, width});
  };
  clip("text_encoders.clip_l.transformer.", 768, 12, 3072, false);
  clip("text_encoders.clip_g.transformer.", 1280, 32, 5120, true);
  const std::string t5 = "text_encoders.t5xxl.transformer.";
  t[t5 + "shared.weight"] = meta({32128, 4096});
  for (int l = 0; l < 24; ++l)
    t[t5 + "encoder.block." + std::to_string(l) + ".layer.0.SelfAttention.q.weight"] =
        meta({4096, 4096});
  t[t5 + "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] = meta({32, 64});
  t[t5 + "encoder.block.0.layer.1.DenseReluDense.wi_0.weight"] = meta({10240, 4096});
  const auto l =
      models::CLIPTextConfig::from_json(models::sd3_clip_config_from_single_file(f, 0), "l");
  const auto g =
      models::CLIPTextConfig::from_json(models::sd3_clip_config_from_single_file(f, 1), "g");
  EXPECT_TRUE(l.with_projection && g.with_projection);
  EXPECT_EQ(std::tuple(l.hidden_size, l.num_hidden_layers, l.num_attention_heads,
                       l.intermediate_size, l.projection_dim, l.hidden_act),
            std::tuple(768, 12, 12, 3072, 768, std::string("quick_gelu")));
  EXPECT_EQ(std::tuple(g.hidden_size, g.num_hidden_layers, g.num_attention_heads,
                       g.intermediate_size, g.projection_dim, g.hidden_act),
            std::tuple(1280, 32, 20, 5120, 1280, std::string("gelu")));
  const auto x =
      models::T5EncoderConfig::from_json(models::sd3_t5_config_from_single_file(f), "t5");
  EXPECT_EQ(std::tuple(x.vocab_size, x.d_model, x.d_kv, x.num_heads, x.d_ff, x.num_layers,
                       x.relative_attention_num_buckets, x.feed_forward_proj),
            std::tuple(32128, 4096, 64, 64, 10240, 24, 32, std::string("gated-gelu")));
}

// ---- CogVideoX SAT checkpoints -----------------------------------------------------------------
// CogVideoX checkpoints of the SAT training code (tests/reference/ref_cogvideox_sat.py):
// DeepSpeed's mp_rank_00_model_states.pt of every transformer kind (2B's fixed table, 5B's rotary
// embeddings, I2V's learned table, 1.5's frame-pair patches and ofs embedding), two from SAT's LoRA
// fine-tuning (merged as SAT's merge_lora does, alpha 1 and 8) and a 3d-vae.pt read into diffusers'
// models equal, tensor for tensor, what diffusers' convert_cogvideox_to_diffusers.py makes of them;
// the objects beside the weights are read as inert placeholders, never called; damaged files named.

namespace sat_test {

fs::path sat_dir() { return fs::path(DIFFTRAIN_GOLDEN_DIR) / "cogvideox_sat"; }

using dt::test::error_of;
using dt::test::expect_same;

template <class Config>
Config config_of(const fs::path& folder) {
  return Config::from_json(models::read_model_config(folder), (folder / "config.json").string());
}

}  // namespace sat_test
using namespace sat_test;

// One case, with the activation policy its config names.
template <class Act>
void check_transformer(const std::string& name, const nlohmann::json& c) {
  using Model =
      models::CogVideoXTransformer3DModel<dt::nn::attention::Sdpa<dt::nn::attention::Auto>, Act>;
  const double alpha = c["lora_alpha"].is_null() ? 1.0 : c["lora_alpha"].get<double>();
  auto want = models::from_pretrained<Model>(sat_dir() / name);
  auto got = models::cogvideox_transformer_from_sat<Model>(
      sat_dir() / (name + ".pt"), config_of<models::CogVideoXTransformer3DConfig>(sat_dir() / name),
      alpha);
  if (c["lora_alpha"].is_null()) {
    expect_same(got, want, name);
  } else {  // merged in float32 as SAT merges, in another order of the same sums
    const auto a = dt::nn::module_tensors(*got);
    for (const auto& [key, t] : dt::nn::module_tensors(*want))
      EXPECT_TRUE(at::allclose(a.at(key), t, 1e-5, 1e-6)) << key;
  }
}

TEST(SingleFileSat, TransformersAndVaeEqualDiffusersConversion) {
  const auto& index = dt::test::golden("cogvideox_sat/index.json");
  ASSERT_GE(index["transformers"].size(), 7U);
  for (const auto& c : index["transformers"]) {
    const std::string name = c["name"].get<std::string>();
    SCOPED_TRACE(name);
    const std::string act = models::read_model_config(sat_dir() / name)
                                .value("activation_fn", std::string("gelu-approximate"));
    if (act == "gelu" || act == "geglu")
      check_transformer<dt::nn::activation::GELU>(name, c);
    else
      check_transformer<dt::nn::activation::GELUTanh>(name, c);
  }
  auto want = models::from_pretrained<models::AutoencoderKLCogVideoX<>>(sat_dir() / "vae_4_levels");
  auto got = models::cogvideox_vae_from_sat(
      sat_dir() / "vae_4_levels.pt",
      config_of<models::AutoencoderKLCogVideoXConfig>(sat_dir() / "vae_4_levels"));
  expect_same(got, want, "vae_4_levels");
}

// DeepSpeed's file holds an argparse.Namespace, numpy's and Python's random states and a set: the
// weights-only reading refuses it as torch.load(weights_only=True) does; the checkpoint reading
// keeps them as inert placeholders and the counters and weights as they are.
TEST(SingleFileSat, ObjectsBesideTheWeightsAreInert) {
  const fs::path file = sat_dir() / "cogvideox_sincos.pt";
  const std::string refused =
      error_of<dt::FormatError>([&] { (void)dt::io::load_torch_file(file); });
  EXPECT_NE(refused.find("calls the Python global"), std::string::npos) << refused;
  const auto root = dt::io::load_torch_file(file, dt::io::ObjectPolicy::inert);
  ASSERT_TRUE(root.contains("args"));
  EXPECT_EQ(root.at("args").ivalue().toStringRef(), std::string("\x02") + "argparse.Namespace");
  EXPECT_EQ(root.at("global_steps").ivalue().toInt(), 1000);
  EXPECT_EQ(root.at("ds_version").ivalue().toStringRef(), "0.14.4");
  EXPECT_TRUE(root.at("module").is_dict());
  const auto sd = models::read_sat_state_dict(file);
  EXPECT_EQ(sd.size(),
            dt::test::golden("cogvideox_sat/index.json")["transformers"][0]["sat_tensors"]
                .get<std::size_t>());
  // The fuzz corpus' hostile pickles: nothing is called (the call to print is a placeholder
  // holding no weights) and the bounds hold in this mode too.
  const fs::path dir = fs::temp_directory_path() / ("difftrain-sat-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  for (const auto& [name, why] : {std::pair{"python_global", "holds no tensors"},
                                  std::pair{"dag_dicts", "expands to more than 4194304 values"}}) {
    fs::copy_file(fs::path(DIFFTRAIN_FUZZ_CORPUS_DIR) / "torch_file" / name, dir / "bad.pt",
                  fs::copy_options::overwrite_existing);
    const std::string msg =
        error_of<dt::FormatError>([&] { (void)models::read_sat_state_dict(dir / "bad.pt"); });
    EXPECT_NE(msg.find(why), std::string::npos) << name << ": " << msg;
  }
  dt::io::remove_tree(dir);
}

TEST(SingleFileSat, DamagedCheckpointsAreNamed) {
  const std::string where = "test.pt";
  const auto lora = models::read_sat_state_dict(sat_dir() / "cogvideox_sincos_lora.pt");
  const std::string qkv = "model.diffusion_model.transformer.layers.0.attention.query_key_value.";
  auto convert = [&](std::map<std::string, at::Tensor> sd) {
    return error_of<dt::FormatError>(
        [&] { (void)models::cogvideox_transformer_tensors_from_sat(std::move(sd), where); });
  };
  {  // half of a LoRA pair
    auto sd = lora;
    sd.erase(qkv + "matrix_B.1");
    EXPECT_NE(convert(sd).find("matrix_A.1 without its matrix_B"), std::string::npos);
  }
  {  // LoRA matrices without the layer's weight
    auto sd = lora;
    sd.erase(qkv + "original.weight");
    EXPECT_NE(convert(sd).find("without the layer's original weight"), std::string::npos);
  }
  {  // a LoRA matrix of the wrong rank
    auto sd = lora;
    sd[qkv + "matrix_A.2"] = at::zeros({5, sd[qkv + "matrix_A.2"].size(1)});
    EXPECT_NE(convert(sd).find("do not fit its weight"), std::string::npos);
  }
  const auto plain = models::read_sat_state_dict(sat_dir() / "cogvideox_sincos.pt");
  {  // q, k and v of unequal rows
    auto sd = plain;
    sd[qkv + "weight"] = sd[qkv + "weight"].narrow(0, 0, sd[qkv + "weight"].size(0) - 1);
    EXPECT_NE(convert(sd).find("is not q, k and v"), std::string::npos);
  }
  {  // a modulation that is not 12 chunks
    auto sd = plain;
    const std::string key = "model.diffusion_model.mixins.adaln_layer.adaLN_modulations.0.1.bias";
    sd[key] = at::zeros({sd[key].size(0) + 1});
    EXPECT_NE(convert(sd).find("is not 12 chunks"), std::string::npos);
  }
  // Not a transformer checkpoint (the VAE's), and a transformer of another config.
  const std::string vae = error_of<dt::FormatError>([&] {
    (void)models::cogvideox_transformer_from_sat(
        sat_dir() / "vae_4_levels.pt",
        config_of<models::CogVideoXTransformer3DConfig>(sat_dir() / "cogvideox_sincos"));
  });
  EXPECT_NE(vae.find("not a SAT CogVideoX transformer"), std::string::npos) << vae;
  const std::string other = error_of<dt::FormatError>([&] {
    (void)models::cogvideox_transformer_from_sat(
        sat_dir() / "cogvideox_rotary.pt",
        config_of<models::CogVideoXTransformer3DConfig>(sat_dir() / "cogvideox_sincos"));
  });
  EXPECT_NE(other.find("do not fit the model"), std::string::npos) << other;
}
