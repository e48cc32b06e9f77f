// Attention backends against the Math reference; attention modules and transformer blocks against
// the Python modules of tests/reference/ref_attention.py; gradient checkpointing.
#include <gtest/gtest.h>
#include <difftrain/io/safetensors.hpp>
#include <difftrain/nn/attention/attention.hpp>
#include <difftrain/nn/blocks/blocks.hpp>

#include <filesystem>
#include <nlohmann/json.hpp>

namespace dt = difftrain;
namespace att = difftrain::nn::attention;
namespace blk = difftrain::nn::blocks;

namespace {

struct Case {
  std::int64_t lq, lk, d;
};

enum class MaskKind { none, key_padding, additive, causal };

att::AttentionArgs args_for(MaskKind kind, std::int64_t b, std::int64_t lq, std::int64_t lk,
                            const at::TensorOptions& opt) {
  att::AttentionArgs a;
  if (kind == MaskKind::key_padding) {
    at::Tensor m = at::ones({b, 1, 1, lk}, opt.dtype(at::kBool));
    m.index_put_({0, 0, 0, at::indexing::Slice(lk / 2, at::indexing::None)}, false);
    a.mask = m;
  } else if (kind == MaskKind::additive) {
    a.mask = at::randn({1, 1, lq, lk}, opt);
  } else if (kind == MaskKind::causal) {
    a.is_causal = true;
  }
  return a;
}

template <class Backend>
double max_error_vs_math(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const att::AttentionArgs& a) {
  const at::Tensor ref =
      att::Math::forward(q.to(at::kDouble), k.to(at::kDouble), v.to(at::kDouble), [&] {
        att::AttentionArgs d = a;
        if (d.mask && d.mask->scalar_type() != at::kBool) d.mask = d.mask->to(at::kDouble);
        return d;
      }());
  const at::Tensor got = Backend::forward(q, k, v, a);
  EXPECT_EQ(got.sizes(), ref.sizes());
  return (got.to(at::kDouble) - ref).abs().max().item<double>();
}

template <class Backend>
void expect_agrees_with_math_on_cpu(double tol) {
  at::manual_seed(1);
  const auto opt = at::TensorOptions().dtype(at::kFloat);
  for (const Case c :
       {Case{17, 17, 40}, Case{64, 33, 64}, Case{1, 17, 80}, Case{31, 5, 128}, Case{9, 9, 256}}) {
    for (MaskKind mk :
         {MaskKind::none, MaskKind::key_padding, MaskKind::additive, MaskKind::causal}) {
      if (mk == MaskKind::causal && c.lq > c.lk) continue;  // rows with no key are NaN everywhere
      const at::Tensor q = at::randn({2, 3, c.lq, c.d}, opt), k = at::randn({2, 3, c.lk, c.d}, opt),
                       v = at::randn({2, 3, c.lk, c.d}, opt);
      const att::AttentionArgs a = args_for(mk, 2, c.lq, c.lk, opt);
      EXPECT_LT(max_error_vs_math<Backend>(q, k, v, a), tol)
          << Backend::name << " lq=" << c.lq << " lk=" << c.lk << " d=" << c.d
          << " mask=" << static_cast<int>(mk);
    }
  }
}

std::string config_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const dt::ConfigError& e) {
    return e.what();
  }
  return "(no ConfigError)";
}

}  // namespace

TEST(AttentionBackends, EveryCpuBackendAgreesWithMathInFloat32) {
  expect_agrees_with_math_on_cpu<att::Math>(1e-5);
  expect_agrees_with_math_on_cpu<att::Sdpa<att::Auto>>(1e-5);
  expect_agrees_with_math_on_cpu<att::Sdpa<att::MathKernel>>(1e-5);
  expect_agrees_with_math_on_cpu<att::Sdpa<att::Flash>>(1e-5);
  expect_agrees_with_math_on_cpu<att::Chunked<att::Math, 8>>(1e-5);
  expect_agrees_with_math_on_cpu<att::Chunked<att::Sdpa<att::Flash>, 16>>(1e-5);
  expect_agrees_with_math_on_cpu<
      att::Fallback<att::Sdpa<att::CuDNN>, att::Sdpa<att::MemEfficient>, att::Sdpa<att::Flash>>>(
      1e-5);
}

