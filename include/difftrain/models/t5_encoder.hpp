#pragma once
// transformers' T5EncoderModel, the text encoder of SD3 (text_encoder_3), Flux (text_encoder_2),
// PixArt and CogVideoX (T5 v1.1 XXL, 4,762,310,656 parameters): a token table, pre-norm blocks of
// self-attention with T5's bucketed relative position bias (computed by the first block, shared by
// all) and a feed-forward layer (gated-gelu in v1.1, relu in the original T5), RMS norms without
// bias or mean, no position embeddings and no 1/sqrt(d) scaling of the attention scores.
//
// Precision as transformers keeps it: the norms accumulate in float32 whatever the dtype; with
// float16 weights the feed-forward output projections (`wo`) stay float32 (`to(kHalf)` keeps
// them, as from_pretrained with torch_dtype=float16 does) and every block clamps infinities. The
// parameter names are transformers' ("encoder.block.N.layer.0.SelfAttention.q.weight"), so
// folders with config.json + model.safetensors load strictly; the projections are adaptable
// layers that carry LoRA.

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/models/config_reader.hpp"
#include "difftrain/models/transformers_config.hpp"
#include "difftrain/nn/attention/sdpa.hpp"
#include "difftrain/nn/blocks/checkpoint.hpp"
#include "difftrain/nn/layers/adaptable.hpp"

namespace difftrain::models {

struct T5EncoderConfig {
  static constexpr std::string_view class_name = "T5EncoderModel";
  static constexpr bool transformers_folder = true;

  std::int64_t vocab_size = 32128;
  std::int64_t d_model = 512;
  std::int64_t d_kv = 64;
  std::int64_t d_ff = 2048;
  std::int64_t num_layers = 6;
  std::int64_t num_heads = 8;
  std::int64_t relative_attention_num_buckets = 32;
  std::int64_t relative_attention_max_distance = 128;
  double dropout_rate = 0.1;
  double layer_norm_epsilon = 1e-6;
  double initializer_factor = 1.0;
  /// "relu", "gated-gelu" (T5 v1.1: gelu_new), "gated-silu", ...: [gated-]activation.
  std::string feed_forward_proj = "relu";
  std::int64_t pad_token_id = 0;
  std::int64_t eos_token_id = 1;

  [[nodiscard]] bool gated() const { return feed_forward_proj.starts_with("gated-"); }
  /// The activation of the feed-forward layer ("gated-gelu" means gelu_new, as transformers
  /// keeps it for compatibility).
  [[nodiscard]] HiddenAct activation(const std::string& where) const {
    const std::string name = gated() ? feed_forward_proj.substr(6) : feed_forward_proj;
    if (name.find('-') != std::string::npos || name.empty())
      throw ConfigError("'feed_forward_proj' = \"" + feed_forward_proj +
                            "\" is not of the form \"gated-{act}\" or \"{act}\"",
                        where);
    try {
      return hidden_activation(feed_forward_proj == "gated-gelu" ? "gelu_new" : name,
                               "feed_forward_proj", "T5 encoder", where);
    } catch (const ConfigError&) {
      throw ConfigError("'feed_forward_proj' = \"" + feed_forward_proj + "\" names \"" + name +
                            "\", not an activation difftrain's T5 encoder has (gelu, gelu_new, "
                            "gelu_pytorch_tanh, gelu_fast, quick_gelu, relu, silu, swish)",
                        where);
    }
  }

