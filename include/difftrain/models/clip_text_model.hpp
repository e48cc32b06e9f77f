#pragma once
// transformers' CLIPTextModel and CLIPTextModelWithProjection, the text encoders of Stable
// Diffusion 1.x (CLIP ViT-L/14), 2.x (OpenCLIP ViT-H/14) and SDXL (both, the second with its
// projection): token + position embeddings, pre-norm transformer layers with causal self-attention
// (through a difftrain attention backend), a final LayerNorm, the pooled output at the end token
// and, with the projection, text_embeds. Parameter names are transformers' ("text_model.encoder.
// layers.N.self_attn.q_proj.weight"), so folders with config.json + model.safetensors load
// strictly; the q/k/v/out and fc1/fc2 projections are adaptable layers that carry LoRA.

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/normalization.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/models/config_reader.hpp"
#include "difftrain/models/transformers_config.hpp"
#include "difftrain/nn/attention/sdpa.hpp"
#include "difftrain/nn/blocks/checkpoint.hpp"
#include "difftrain/nn/layers/adaptable.hpp"

namespace difftrain::models {

struct CLIPTextConfig {
  static constexpr std::string_view class_name = "CLIPTextModel";
  /// transformers' model folder files (not diffusers').
  static constexpr bool transformers_folder = true;

  std::int64_t vocab_size = 49408;
  std::int64_t hidden_size = 512;
  std::int64_t intermediate_size = 2048;
  std::int64_t projection_dim = 512;
  std::int64_t num_hidden_layers = 12;
  std::int64_t num_attention_heads = 8;
  std::int64_t max_position_embeddings = 77;
  std::string hidden_act = "quick_gelu";
  double layer_norm_eps = 1e-5;
  double attention_dropout = 0.0;
  double initializer_range = 0.02;
  double initializer_factor = 1.0;
  std::int64_t pad_token_id = 1;
  std::int64_t bos_token_id = 49406;
  /// 2 in configs written before transformers #24773: the pooled output then sits at the
  /// largest id of each sequence (the end token, when no token was added after it).
  std::int64_t eos_token_id = 49407;
  /// CLIPTextModelWithProjection (SDXL's second encoder): text_projection, text_embeds.
  bool with_projection = false;

  /// Sizes and names checked: a ConfigError names the field.
  void resolve(const std::string& where) const {
    using L = ConfigLimits;
    check_config_range("vocab_size", vocab_size, 1, std::int64_t{1} << 24, where);
    check_config_range("hidden_size", hidden_size, 1, L::channels, where);
    check_config_range("intermediate_size", intermediate_size, 1, 8 * L::channels, where);
    check_config_range("projection_dim", projection_dim, 1, L::channels, where);
    check_config_range("num_hidden_layers", num_hidden_layers, 1, L::layers, where);
    check_config_range("num_attention_heads", num_attention_heads, 1, hidden_size, where);
    check_config_range("max_position_embeddings", max_position_embeddings, 1, 1 << 16, where);
    if (hidden_size % num_attention_heads != 0)
      throw ConfigError(
          "'hidden_size' = " + std::to_string(hidden_size) +
              " is not divisible by 'num_attention_heads' = " + std::to_string(num_attention_heads),
          where);
    if (!(layer_norm_eps > 0.0) || !std::isfinite(layer_norm_eps))
      throw ConfigError("'layer_norm_eps' must be positive", where);
    if (!(attention_dropout >= 0.0 && attention_dropout < 1.0))
      throw ConfigError("'attention_dropout' must be in [0, 1)", where);
    (void)activation(where);
  }

  using Act = HiddenAct;
  /// The activation hidden_act names (transformers' ACT2FN names for those CLIP configs use).
  [[nodiscard]] Act activation(const std::string& where) const {
    return hidden_activation(hidden_act, "hidden_act", "CLIP text model", where);
  }