TEST(AttentionBackends, BFloat16OnCpuAgreesWithinItsPrecision) {
  at::manual_seed(2);
  const auto opt = at::TensorOptions().dtype(at::kBFloat16);
  const at::Tensor q = at::randn({2, 4, 33, 64}, opt), k = at::randn({2, 4, 47, 64}, opt),
                   v = at::randn({2, 4, 47, 64}, opt);
  EXPECT_LT(max_error_vs_math<att::Sdpa<att::Flash>>(q, k, v, {}), 2e-2);
  EXPECT_LT(max_error_vs_math<att::Sdpa<att::MathKernel>>(q, k, v, {}), 2e-2);
  EXPECT_LT((max_error_vs_math<att::Chunked<att::Math, 10>>(q, k, v, {})), 2e-2);
}

TEST(AttentionBackends, GradientsOfTheFusedCpuKernelMatchMath) {
  at::manual_seed(3);
  auto make = [] { return at::randn({1, 2, 13, 40}, at::kDouble).requires_grad_(); };
  const at::Tensor q = make(), k = make(), v = make();
  const at::Tensor w = at::randn({1, 2, 13, 40}, at::kDouble);
  auto grads = [&](auto forward) {
    (forward(q, k, v) * w).sum().backward();
    std::vector<at::Tensor> g{q.grad().clone(), k.grad().clone(), v.grad().clone()};
    for (auto t : {q, k, v}) t.mutable_grad().reset();
    return g;
  };
  const auto ref = grads([](auto& a, auto& b, auto& c) { return att::Math::forward(a, b, c, {}); });
  const auto got = grads([](auto& a, auto& b, auto& c) {
    return att::Chunked<att::Sdpa<att::Flash>, 5>::forward(a, b, c, {});
  });
  for (std::size_t i = 0; i < 3; ++i) EXPECT_TRUE(at::allclose(got[i], ref[i], 1e-9, 1e-10)) << i;
}

TEST(AttentionBackends, AForcedBackendThatCannotRunSaysWhy) {
  const at::Tensor q = at::randn({1, 2, 8, 64}), k = at::randn({1, 2, 8, 64});
  EXPECT_NE(config_error([&] { (void)att::Sdpa<att::MemEfficient>::forward(q, k, k, {}); })
                .find("the sdpa_mem_efficient backend cannot run these inputs: memory-efficient "
                      "attention runs on CUDA only"),
            std::string::npos);
  EXPECT_NE(config_error([&] {
              (void)att::Sdpa<att::CuDNN>::forward(q, k, k, {});
            }).find("cuDNN attention runs on CUDA only"),
            std::string::npos);
  att::AttentionArgs dropout;
  dropout.dropout_p = 0.1;
  EXPECT_NE(config_error([&] {
              (void)att::Sdpa<att::Flash>::forward(q, k, k, dropout);
            }).find("the CPU flash kernel has no dropout"),
            std::string::npos);
  const att::Eligibility e = att::Sdpa<att::CuDNN>::eligibility(q, k, k, {});
  EXPECT_FALSE(e.ok);
  EXPECT_EQ(e.reason, "cuDNN attention runs on CUDA only");
}

