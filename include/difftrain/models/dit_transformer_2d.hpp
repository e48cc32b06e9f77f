#pragma once
// diffusers' DiTTransformer2DModel (Peebles & Xie's DiT, class-conditional, adaLN-Zero), built
// from its config.json with diffusers' parameter names:
//
//   pos_embed (PatchEmbed: p×p patches + 2-D sine-cosine positions)
//   transformer_blocks.N: norm1 (AdaLayerNormZero: its own timestep + class embedding `emb`,
//     `linear` → shift, scale, gate for attention and for the MLP), attn1 (self-attention),
//     norm3, ff (FeedForward)
//   norm_out, proj_out_1 (shift and scale from block 0's embedding), proj_out_2 → unpatchify.
//
// Each block owns a timestep and class embedding, as diffusers builds it (DiT-XL/2 has 749,826,464
// parameters there, not the paper's 675 M); the sinusoidal projection they share is computed once
// per call. Folders the hub still labels `Transformer2DModel` (diffusers' legacy class, remapped
// for norm_type "ada_norm_zero") load too.
//
// Label dropout for classifier-free guidance happens inside the model in training mode, as in
// diffusers (probability 0.1; label `num_embeds_ada_norm` is the null class). diffusers draws a
// separate dropout in every block's embedding, so one sample can be conditional in one block and
// unconditional in the next; difftrain draws once per call and every block sees the same labels
// (docs/parity.md).

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/models/adaln.hpp"
#include "difftrain/models/config_reader.hpp"
#include "difftrain/models/embeddings.hpp"
#include "difftrain/models/feed_forward.hpp"
#include "difftrain/models/patch_embed.hpp"
#include "difftrain/models/patched_transformer_config.hpp"
#include "difftrain/nn/activation/elementwise.hpp"
#include "difftrain/nn/attention/concepts.hpp"
#include "difftrain/nn/attention/sdpa.hpp"
#include "difftrain/nn/blocks/checkpoint.hpp"
#include "difftrain/nn/blocks/cross_attention.hpp"
#include "difftrain/nn/unit_scope.hpp"

namespace difftrain::models {

struct DiTTransformer2DConfig {
  static constexpr std::string_view class_name = "DiTTransformer2DModel";

  std::int64_t num_attention_heads = 16;
  std::int64_t attention_head_dim = 72;
  std::int64_t in_channels = 4;
  std::optional<std::int64_t> out_channels;  // none: in_channels (2·in_channels is learned sigma)
  std::int64_t num_layers = 28;
  double dropout = 0.0;
  std::int64_t norm_num_groups = 32;  // unused by DiT's layers (diffusers keeps it in the config)
  bool attention_bias = true;
  std::int64_t sample_size = 32;
  std::int64_t patch_size = 2;
  std::string activation_fn = "gelu-approximate";
  std::int64_t num_embeds_ada_norm = 1000;
  bool upcast_attention = false;  // no effect with scaled-dot-product attention, as in diffusers
  bool norm_elementwise_affine = false;
  double norm_eps = 1e-5;
  /// diffusers' CombinedTimestepLabelEmbeddings fixes it at 0.1 (not a config field); it also
  /// gives the class table its null row.
  static constexpr double class_dropout_prob = 0.1;

  [[nodiscard]] std::int64_t inner_dim() const { return num_attention_heads * attention_head_dim; }
  [[nodiscard]] std::int64_t out() const { return out_channels.value_or(in_channels); }

  /// Checks every size before anything is built.
  void validate(const std::string& where) const {
    validate_patched_transformer(*this, where);
    check_config_range("num_embeds_ada_norm", num_embeds_ada_norm, 1, ConfigLimits::classes, where);
  }

  /// A folder's `_class_name` this config reads: its own, or diffusers' legacy Transformer2DModel
  /// with the adaLN-Zero norm (which diffusers remaps to DiT).
  static bool reads_class(const std::string& name, const nlohmann::json& j) {
    return reads_transformer_2d_class(class_name, "ada_norm_zero", name, j);
  }

