// CogVideoX checkpoints of the SAT training code (tests/reference/ref_cogvideox_sat.py):
// DeepSpeed's mp_rank_00_model_states.pt of every transformer kind (2B's fixed table, 5B's rotary
// embeddings, I2V's learned table, 1.5's frame-pair patches and ofs embedding), two from SAT's LoRA
// fine-tuning (merged as SAT's merge_lora does, alpha 1 and 8) and a 3d-vae.pt read into diffusers'
// models equal, tensor for tensor, what diffusers' convert_cogvideox_to_diffusers.py makes of them;
// the objects beside the weights are read as inert placeholders, never called; damaged files named.
#include <unistd.h>
#include <difftrain/io/remove_tree.hpp>
#include <difftrain/io/torch_file.hpp>
#include <difftrain/models/models.hpp>
#include <difftrain/models/single_file/cogvideox_sat.hpp>
#include <difftrain/nn/module_tensors.hpp>

#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <string>

#include "golden.hpp"
#include "single_file_checks.hpp"

namespace dt = difftrain;
namespace fs = std::filesystem;
namespace models = difftrain::models;

namespace {

fs::path sat_dir() { return fs::path(DIFFTRAIN_GOLDEN_DIR) / "cogvideox_sat"; }

using dt::test::error_of;
using dt::test::expect_same;

template <class Config>
Config config_of(const fs::path& folder) {
  return Config::from_json(models::read_model_config(folder), (folder / "config.json").string());
}

}  // namespace

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
