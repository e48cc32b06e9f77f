// Model configs written as diffusers and transformers write them. Every model folder the reference
// scripts made (every class difftrain reads, 43 configurations) is loaded, fine-tuned (every weight
// moved) and saved: the saved config.json is the file that was read, key for key and type for
// type, so a fine-tune's config equals its base's. A config built in code, or changed after
// reading, is written from its fields with diffusers' types: one value where diffusers' signature
// takes an int or a list and every block has the same, integers where diffusers writes integers.
// tests/reference/check_cpp_models.py reads the saved folders with diffusers and transformers
// (DIFFTRAIN_MODELS_OUT) and runs ControlNetModel.from_unet on a UNet built in code.
#include <unistd.h>
#include <difftrain/io/json_file.hpp>
#include <difftrain/io/remove_tree.hpp>
#include <difftrain/models/models.hpp>

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>

namespace dt = difftrain;
namespace fs = std::filesystem;
namespace models = difftrain::models;
namespace act = difftrain::nn::activation;

namespace {

using Backend = dt::nn::attention::Sdpa<dt::nn::attention::Auto>;

fs::path golden() { return fs::path(DIFFTRAIN_GOLDEN_DIR); }

fs::path scratch(const std::string& name) {
  const fs::path dir =
      fs::temp_directory_path() / ("difftrain-configs-" + name + "-" + std::to_string(::getpid()));
  dt::io::remove_tree(dir);
  fs::create_directories(dir);
  return dir;
}

/// The variant a folder's weights need: "fp16" when it holds only fp16 files.
models::LoadOptions load_options(const fs::path& folder) {
  bool plain = false, half = false;
  for (const auto& e : fs::directory_iterator(folder)) {
    const std::string n = e.path().filename().string();
    if (n.ends_with(".safetensors") || n.ends_with(".json")) {
      if (n.find(".fp16.") != std::string::npos)
        half = true;
      else if (n != "config.json")
        plain = true;
    }
  }
  models::LoadOptions o;
  if (half && !plain) o.variant = "fp16";
  return o;
}

/// Loads `from` as the first of `Holders` that builds it (they differ in the activation the
/// config names), moves every weight, saves to `to`. The error of the last when none does.
template <class... Holders>
void fine_tune_and_save(const fs::path& from, const fs::path& to) {
  std::string refused;
  bool saved = false;
  auto attempt = [&]<class Holder>() {
    if (saved) return;
    std::optional<Holder> m;
    try {
      m.emplace(models::from_pretrained<Holder>(from, load_options(from)));
    } catch (const dt::ConfigError& e) {
      refused = e.what();
      return;
    }
    {
      at::NoGradGuard no_grad;
      for (auto& p : (*m)->parameters()) p.add_(0.01);
    }
    models::save_pretrained(*m, to);
    saved = true;
  };
  (attempt.template operator()<Holders>(), ...);
  ASSERT_TRUE(saved) << from << ": " << refused;
}

/// The class a folder's config names: diffusers' `_class_name`, or transformers' architecture.
std::string class_of(const nlohmann::json& j) {
  if (j.contains("_class_name")) return j["_class_name"].get<std::string>();
  if (j.contains("architectures") && j["architectures"].is_array() && !j["architectures"].empty())
    return j["architectures"][0].get<std::string>();
  return "";
}

}  // namespace

