// The library on a CUDA device: the trainer's Python parity, fp16 with the gradient scaler, bf16,
// a bit-identical resume that restores the CUDA generator, checkpoints moving between devices,
// and diffusers' UNet and VAE against diffusers' golden outputs and gradients. Every case skips
// (and says so) where no GPU is present; scripts/gpu-check.sh runs them on a GPU machine.
//
// cuDNN convolutions and cuBLAS matmuls may use TF32 by default, which is 1e-3-accurate: the
// parity cases turn it off for their duration, as a user comparing against float32 would.
#include <unistd.h>
#include <difftrain/adapters/unet_adapters.hpp>
#include <difftrain/io/remove_tree.hpp>
#include <difftrain/io/safetensors.hpp>
#include <difftrain/models/models.hpp>
#include <difftrain/nn/attention/math.hpp>
#include <difftrain/text/encode_prompt.hpp>
#include <difftrain/train/train.hpp>

#include <ATen/Context.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <filesystem>

#include "golden.hpp"
#include "unet_inputs.hpp"
#include "xy_batch.hpp"

namespace dt = difftrain;
namespace tr = difftrain::train;
namespace models = difftrain::models;
namespace fs = std::filesystem;

namespace {

#define DIFFTRAIN_NEEDS_CUDA() \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device on this machine"

const c10::Device kGpu(c10::kCUDA, 0);

/// Full float32 on the GPU while alive (no TF32 in cuDNN or cuBLAS); restores the settings.
class NoTf32 {
 public:
  NoTf32()
      : cudnn_(at::globalContext().allowTF32CuDNN()),
        cublas_(at::globalContext().allowTF32CuBLAS()) {
    at::globalContext().setAllowTF32CuDNN(false);
    at::globalContext().setAllowTF32CuBLAS(false);
  }
  ~NoTf32() {
    at::globalContext().setAllowTF32CuDNN(cudnn_);
    at::globalContext().setAllowTF32CuBLAS(cublas_);
  }
  NoTf32(const NoTf32&) = delete;
  NoTf32& operator=(const NoTf32&) = delete;

 private:
  bool cudnn_, cublas_;
};

fs::path scratch(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("difftrain-cuda-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  return dir / name;
}

using Batch = difftrain::test::XyBatch;

// The trainer tests' network (fc1 → LayerNorm → SiLU → fc2, MSE), taking batches from the CPU to
// wherever its parameters are, as a user's loss does.
struct NetImpl : torch::nn::Module {
  using Batch = ::Batch;
  explicit NetImpl(double dropout = 0.0) {
    fc1 = register_module("fc1", torch::nn::Linear(6, 16));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({16})));
    fc2 = register_module("fc2", torch::nn::Linear(16, 4));
    drop = register_module("drop", torch::nn::Dropout(dropout));
  }
  at::Tensor forward(const at::Tensor& x) { return fc2(drop(torch::silu(norm(fc1(x))))); }
  at::Tensor loss(const Batch& b) {
    const c10::Device d = fc1->weight.device();
    return torch::mse_loss(forward(b.x.to(d)), b.y.to(d));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Dropout drop{nullptr};
};

struct ParityConfig : tr::DefaultConfig {
  using Schedule = dt::schedule::Cosine;
  using Ema = dt::ema::Ema<dt::ema::WarmupDecay>;
};

template <class Cfg = ParityConfig>
typename tr::Trainer<NetImpl, Cfg>::Options parity_options() {
  typename tr::Trainer<NetImpl, Cfg>::Options o;
  o.optimizer.lr = 3e-3;
  o.optimizer.weight_decay = 1e-2;
  o.schedule = {20, 200, 0.5};
  o.ema.rule.decay = 0.99;
  o.ema.rule.use_ema_warmup = true;
  o.clipping.max_norm = 0.5;
  o.accumulation_steps = 2;
  return o;
}

Batch random_batch(std::int64_t s, std::int64_t m) {
  auto gen = [](std::uint64_t seed) { return at::detail::createCPUGenerator(seed); };
  return {at::randn({8, 6}, gen(static_cast<std::uint64_t>(s * 7 + m))),
          at::randn({8, 4}, gen(static_cast<std::uint64_t>(s * 7 + m + 1000)))};
}

std::vector<at::Tensor> snapshot(torch::nn::Module& m) {
  std::vector<at::Tensor> out;
  for (auto& p : m.parameters()) out.push_back(p.detach().cpu().clone());
  return out;
}

double max_diff(torch::nn::Module& m, const std::map<std::string, at::Tensor>& t,
                const std::string& prefix) {
  double d = 0;
  for (auto& p : m.named_parameters())
    d = std::max(d, (p.value().cpu() - t.at(prefix + p.key())).abs().max().item<double>());
  return d;
}

/// max |a − b| relative to the reference's scale (at least 1).
double scaled_error(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor x = a.detach().cpu().to(at::kDouble), y = b.detach().cpu().to(at::kDouble);
  return (x - y).abs().max().item<double>() / std::max(1.0, y.abs().max().item<double>());
}

fs::path golden_models() { return fs::path(DIFFTRAIN_GOLDEN_DIR) / "models"; }

/// A text encoder's gradient of parameter `key` against the float64 reference `t`: max |got −
/// want| over the reference's scale (at least 1e-3). An attention key's bias adds q·b to every
/// score of a row, which softmax ignores: its gradient is zero (1e-15 in the reference) and what
/// float32 leaves of the cancellation (a few 1e-6 on the GPU) is measured against the layer's
/// key-weight gradient instead.
double text_encoder_grad_error(const std::string& key, const at::Tensor& grad,
                               const std::map<std::string, at::Tensor>& t) {
  const at::Tensor& want = t.at("grad." + key);
  double scale = std::max(want.abs().max().item<double>(), 1e-3);
  const std::string k_bias = "k_proj.bias";
  if (key.ends_with(k_bias))
    scale =
        std::max(scale, t.at("grad." + key.substr(0, key.size() - k_bias.size()) + "k_proj.weight")
                            .abs()
                            .max()
                            .item<double>());
  return (grad.cpu().to(at::kDouble) - want).abs().max().item<double>() / scale;
}

}  // namespace