  [[nodiscard]] WeightSignature weight_signature() const {
    WeightSignature s;
    const std::int64_t d = inner_dim();
    s.shapes.push_back({"pos_embed.proj.weight", {d, in_channels, patch_size, patch_size}});
    s.shapes.push_back({"proj_out_2.weight", {patch_size * patch_size * out(), d}});
    s.shapes.push_back({"transformer_blocks.0.norm1.emb.class_embedder.embedding_table.weight",
                        {num_embeds_ada_norm + 1, d}});
    s.counts.push_back({"transformer_blocks.", num_layers});
    return s;
  }

  /// The fields read and written as they are (the others have rules of their own).
  static constexpr auto fields() {
    using C = DiTTransformer2DConfig;
    return std::tuple{config_field("num_attention_heads", &C::num_attention_heads),
                      config_field("attention_head_dim", &C::attention_head_dim),
                      config_field("in_channels", &C::in_channels),
                      config_field("num_layers", &C::num_layers),
                      config_field("dropout", &C::dropout),
                      config_field("norm_num_groups", &C::norm_num_groups),
                      config_field("attention_bias", &C::attention_bias),
                      config_field("sample_size", &C::sample_size),
                      config_field("patch_size", &C::patch_size),
                      config_field("activation_fn", &C::activation_fn),
                      config_field("num_embeds_ada_norm", &C::num_embeds_ada_norm),
                      config_field("upcast_attention", &C::upcast_attention),
                      config_field("norm_elementwise_affine", &C::norm_elementwise_affine),
                      config_field("norm_eps", &C::norm_eps)};
  }

  static DiTTransformer2DConfig from_json(const nlohmann::json& j, const std::string& where) {
    ConfigReader r(j, where);
    DiTTransformer2DConfig c;
    read_fields(r, c, fields());
    c.out_channels = r.optional<std::int64_t>("out_channels");
    r.accept("num_embeds_ada_norm");
    if (j.contains("num_embeds_ada_norm") && j["num_embeds_ada_norm"].is_null())
      throw ConfigError(
          "'num_embeds_ada_norm' = null: the adaLN-Zero norm needs the number of classes", where);
    r.require_default("norm_type", "ada_norm_zero",
                      "diffusers' DiTTransformer2DModel implements only adaLN-Zero");
    // Fields of the legacy Transformer2DModel config, meaningful only at these values for a DiT.
    r.require_default("cross_attention_dim", nullptr, "DiT has no cross-attention");
    r.require_default("num_vector_embeds", nullptr, "DiT takes continuous latents");
    r.require_default("only_cross_attention", false);
    r.require_default("double_self_attention", false);
    r.require_default("attention_type", "default");
    r.require_default("caption_channels", nullptr, "a caption projection is PixArt's");
    r.accept("use_linear_projection");  // no effect on patched inputs
    r.finish();
    c.validate(where);
    return c;
  }

  /// The file from_pretrained read this config from (see ConfigAsRead).
  ConfigAsRead as_read{};

  [[nodiscard]] nlohmann::json to_json() const {
    nlohmann::json j = diffusers_config_json<DiTTransformer2DConfig>();
    write_fields(j, *this, fields());
    j["out_channels"] = out_channels ? nlohmann::json(*out_channels) : nlohmann::json(nullptr);
    j["norm_type"] = "ada_norm_zero";
    return j;
  }
};

/// diffusers' LabelEmbedding: a class table with a null row when labels are dropped for
/// classifier-free guidance (its dropout is drawn by the model, once per call).
class LabelEmbeddingImpl : public torch::nn::Module {
 public:
  LabelEmbeddingImpl(std::int64_t num_classes, std::int64_t hidden_size, double dropout_prob) {
    embedding_table = register_module(
        "embedding_table",
        torch::nn::Embedding(num_classes + (dropout_prob > 0 ? 1 : 0), hidden_size));
  }
  at::Tensor forward(const at::Tensor& labels) { return embedding_table->forward(labels); }
  torch::nn::Embedding embedding_table{nullptr};
};
TORCH_MODULE(LabelEmbedding);

/// diffusers' CombinedTimestepLabelEmbeddings: TimestepEmbedding(256 → D) of the sinusoidal
/// projection (flip_sin_to_cos, shift 1) plus the class embedding.
class CombinedTimestepLabelEmbeddingsImpl : public torch::nn::Module {
 public:
  CombinedTimestepLabelEmbeddingsImpl(std::int64_t num_classes, std::int64_t embedding_dim,
                                      double class_dropout_prob) {
    timestep_embedder =
        register_module("timestep_embedder", adaln_timestep_embedder(embedding_dim));
    class_embedder = register_module(
        "class_embedder", LabelEmbedding(num_classes, embedding_dim, class_dropout_prob));
  }