  static CLIPTextConfig from_json(const nlohmann::json& j, const std::string& where) {
    ConfigReader r(j, where);
    CLIPTextConfig c;
    if (j.contains("architectures") && j["architectures"].is_array())
      for (const auto& a : j["architectures"]) {
        if (a == "CLIPTextModelWithProjection")
          c.with_projection = true;
        else if (a != "CLIPTextModel")
          throw ConfigError("the config is for a " + a.dump() +
                                ", not CLIPTextModel or CLIPTextModelWithProjection",
                            where);
      }
    if (j.contains("model_type") && j["model_type"] != "clip_text_model")
      throw ConfigError("'model_type' = " + j["model_type"].dump() +
                            " is not \"clip_text_model\" (a full CLIP config? pass its "
                            "text_config)",
                        where);
    accept_transformers_common_fields(r);
    c.vocab_size = r.get("vocab_size", c.vocab_size);
    c.hidden_size = r.get("hidden_size", c.hidden_size);
    c.intermediate_size = r.get("intermediate_size", c.intermediate_size);
    c.projection_dim = r.get("projection_dim", c.projection_dim);
    c.num_hidden_layers = r.get("num_hidden_layers", c.num_hidden_layers);
    c.num_attention_heads = r.get("num_attention_heads", c.num_attention_heads);
    c.max_position_embeddings = r.get("max_position_embeddings", c.max_position_embeddings);
    c.hidden_act = r.get("hidden_act", c.hidden_act);
    c.layer_norm_eps = r.get("layer_norm_eps", c.layer_norm_eps);
    c.attention_dropout = r.get("attention_dropout", c.attention_dropout);
    c.initializer_range = r.get("initializer_range", c.initializer_range);
    c.initializer_factor = r.get("initializer_factor", c.initializer_factor);
    c.pad_token_id = r.get("pad_token_id", c.pad_token_id);
    c.bos_token_id = r.get("bos_token_id", c.bos_token_id);
    c.eos_token_id = r.get("eos_token_id", c.eos_token_id);
    r.finish();
    c.resolve(where);
    return c;
  }

  /// The file from_pretrained read this config from (see ConfigAsRead).
  ConfigAsRead as_read{};

  [[nodiscard]] nlohmann::json to_json() const {
    return {{"architectures", {with_projection ? "CLIPTextModelWithProjection" : "CLIPTextModel"}},
            {"model_type", "clip_text_model"},
            {"vocab_size", vocab_size},
            {"hidden_size", hidden_size},
            {"intermediate_size", intermediate_size},
            {"projection_dim", projection_dim},
            {"num_hidden_layers", num_hidden_layers},
            {"num_attention_heads", num_attention_heads},
            {"max_position_embeddings", max_position_embeddings},
            {"hidden_act", hidden_act},
            {"layer_norm_eps", layer_norm_eps},
            {"attention_dropout", attention_dropout},
            {"initializer_range", initializer_range},
            {"initializer_factor", initializer_factor},
            {"pad_token_id", pad_token_id},
            {"bos_token_id", bos_token_id},
            {"eos_token_id", eos_token_id},
            {"dtype", "float32"}};
  }

  /// Weights as the libraries name them, put as this model names them: transformers 4 and the
  /// files in the wild write "text_model." before the text model's names (and the position_ids
  /// buffer, which transformers ignores on load); transformers 5 saves CLIPTextModel without the
  /// prefix. Both load; difftrain saves with it, which both transformers versions read.
  static void adapt_weight_names(std::map<std::string, at::Tensor>& w) {
    w.erase("text_model.embeddings.position_ids");
    w.erase("embeddings.position_ids");
    bool prefixed = false;
    for (const auto& [name, t] : w) prefixed = prefixed || name.starts_with("text_model.");
    if (prefixed) return;
    std::map<std::string, at::Tensor> renamed;
    for (auto& [name, t] : w)
      renamed.emplace(name.starts_with("text_projection.") ? name : "text_model." + name, t);
    w = std::move(renamed);
  }