// The CPU parity test's 200 steps (AdamW with decay groups, cosine warm-up, EMA with warm-up,
// clipping, accumulation) on the GPU end where Python's loop ended on the CPU.
TEST(Cuda, TrainerMatchesThePythonLoopOnTheGpu) {
  DIFFTRAIN_NEEDS_CUDA();
  NoTf32 full_precision;
  const auto ref =
      dt::io::load_safetensors(fs::path(DIFFTRAIN_GOLDEN_DIR) / "trainer_parity.safetensors", true)
          .tensors;
  auto net = std::make_shared<NetImpl>();
  {
    at::NoGradGuard no_grad;
    for (auto& p : net->named_parameters()) p.value().copy_(ref.at("init." + p.key()));
  }
  net->to(kGpu);
  tr::Trainer<NetImpl, ParityConfig> trainer(*net, parity_options());
  const at::Tensor xs = ref.at("xs"), ys = ref.at("ys");
  trainer.fit([&](std::int64_t s, std::int64_t m) { return Batch{xs[s][m], ys[s][m]}; }, 200);
  EXPECT_TRUE(net->fc1->weight.is_cuda());
  EXPECT_LT(max_diff(*net, ref, "final."), 1e-5);
  dt::ema::EmaScope scope(trainer.ema());
  EXPECT_LT(max_diff(*net, ref, "ema."), 1e-5);
}

// Stopped at 30, saved, resumed in a fresh model: the end equals an uninterrupted run bit for bit,
// dropout included (the CUDA generator's state travels in the checkpoint).
TEST(Cuda, AResumedGpuRunWithDropoutEndsBitIdentical) {
  DIFFTRAIN_NEEDS_CUDA();
  auto options = parity_options();
  options.schedule = {10, 60, 0.5};
  auto run = [&](std::int64_t stop, const fs::path& save, const fs::path& load) {
    tr::set_seed(load.empty() ? 5 : 77);
    auto net = std::make_shared<NetImpl>(0.2);
    net->to(kGpu);
    tr::Trainer<NetImpl, ParityConfig> t(*net, options);
    if (!load.empty()) t.load_checkpoint(load);
    t.fit(random_batch, stop);
    if (!save.empty()) t.save_checkpoint(save);
    dt::ema::EmaScope scope(t.ema());
    return std::make_pair(snapshot(*net), t.global_step());
  };
  const auto [want, want_step] = run(60, {}, {});
  const fs::path ckpt = scratch("resume.pt");
  (void)run(30, ckpt, {});
  const auto [got, got_step] = run(60, {}, ckpt);
  EXPECT_EQ(got_step, want_step);
  for (std::size_t i = 0; i < want.size(); ++i) EXPECT_TRUE(at::equal(got[i], want[i])) << i;
}