  /// The sinusoidal projection of timesteps (B,), shared by every block's embedding.
  static at::Tensor project(const at::Tensor& timesteps) {
    return project_timesteps(timesteps, /*downscale_freq_shift=*/1.0);
  }

  /// `projected` from project(), cast to `dtype` as diffusers casts it to the hidden states'.
  at::Tensor forward(const at::Tensor& projected, const at::Tensor& labels, at::ScalarType dtype) {
    return timestep_embedder->forward(projected.to(dtype)) + class_embedder->forward(labels);
  }

  TimestepEmbedding<> timestep_embedder{nullptr};
  LabelEmbedding class_embedder{nullptr};
};
TORCH_MODULE(CombinedTimestepLabelEmbeddings);

/// The modulation of one adaLN-Zero block: the normalised input shifted and scaled for attention,
/// and the gate, shift and scale the rest of the block uses.
struct AdaLayerNormZeroOutput {
  at::Tensor x, gate_msa, shift_mlp, scale_mlp, gate_mlp;
};

/// diffusers' AdaLayerNormZero (with its embedding): linear(silu(emb)) → six chunks; the
/// LayerNorm has no affine parameters and eps 1e-6.
class AdaLayerNormZeroImpl : public torch::nn::Module {
 public:
  AdaLayerNormZeroImpl(std::int64_t embedding_dim, std::int64_t num_embeddings,
                       double class_dropout_prob) {
    emb = register_module(
        "emb", CombinedTimestepLabelEmbeddings(num_embeddings, embedding_dim, class_dropout_prob));
    linear = register_module("linear", torch::nn::Linear(embedding_dim, 6 * embedding_dim));
    norm = register_module("norm", adaln_layer_norm(embedding_dim));
  }

  AdaLayerNormZeroOutput forward(const at::Tensor& x, const at::Tensor& projected,
                                 const at::Tensor& labels) {
    const at::Tensor e =
        linear->forward(at::silu(emb->forward(projected, labels, x.scalar_type())));
    const auto c = e.chunk(6, 1);  // shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp
    return {modulate(norm->forward(x), c[0], c[1]), c[2], c[3], c[4], c[5]};
  }

  CombinedTimestepLabelEmbeddings emb{nullptr};
  torch::nn::Linear linear{nullptr};
  torch::nn::LayerNorm norm{nullptr};
};
TORCH_MODULE(AdaLayerNormZero);

/// diffusers' BasicTransformerBlock with norm_type "ada_norm_zero" and no cross-attention:
/// x + gate_msa · attn1(modulated norm1(x)), then x + gate_mlp · ff(norm3(x)·(1+scale)+shift).
template <nn::attention::AttentionBackend Backend, nn::ElementwiseActivation Act>
class DiTBlockImpl : public torch::nn::Module {
 public:
  DiTBlockImpl(const DiTTransformer2DConfig& c, bool gated_ff) {
    const std::int64_t d = c.inner_dim();
    norm1 = register_module("norm1", AdaLayerNormZero(d, c.num_embeds_ada_norm,
                                                      DiTTransformer2DConfig::class_dropout_prob));
    nn::blocks::CrossAttentionOptions a;
    a.query_dim = d;
    a.heads = c.num_attention_heads;
    a.dim_head = c.attention_head_dim;
    a.dropout = c.dropout;
    a.qkv_bias = c.attention_bias;
    attn1 = register_module("attn1", nn::blocks::CrossAttention<Backend>(a));
    norm3 = register_module("norm3",
                            torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})
                                                     .elementwise_affine(c.norm_elementwise_affine)
                                                     .eps(c.norm_eps)));
    FeedForwardOptions f;
    f.dim = d;
    f.gated = gated_ff;
    f.dropout = c.dropout;
    ff = register_module("ff", FeedForward<Act>(f));
  }

  at::Tensor forward(const at::Tensor& x, const at::Tensor& projected, const at::Tensor& labels) {
    const AdaLayerNormZeroOutput n = norm1->forward(x, projected, labels);
    at::Tensor h = n.gate_msa.unsqueeze(1) * attn1->forward(n.x) + x;
    const at::Tensor m = modulate(norm3->forward(h), n.shift_mlp, n.scale_mlp);
    return n.gate_mlp.unsqueeze(1) * ff->forward(m) + h;
  }

  AdaLayerNormZero norm1{nullptr};
  nn::blocks::CrossAttention<Backend> attn1{nullptr};
  torch::nn::LayerNorm norm3{nullptr};
  FeedForward<Act> ff{nullptr};
};
template <nn::attention::AttentionBackend Backend, nn::ElementwiseActivation Act>
using DiTBlock = torch::nn::ModuleHolder<DiTBlockImpl<Backend, Act>>;