  /// The names and shapes the weights must have: checked before the model is built.
  [[nodiscard]] WeightSignature weight_signature() const {
    WeightSignature s;
    s.shapes = {
        {"text_model.embeddings.token_embedding.weight", {vocab_size, hidden_size}},
        {"text_model.embeddings.position_embedding.weight", {max_position_embeddings, hidden_size}},
        {"text_model.encoder.layers.0.mlp.fc1.weight", {intermediate_size, hidden_size}},
        {"text_model.final_layer_norm.weight", {hidden_size}}};
    if (with_projection)
      s.shapes.push_back({"text_projection.weight", {projection_dim, hidden_size}});
    s.counts = {{"text_model.encoder.layers.", num_hidden_layers}};
    return s;
  }
};

/// What the text model returns. `hidden_states` holds the embeddings' output and every layer's
/// (num_hidden_layers + 1 entries, before the final LayerNorm) when asked for: the web UI's CLIP
/// skip and SDXL take the penultimate one.
struct CLIPTextOutput {
  at::Tensor last_hidden_state;  ///< (B, L, hidden), after the final LayerNorm
  at::Tensor pooler_output;      ///< (B, hidden): last_hidden_state at the end token
  at::Tensor text_embeds;        ///< (B, projection_dim), CLIPTextModelWithProjection only
  std::vector<at::Tensor> hidden_states;
};

/// One pre-norm layer: x + attn(ln1(x)), then x + mlp(ln2(x)); transformers' CLIPEncoderLayer.
template <nn::attention::AttentionBackend Backend>
class CLIPEncoderLayerImpl : public torch::nn::Module {
 public:
  explicit CLIPEncoderLayerImpl(const CLIPTextConfig& c)
      : heads_(c.num_attention_heads),
        dropout_(c.attention_dropout),
        act_(c.activation("CLIPTextModel")) {
    const std::int64_t d = c.hidden_size;
    using torch::nn::LinearOptions;
    self_attn = register_module("self_attn", std::make_shared<torch::nn::Module>());
    k_proj = self_attn->register_module("k_proj", nn::AdaptableLinear(LinearOptions(d, d)));
    v_proj = self_attn->register_module("v_proj", nn::AdaptableLinear(LinearOptions(d, d)));
    q_proj = self_attn->register_module("q_proj", nn::AdaptableLinear(LinearOptions(d, d)));
    out_proj = self_attn->register_module("out_proj", nn::AdaptableLinear(LinearOptions(d, d)));
    layer_norm1 = register_module(
        "layer_norm1",
        torch::nn::LayerNorm(torch::nn::LayerNormOptions({d}).eps(c.layer_norm_eps)));
    mlp = register_module("mlp", std::make_shared<torch::nn::Module>());
    fc1 = mlp->register_module("fc1", nn::AdaptableLinear(LinearOptions(d, c.intermediate_size)));
    fc2 = mlp->register_module("fc2", nn::AdaptableLinear(LinearOptions(c.intermediate_size, d)));
    layer_norm2 = register_module(
        "layer_norm2",
        torch::nn::LayerNorm(torch::nn::LayerNormOptions({d}).eps(c.layer_norm_eps)));
  }

  /// `mask`: none, or an additive float mask (B, 1, L, L) of the padding; causal always.
  at::Tensor forward(const at::Tensor& x, const std::optional<at::Tensor>& mask) {
    const auto b = x.size(0), l = x.size(1), d = x.size(2);
    const auto hd = d / heads_;
    const at::Tensor h = layer_norm1(x);
    auto split = [&](const at::Tensor& t) { return t.view({b, l, heads_, hd}).transpose(1, 2); };
    nn::attention::AttentionArgs args;
    args.is_causal = !mask.has_value();
    if (mask) args.mask = *mask;  // already holds the causal part
    args.dropout_p = is_training() ? dropout_ : 0.0;
    const at::Tensor a =
        Backend::forward(split(q_proj(h)), split(k_proj(h)), split(v_proj(h)), args)
            .transpose(1, 2)
            .reshape({b, l, d});
    const at::Tensor y = x + out_proj(a);
    return y + fc2(activate(fc1(layer_norm2(y)), act_));
  }