// A checkpoint written by a GPU run loads into a CPU model (and back): the weights, the
// optimizer moments and the EMA follow the model's device.
TEST(Cuda, CheckpointsMoveBetweenGpuAndCpu) {
  DIFFTRAIN_NEEDS_CUDA();
  const fs::path gpu_ckpt = scratch("gpu.pt"), cpu_ckpt = scratch("cpu.pt");
  tr::set_seed(1);
  auto gpu = std::make_shared<NetImpl>();
  gpu->to(kGpu);
  tr::Trainer<NetImpl, ParityConfig> tg(*gpu, parity_options());
  tg.fit(random_batch, 12);
  tg.save_checkpoint(gpu_ckpt);

  auto cpu = std::make_shared<NetImpl>();
  tr::Trainer<NetImpl, ParityConfig> tc(*cpu, parity_options());
  tc.load_checkpoint(gpu_ckpt);
  EXPECT_FALSE(cpu->fc1->weight.is_cuda());
  const auto g = snapshot(*gpu), c = snapshot(*cpu);
  for (std::size_t i = 0; i < g.size(); ++i) EXPECT_TRUE(at::equal(g[i], c[i])) << i;
  // Both go on for the same steps; float32 on two devices agrees to rounding.
  tg.fit(random_batch, 20);
  tc.fit(random_batch, 20);
  const auto g2 = snapshot(*gpu), c2 = snapshot(*cpu);
  for (std::size_t i = 0; i < g2.size(); ++i)
    EXPECT_LT((g2[i] - c2[i]).abs().max().item<double>(), 1e-4) << i;
  tc.save_checkpoint(cpu_ckpt);
  auto back = std::make_shared<NetImpl>();
  back->to(kGpu);
  tr::Trainer<NetImpl, ParityConfig> tb(*back, parity_options());
  tb.load_checkpoint(cpu_ckpt);
  EXPECT_TRUE(back->fc1->weight.is_cuda());
  EXPECT_EQ(tb.global_step(), 20);
  tb.fit(random_batch, 22);  // the optimizer state it loaded is on the GPU, or this throws
  EXPECT_TRUE(back->fc1->weight.is_cuda());
}

// fp16 autocast with the gradient scaler: the step runs in half precision on the GPU, the
// parameters stay float32, the scale lives on the GPU, an overflow skips the step and halves
// the scale, and the loss goes down.
TEST(Cuda, Fp16WithTheGradScalerTrainsAndSkipsOverflows) {
  DIFFTRAIN_NEEDS_CUDA();
  struct Cfg : ParityConfig {
    using Precision = tr::AutocastFp16;
  };
  tr::set_seed(2);
  auto net = std::make_shared<NetImpl>();
  net->to(kGpu);
  auto o = parity_options<Cfg>();
  o.scaler.init_scale = 65536.0 * 65536.0;  // overflows the half-precision gradients at first
  tr::Trainer<NetImpl, Cfg> trainer(*net, o);
  const Batch fixed = random_batch(0, 0);
  const tr::StepInfo first = trainer.step({fixed, fixed});
  EXPECT_FALSE(first.stepped);
  EXPECT_LT(trainer.scaler().current_scale(), o.scaler.init_scale);
  double loss0 = 0, loss = 0;
  int stepped = 0;
  for (int i = 0; i < 160; ++i) {
    const tr::StepInfo info = trainer.step({fixed, fixed});
    if (i == 0) loss0 = info.loss;
    loss = info.loss;
    stepped += info.stepped ? 1 : 0;
  }
  EXPECT_GT(stepped, 120);
  EXPECT_LT(loss, 0.5 * loss0);
  EXPECT_EQ(net->fc1->weight.scalar_type(), at::kFloat);
  EXPECT_TRUE(std::isfinite(trainer.scaler().current_scale()));
}

TEST(Cuda, Bf16AutocastTrainsOnTheGpu) {
  DIFFTRAIN_NEEDS_CUDA();
  struct Cfg : ParityConfig {
    using Precision = tr::AutocastBf16;
  };
  tr::set_seed(3);
  auto net = std::make_shared<NetImpl>();
  net->to(kGpu);
  tr::Trainer<NetImpl, Cfg> trainer(*net, parity_options<Cfg>());
  const Batch fixed = random_batch(0, 0);
  const double loss0 = trainer.step({fixed, fixed}).loss;
  double loss = loss0;
  for (int i = 0; i < 100; ++i) loss = trainer.step({fixed, fixed}).loss;
  EXPECT_LT(loss, 0.5 * loss0);
  EXPECT_EQ(net->fc1->weight.scalar_type(), at::kFloat);
}