TEST(AttentionBackends, FallbackRunsTheFirstEligibleAndSaysWhichAndWhy) {
  using F = att::Fallback<att::Sdpa<att::CuDNN>, att::Sdpa<att::MemEfficient>, att::Math>;
  const at::Tensor q = at::randn({1, 2, 8, 64});
  std::string ran, chosen;
  att::AttentionArgs a;
  a.ran = &ran;
  (void)F::forward(q, q, q, a);
  EXPECT_EQ(ran, "math");
  EXPECT_TRUE(F::choose(q, q, q, {}, &chosen));
  EXPECT_EQ(chosen, "math");
  using None = att::Fallback<att::Sdpa<att::CuDNN>, att::Sdpa<att::MemEfficient>>;
  const att::Eligibility e = None::choose(q, q, q, {});
  EXPECT_FALSE(e.ok);
  EXPECT_NE(e.reason.find("sdpa_cudnn: cuDNN attention runs on CUDA only; sdpa_mem_efficient:"),
            std::string::npos)
      << e.reason;
  EXPECT_NE(config_error([&] {
              (void)None::forward(q, q, q, {});
            }).find("no backend in the fallback list"),
            std::string::npos);
  // Chunked reports the kernel inside it.
  a.ran = &ran;
  (void)att::Chunked<att::Sdpa<att::Flash>, 4>::forward(q, q, q, a);
  EXPECT_EQ(ran, "chunked(sdpa_flash)");
}

TEST(AttentionBackends, WrongShapesAreShapeErrorsNamingBothShapes) {
  const at::Tensor q = at::randn({2, 4, 8, 64});
  auto shape_error = [](const std::function<void()>& f) -> std::string {
    try {
      f();
    } catch (const dt::ShapeError& e) {
      return e.what();
    }
    return "(no ShapeError)";
  };
  const std::string dims = shape_error([&] {
    (void)att::Math::forward(q, at::randn({2, 4, 8, 32}), q, {});
  });
  EXPECT_NE(dims.find("q and k head dims differ: q [2, 4, 8, 64], k [2, 4, 8, 32]"),
            std::string::npos)
      << dims;
  const std::string len = shape_error([&] {
    (void)att::Sdpa<att::Auto>::forward(q, q, at::randn({2, 4, 9, 64}), {});
  });
  EXPECT_NE(len.find("k and v lengths differ: k [2, 4, 8, 64], v [2, 4, 9, 64]"), std::string::npos)
      << len;
  att::AttentionArgs bad_mask;
  bad_mask.mask = at::ones({2, 1, 1, 7}, at::kBool);
  const std::string m = shape_error([&] { (void)att::Math::forward(q, q, q, bad_mask); });
  EXPECT_NE(m.find("mask [2, 1, 1, 7] does not broadcast to (B, H, Lq, Lk) = [2, 4, 8, 8]"),
            std::string::npos)
      << m;
  EXPECT_NE(shape_error([&] {
              (void)att::Math::forward(q.flatten(0, 1), q, q, {});
            }).find("must be (batch"),
            std::string::npos);
}

// ---- modules against the Python reference
// --------------------------------------------------------

namespace {
struct Reference {
  std::map<std::string, at::Tensor> t;
  at::Tensor in(const std::string& n) const { return t.at("in." + n); }
  at::Tensor out() const { return t.at("out.y"); }
};

Reference reference(const std::string& name) {
  auto f = dt::io::load_safetensors(
      std::filesystem::path(DIFFTRAIN_GOLDEN_DIR) / ("attention_" + name + ".safetensors"), true);
  return {std::move(f.tensors)};
}

// Copies "w.<name>" into every parameter and buffer; the sets of names must be equal.
void load_weights(torch::nn::Module& m, const Reference& r) {
  std::set<std::string> expected;
  for (const auto& [k, v] : r.t)
    if (k.rfind("w.", 0) == 0) expected.insert(k.substr(2));
  std::set<std::string> have;
  torch::NoGradGuard no_grad;
  for (auto& p : m.named_parameters()) {
    have.insert(p.key());
    ASSERT_TRUE(expected.contains(p.key())) << "difftrain has " << p.key() << ", Python does not";
    ASSERT_EQ(p.value().sizes(), r.t.at("w." + p.key()).sizes()) << p.key();
    p.value().copy_(r.t.at("w." + p.key()));
  }
  for (auto& b : m.named_buffers()) {
    have.insert(b.key());
    b.value().copy_(r.t.at("w." + b.key()));
  }
  EXPECT_EQ(have, expected);
}

void expect_close(const at::Tensor& got, const at::Tensor& want, double tol = 2e-5) {
  ASSERT_EQ(got.sizes(), want.sizes());
  EXPECT_LT((got - want).abs().max().item<double>(), tol);
}
}  // namespace