  std::shared_ptr<torch::nn::Module> self_attn, mlp;
  nn::AdaptableLinear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, out_proj{nullptr};
  nn::AdaptableLinear fc1{nullptr}, fc2{nullptr};
  torch::nn::LayerNorm layer_norm1{nullptr}, layer_norm2{nullptr};

 private:
  std::int64_t heads_;
  double dropout_;
  CLIPTextConfig::Act act_;
};

template <nn::attention::AttentionBackend Backend>
using CLIPEncoderLayer = torch::nn::ModuleHolder<CLIPEncoderLayerImpl<Backend>>;

/// CLIPTextModel (or, with config.with_projection, CLIPTextModelWithProjection).
template <nn::attention::AttentionBackend Backend = nn::attention::Sdpa<nn::attention::Auto>>
class CLIPTextModelImpl : public torch::nn::Module {
 public:
  using Config = CLIPTextConfig;

  explicit CLIPTextModelImpl(Config config, const std::string& where = "CLIPTextModel")
      : c_(std::move(config)) {
    c_.resolve(where);
    const std::int64_t d = c_.hidden_size;
    text_model = register_module("text_model", std::make_shared<torch::nn::Module>());
    auto embeddings =
        text_model->register_module("embeddings", std::make_shared<torch::nn::Module>());
    token_embedding =
        embeddings->register_module("token_embedding", torch::nn::Embedding(c_.vocab_size, d));
    position_embedding = embeddings->register_module(
        "position_embedding", torch::nn::Embedding(c_.max_position_embeddings, d));
    auto encoder = text_model->register_module("encoder", std::make_shared<torch::nn::Module>());
    layers = encoder->register_module("layers", torch::nn::ModuleList());
    for (std::int64_t i = 0; i < c_.num_hidden_layers; ++i)
      layers->push_back(CLIPEncoderLayer<Backend>(c_));
    final_layer_norm = text_model->register_module(
        "final_layer_norm",
        torch::nn::LayerNorm(torch::nn::LayerNormOptions({d}).eps(c_.layer_norm_eps)));
    if (c_.with_projection)
      text_projection = register_module(
          "text_projection",
          nn::AdaptableLinear(torch::nn::LinearOptions(d, c_.projection_dim).bias(false)));
    init_weights();
  }

  [[nodiscard]] const Config& config() const { return c_; }

  /// Grows (or shrinks) the token table to `rows`, as transformers' resize_token_embeddings: the
  /// rows kept are unchanged, new rows start at the mean of the old ones (the caller, e.g.
  /// textual inversion, usually overwrites them). The parameter stays the same object; resize
  /// before building an optimizer on it, and with no autograd graph alive that uses the table
  /// (its gradient is dropped). config().vocab_size follows.
  void resize_token_embeddings(std::int64_t rows) {
    check_config_range("vocab_size", rows, 1, std::int64_t{1} << 24, "resize_token_embeddings");
    at::NoGradGuard no_grad;
    const at::Tensor old = token_embedding->weight;
    const std::int64_t keep = std::min(rows, old.size(0));
    at::Tensor grown = at::empty({rows, old.size(1)}, old.options());
    grown.slice(0, 0, keep).copy_(old.slice(0, 0, keep));
    if (rows > keep) grown.slice(0, keep).copy_(old.mean(0, true).expand({rows - keep, -1}));
    token_embedding->weight.mutable_grad() = at::Tensor();
    token_embedding->weight.set_data(grown);
    token_embedding->options.num_embeddings(rows);
    c_.vocab_size = rows;
  }

  /// Recomputes each layer's activations in backward instead of storing them.
  void set_gradient_checkpointing(bool on) { checkpointing_ = on; }

  /// `input_ids` (B, L) with L <= max_position_embeddings; `attention_mask` (B, L) of 1 and 0,
  /// optional (diffusers' pipelines pass none); `output_hidden_states` fills every layer's.
  CLIPTextOutput forward(const at::Tensor& input_ids,
                         const std::optional<at::Tensor>& attention_mask = std::nullopt,
                         bool output_hidden_states = false) {
    check_ids(input_ids, attention_mask);
    const auto b = input_ids.size(0), l = input_ids.size(1);
    at::Tensor h =
        token_embedding(input_ids) + position_embedding->weight.slice(0, 0, l).unsqueeze(0);
    return run(h, input_ids, attention_mask, output_hidden_states, b, l);
  }

