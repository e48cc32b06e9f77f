// diffusers' UNet2DConditionModel and AutoencoderKL in difftrain: outputs and every parameter
// gradient equal diffusers' on the same save_pretrained folders (tests/reference/ref_models.py),
// full-size Stable Diffusion configurations have diffusers' parameter names and shapes, folders
// round-trip, and bad folders and configs fail with typed errors naming the file and field.
#include <unistd.h>
#include <difftrain/io/safetensors.hpp>
#include <difftrain/models/models.hpp>

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>

#include "golden.hpp"

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
  fs::remove_all(dir);
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
  std::int64_t count = 0;
  for (const auto& p : unet->parameters()) count += p.numel();
  for (const auto& c : cases) {
    if (c["name"] == name) {
      EXPECT_EQ(count, c["parameters"].get<std::int64_t>());
    }
  }
  models::UNetConditions cond;
  if (t.contains("input.class_labels")) cond.class_labels = t.at("input.class_labels");
  if (t.contains("input.timestep_cond")) cond.timestep_cond = t.at("input.timestep_cond");
  const at::Tensor out = unet->forward(t.at("input.sample"), t.at("input.timestep"),
                                       t.at("input.encoder_hidden_states"), cond);
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
  ASSERT_GE(cases.size(), 4U);
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