TEST(AttentionModules, CrossAttentionMatchesThePythonModule) {
  const Reference r = reference("cross");
  blk::CrossAttention<> m(blk::CrossAttentionOptions{32, 24, 4, 8, 0.0});
  load_weights(*m, r);
  blk::AttentionCall call;
  call.context = r.in("context");
  call.mask = r.in("mask");
  expect_close(m->forward(r.in("x"), call), r.out());
  // The same through other backends.
  blk::CrossAttention<att::Chunked<att::Math, 3>> chunked(
      blk::CrossAttentionOptions{32, 24, 4, 8, 0.0});
  load_weights(*chunked, r);
  expect_close(chunked->forward(r.in("x"), call), r.out());
  EXPECT_EQ(chunked->last_backend(), "chunked(math)");
}

TEST(AttentionModules, AdditionalTokensAndCrossFrameAttentionMatch) {
  const Reference r = reference("self_extra_crossframe");
  blk::CrossAttention<att::Math> m(blk::CrossAttentionOptions{32, std::nullopt, 4, 8, 0.0});
  load_weights(*m, r);
  blk::AttentionCall call;
  call.additional_tokens = r.in("additional_tokens");
  call.n_times_crossframe_attn_in_self = 2;
  expect_close(m->forward(r.in("x"), call), r.out());
  call.n_times_crossframe_attn_in_self = 3;
  EXPECT_THROW((void)m->forward(r.in("x"), call), dt::ShapeError);
}

TEST(AttentionModules, TheContextHookTransformsKeysAndValuesSeparately) {
  const Reference r = reference("cross");
  blk::CrossAttention<att::Math> hooked(blk::CrossAttentionOptions{32, 24, 4, 8, 0.0});
  blk::CrossAttention<att::Math> plain(blk::CrossAttentionOptions{32, 24, 4, 8, 0.0});
  load_weights(*hooked, r);
  load_weights(*plain, r);
  hooked->set_context_hook([](const at::Tensor& c) { return std::pair{c * 2.0, c - 1.0}; });
  const at::Tensor x = r.in("x"), c = r.in("context");
  // Reference computation by hand: keys from 2c, values from c - 1.
  auto heads = [](const at::Tensor& t) {
    return t.view({t.size(0), t.size(1), 4, 8}).transpose(1, 2);
  };
  const at::Tensor attn = att::Math::forward(heads(plain->to_q(x)), heads(plain->to_k(c * 2.0)),
                                             heads(plain->to_v(c - 1.0)), {});
  const at::Tensor want = plain->to_out->forward(attn.transpose(1, 2).reshape({2, 7, 32}));
  blk::AttentionCall call;
  call.context = c;
  expect_close(hooked->forward(x, call), want, 1e-6);
}

TEST(AttentionModules, BadModuleInputsAreShapeErrors) {
  blk::CrossAttention<> m(blk::CrossAttentionOptions{32, 24, 4, 8, 0.0});
  blk::AttentionCall call;
  call.context = at::randn({2, 5, 16});
  EXPECT_THROW((void)m->forward(at::randn({2, 7, 32}), call), dt::ShapeError);
  call.context = at::randn({2, 5, 24});
  call.mask = at::ones({2, 4}, at::kBool);
  EXPECT_THROW((void)m->forward(at::randn({2, 7, 32}), call), dt::ShapeError);
  EXPECT_THROW((void)m->forward(at::randn({2, 7, 31})), dt::ShapeError);
  EXPECT_THROW(blk::CrossAttention<>(blk::CrossAttentionOptions{0, 24, 4, 8, 0.0}),
               dt::ConfigError);
}