  void resolve(const std::string& where) const {
    using L = ConfigLimits;
    check_config_range("vocab_size", vocab_size, 1, std::int64_t{1} << 24, where);
    check_config_range("d_model", d_model, 1, L::channels, where);
    check_config_range("d_kv", d_kv, 1, L::channels, where);
    check_config_range("d_ff", d_ff, 1, 8 * L::channels, where);
    check_config_range("num_layers", num_layers, 1, L::layers, where);
    check_config_range("num_heads", num_heads, 1, 1024, where);
    check_config_range("relative_attention_num_buckets", relative_attention_num_buckets, 4, 4096,
                       where);
    check_config_range("relative_attention_max_distance", relative_attention_max_distance, 1,
                       1 << 20, where);
    // The bidirectional buckets: half per direction, half of those exact, the rest logarithmic
    // up to max_distance, which must lie past the exact ones.
    if (relative_attention_max_distance <= relative_attention_num_buckets / 4)
      throw ConfigError(
          "'relative_attention_max_distance' = " + std::to_string(relative_attention_max_distance) +
              " must exceed the exact buckets (relative_attention_num_buckets / 4 = " +
              std::to_string(relative_attention_num_buckets / 4) + ")",
          where);
    if (!(layer_norm_epsilon > 0.0) || !std::isfinite(layer_norm_epsilon))
      throw ConfigError("'layer_norm_epsilon' must be positive", where);
    if (!(dropout_rate >= 0.0 && dropout_rate < 1.0))
      throw ConfigError("'dropout_rate' must be in [0, 1)", where);
    (void)activation(where);
  }

  static T5EncoderConfig from_json(const nlohmann::json& j, const std::string& where) {
    ConfigReader r(j, where);
    T5EncoderConfig c;
    if (j.contains("architectures") && j["architectures"].is_array())
      for (const auto& a : j["architectures"])
        if (a != "T5EncoderModel" && a != "T5ForConditionalGeneration" && a != "T5Model")
          throw ConfigError("the config is for a " + a.dump() +
                                ", not T5EncoderModel (or a T5 whose encoder it would load)",
                            where);
    if (j.contains("model_type") && j["model_type"] != "t5")
      throw ConfigError("'model_type' = " + j["model_type"].dump() +
                            " is not \"t5\" (UMT5 and MT5 have other layouts)",
                        where);
    accept_transformers_common_fields(r);
    for (const char* key : {"num_decoder_layers", "classifier_dropout", "scale_decoder_outputs",
                            "n_positions", "output_past", "is_gated_act", "dense_act_fn"})
      r.accept(key);
    c.vocab_size = r.get("vocab_size", c.vocab_size);
    c.d_model = r.get("d_model", c.d_model);
    c.d_kv = r.get("d_kv", c.d_kv);
    c.d_ff = r.get("d_ff", c.d_ff);
    c.num_layers = r.get("num_layers", c.num_layers);
    c.num_heads = r.get("num_heads", c.num_heads);
    c.relative_attention_num_buckets =
        r.get("relative_attention_num_buckets", c.relative_attention_num_buckets);
    c.relative_attention_max_distance =
        r.get("relative_attention_max_distance", c.relative_attention_max_distance);
    c.dropout_rate = r.get("dropout_rate", c.dropout_rate);
    c.layer_norm_epsilon = r.get("layer_norm_epsilon", c.layer_norm_epsilon);
    c.initializer_factor = r.get("initializer_factor", c.initializer_factor);
    c.feed_forward_proj = r.get("feed_forward_proj", c.feed_forward_proj);
    c.pad_token_id = r.get("pad_token_id", c.pad_token_id);
    c.eos_token_id = r.get("eos_token_id", c.eos_token_id);
    r.finish();
    // Fields transformers derives from feed_forward_proj: a file that says otherwise describes
    // another model.
    const std::string act = c.gated() ? c.feed_forward_proj.substr(6) : c.feed_forward_proj;
    if (j.contains("is_gated_act") && j["is_gated_act"] != c.gated())
      throw ConfigError("'is_gated_act' = " + j["is_gated_act"].dump() +
                            " contradicts 'feed_forward_proj' = \"" + c.feed_forward_proj + "\"",
                        where);
    if (j.contains("dense_act_fn") && j["dense_act_fn"].is_string() &&
        j["dense_act_fn"] != (c.feed_forward_proj == "gated-gelu" ? "gelu_new" : act))
      throw ConfigError("'dense_act_fn' = " + j["dense_act_fn"].dump() +
                            " contradicts 'feed_forward_proj' = \"" + c.feed_forward_proj + "\"",
                        where);
    c.resolve(where);
    return c;
  }

  /// The file from_pretrained read this config from (see ConfigAsRead).
  ConfigAsRead as_read{};