  /// The same from token embeddings (B, L, hidden) already looked up: textual inversion puts its
  /// vectors into the rows of the prompt's sequence this way. `input_ids` still choose the pooled
  /// position.
  CLIPTextOutput forward_embeds(const at::Tensor& inputs_embeds, const at::Tensor& input_ids,
                                const std::optional<at::Tensor>& attention_mask = std::nullopt,
                                bool output_hidden_states = false) {
    check_ids(input_ids, attention_mask);
    const auto b = input_ids.size(0), l = input_ids.size(1);
    if (inputs_embeds.dim() != 3 || inputs_embeds.size(0) != b || inputs_embeds.size(1) != l ||
        inputs_embeds.size(2) != c_.hidden_size)
      throw ShapeError("inputs_embeds must be (" + std::to_string(b) + ", " + std::to_string(l) +
                           ", " + std::to_string(c_.hidden_size) + "), got " +
                           c10::str(inputs_embeds.sizes()),
                       "CLIPTextModel");
    at::Tensor h = inputs_embeds + position_embedding->weight.slice(0, 0, l).unsqueeze(0);
    return run(h, input_ids, attention_mask, output_hidden_states, b, l);
  }

  std::shared_ptr<torch::nn::Module> text_model;
  torch::nn::Embedding token_embedding{nullptr}, position_embedding{nullptr};
  torch::nn::ModuleList layers{nullptr};
  torch::nn::LayerNorm final_layer_norm{nullptr};
  nn::AdaptableLinear text_projection{nullptr};

 private:
  void check_ids(const at::Tensor& ids, const std::optional<at::Tensor>& mask) const {
    const std::string where = "CLIPTextModel input_ids";
    if (ids.dim() != 2)
      throw ShapeError("must be (batch, length), got " + c10::str(ids.sizes()), where);
    if (at::isFloatingType(ids.scalar_type()) || ids.scalar_type() == at::kBool)
      throw ShapeError(
          "must be integer token ids, got " + std::string(c10::toString(ids.scalar_type())), where);
    if (ids.size(1) > c_.max_position_embeddings || ids.size(1) < 1)
      throw ShapeError("has length " + std::to_string(ids.size(1)) + "; the model has " +
                           std::to_string(c_.max_position_embeddings) +
                           " positions (max_position_embeddings)",
                       where);
    if (ids.device().is_cpu() && ids.numel() > 0) {  // on a GPU an index assert does this
      const auto lo = ids.min().item<std::int64_t>(), hi = ids.max().item<std::int64_t>();
      if (lo < 0 || hi >= c_.vocab_size) {
        const at::Tensor bad = ((ids < 0) | (ids >= c_.vocab_size)).nonzero()[0];
        throw ShapeError("token id " + std::to_string(ids[bad[0]][bad[1]].item<std::int64_t>()) +
                             " at (" + std::to_string(bad[0].item<std::int64_t>()) + ", " +
                             std::to_string(bad[1].item<std::int64_t>()) +
                             ") is outside the vocabulary (vocab_size " +
                             std::to_string(c_.vocab_size) + ")",
                         where);
      }
    }
    if (mask && (mask->sizes() != ids.sizes()))
      throw ShapeError("attention_mask must have the shape of input_ids " + c10::str(ids.sizes()) +
                           ", got " + c10::str(mask->sizes()),
                       "CLIPTextModel attention_mask");
  }

