#pragma once
// Layers that can carry a LoRA branch (Hu et al. 2021) as PEFT / diffusers apply it: a frozen
// layer W plus a trainable low-rank branch, y = W·x + (alpha / rank) · B·A·dropout(x), with A
// Kaiming-uniform (a = √5) and B zero, so an adapter starts as the identity. For a convolution, A
// is a convolution with the layer's kernel, stride and padding into `rank` channels and B a 1×1
// convolution (kohya / PEFT conv LoRA).
//
// LibTorch calls a submodule through its parent's member, not through the module registry, so a
// layer cannot be swapped for a wrapper after the fact. Instead the layers difftrain's blocks are
// built from (`AdaptableLinear`, `AdaptableConv2d`) carry an optional branch, and `inject_lora`
// (adapters/lora_inject.hpp) attaches one to every such layer whose name matches. The layers live
// here, below the blocks built of them; the injection rules and the files live in adapters/. The
// branch's parameters are the layer's children `lora_A` and `lora_B`, so names read
// `…to_q.lora_A.weight`, as in diffusers' LoRA files.
//
// A frozen base weight can be stored in float8 e4m3 with a per-tensor scale (kohya's --fp8_base:
// store_frozen_weights_fp8), dequantised per layer in the forward; the adapters stay in the compute
// dtype.
//
// DoRA (Liu et al. 2024, PEFT's `use_dora`) splits the adapted weight W' = W + scale·B·A into a
// trained magnitude m and a direction: W_eff = m · W' / ‖W'‖. PEFT and diffusers (and LyCORIS'
// default, `wd_on_output`) take the norm per output row; the web UI and LyCORIS'
// `wd_on_output=False` per input column. Both are offered (`DoraAxis`); the output-row form
// follows PEFT exactly (the norm is detached, as the paper's §4.3 recommends, and the base output
// is reused), the input-column form follows LyCORIS (merged weight, norm + ε, not detached).

#include <ATen/ops/linalg_vector_norm.h>
#include <torch/nn/init.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "difftrain/core/error.hpp"

namespace difftrain::nn {

/// Which norm DoRA's magnitude divides by: per output row (PEFT, diffusers, LyCORIS' default,
/// ComfyUI) or per input column (the web UI, LyCORIS' `wd_on_output=False`).
enum class DoraAxis { output, input };

struct LoraOptions {
  std::int64_t rank = 4;
  std::optional<double> alpha{};  ///< default: rank (scale 1)
  double dropout = 0.0;
  bool use_dora = false;  ///< weight-decomposed LoRA (a trained magnitude per row/column)
  DoraAxis dora_axis = DoraAxis::output;
  [[nodiscard]] double scale() const {
    return alpha.value_or(static_cast<double>(rank)) / static_cast<double>(rank);
  }
  void validate(const std::string& where) const {
    if (rank < 1) throw ConfigError("LoRA rank must be >= 1, got " + std::to_string(rank), where);
    if (alpha && !(std::isfinite(*alpha) && *alpha > 0))
      throw ConfigError("LoRA alpha must be finite and > 0", where);
    if (!(dropout >= 0 && dropout < 1)) throw ConfigError("LoRA dropout must be in [0, 1)", where);
    if (use_dora && dora_axis == DoraAxis::input && dropout > 0)
      throw ConfigError(
          "DoRA per input column works on the merged weight and takes no LoRA dropout", where);
  }
};

namespace lora_detail {
inline void init_a(const at::Tensor& w) {
  at::NoGradGuard no_grad;
  torch::nn::init::kaiming_uniform_(w, std::sqrt(5.0));  // PEFT's init_lora_weights=True
}
}  // namespace lora_detail

/// What every adaptable layer offers; `inject_lora` and the file formats work through it.
class LoraHost {
 public:
  virtual ~LoraHost() = default;
  LoraHost() = default;
  LoraHost(const LoraHost&) = default;
  LoraHost& operator=(const LoraHost&) = default;
  LoraHost(LoraHost&&) = default;
  LoraHost& operator=(LoraHost&&) = default;