  [[nodiscard]] nlohmann::json to_json() const {
    const std::string act = gated() ? feed_forward_proj.substr(6) : feed_forward_proj;
    return {{"architectures", {"T5EncoderModel"}},
            {"model_type", "t5"},
            {"vocab_size", vocab_size},
            {"d_model", d_model},
            {"d_kv", d_kv},
            {"d_ff", d_ff},
            {"num_layers", num_layers},
            {"num_decoder_layers", num_layers},
            {"num_heads", num_heads},
            {"relative_attention_num_buckets", relative_attention_num_buckets},
            {"relative_attention_max_distance", relative_attention_max_distance},
            {"dropout_rate", dropout_rate},
            {"layer_norm_epsilon", layer_norm_epsilon},
            {"initializer_factor", initializer_factor},
            {"feed_forward_proj", feed_forward_proj},
            {"dense_act_fn", feed_forward_proj == "gated-gelu" ? "gelu_new" : act},
            {"is_gated_act", gated()},
            {"is_encoder_decoder", false},
            {"use_cache", false},
            {"pad_token_id", pad_token_id},
            {"eos_token_id", eos_token_id},
            {"dtype", "float32"}};
  }

  /// The token table is one tensor tied to two names: transformers saves "shared.weight", other
  /// files hold "encoder.embed_tokens.weight" (or both); a full T5's decoder is not the encoder's.
  static void adapt_weight_names(std::map<std::string, at::Tensor>& w) {
    if (auto it = w.find("encoder.embed_tokens.weight"); it != w.end()) {
      if (!w.contains("shared.weight")) w["shared.weight"] = it->second;
      w.erase("encoder.embed_tokens.weight");
    }
    for (auto it = w.begin(); it != w.end();)
      it = it->first.starts_with("decoder.") || it->first == "lm_head.weight" ? w.erase(it)
                                                                              : std::next(it);
  }

  /// Every parameter's name and shape, from the config alone (a model too large to build here,
  /// such as T5 v1.1 XXL, can still be checked against transformers').
  [[nodiscard]] std::map<std::string, std::vector<std::int64_t>> parameter_shapes() const {
    std::map<std::string, std::vector<std::int64_t>> s;
    const std::int64_t inner = num_heads * d_kv;
    s["shared.weight"] = {vocab_size, d_model};
    for (std::int64_t i = 0; i < num_layers; ++i) {
      const std::string b = "encoder.block." + std::to_string(i) + ".layer.";
      for (const char* p : {"q", "k", "v"})
        s[b + "0.SelfAttention." + p + ".weight"] = {inner, d_model};
      s[b + "0.SelfAttention.o.weight"] = {d_model, inner};
      if (i == 0)
        s[b + "0.SelfAttention.relative_attention_bias.weight"] = {relative_attention_num_buckets,
                                                                   num_heads};
      s[b + "0.layer_norm.weight"] = {d_model};
      if (gated()) {
        s[b + "1.DenseReluDense.wi_0.weight"] = {d_ff, d_model};
        s[b + "1.DenseReluDense.wi_1.weight"] = {d_ff, d_model};
      } else {
        s[b + "1.DenseReluDense.wi.weight"] = {d_ff, d_model};
      }
      s[b + "1.DenseReluDense.wo.weight"] = {d_model, d_ff};
      s[b + "1.layer_norm.weight"] = {d_model};
    }
    s["encoder.final_layer_norm.weight"] = {d_model};
    return s;
  }