TEST(ModelConfigs, AFineTuneKeepsTheConfigFileItWasReadFrom) {
  const char* out_env = std::getenv("DIFFTRAIN_MODELS_OUT");
  const fs::path out = out_env ? fs::path(out_env) / "configs" : scratch("fine-tuned");
  std::map<std::string, int> per_class;
  nlohmann::json listing = nlohmann::json::array();
  for (const auto& e : fs::recursive_directory_iterator(golden())) {
    if (e.path().filename() != "config.json") continue;
    const fs::path from = e.path().parent_path();
    const nlohmann::json original = dt::io::read_json_object(e.path());
    const std::string cls = class_of(original);
    const std::string rel = fs::relative(from, golden()).string();
    std::string flat = rel;
    for (char& c : flat)
      if (c == '/') c = '-';
    const fs::path to = out / flat;
    SCOPED_TRACE(rel + " (" + cls + ")");
    if (cls == "UNet2DConditionModel")
      fine_tune_and_save<models::UNet2DConditionModel<>,
                         models::UNet2DConditionModel<Backend, act::Mish>>(from, to);
    else if (cls == "AutoencoderKL")
      fine_tune_and_save<models::AutoencoderKL<>, models::AutoencoderKL<Backend, act::Mish>>(from,
                                                                                             to);
    else if (cls == "AutoencoderKLCogVideoX")
      fine_tune_and_save<models::AutoencoderKLCogVideoX<act::SiLU>,
                         models::AutoencoderKLCogVideoX<act::Mish>>(from, to);
    else if (cls == "DiTTransformer2DModel" || cls == "Transformer2DModel" ||
             cls == "PixArtTransformer2DModel") {
      if (cls == "PixArtTransformer2DModel" || original.contains("caption_channels"))
        fine_tune_and_save<models::PixArtTransformer2DModel<Backend, act::GELUTanh>,
                           models::PixArtTransformer2DModel<Backend, act::GELU>,
                           models::PixArtTransformer2DModel<Backend, act::QuickGELU>>(from, to);
      else
        fine_tune_and_save<models::DiTTransformer2DModel<Backend, act::GELUTanh>,
                           models::DiTTransformer2DModel<Backend, act::GELU>,
                           models::DiTTransformer2DModel<Backend, act::QuickGELU>>(from, to);
    } else if (cls == "SD3Transformer2DModel")
      fine_tune_and_save<models::SD3Transformer2DModel<Backend>>(from, to);
    else if (cls == "CogVideoXTransformer3DModel")
      fine_tune_and_save<models::CogVideoXTransformer3DModel<Backend, act::GELUTanh>,
                         models::CogVideoXTransformer3DModel<Backend, act::GELU>>(from, to);
    else if (cls == "CLIPTextModel" || cls == "CLIPTextModelWithProjection")
      fine_tune_and_save<models::CLIPTextModel<Backend>>(from, to);
    else if (cls == "T5EncoderModel")
      fine_tune_and_save<models::T5EncoderModel<Backend>>(from, to);
    else
      continue;  // not a model difftrain builds (a scheduler or tokenizer config)
    if (HasFatalFailure()) return;
    EXPECT_EQ(dt::io::read_json_object(to / "config.json"), original);
    ++per_class[cls];
    listing.push_back({{"original", from.string()}, {"saved", to.string()}});
  }
  // Every class difftrain reads was swept.
  for (const char* cls :
       {"UNet2DConditionModel", "AutoencoderKL", "AutoencoderKLCogVideoX", "SD3Transformer2DModel",
        "CogVideoXTransformer3DModel", "CLIPTextModel", "T5EncoderModel"})
    EXPECT_GT(per_class[cls], 0) << cls;
  EXPECT_GT(per_class["DiTTransformer2DModel"] + per_class["Transformer2DModel"] +
                per_class["PixArtTransformer2DModel"],
            3);
  EXPECT_GE(listing.size(), 35U);
  if (out_env)
    std::ofstream(fs::path(out_env) / "configs.json") << listing.dump();
  else
    dt::io::remove_tree(out);
}

TEST(ModelConfigs, ConfigsBuiltInCodeAreWrittenWithDiffusersTypes) {
  // A UNet as the Fashion-MNIST example builds it: one value per field, filled per block.
  models::UNet2DConditionConfig c;
  c.sample_size = 8;
  c.in_channels = c.out_channels = 4;
  c.block_out_channels = {8, 16};
  c.down_block_types = {"CrossAttnDownBlock2D", "DownBlock2D"};
  c.up_block_types = {"UpBlock2D", "CrossAttnUpBlock2D"};
  c.layers_per_block = {1, 1};
  c.cross_attention_dim = {12, 12};
  c.attention_head_dim = {2, 2};
  c.norm_num_groups = 4;
  c.resolve("test");
  const nlohmann::json j = c.to_json();
  for (const char* key : {"layers_per_block", "cross_attention_dim", "attention_head_dim",
                          "transformer_layers_per_block"})
    EXPECT_TRUE(j[key].is_number_integer()) << key << ": " << j[key];
  EXPECT_TRUE(j["only_cross_attention"].is_boolean());
  EXPECT_TRUE(j["freq_shift"].is_number_integer());
  EXPECT_TRUE(j["mid_block_scale_factor"].is_number_integer());
  // Blocks that differ keep their list.
  models::UNet2DConditionConfig d = c;
  d.attention_head_dim = {2, 4};
  EXPECT_EQ(d.to_json()["attention_head_dim"], nlohmann::json::array({2, 4}));
  // Read back, the config is the one written.
  EXPECT_EQ(models::UNet2DConditionConfig::from_json(j, "test").to_json(), j);

  // A CogVideoX VAE changed after reading is written from its fields: the temporal ratio stays
  // an integer (CogVideoXPipeline computes frame counts with it).
  const fs::path vae_dir = golden() / "cogvideox_vae" / "two_levels_odd_frames";
  auto vae = models::from_pretrained<models::AutoencoderKLCogVideoX<act::SiLU>>(vae_dir);
  auto changed = vae->config();
  changed.scaling_factor = 0.5;
  const nlohmann::json v = models::config_json_to_save(changed);
  EXPECT_TRUE(v["temporal_compression_ratio"].is_number_integer())
      << v["temporal_compression_ratio"];
  EXPECT_EQ(v["scaling_factor"], 0.5);

  if (const char* out_env = std::getenv("DIFFTRAIN_MODELS_OUT")) {
    at::manual_seed(3);
    models::UNet2DConditionModel<> unet(c, "test");
    models::save_pretrained(unet, fs::path(out_env) / "unet_built_in_code");
  }
}