/// The model. `Act` is the feed-forward's activation policy; it must be the one the config's
/// activation_fn names (GELUTanh for "gelu-approximate", every published DiT).
template <nn::attention::AttentionBackend Backend = nn::attention::Sdpa<nn::attention::Auto>,
          nn::ElementwiseActivation Act = nn::activation::GELUTanh>
class DiTTransformer2DModelImpl : public torch::nn::Module {
 public:
  using Config = DiTTransformer2DConfig;

  explicit DiTTransformer2DModelImpl(Config config,
                                     const std::string& where = "DiTTransformer2DModel")
      : c_(std::move(config)) {
    c_.validate(where);
    const bool gated = check_feed_forward_activation<Act>(c_.activation_fn, where);
    const std::int64_t d = c_.inner_dim();
    PatchEmbedOptions pe;
    pe.height = pe.width = c_.sample_size;
    pe.patch_size = c_.patch_size;
    pe.in_channels = c_.in_channels;
    pe.embed_dim = d;
    pos_embed = register_module("pos_embed", PatchEmbed(pe));
    transformer_blocks = register_module("transformer_blocks", torch::nn::ModuleList());
    for (std::int64_t i = 0; i < c_.num_layers; ++i) {
      blocks_.push_back(DiTBlock<Backend, Act>(c_, gated));
      transformer_blocks->push_back(blocks_.back());
    }
    norm_out = register_module("norm_out", adaln_layer_norm(d));
    proj_out_1 = register_module("proj_out_1", torch::nn::Linear(d, 2 * d));
    proj_out_2 = register_module("proj_out_2",
                                 torch::nn::Linear(d, c_.patch_size * c_.patch_size * c_.out()));
  }

  [[nodiscard]] const Config& config() const { return c_; }
  /// The label that means "no class" (classifier-free guidance's unconditional half).
  [[nodiscard]] std::int64_t null_label() const { return c_.num_embeds_ada_norm; }
  /// Label dropout in training mode (diffusers' 0.1); 0 turns it off, for a trainer that drops
  /// labels itself.
  void set_class_dropout_prob(double p) {
    if (!(p >= 0.0 && p <= 1.0))
      throw ConfigError("the label dropout must lie in [0, 1], got " + std::to_string(p),
                        "DiTTransformer2DModel");
    class_dropout_ = p;
  }
  [[nodiscard]] double class_dropout_prob() const { return class_dropout_; }

  /// Gradient checkpointing of every transformer block (diffusers' enable_gradient_checkpointing).
  void set_gradient_checkpointing(bool on) { checkpointing_ = on; }
  [[nodiscard]] bool gradient_checkpointing() const { return checkpointing_; }