  [[nodiscard]] WeightSignature weight_signature() const {
    WeightSignature s;
    const auto all = parameter_shapes();
    for (const char* name :
         {"shared.weight", "encoder.block.0.layer.0.SelfAttention.q.weight",
          "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
          "encoder.block.0.layer.1.DenseReluDense.wo.weight", "encoder.final_layer_norm.weight"})
      s.shapes.push_back({name, all.at(name)});
    s.counts = {{"encoder.block.", num_layers}};
    return s;
  }
};

/// What the encoder returns. `hidden_states` (when asked for) holds num_layers + 1 entries as
/// transformers gives them: the embeddings, each block's output but the last, and
/// last_hidden_state (after the final norm) in place of the last block's.
struct T5EncoderOutput {
  at::Tensor last_hidden_state;  ///< (B, L, d_model)
  std::vector<at::Tensor> hidden_states;
};

namespace t5_detail {

/// Root-mean-square norm with a weight and no bias or mean (T5LayerNorm); the mean square in
/// float32 whatever the input dtype, the result in the weight's dtype when that is 16-bit.
class RmsNormImpl : public torch::nn::Module {
 public:
  RmsNormImpl(std::int64_t d, double eps) : eps_(eps) {
    weight = register_parameter("weight", at::ones({d}));
  }
  at::Tensor forward(const at::Tensor& x) {
    const at::Tensor variance = x.to(at::kFloat).pow(2).mean(-1, true);
    at::Tensor h = x * at::rsqrt(variance + eps_);
    if (weight.scalar_type() == at::kHalf || weight.scalar_type() == at::kBFloat16)
      h = h.to(weight.scalar_type());
    return weight * h;
  }
  at::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(RmsNorm);

/// transformers' clamp of float16 hidden states: to the largest finite value (less 1000 when an
/// infinity appeared), without reading anything back to the host.
inline at::Tensor clamp_half(const at::Tensor& h) {
  if (h.scalar_type() != at::kHalf) return h;
  const double max = 65504.0;
  const at::Tensor limit = at::where(h.isinf().any(), at::scalar_tensor(max - 1000, h.options()),
                                     at::scalar_tensor(max, h.options()));
  return at::clamp(h, -limit, limit);
}

/// The bidirectional bucket of each relative position (memory - query), as T5's
/// _relative_position_bucket: half the buckets per direction, exact up to a quarter of them,
/// logarithmic up to max_distance, the last bucket beyond.
inline at::Tensor relative_position_bucket(const at::Tensor& relative, std::int64_t num_buckets,
                                           std::int64_t max_distance) {
  const std::int64_t half = num_buckets / 2;
  at::Tensor buckets = (relative > 0).to(at::kLong) * half;
  const at::Tensor distance = relative.abs();
  const std::int64_t max_exact = half / 2;
  const at::Tensor is_small = distance < max_exact;
  at::Tensor large =
      max_exact + (at::log(distance.to(at::kFloat) / static_cast<double>(max_exact)) /
                   std::log(static_cast<double>(max_distance) / static_cast<double>(max_exact)) *
                   static_cast<double>(half - max_exact))
                      .to(at::kLong);
  large = at::minimum(large, at::full_like(large, half - 1));
  return buckets + at::where(is_small, distance, large);
}

}  // namespace t5_detail

/// One block: x + attn(norm(x)) with the shared position bias, then x + ff(norm(x)).
template <nn::attention::AttentionBackend Backend>
class T5BlockImpl : public torch::nn::Module {
 public:
  T5BlockImpl(const T5EncoderConfig& c, bool has_relative_bias)
      : heads_(c.num_heads), d_kv_(c.d_kv), dropout_(c.dropout_rate), act_(c.activation("T5")) {
    using torch::nn::LinearOptions;
    const std::int64_t inner = c.num_heads * c.d_kv;
    layer = register_module("layer", torch::nn::ModuleList());
    auto attn_layer = std::make_shared<torch::nn::Module>();
    auto ff_layer = std::make_shared<torch::nn::Module>();
    layer->push_back(attn_layer);
    layer->push_back(ff_layer);
    auto sa = attn_layer->register_module("SelfAttention", std::make_shared<torch::nn::Module>());
    q = sa->register_module("q", nn::AdaptableLinear(LinearOptions(c.d_model, inner).bias(false)));
    k = sa->register_module("k", nn::AdaptableLinear(LinearOptions(c.d_model, inner).bias(false)));
    v = sa->register_module("v", nn::AdaptableLinear(LinearOptions(c.d_model, inner).bias(false)));
    o = sa->register_module("o", nn::AdaptableLinear(LinearOptions(inner, c.d_model).bias(false)));
    if (has_relative_bias)
      relative_attention_bias =
          sa->register_module("relative_attention_bias",
                              torch::nn::Embedding(c.relative_attention_num_buckets, c.num_heads));
    attn_norm = attn_layer->register_module("layer_norm",
                                            t5_detail::RmsNorm(c.d_model, c.layer_norm_epsilon));
    auto ff = ff_layer->register_module("DenseReluDense", std::make_shared<torch::nn::Module>());
    if (c.gated()) {
      wi_0 = ff->register_module("wi_0",
                                 nn::AdaptableLinear(LinearOptions(c.d_model, c.d_ff).bias(false)));
      wi_1 = ff->register_module("wi_1",
                                 nn::AdaptableLinear(LinearOptions(c.d_model, c.d_ff).bias(false)));
    } else {
      wi = ff->register_module("wi",
                               nn::AdaptableLinear(LinearOptions(c.d_model, c.d_ff).bias(false)));
    }
    wo = ff->register_module("wo",
                             nn::AdaptableLinear(LinearOptions(c.d_ff, c.d_model).bias(false)));
    ff_norm = ff_layer->register_module("layer_norm",
                                        t5_detail::RmsNorm(c.d_model, c.layer_norm_epsilon));
  }