// Every swept UNet and VAE configuration, loaded straight onto the GPU: outputs within 1e-5 and
// every gradient within 1e-4 of diffusers' (computed on the CPU), with every attention backend
// that runs float32 there.
TEST(Cuda, UNetAndVaeMatchDiffusersOnTheGpu) {
  DIFFTRAIN_NEEDS_CUDA();
  NoTf32 full_precision;
  const auto& cases = dt::test::golden("models.json");
  models::LoadOptions lo;
  lo.device = kGpu;
  auto check_unet = [&](auto backend_tag, const nlohmann::json& c) {
    using Backend = decltype(backend_tag);
    const std::string name = c["name"];
    if (c["act_fn"] == "mish") return;  // the SiLU cases cover the device; Mish is elementwise
    SCOPED_TRACE(name);
    const auto t =
        dt::io::load_safetensors(golden_models() / (name + ".io.safetensors"), true).tensors;
    models::LoadOptions l = lo;
    if (!c["variant"].is_null()) l.variant = c["variant"].get<std::string>();
    auto unet =
        models::from_pretrained<models::UNet2DConditionModel<Backend, dt::nn::activation::SiLU>>(
            golden_models() / name, l);
    unet->train();
    const at::Tensor out = unet->forward(
        t.at("input.sample").to(kGpu), t.at("input.timestep").to(kGpu),
        t.at("input.encoder_hidden_states").to(kGpu), dt::test::unet_conditions(t, kGpu));
    EXPECT_TRUE(out.is_cuda());
    const bool masked = dt::test::masks_text(t);
    EXPECT_LE(scaled_error(out, t.at("output")), masked ? 2e-4 : 1e-5) << "output";
    (out * t.at("weight").to(kGpu)).sum().backward();
    for (const auto& p : unet->named_parameters()) {
      ASSERT_TRUE(p.value().grad().defined()) << p.key();
      EXPECT_LE(scaled_error(p.value().grad(), t.at("grad." + p.key())), masked ? 2e-3 : 1e-4)
          << p.key();
    }
  };
  for (const auto& c : cases["unet"]) {
    check_unet(dt::nn::attention::Sdpa<dt::nn::attention::Auto>{}, c);
    check_unet(dt::nn::attention::Math{}, c);
    check_unet(dt::nn::attention::Sdpa<dt::nn::attention::MemEfficient>{}, c);
  }
  for (const auto& c : cases["vae"]) {
    const std::string name = c["name"];
    SCOPED_TRACE(name);
    const auto t =
        dt::io::load_safetensors(golden_models() / (name + ".io.safetensors"), true).tensors;
    auto vae = models::from_pretrained<models::AutoencoderKL<>>(golden_models() / name, lo);
    const auto posterior = vae->encode(t.at("input.x").to(kGpu));
    EXPECT_LE(scaled_error(posterior.mean, t.at("mean")), 1e-5);
    EXPECT_LE(scaled_error(posterior.logvar, t.at("logvar")), 1e-5);
  }
}