  CLIPTextOutput run(at::Tensor h, const at::Tensor& input_ids,
                     const std::optional<at::Tensor>& attention_mask, bool output_hidden_states,
                     std::int64_t b, std::int64_t l) {
    // With a padding mask: causal and padding in one additive mask, as transformers builds it
    // (the dtype's lowest value where masked).
    std::optional<at::Tensor> mask;
    if (attention_mask) {
      const at::Tensor causal =
          at::ones({l, l}, h.options().dtype(at::kBool)).tril().view({1, 1, l, l});
      const at::Tensor keep =
          causal & attention_mask->to(h.device()).to(at::kBool).view({b, 1, 1, l});
      mask = at::zeros({b, 1, l, l}, h.options())
                 .masked_fill(keep.logical_not(), std::numeric_limits<float>::lowest());
      if (h.scalar_type() == at::kHalf || h.scalar_type() == at::kBFloat16)
        mask = at::zeros({b, 1, l, l}, h.options())
                   .masked_fill(keep.logical_not(), -std::numeric_limits<double>::infinity())
                   .clamp_min(h.scalar_type() == at::kHalf ? -65504.0 : -3.38953e38);
    }
    CLIPTextOutput out;
    if (output_hidden_states) out.hidden_states.push_back(h);
    for (std::size_t i = 0; i < layers->size(); ++i) {
      auto layer = layers[i]->as<CLIPEncoderLayerImpl<Backend>>();
      if (checkpointing_ && is_training()) {
        std::vector<at::Tensor> params;
        for (const auto& p : layer->parameters()) params.push_back(p);
        h = nn::checkpoint(
            [layer, mask](const std::vector<at::Tensor>& in) {
              return layer->forward(in[0], mask);
            },
            {h}, params);
      } else {
        h = layer->forward(h, mask);
      }
      if (output_hidden_states) out.hidden_states.push_back(h);
    }
    out.last_hidden_state = final_layer_norm(h);
    // The end token's position: the first eos_token_id, or with the old configs (eos 2) the
    // largest id.
    const at::Tensor ids = input_ids.to(h.device());
    const at::Tensor pos = c_.eos_token_id == 2 ? ids.to(at::kInt).argmax(-1)
                                                : (ids == c_.eos_token_id).to(at::kInt).argmax(-1);
    out.pooler_output =
        out.last_hidden_state.index({at::arange(b, pos.options().dtype(at::kLong)), pos});
    if (text_projection) out.text_embeds = text_projection(out.pooler_output);
    return out;
  }

  // transformers' _init_weights for CLIP's text side (a model built from a config, not loaded):
  // linear biases zero, LayerNorms one and zero (LibTorch's defaults), the stds below.
  void init_weights() {
    at::NoGradGuard no_grad;
    const double f = c_.initializer_factor;
    const double d = static_cast<double>(c_.hidden_size);
    const double n = static_cast<double>(c_.num_hidden_layers);
    token_embedding->weight.normal_(0.0, f * 0.02);
    position_embedding->weight.normal_(0.0, f * 0.02);
    const double in_std = std::pow(d, -0.5) * std::pow(2.0 * n, -0.5) * f;
    const double out_std = std::pow(d, -0.5) * f;
    const double fc_std = std::pow(2.0 * d, -0.5) * f;
    for (std::size_t i = 0; i < layers->size(); ++i) {
      auto layer = layers[i]->as<CLIPEncoderLayerImpl<Backend>>();
      for (auto* p : {&layer->q_proj, &layer->k_proj, &layer->v_proj}) {
        (*p)->weight.normal_(0.0, in_std);
        (*p)->bias.zero_();
      }
      layer->out_proj->weight.normal_(0.0, out_std);
      layer->out_proj->bias.zero_();
      layer->fc1->weight.normal_(0.0, fc_std);
      layer->fc1->bias.zero_();
      layer->fc2->weight.normal_(0.0, in_std);
      layer->fc2->bias.zero_();
    }
    if (text_projection) text_projection->weight.normal_(0.0, std::pow(d, -0.5) * f);
  }

  Config c_;
  bool checkpointing_ = false;
};

template <nn::attention::AttentionBackend Backend = nn::attention::Sdpa<nn::attention::Auto>>
using CLIPTextModel = torch::nn::ModuleHolder<CLIPTextModelImpl<Backend>>;

}  // namespace difftrain::models