  /// `bias`: the position bias plus the padding mask, additive, (1 or B, H, L, L).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& bias) {
    const auto b = x.size(0), l = x.size(1);
    const at::Tensor n = attn_norm(x);
    auto split = [&](const at::Tensor& t) { return t.view({b, l, heads_, d_kv_}).transpose(1, 2); };
    nn::attention::AttentionArgs args;
    args.mask = bias.to(n.scalar_type());
    args.scale = 1.0;  // T5 folds the scaling into its initialisation
    args.dropout_p = is_training() ? dropout_ : 0.0;
    const at::Tensor a = Backend::forward(split(q(n)), split(k(n)), split(v(n)), args)
                             .transpose(1, 2)
                             .reshape({b, l, heads_ * d_kv_});
    at::Tensor h = t5_detail::clamp_half(x + drop(o(a)));
    const at::Tensor m = ff_norm(h);
    at::Tensor f = wi_0 ? activate(wi_0(m), act_) * wi_1(m) : activate(wi(m), act_);
    f = drop(f);
    if (f.scalar_type() != wo->weight.scalar_type()) f = f.to(wo->weight.scalar_type());
    return t5_detail::clamp_half(h + drop(wo(f)));
  }

  torch::nn::ModuleList layer{nullptr};
  nn::AdaptableLinear q{nullptr}, k{nullptr}, v{nullptr}, o{nullptr};
  nn::AdaptableLinear wi{nullptr}, wi_0{nullptr}, wi_1{nullptr}, wo{nullptr};
  torch::nn::Embedding relative_attention_bias{nullptr};
  t5_detail::RmsNorm attn_norm{nullptr}, ff_norm{nullptr};

 private:
  at::Tensor drop(const at::Tensor& t) {
    return is_training() && dropout_ > 0 ? at::dropout(t, dropout_, true) : t;
  }

  std::int64_t heads_, d_kv_;
  double dropout_;
  HiddenAct act_;
};

template <nn::attention::AttentionBackend Backend>
using T5Block = torch::nn::ModuleHolder<T5BlockImpl<Backend>>;

template <nn::attention::AttentionBackend Backend = nn::attention::Sdpa<nn::attention::Auto>>
class T5EncoderModelImpl : public torch::nn::Module {
 public:
  using Config = T5EncoderConfig;

  explicit T5EncoderModelImpl(Config config, const std::string& where = "T5EncoderModel")
      : c_(std::move(config)) {
    c_.resolve(where);
    shared = register_module("shared", torch::nn::Embedding(c_.vocab_size, c_.d_model));
    encoder = register_module("encoder", std::make_shared<torch::nn::Module>());
    block = encoder->register_module("block", torch::nn::ModuleList());
    for (std::int64_t i = 0; i < c_.num_layers; ++i) block->push_back(T5Block<Backend>(c_, i == 0));
    final_layer_norm = encoder->register_module(
        "final_layer_norm", t5_detail::RmsNorm(c_.d_model, c_.layer_norm_epsilon));
    init_weights();
  }