// The diffusion transformers on the GPU: DiT, PixArt, SD3.5 (qk norm, dual attention) and
// CogVideoX (rotary embeddings computed on the GPU, the learned table) folders from the parity
// sweep give diffusers' CPU outputs and gradients (SDPA and Math backends), and DiT under bf16
// autocast stays close to them.
TEST(Cuda, DiffusionTransformersMatchDiffusersOnTheGpu) {
  DIFFTRAIN_NEEDS_CUDA();
  NoTf32 full_precision;
  const fs::path dir = fs::path(DIFFTRAIN_GOLDEN_DIR) / "transformers";
  models::LoadOptions lo;
  lo.device = kGpu;
  using Tanh = dt::nn::activation::GELUTanh;
  // PixArt's case masks its caption (one row fully): see masks_text for the looser bound.
  auto check_grads = [](torch::nn::Module& m, const auto& t) {
    const double tolerance = dt::test::masks_text(t) ? 2e-3 : 1e-4;
    for (const auto& p : m.named_parameters()) {
      ASSERT_TRUE(p.value().grad().defined()) << p.key();
      EXPECT_LE(scaled_error(p.value().grad(), t.at("grad." + p.key())), tolerance) << p.key();
    }
  };
  auto check = [&](auto backend_tag) {
    using Backend = decltype(backend_tag);
    {
      const auto t = dt::io::load_safetensors(dir / "dit_tiny.io.safetensors", true).tensors;
      auto dit = models::from_pretrained<models::DiTTransformer2DModel<Backend, Tanh>>(
          dir / "dit_tiny", lo);
      dit->eval();
      const at::Tensor out =
          dit->forward(t.at("input.sample").to(kGpu), t.at("input.timestep").to(kGpu),
                       t.at("input.class_labels").to(kGpu));
      EXPECT_TRUE(out.is_cuda());
      EXPECT_LE(scaled_error(out, t.at("output")), 1e-5) << "DiT output";
      (out * t.at("weight").to(kGpu)).sum().backward();
      check_grads(*dit, t);
      at::Tensor bf16;
      {
        tr::AutocastGuard autocast(c10::kCUDA, at::kBFloat16);
        bf16 = dit->forward(t.at("input.sample").to(kGpu), t.at("input.timestep").to(kGpu),
                            t.at("input.class_labels").to(kGpu));
      }
      EXPECT_LE(scaled_error(bf16.to(at::kFloat), t.at("output")), 5e-2) << "DiT under bf16";
    }
    const auto t =
        dt::io::load_safetensors(dir / "pixart_caption_projection.io.safetensors", true).tensors;
    auto pixart = models::from_pretrained<models::PixArtTransformer2DModel<Backend, Tanh>>(
        dir / "pixart_caption_projection", lo);
    pixart->train();
    models::PixArtConditions cond;
    cond.encoder_attention_mask = t.at("input.encoder_attention_mask").to(kGpu);
    const at::Tensor out =
        pixart->forward(t.at("input.sample").to(kGpu), t.at("input.timestep").to(kGpu),
                        t.at("input.encoder_hidden_states").to(kGpu), cond);
    EXPECT_LE(scaled_error(out, t.at("output")), 1e-5) << "PixArt output";
    (out * t.at("weight").to(kGpu)).sum().backward();
    check_grads(*pixart, t);
    // SD3's joint attention and CogVideoX's rotary embeddings (computed on the GPU).
    {
      const auto s =
          dt::io::load_safetensors(dir / "sd35_qk_norm_dual.io.safetensors", true).tensors;
      auto sd3 = models::from_pretrained<models::SD3Transformer2DModel<Backend>>(
          dir / "sd35_qk_norm_dual", lo);
      sd3->train();
      const at::Tensor y =
          sd3->forward(s.at("input.sample").to(kGpu), s.at("input.encoder_hidden_states").to(kGpu),
                       s.at("input.pooled_projections").to(kGpu), s.at("input.timestep").to(kGpu));
      EXPECT_LE(scaled_error(y, s.at("output")), 1e-5) << "SD3 output";
      (y * s.at("weight").to(kGpu)).sum().backward();
      check_grads(*sd3, s);
    }
    const auto c =
        dt::io::load_safetensors(dir / "cogvideox_rotary_learned.io.safetensors", true).tensors;
    auto cog = models::from_pretrained<models::CogVideoXTransformer3DModel<Backend, Tanh>>(
        dir / "cogvideox_rotary_learned", lo);
    cog->train();
    const at::Tensor v =
        cog->forward(c.at("input.hidden_states").to(kGpu),
                     c.at("input.encoder_hidden_states").to(kGpu), c.at("input.timestep").to(kGpu));
    EXPECT_LE(scaled_error(v, c.at("output")), 1e-5) << "CogVideoX output";
    (v * c.at("weight").to(kGpu)).sum().backward();
    check_grads(*cog, c);
  };
  check(dt::nn::attention::Sdpa<dt::nn::attention::Auto>{});
  check(dt::nn::attention::Math{});
  // CogVideoX's 3-D VAE: 17 frames in 8-frame batches, its causal convolutions carrying frames
  // between them, on the GPU.
  const fs::path vae_dir = fs::path(DIFFTRAIN_GOLDEN_DIR) / "cogvideox_vae";
  const auto v =
      dt::io::load_safetensors(vae_dir / "three_levels_frame_batched.io.safetensors", true).tensors;
  auto vae = models::from_pretrained<models::AutoencoderKLCogVideoX<>>(
      vae_dir / "three_levels_frame_batched", lo);
  vae->train();
  vae->set_frame_batches({8, 2});
  const at::Tensor recon = vae->forward(v.at("input.sample").to(kGpu));
  EXPECT_TRUE(recon.is_cuda());
  EXPECT_LE(scaled_error(recon, v.at("output")), 1e-5) << "CogVideoX VAE output";
  (recon * v.at("weight").to(kGpu)).sum().backward();
  check_grads(*vae, v);
}