  /// The prediction for latents (B, in_channels, H, W) at timesteps (B,) (or one for all) and
  /// class labels (B,) in [0, num_embeds_ada_norm]: (B, out_channels, H, W). H and W must be
  /// multiples of the patch size; unlike diffusers, H ≠ W is allowed.
  at::Tensor forward(const at::Tensor& sample, const at::Tensor& timestep,
                     const at::Tensor& class_labels) {
    const std::string where = "DiTTransformer2DModel";
    const auto [h, w] = patch_grid(sample, c_.in_channels, c_.patch_size, where);
    const std::int64_t b = sample.size(0);
    const at::Tensor t = batch_timesteps(timestep, b, sample.device(), where);
    at::Tensor labels = checked_labels(class_labels, b, sample.device(), where);
    if (is_training() && class_dropout_ > 0.0) {
      const at::Tensor drop =
          at::rand({b}, at::TensorOptions().device(labels.device())) < class_dropout_;
      labels = at::where(drop, at::full_like(labels, c_.num_embeds_ada_norm), labels);
    }
    at::Tensor x = pos_embed->forward(sample);
    const at::Tensor projected = CombinedTimestepLabelEmbeddingsImpl::project(t);
    for (auto& block : blocks_) {
      // By value: a checkpointed block replays this in backward, after forward has returned.
      auto body = [impl = block.ptr(), projected, labels](const std::vector<at::Tensor>& in) {
        return impl->forward(in[0], projected, labels);
      };
      x = nn::in_unit(*block, [&] {
        return checkpointing_ && is_training() ? nn::checkpoint(body, {x}, block->parameters())
                                               : body({x});
      });
    }
    // diffusers takes the final modulation from the first block's embedding: its unit again.
    const at::Tensor cond = nn::in_unit(*blocks_.front(), [&] {
      return blocks_.front()->norm1->emb->forward(projected, labels, x.scalar_type());
    });
    const auto ss = proj_out_1->forward(at::silu(cond)).chunk(2, 1);
    x = modulate(norm_out->forward(x), ss[0], ss[1]);
    x = proj_out_2->forward(x);
    return unpatchify(x, h, w, c_.patch_size, c_.out());
  }

  PatchEmbed pos_embed{nullptr};
  torch::nn::ModuleList transformer_blocks{nullptr};
  torch::nn::LayerNorm norm_out{nullptr};
  torch::nn::Linear proj_out_1{nullptr}, proj_out_2{nullptr};

  [[nodiscard]] const std::vector<DiTBlock<Backend, Act>>& blocks() const { return blocks_; }

 private:
  at::Tensor checked_labels(const at::Tensor& labels, std::int64_t b, at::Device device,
                            const std::string& where) const {
    if (!labels.defined())
      throw ShapeError("DiT is class-conditional: pass class_labels (B,), " +
                           std::to_string(c_.num_embeds_ada_norm) + " for no class",
                       where);
    if (labels.dim() != 1 || labels.size(0) != b)
      throw ShapeError("class_labels must be (B,) = (" + std::to_string(b) + ",), got " +
                           c10::str(labels.sizes()),
                       where);
    if (at::isFloatingType(labels.scalar_type()) || labels.scalar_type() == at::kBool)
      throw ShapeError("class_labels must be integer labels, got " +
                           std::string(c10::toString(labels.scalar_type())),
                       where);
    // On the CPU a bad label is a typed error here; on CUDA the embedding's device-side assert
    // stops it without a host sync every call.
    if (labels.device().is_cpu() && labels.numel() > 0) {
      const auto lo = labels.min().item<std::int64_t>(), hi = labels.max().item<std::int64_t>();
      if (lo < 0 || hi > c_.num_embeds_ada_norm)
        throw ShapeError("class_labels must lie in [0, " + std::to_string(c_.num_embeds_ada_norm) +
                             "] (the last is the null class), got " + std::to_string(lo) + " … " +
                             std::to_string(hi),
                         where);
    }
    return labels.to(device, at::kLong);
  }

  Config c_;
  std::vector<DiTBlock<Backend, Act>> blocks_;
  double class_dropout_ = Config::class_dropout_prob;
  bool checkpointing_ = false;
};

template <nn::attention::AttentionBackend Backend = nn::attention::Sdpa<nn::attention::Auto>,
          nn::ElementwiseActivation Act = nn::activation::GELUTanh>
using DiTTransformer2DModel = torch::nn::ModuleHolder<DiTTransformer2DModelImpl<Backend, Act>>;

}  // namespace difftrain::models