  [[nodiscard]] const Config& config() const { return c_; }

  void set_gradient_checkpointing(bool on) { checkpointing_ = on; }

  using torch::nn::Module::to;
  /// Casts as transformers' from_pretrained(torch_dtype=float16) does: the feed-forward output
  /// projections stay float32 under float16 (T5's activations there overflow half precision).
  void to(at::ScalarType dtype, bool non_blocking = false) override {
    std::vector<at::Tensor> wo_fp32;
    if (dtype == at::kHalf)
      for (std::size_t i = 0; i < block->size(); ++i)
        wo_fp32.push_back(layer(i)->wo->weight.detach().to(at::kFloat));
    torch::nn::Module::to(dtype, non_blocking);
    at::NoGradGuard no_grad;
    for (std::size_t i = 0; i < wo_fp32.size(); ++i) layer(i)->wo->weight.set_data(wo_fp32[i]);
  }

  /// `input_ids` (B, L); `attention_mask` (B, L) of 1 and 0, optional (SD3's and Flux's pipelines
  /// pass none); `output_hidden_states` fills every block's.
  T5EncoderOutput forward(const at::Tensor& input_ids,
                          const std::optional<at::Tensor>& attention_mask = std::nullopt,
                          bool output_hidden_states = false) {
    check_ids(input_ids, attention_mask);
    return run(shared(input_ids), attention_mask, output_hidden_states);
  }

  /// The same from token embeddings (B, L, d_model) already looked up (textual inversion).
  T5EncoderOutput forward_embeds(const at::Tensor& inputs_embeds,
                                 const std::optional<at::Tensor>& attention_mask = std::nullopt,
                                 bool output_hidden_states = false) {
    if (inputs_embeds.dim() != 3 || inputs_embeds.size(2) != c_.d_model ||
        inputs_embeds.size(1) < 1)
      throw ShapeError("inputs_embeds must be (batch, length, " + std::to_string(c_.d_model) +
                           "), got " + c10::str(inputs_embeds.sizes()),
                       "T5EncoderModel");
    if (attention_mask &&
        (attention_mask->dim() != 2 || attention_mask->size(0) != inputs_embeds.size(0) ||
         attention_mask->size(1) != inputs_embeds.size(1)))
      throw ShapeError("attention_mask must be (batch, length) of inputs_embeds, got " +
                           c10::str(attention_mask->sizes()),
                       "T5EncoderModel attention_mask");
    return run(inputs_embeds, attention_mask, output_hidden_states);
  }

  /// The position bias (1, H, L, L) of a sequence of `length`, from the first block's table.
  at::Tensor position_bias(std::int64_t length) {
    auto table = layer(0)->relative_attention_bias;
    const auto opts = at::TensorOptions().dtype(at::kLong).device(table->weight.device());
    const at::Tensor pos = at::arange(length, opts);
    const at::Tensor relative = pos.unsqueeze(0) - pos.unsqueeze(1);  // memory - query
    const at::Tensor buckets = t5_detail::relative_position_bucket(
        relative, c_.relative_attention_num_buckets, c_.relative_attention_max_distance);
    return table(buckets).permute({2, 0, 1}).unsqueeze(0);
  }

  torch::nn::Embedding shared{nullptr};
  std::shared_ptr<torch::nn::Module> encoder;
  torch::nn::ModuleList block{nullptr};
  t5_detail::RmsNorm final_layer_norm{nullptr};

 private:
  std::shared_ptr<T5BlockImpl<Backend>> layer(std::size_t i) {
    return std::dynamic_pointer_cast<T5BlockImpl<Backend>>(block->ptr(i));
  }