  virtual void attach_lora(const LoraOptions& o) = 0;
  virtual void detach_lora() = 0;
  /// W += scale·B·A: inference at the base layer's cost; the branch stops contributing.
  virtual void merge() = 0;
  /// W −= scale·B·A: back to the frozen base.
  virtual void unmerge() = 0;
  [[nodiscard]] virtual bool has_lora() const = 0;
  [[nodiscard]] virtual bool merged() const = 0;
  [[nodiscard]] virtual const LoraOptions& lora_options() const = 0;
  /// The branch's A and B weights (undefined without a branch).
  [[nodiscard]] virtual at::Tensor lora_a() const = 0;
  [[nodiscard]] virtual at::Tensor lora_b() const = 0;
  /// DoRA's magnitude, shaped to broadcast over the base weight ((out, 1, ...) per output row,
  /// (1, in, ...) per input column); undefined without DoRA.
  [[nodiscard]] virtual at::Tensor lora_magnitude() const = 0;
  /// Stores the frozen base weight as float8 e4m3 with a per-tensor scale (absmax / 448, the
  /// buffer `scale_weight`, as ComfyUI's scaled-fp8 files name it), halving bf16's storage; the
  /// forward dequantises it to `compute` per call. Adapters stay in `compute`. A weight that
  /// trains is a ConfigError.
  virtual void store_weight_fp8(at::ScalarType compute) = 0;
  [[nodiscard]] virtual bool weight_in_fp8() const = 0;
  /// The change the branch makes to the base weight (scale·B·A; with DoRA, W_eff − W).
  [[nodiscard]] virtual at::Tensor delta_weight() const = 0;
};

/// An adapter whose effect is a change of the layer's weight, ΔW(θ), rather than a low-rank path
/// of its own (LoHa's Hadamard product, LoKr's Kronecker product: adapters/weight_delta.hpp). The
/// layer adds its own operation with ΔW to its output, as PEFT and LyCORIS apply them.
class WeightDelta : public torch::nn::Module {
 public:
  /// ΔW (scale included), shaped as `weight`.
  [[nodiscard]] virtual at::Tensor delta_weight(const at::Tensor& weight) const = 0;
};

/// A torch layer (`Base`: LinearImpl or Conv2dImpl) with an optional LoRA branch. `Traits` says how
/// the branch's A and B are shaped for that layer and how B·A folds into its weight.
template <class Base, class Traits>
class AdaptableImpl : public Base, public LoraHost {
 public:
  using Base::Base;
  using Branch = typename Traits::Branch;  // the ModuleHolder of A's and B's layer type

  at::Tensor forward(const at::Tensor& x) {
    if (lora_A && !merged_ && o_.use_dora && o_.dora_axis == DoraAxis::input)
      return with_bias(Traits::with_weight(this->options, x, dora_weight()));
    at::Tensor y =
        fp8_ ? with_bias(Traits::with_weight(this->options, x, base_weight().to(x.scalar_type())))
             : Base::forward(x);
    if (lora_A && !merged_) {
      const bool drop = dropout_ && this->is_training();
      const at::Tensor in = drop ? dropout_->forward(x) : x;
      if (o_.use_dora) {  // PEFT's DoraLinearLayer / _DoraConvNdLayer.forward
        const at::Tensor norm = weight_norm(lora_product().detach()).detach();
        const at::Tensor ratio = Traits::per_output(lora_magnitude_vector / norm);
        const at::Tensor base =
            drop ? Traits::with_weight(this->options, in, base_weight()) : without_bias(y);
        y = y + (ratio - 1) * base + ratio * lora_B->forward(lora_A->forward(in)) * o_.scale();
      } else {
        y = y + lora_B->forward(lora_A->forward(in)) * o_.scale();
      }
    }
    if (delta_)  // the layer's own operation with ΔW, without bias
      y = y + Traits::with_weight(this->options, x, delta_->delta_weight(base_weight()));
    return y;
  }