// Half precision on the GPU: a UNet loaded as float16 and one run under bf16 autocast stay close
// to the float32 output, flash attention included; gradient checkpointing gives the same
// gradients on the GPU.
TEST(Cuda, HalfPrecisionUNetAndCheckpointingOnTheGpu) {
  DIFFTRAIN_NEEDS_CUDA();
  using Flash = dt::nn::attention::Sdpa<dt::nn::attention::Flash>;
  using Auto = dt::nn::attention::Sdpa<dt::nn::attention::Auto>;
  const fs::path folder = golden_models() / "unet_conv_proj";
  const auto t =
      dt::io::load_safetensors(golden_models() / "unet_conv_proj.io.safetensors", true).tensors;
  const at::Tensor x = t.at("input.sample").to(kGpu), ts = t.at("input.timestep").to(kGpu),
                   ctx = t.at("input.encoder_hidden_states").to(kGpu);
  const at::Tensor want = t.at("output");
  {
    models::LoadOptions lo;
    lo.device = kGpu;
    lo.dtype = at::kHalf;
    auto unet = models::from_pretrained<models::UNet2DConditionModel<Flash>>(folder, lo);
    unet->eval();
    at::NoGradGuard no_grad;
    const at::Tensor out = unet->forward(x.to(at::kHalf), ts, ctx.to(at::kHalf));
    EXPECT_EQ(out.scalar_type(), at::kHalf);
    EXPECT_LE(scaled_error(out, want), 1e-2) << "float16 weights, flash attention";
  }
  {
    models::LoadOptions lo;
    lo.device = kGpu;
    auto unet = models::from_pretrained<models::UNet2DConditionModel<Auto>>(folder, lo);
    unet->eval();
    at::NoGradGuard no_grad;
    tr::AutocastGuard autocast(c10::kCUDA, at::kBFloat16);
    EXPECT_LE(scaled_error(unet->forward(x, ts, ctx), want), 5e-2) << "bf16 autocast";
  }
  NoTf32 full_precision;
  auto grads = [&](bool checkpointing) {
    models::LoadOptions lo;
    lo.device = kGpu;
    auto unet = models::from_pretrained<models::UNet2DConditionModel<Auto>>(folder, lo);
    unet->train();
    unet->set_gradient_checkpointing(checkpointing);
    (unet->forward(x, ts, ctx) * t.at("weight").to(kGpu)).sum().backward();
    std::map<std::string, at::Tensor> g;
    for (const auto& p : unet->named_parameters()) g[p.key()] = p.value().grad().cpu();
    return g;
  };
  const auto plain = grads(false), ckpt = grads(true);
  for (const auto& [name, g] : plain) EXPECT_LE(scaled_error(ckpt.at(name), g), 1e-5) << name;
}