TEST(AttentionModules, FeedForwardMatchesWithAndWithoutGlu) {
  for (bool glu : {false, true}) {
    const Reference r = reference(glu ? "ff_glu1" : "ff_glu0");
    blk::FeedForward<> m(blk::FeedForwardOptions{32, std::nullopt, 4.0, glu, 0.0});
    load_weights(*m, r);
    expect_close(m->forward(r.in("x")), r.out());
  }
}

TEST(AttentionModules, LinearAndSpatialSelfAttentionMatch) {
  {
    const Reference r = reference("linear");
    att::LinearAttention m(32, 4, 8);
    load_weights(*m, r);
    expect_close(m->forward(r.in("x")), r.out());
  }
  {
    const Reference r = reference("spatial_self");
    att::SpatialSelfAttention<> m(32);
    load_weights(*m, r);
    expect_close(m->forward(r.in("x")), r.out());
  }
}

TEST(AttentionModules, SpatialTransformerMatchesWithConvAndLinearProjections) {
  for (bool linear : {false, true}) {
    const Reference r = reference(linear ? "spatial_linear1" : "spatial_linear0");
    blk::SpatialTransformerOptions o;
    o.in_channels = 32;
    o.n_heads = 2;
    o.d_head = 16;
    o.depth = 2;
    o.context_dim = {24};
    o.use_linear = linear;
    blk::SpatialTransformer<> m(o);
    load_weights(*m, r);
    expect_close(m->forward(r.in("x"), r.in("context")), r.out(), 5e-5);
  }
  blk::SpatialTransformerOptions o;
  o.in_channels = 32;
  o.depth = 3;
  o.context_dim = {24, 16};
  EXPECT_THROW(blk::SpatialTransformer<>{o}, dt::ConfigError);
  o.depth = 2;
  o.context_dim = {24};
  blk::SpatialTransformer<> fresh(o);
  const at::Tensor x = at::randn({1, 32, 2, 2});
  EXPECT_TRUE(at::equal(fresh->forward(x, at::randn({1, 3, 24})), x));  // proj_out starts at zero
}

TEST(TransformerBlock, ForwardAndGradientsMatchPythonWithAndWithoutCheckpointing) {
  const Reference r = reference("block");
  for (bool ckpt : {false, true}) {
    SCOPED_TRACE(ckpt ? "checkpointed" : "plain");
    blk::TransformerBlockOptions o;
    o.dim = 32;
    o.n_heads = 4;
    o.d_head = 8;
    o.context_dim = 24;
    o.checkpoint = ckpt;
    blk::BasicTransformerBlock<> m(o);
    load_weights(*m, r);
    const at::Tensor x = r.in("x").clone().requires_grad_();
    const at::Tensor y = m->forward(x, r.in("context"));
    expect_close(y, r.out());
    (y * r.t.at("grad.weight")).sum().backward();
    expect_close(x.grad(), r.t.at("grad.x"), 5e-5);
    for (auto& p : m->named_parameters())
      expect_close(p.value().grad(), r.t.at("grad.p." + p.key()), 5e-5);
  }
}