  void store_weight_fp8(at::ScalarType compute) override {
    const std::string where = std::string(Traits::name) + "::store_weight_fp8";
    if (fp8_) return;
    if (this->weight.requires_grad())
      throw ConfigError("the weight trains; only a frozen base weight is stored in fp8", where);
    if (merged_) throw ConfigError("has a merged branch; unmerge it first", where);
    at::NoGradGuard no_grad;
    const at::Tensor w = this->weight.detach().to(at::kFloat);
    const double absmax = w.abs().max().item<double>();
    const double scale = absmax > 0 ? absmax / 448.0 : 1.0;  // e4m3's largest finite value
    scale_weight = this->register_buffer("scale_weight",
                                         at::scalar_tensor(scale, w.options().dtype(at::kFloat)));
    this->weight.set_data((w / scale).to(at::kFloat8_e4m3fn));
    compute_ = compute;
    fp8_ = true;
  }
  [[nodiscard]] bool weight_in_fp8() const override { return fp8_; }
  /// The base weight in the compute dtype (dequantised when stored in fp8).
  [[nodiscard]] at::Tensor base_weight() const {
    if (!fp8_) return this->weight;
    return (this->weight.to(at::kFloat) * scale_weight).to(compute_);
  }

  /// Attaches a weight-change adapter (LoHa, LoKr) as the child "adapter"; one per layer, and
  /// not beside a LoRA branch.
  void attach_delta(std::shared_ptr<WeightDelta> delta) {
    const std::string where = std::string(Traits::name) + "::attach_delta";
    if (lora_A || delta_) throw ConfigError("already has an adapter", where);
    Traits::check(this->options, where);
    delta_ = this->register_module("adapter", std::move(delta));
  }
  /// The weight-change adapter (null without one).
  [[nodiscard]] const std::shared_ptr<WeightDelta>& delta() const { return delta_; }

  void attach_lora(const LoraOptions& o) override {
    const std::string where = std::string(Traits::name) + "::attach_lora";
    o.validate(where);
    if (lora_A) throw ConfigError("already has a LoRA branch", where);
    Traits::check(this->options, where);
    o_ = o;
    lora_A = this->register_module("lora_A", Traits::make_a(this->options, o.rank));
    lora_B = this->register_module("lora_B", Traits::make_b(this->options, o.rank));
    const at::ScalarType dtype = fp8_ ? compute_ : this->weight.scalar_type();
    lora_A->to(this->weight.device(), dtype);
    lora_B->to(this->weight.device(), dtype);
    lora_detail::init_a(lora_A->weight);
    {
      at::NoGradGuard no_grad;
      lora_B->weight.zero_();
    }
    if (o.use_dora) {  // m starts as ‖W‖, so the adapted layer starts as the base layer
      at::NoGradGuard no_grad;
      lora_magnitude_vector = this->register_parameter(
          "lora_magnitude_vector",
          weight_norm(at::zeros(this->weight.sizes(), this->weight.options().dtype(dtype)))
              .detach()
              .clone());
    }
    if (o.dropout > 0)
      dropout_ = this->register_module("lora_dropout", torch::nn::Dropout(o.dropout));
  }
  void detach_lora() override {
    if (merged_) unmerge();
    for (const char* name : {"lora_A", "lora_B", "lora_dropout"})
      if (this->named_children().contains(name)) this->unregister_module(name);
    if (lora_magnitude_vector.defined()) {
      // LibTorch has no unregister_parameter; the parameter table is rebuilt without it.
      auto& params = this->parameters_;
      torch::OrderedDict<std::string, at::Tensor> kept;
      for (const auto& item : params)
        if (item.key() != "lora_magnitude_vector") kept.insert(item.key(), item.value());
      params = std::move(kept);
      lora_magnitude_vector = at::Tensor();
    }
    lora_A = nullptr;
    lora_B = nullptr;
    dropout_ = nullptr;
  }
  void merge() override {
    require_branch("merge");
    if (merged_) return;
    if (fp8_)
      throw ConfigError("keeps its base weight in fp8; a branch cannot be merged into it",
                        std::string(Traits::name) + "::merge");
    at::NoGradGuard no_grad;
    merged_delta_ = delta_weight();  // kept, so that unmerge restores W even with DoRA
    this->weight.add_(merged_delta_);
    merged_ = true;
  }
  void unmerge() override {
    require_branch("unmerge");
    if (!merged_) return;
    at::NoGradGuard no_grad;
    this->weight.sub_(merged_delta_);
    merged_delta_ = at::Tensor();
    merged_ = false;
  }
  [[nodiscard]] bool has_lora() const override { return static_cast<bool>(lora_A); }
  [[nodiscard]] bool merged() const override { return merged_; }
  [[nodiscard]] const LoraOptions& lora_options() const override { return o_; }
  [[nodiscard]] at::Tensor lora_a() const override {
    return lora_A ? lora_A->weight : at::Tensor();
  }
  [[nodiscard]] at::Tensor lora_b() const override {
    return lora_B ? lora_B->weight : at::Tensor();
  }
  [[nodiscard]] at::Tensor lora_magnitude() const override { return lora_magnitude_vector; }
  [[nodiscard]] at::Tensor delta_weight() const override {
    require_branch("delta_weight");
    if (merged_) return merged_delta_;
    if (o_.use_dora) return dora_weight() - base_weight();
    return lora_product() * o_.scale();
  }