// A LoRA on the GPU UNet trains, and its PEFT file applied to a CPU UNet gives the same output.
TEST(Cuda, UNetLoraTrainsOnTheGpuAndItsFileWorksOnTheCpu) {
  DIFFTRAIN_NEEDS_CUDA();
  namespace ad = difftrain::adapters;
  NoTf32 full_precision;
  const fs::path folder = golden_models() / "unet_conv_proj";
  const auto t =
      dt::io::load_safetensors(golden_models() / "unet_conv_proj.io.safetensors", true).tensors;
  models::LoadOptions lo;
  lo.device = kGpu;
  auto unet = models::from_pretrained<models::UNet2DConditionModel<>>(folder, lo);
  (void)ad::inject_lora(*unet, ad::unet_lora_targets(), {.rank = 4, .alpha = 8.0});
  std::vector<at::Tensor> trainable;
  for (const auto& p : unet->parameters())
    if (p.requires_grad()) {
      EXPECT_TRUE(p.is_cuda());
      trainable.push_back(p);
    }
  ASSERT_FALSE(trainable.empty());
  torch::optim::AdamW opt(trainable, torch::optim::AdamWOptions(1e-2));
  const at::Tensor x = t.at("input.sample").to(kGpu), ts = t.at("input.timestep").to(kGpu),
                   ctx = t.at("input.encoder_hidden_states").to(kGpu);
  const at::Tensor target = at::randn(x.sizes(), x.options());
  double first = 0, last = 0;
  for (int step = 0; step < 8; ++step) {
    opt.zero_grad();
    const at::Tensor loss = (unet->forward(x, ts, ctx) - target).square().mean();
    loss.backward();
    opt.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  EXPECT_LT(last, first);
  unet->eval();
  at::NoGradGuard no_grad;
  const at::Tensor out = unet->forward(x, ts, ctx).cpu();
  const auto keys = ad::unet_lora_keys(ad::LoraLayout::peft);
  const auto file = ad::lora_state_dict(*unet, keys);
  auto cpu = models::from_pretrained<models::UNet2DConditionModel<>>(folder);
  cpu->eval();
  ad::load_lora_state_dict(*cpu, file, keys, {.rank = 4, .alpha = 8.0});
  EXPECT_LE(scaled_error(cpu->forward(t.at("input.sample"), t.at("input.timestep"),
                                      t.at("input.encoder_hidden_states")),
                         out),
            1e-5);
}

// Every EMA engine over GPU parameters (the offloaded one with host shadows, overlapped or not)
// ends where the per-tensor reference on the CPU ends.
TEST(Cuda, EveryEmaEngineOnGpuParametersMatchesTheCpu) {
  DIFFTRAIN_NEEDS_CUDA();
  namespace ema = difftrain::ema;
  tr::set_seed(4);
  auto cpu = std::make_shared<NetImpl>();
  auto run = [&](auto engine_tag, const typename decltype(engine_tag)::type::Options& eo,
                 bool gpu) {
    using Engine = typename decltype(engine_tag)::type;
    auto net = std::make_shared<NetImpl>();
    {
      at::NoGradGuard no_grad;
      for (std::size_t i = 0; i < net->parameters().size(); ++i)
        net->parameters()[i].copy_(cpu->parameters()[i]);
    }
    if (gpu) net->to(kGpu);
    ema::Ema<ema::WarmupDecay, Engine> e(*net, {.decay = 0.9, .use_ema_warmup = true}, eo);
    for (int step = 0; step < 25; ++step) {
      {
        at::NoGradGuard no_grad;
        for (auto& p : net->parameters()) p.mul_(0.97).add_(0.01 * (step + 1));
      }
      e.update();
    }
    ema::EmaScope scope(e);
    return snapshot(*net);
  };
  const auto want = run(std::type_identity<ema::PerTensor>{}, {}, false);
  const std::vector<std::pair<std::string, std::vector<at::Tensor>>> got = {
      {"per_tensor", run(std::type_identity<ema::PerTensor>{}, {}, true)},
      {"multi_tensor", run(std::type_identity<ema::MultiTensor>{}, {}, true)},
      {"offloaded",
       run(std::type_identity<ema::Offloaded>{}, {.pin_memory = true, .overlap = false}, true)},
      {"offloaded_overlapped",
       run(std::type_identity<ema::Offloaded>{}, {.pin_memory = true, .overlap = true}, true)},
  };
  for (const auto& [name, g] : got)
    for (std::size_t i = 0; i < want.size(); ++i)
      EXPECT_LT((g[i] - want[i]).abs().max().item<double>(), 1e-6) << name << " " << i;
}

// CLIP text encoders on the GPU: transformers' outputs and gradients (float32, no TF32) with the
// default SDPA backend and with the math one, diffusers' SD and SDXL encode_prompt, and a bf16
// autocast forward close to float32.
TEST(Cuda, ClipTextEncodersMatchTransformersOnTheGpu) {
  DIFFTRAIN_NEEDS_CUDA();
  NoTf32 full_precision;
  namespace text = difftrain::text;
  const fs::path golden = dt::test::golden_dir();
  models::LoadOptions lo;
  lo.device = kGpu;
  auto check = [&](auto backend_tag, const nlohmann::json& c) {
    using Backend = decltype(backend_tag);
    const std::string name = c["name"];
    SCOPED_TRACE(name + " " + std::string(Backend::name));
    const fs::path dir = golden / "text_encoders" / name;
    const auto t = dt::io::load_safetensors(dir.string() + ".io.safetensors", true).tensors;
    models::LoadOptions l = lo;
    if (!c["variant"].is_null()) l.variant = c["variant"].get<std::string>();
    auto te = models::from_pretrained<models::CLIPTextModel<Backend>>(dir, l);
    te->train();
    std::optional<at::Tensor> mask;
    if (t.contains("attention_mask")) mask = t.at("attention_mask").to(kGpu);
    const auto out = te->forward(t.at("input_ids").to(kGpu), mask, true);
    EXPECT_TRUE(out.last_hidden_state.is_cuda());
    EXPECT_LE(scaled_error(out.last_hidden_state, t.at("last_hidden_state")), 1e-5);
    const auto layers = c["layers"].get<std::size_t>();
    at::Tensor loss = (out.last_hidden_state * t.at("w_last").to(kGpu, at::kFloat)).sum() +
                      (out.hidden_states[layers - 1] * t.at("w_hidden").to(kGpu, at::kFloat)).sum();
    if (c["projection"].get<bool>())
      loss = loss + (out.text_embeds * t.at("w_embeds").to(kGpu, at::kFloat)).sum();
    else
      loss = loss + (out.pooler_output * t.at("w_pooled").to(kGpu, at::kFloat)).sum();
    loss.backward();
    for (const auto& p : te->named_parameters(true)) {
      ASSERT_TRUE(p.value().grad().defined()) << p.key();
      EXPECT_LE(text_encoder_grad_error(p.key(), p.value().grad(), t), 1e-4) << p.key();
    }
  };
  for (const auto& c : dt::test::golden("text_encoders.json")["cases"]) {
    check(dt::nn::attention::Sdpa<dt::nn::attention::Auto>{}, c);
    check(dt::nn::attention::Math{}, c);
  }
  // diffusers' encode_prompt, computed on the GPU.
  const fs::path root = golden / "encode_prompt";
  const auto want = dt::io::load_safetensors(root / "outputs.safetensors", true).tensors;
  auto te1 = models::from_pretrained<models::CLIPTextModel<>>(root / "text_encoder", lo);
  auto te2 = models::from_pretrained<models::CLIPTextModel<>>(root / "text_encoder_2", lo);
  te1->eval();
  te2->eval();
  const auto tok = text::CLIPTokenizer::from_folder(golden / "clip_tokenizer" / "sd15");
  const auto tok2 = text::CLIPTokenizer::from_folder(golden / "clip_tokenizer" / "sd2");
  const auto prompts =
      dt::test::golden("encode_prompt.json")["prompts"].get<std::vector<std::string>>();
  at::NoGradGuard no_grad;
  const auto sd = text::encode_prompt(tok, te1, prompts, {});
  EXPECT_TRUE(sd.prompt_embeds.is_cuda());
  EXPECT_LE(scaled_error(sd.prompt_embeds, want.at("sd_plain.prompt_embeds")), 1e-5);
  EXPECT_LE(scaled_error(sd.negative_prompt_embeds, want.at("sd_plain.negative_prompt_embeds")),
            1e-5);
  const auto xl = text::encode_prompt_sdxl(tok, te1, tok2, te2, prompts, {});
  EXPECT_LE(scaled_error(xl.prompt_embeds, want.at("xl_zero_negative.prompt_embeds")), 1e-5);
  EXPECT_LE(scaled_error(xl.pooled_prompt_embeds, want.at("xl_zero_negative.pooled_prompt_embeds")),
            1e-5);
  {
    tr::AutocastGuard autocast(c10::kCUDA, at::kBFloat16);
    const auto bf = text::encode_prompt(tok, te1, prompts, {});
    EXPECT_LE(scaled_error(bf.prompt_embeds.to(at::kFloat), want.at("sd_plain.prompt_embeds")),
              5e-2);
  }
}

// T5 encoders on the GPU: the tiny configurations' hidden states and gradients equal
// transformers' (float64 on the CPU) with SDPA and math, and a float16 copy (wo kept float32)
// gives SD3's T5 prompt embeddings within half precision.
TEST(Cuda, T5EncodersMatchTransformersOnTheGpu) {
  DIFFTRAIN_NEEDS_CUDA();
  NoTf32 full_precision;
  namespace text = difftrain::text;
  const fs::path golden = dt::test::golden_dir();
  models::LoadOptions lo;
  lo.device = kGpu;
  auto check = [&](auto backend_tag, const nlohmann::json& c) {
    using Backend = decltype(backend_tag);
    const std::string name = c["name"];
    SCOPED_TRACE(name + " " + std::string(Backend::name));
    const fs::path dir = golden / "t5_encoders" / name;
    const auto t = dt::io::load_safetensors(dir.string() + ".io.safetensors", true).tensors;
    models::LoadOptions l = lo;
    if (!c["variant"].is_null()) l.variant = c["variant"].get<std::string>();
    auto te = models::from_pretrained<models::T5EncoderModel<Backend>>(dir, l);
    te->train();
    std::optional<at::Tensor> mask;
    if (t.contains("attention_mask")) mask = t.at("attention_mask").to(kGpu);
    const auto out = te->forward(t.at("input_ids").to(kGpu), mask, true);
    EXPECT_TRUE(out.last_hidden_state.is_cuda());
    at::Tensor loss = at::zeros({}, out.last_hidden_state.options());
    for (std::size_t i = 0; i < out.hidden_states.size(); ++i) {
      const std::string k = std::to_string(i);
      EXPECT_LE(scaled_error(out.hidden_states[i], t.at("hidden_states." + k)), 1e-5) << k;
      loss = loss + (out.hidden_states[i] * t.at("w." + k).to(kGpu, at::kFloat)).sum();
    }
    loss.backward();
    for (const auto& p : te->named_parameters(true)) {
      ASSERT_TRUE(p.value().grad().defined()) << p.key();
      EXPECT_LE(text_encoder_grad_error(p.key(), p.value().grad(), t), 1e-4) << p.key();
    }
  };
  for (const auto& c : dt::test::golden("t5_encoders.json")["cases"]) {
    check(dt::nn::attention::Sdpa<dt::nn::attention::Auto>{}, c);
    check(dt::nn::attention::Math{}, c);
  }
  const fs::path root = golden / "t5_tokenizer";
  const auto want = dt::io::load_safetensors(root / "t5_prompt_embeds.safetensors", true).tensors;
  const auto tok = text::T5Tokenizer::from_folder(root / "t5_both");
  auto t5 = models::from_pretrained<models::T5EncoderModel<>>(root / "t5_prompt_encoder", lo);
  t5->eval();
  const auto prompts =
      dt::test::golden("t5_prompt.json")["prompts"].get<std::vector<std::string>>();
  at::NoGradGuard no_grad;
  const at::Tensor full = text::t5_prompt_embeds(tok, t5, prompts, 256, 2);
  EXPECT_TRUE(full.is_cuda());
  EXPECT_LE(scaled_error(full, want.at("sd3")), 1e-5);
  t5->to(at::kHalf);
  const at::Tensor half = text::t5_prompt_embeds(tok, t5, prompts, 256, 2);
  EXPECT_EQ(half.scalar_type(), at::kHalf);
  EXPECT_LE(scaled_error(half.to(at::kFloat), want.at("sd3")), 2e-2);
}