  void check_ids(const at::Tensor& ids, const std::optional<at::Tensor>& mask) const {
    const std::string where = "T5EncoderModel input_ids";
    if (ids.dim() != 2 || ids.size(1) < 1)
      throw ShapeError("must be (batch, length), got " + c10::str(ids.sizes()), where);
    if (at::isFloatingType(ids.scalar_type()) || ids.scalar_type() == at::kBool)
      throw ShapeError(
          "must be integer token ids, got " + std::string(c10::toString(ids.scalar_type())), where);
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
    if (mask && mask->sizes() != ids.sizes())
      throw ShapeError("attention_mask must have the shape of input_ids " + c10::str(ids.sizes()) +
                           ", got " + c10::str(mask->sizes()),
                       "T5EncoderModel attention_mask");
  }

  T5EncoderOutput run(const at::Tensor& embeds, const std::optional<at::Tensor>& attention_mask,
                      bool output_hidden_states) {
    const auto b = embeds.size(0), l = embeds.size(1);
    at::Tensor h =
        is_training() && c_.dropout_rate > 0 ? at::dropout(embeds, c_.dropout_rate, true) : embeds;
    // The position bias and the padding (the dtype's lowest value at padded keys) in one additive
    // mask, as transformers adds them to the scores.
    at::Tensor bias = position_bias(l);
    if (attention_mask) {
      const at::Tensor pad =
          attention_mask->to(h.device()).to(at::kBool).logical_not().view({b, 1, 1, l});
      const double lowest = h.scalar_type() == at::kHalf       ? -65504.0
                            : h.scalar_type() == at::kBFloat16 ? -3.3895313892515355e38
                            : h.scalar_type() == at::kFloat
                                ? static_cast<double>(std::numeric_limits<float>::lowest())
                                : std::numeric_limits<double>::lowest();
      bias = bias + at::zeros({b, 1, 1, l}, bias.options()).masked_fill(pad, lowest);
    }
    T5EncoderOutput out;
    if (output_hidden_states) out.hidden_states.push_back(h);
    for (std::size_t i = 0; i < block->size(); ++i) {
      auto blk = layer(i);
      if (checkpointing_ && is_training()) {
        std::vector<at::Tensor> params;
        for (const auto& p : blk->parameters()) params.push_back(p);
        h = nn::checkpoint(
            [blk](const std::vector<at::Tensor>& in) { return blk->forward(in[0], in[1]); },
            {h, bias}, params);
      } else {
        h = blk->forward(h, bias);
      }
      if (output_hidden_states && i + 1 < block->size()) out.hidden_states.push_back(h);
    }
    h = final_layer_norm(h);
    out.last_hidden_state =
        is_training() && c_.dropout_rate > 0 ? at::dropout(h, c_.dropout_rate, true) : h;
    if (output_hidden_states) out.hidden_states.push_back(out.last_hidden_state);
    return out;
  }

  // transformers' _init_weights for T5 (a model built from a config, not loaded).
  void init_weights() {
    at::NoGradGuard no_grad;
    const double f = c_.initializer_factor;
    const double d = static_cast<double>(c_.d_model);
    shared->weight.normal_(0.0, f * 1.0);
    for (std::size_t i = 0; i < block->size(); ++i) {
      auto blk = layer(i);
      const double inner = static_cast<double>(c_.d_kv * c_.num_heads);
      blk->q->weight.normal_(0.0, f * std::pow(d * static_cast<double>(c_.d_kv), -0.5));
      blk->k->weight.normal_(0.0, f * std::pow(d, -0.5));
      blk->v->weight.normal_(0.0, f * std::pow(d, -0.5));
      blk->o->weight.normal_(0.0, f * std::pow(inner, -0.5));
      if (blk->relative_attention_bias)
        blk->relative_attention_bias->weight.normal_(0.0, f * std::pow(d, -0.5));
      for (auto* w : {&blk->wi, &blk->wi_0, &blk->wi_1})
        if (*w) (*w)->weight.normal_(0.0, f * std::pow(d, -0.5));
      blk->wo->weight.normal_(0.0, f * std::pow(static_cast<double>(c_.d_ff), -0.5));
    }
  }

  Config c_;
  bool checkpointing_ = false;
};

template <nn::attention::AttentionBackend Backend = nn::attention::Sdpa<nn::attention::Auto>>
using T5EncoderModel = torch::nn::ModuleHolder<T5EncoderModelImpl<Backend>>;

}  // namespace difftrain::models