TEST(TransformerBlock, CheckpointingReplaysDropoutSoGradientsAreEqual) {
  blk::TransformerBlockOptions o;
  o.dim = 32;
  o.n_heads = 4;
  o.d_head = 8;
  o.dropout = 0.3;
  o.context_dim = 16;
  at::manual_seed(4);
  blk::BasicTransformerBlock<att::Math> m(o);
  m->train();
  const at::Tensor x0 = at::randn({2, 6, 32}), ctx = at::randn({2, 3, 16}),
                   w = at::randn({2, 6, 32});
  auto run = [&](bool ckpt) {
    m->set_checkpointing(ckpt);
    m->zero_grad();
    const at::Tensor x = x0.clone().requires_grad_();
    at::manual_seed(99);
    const at::Tensor y = m->forward(x, ctx);
    at::manual_seed(12345);  // backward must not depend on the generator's state by then
    (y * w).sum().backward();
    std::vector<at::Tensor> g{y.detach(), x.grad()};
    for (auto& p : m->parameters()) g.push_back(p.grad().clone());
    return g;
  };
  const auto plain = run(false), ckpt = run(true);
  ASSERT_EQ(plain.size(), ckpt.size());
  for (std::size_t i = 0; i < plain.size(); ++i)
    EXPECT_TRUE(at::allclose(plain[i], ckpt[i], 1e-6, 1e-7)) << i;
}

TEST(TransformerBlock, CheckpointGivesParameterGradientsWhenInputsNeedNone) {
  torch::nn::Linear lin(4, 4);
  const at::Tensor x = at::randn({3, 4});  // no grad: like the first block of a network
  const at::Tensor y = dt::nn::checkpoint(
      [&](const std::vector<at::Tensor>& in) { return lin->forward(in[0]).tanh(); }, {x},
      lin->parameters(), true);
  EXPECT_TRUE(y.requires_grad());
  y.sum().backward();
  const at::Tensor got = lin->weight.grad().clone();
  lin->zero_grad();
  lin->forward(x).tanh().sum().backward();
  EXPECT_TRUE(at::allclose(got, lin->weight.grad()));
}

// ---- CUDA: each forced kernel in half precision against Math
// ---------------------------------------

TEST(AttentionBackendsCuda, ForcedKernelsAgreeWithMathInHalfPrecision) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(5);
  for (at::ScalarType dtype : {at::kHalf, at::kBFloat16}) {
    const double tol = dtype == at::kHalf ? 4e-3 : 3e-2;
    const auto opt = at::TensorOptions().device(at::kCUDA).dtype(dtype);
    for (const Case c : {Case{128, 128, 64}, Case{77, 129, 128}, Case{256, 256, 40},
                         Case{64, 64, 80}, Case{64, 33, 256}}) {
      for (MaskKind mk : {MaskKind::none, MaskKind::key_padding, MaskKind::causal}) {
        // Kernels differ on how a causal mask aligns when lengths differ; compare equal lengths.
        if (mk == MaskKind::causal && c.lq != c.lk) continue;
        const at::Tensor q = at::randn({2, 4, c.lq, c.d}, opt),
                         k = at::randn({2, 4, c.lk, c.d}, opt),
                         v = at::randn({2, 4, c.lk, c.d}, opt);
        const att::AttentionArgs a = args_for(mk, 2, c.lq, c.lk, opt);
        auto check = [&](auto backend_tag, const char* n) {
          using B = decltype(backend_tag);
          const att::Eligibility e = B::eligibility(q, k, v, a);
          if (!e) {
            EXPECT_THROW((void)B::forward(q, k, v, a), dt::ConfigError) << n;
            return;
          }
          EXPECT_LT(max_error_vs_math<B>(q, k, v, a), tol)
              << n << " " << c10::toString(dtype) << " lq=" << c.lq << " lk=" << c.lk
              << " d=" << c.d << " mask=" << static_cast<int>(mk);
        };
        check(att::Sdpa<att::Flash>{}, "flash");
        check(att::Sdpa<att::MemEfficient>{}, "mem_efficient");
        check(att::Sdpa<att::CuDNN>{}, "cudnn");
        check(att::Sdpa<att::Auto>{}, "auto");
        check(att::Chunked<att::Sdpa<att::Auto>, 64>{}, "chunked");
      }
    }
  }
}