  Branch lora_A{nullptr}, lora_B{nullptr};
  at::Tensor lora_magnitude_vector{};  ///< DoRA's m (undefined without DoRA)

 private:
  /// B·A with every axis after the first flattened, shaped as the base weight.
  [[nodiscard]] at::Tensor lora_product() const {
    return lora_B->weight.flatten(1).mm(lora_A->weight.flatten(1)).view(this->weight.sizes());
  }
  /// ‖W + scale·Δ‖ along DoRA's axis, shaped as the magnitude. The input-column form adds
  /// float32's ε as LyCORIS does.
  [[nodiscard]] at::Tensor weight_norm(const at::Tensor& product) const {
    const at::Tensor w = base_weight() + product * o_.scale();
    if (o_.dora_axis == DoraAxis::output) {
      std::vector<std::int64_t> dims(static_cast<std::size_t>(w.dim() - 1));
      for (std::size_t i = 0; i < dims.size(); ++i) dims[i] = static_cast<std::int64_t>(i) + 1;
      return at::linalg_vector_norm(w, 2, dims, /*keepdim=*/true);
    }
    std::vector<std::int64_t> dims{0};
    for (std::int64_t i = 2; i < w.dim(); ++i) dims.push_back(i);
    return at::linalg_vector_norm(w, 2, dims, /*keepdim=*/true) +
           std::numeric_limits<float>::epsilon();
  }
  /// W_eff = m · W' / ‖W'‖.
  [[nodiscard]] at::Tensor dora_weight() const {
    const at::Tensor product = lora_product();
    const at::Tensor w = base_weight() + product * o_.scale();
    return w * (lora_magnitude_vector / weight_norm(product));
  }
  [[nodiscard]] at::Tensor with_bias(const at::Tensor& y) const {
    if (!this->bias.defined()) return y;
    return y + Traits::per_output(this->bias);
  }
  [[nodiscard]] at::Tensor without_bias(const at::Tensor& y) const {
    if (!this->bias.defined()) return y;
    return y - Traits::per_output(this->bias);
  }
  void require_branch(const char* what) const {
    if (!lora_A) throw ConfigError("has no LoRA branch", std::string(Traits::name) + "::" + what);
  }
  LoraOptions o_{};
  torch::nn::Dropout dropout_{nullptr};
  std::shared_ptr<WeightDelta> delta_;
  at::Tensor merged_delta_{};
  bool merged_ = false;
  bool fp8_ = false;
  at::ScalarType compute_ = at::kFloat;

 public:
  at::Tensor scale_weight{};  ///< fp8 storage's per-tensor scale (undefined otherwise)
};

/// Linear: A is Linear(in, r), B Linear(r, out), both without bias.
struct LinearLoraTraits {
  static constexpr std::string_view name = "AdaptableLinear";
  using Branch = torch::nn::Linear;
  static void check(const torch::nn::LinearOptions& /*o*/, const std::string& /*where*/) {}
  static Branch make_a(const torch::nn::LinearOptions& o, std::int64_t r) {
    return Branch(torch::nn::LinearOptions(o.in_features(), r).bias(false));
  }
  static Branch make_b(const torch::nn::LinearOptions& o, std::int64_t r) {
    return Branch(torch::nn::LinearOptions(r, o.out_features()).bias(false));
  }
  static at::Tensor with_weight(const torch::nn::LinearOptions& /*o*/, const at::Tensor& x,
                                const at::Tensor& w) {
    return at::linear(x, w);
  }
  /// A per-output-feature tensor of any shape ((out), (out, 1)) shaped to broadcast over y.
  static at::Tensor per_output(const at::Tensor& v) { return v.reshape({-1}); }
};

/// Conv2d: A has the layer's kernel, stride, padding and dilation into r channels; B is 1×1.
struct Conv2dLoraTraits {
  static constexpr std::string_view name = "AdaptableConv2d";
  using Branch = torch::nn::Conv2d;
  static void check(const torch::nn::detail::ConvNdOptions<2>& o, const std::string& where) {
    if (o.groups() != 1) throw ConfigError("LoRA on grouped convolutions is not supported", where);
  }
  static Branch make_a(const torch::nn::detail::ConvNdOptions<2>& o, std::int64_t r) {
    return Branch(torch::nn::Conv2dOptions(o.in_channels(), r, o.kernel_size())
                      .stride(o.stride())
                      .padding(o.padding())
                      .dilation(o.dilation())
                      .bias(false));
  }
  static Branch make_b(const torch::nn::detail::ConvNdOptions<2>& o, std::int64_t r) {
    return Branch(torch::nn::Conv2dOptions(r, o.out_channels(), 1).bias(false));
  }
  /// The layer's convolution (stride, padding, dilation; zero padding) with weight `w`.
  static at::Tensor with_weight(const torch::nn::detail::ConvNdOptions<2>& o, const at::Tensor& x,
                                const at::Tensor& w) {
    const auto* pad = std::get_if<torch::ExpandingArray<2>>(&o.padding());
    if (pad == nullptr || !std::holds_alternative<torch::enumtype::kZeros>(o.padding_mode()))
      throw ConfigError("a weight-change adapter needs explicit zero padding", "AdaptableConv2d");
    return at::conv2d(x, w, {}, *o.stride(), **pad, *o.dilation());
  }
  /// A per-output-channel tensor shaped to broadcast over (N, C, H, W).
  static at::Tensor per_output(const at::Tensor& v) { return v.reshape({1, -1, 1, 1}); }
};

/// torch::nn::Linear with an optional LoRA branch.
class AdaptableLinearImpl : public AdaptableImpl<torch::nn::LinearImpl, LinearLoraTraits> {
 public:
  using AdaptableImpl::AdaptableImpl;
};
TORCH_MODULE(AdaptableLinear);

/// torch::nn::Conv2d with an optional LoRA branch.
class AdaptableConv2dImpl : public AdaptableImpl<torch::nn::Conv2dImpl, Conv2dLoraTraits> {
 public:
  using AdaptableImpl::AdaptableImpl;
};
TORCH_MODULE(AdaptableConv2d);

/// What store_frozen_weights_fp8 did: the layers it converted and the weight bytes before and
/// after.
struct Fp8Storage {
  std::size_t layers = 0;
  std::int64_t bytes_before = 0, bytes_after = 0;
};

/// kohya's --fp8_base for any model built of adaptable layers: every frozen base weight of
/// `root`'s AdaptableLinear / AdaptableConv2d layers stored in float8 e4m3 with a per-tensor
/// scale, dequantised to `compute` in each forward; trainable weights, adapters, biases and norms
/// are left as they are.
inline Fp8Storage store_frozen_weights_fp8(torch::nn::Module& root, at::ScalarType compute) {
  Fp8Storage out;
  for (const auto& item : root.named_modules("", /*include_self=*/false)) {
    auto* host = dynamic_cast<LoraHost*>(item.value().get());
    if (host == nullptr || host->weight_in_fp8()) continue;
    const at::Tensor w = item.value()->named_parameters(false)["weight"];
    if (w.requires_grad()) continue;
    out.bytes_before += static_cast<std::int64_t>(w.nbytes());
    host->store_weight_fp8(compute);
    out.bytes_after += static_cast<std::int64_t>(
        item.value()->named_parameters(false)["weight"].nbytes() + 4);  // + the scale
    ++out.layers;
  }
  return out;
}

}  // namespace difftrain::nn
