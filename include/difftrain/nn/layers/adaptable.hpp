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

#include <torch/nn/init.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <variant>

#include "difftrain/core/error.hpp"

namespace difftrain::nn {

struct LoraOptions {
  std::int64_t rank = 4;
  std::optional<double> alpha{};  ///< default: rank (scale 1)
  double dropout = 0.0;
  [[nodiscard]] double scale() const {
    return alpha.value_or(static_cast<double>(rank)) / static_cast<double>(rank);
  }
  void validate(const std::string& where) const {
    if (rank < 1) throw ConfigError("LoRA rank must be >= 1, got " + std::to_string(rank), where);
    if (alpha && !(std::isfinite(*alpha) && *alpha > 0))
      throw ConfigError("LoRA alpha must be finite and > 0", where);
    if (!(dropout >= 0 && dropout < 1)) throw ConfigError("LoRA dropout must be in [0, 1)", where);
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
  /// scale·B·A shaped as the base weight.
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
    at::Tensor y = Base::forward(x);
    if (lora_A && !merged_) {
      const at::Tensor in = dropout_ ? dropout_->forward(x) : x;
      y = y + lora_B->forward(lora_A->forward(in)) * o_.scale();
    }
    if (delta_)  // the layer's own operation with ΔW, without bias
      y = y + Traits::with_weight(this->options, x, delta_->delta_weight(this->weight));
    return y;
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
    lora_A->to(this->weight.device(), this->weight.scalar_type());
    lora_B->to(this->weight.device(), this->weight.scalar_type());
    lora_detail::init_a(lora_A->weight);
    {
      at::NoGradGuard no_grad;
      lora_B->weight.zero_();
    }
    if (o.dropout > 0)
      dropout_ = this->register_module("lora_dropout", torch::nn::Dropout(o.dropout));
  }
  void detach_lora() override {
    if (merged_) unmerge();
    for (const char* name : {"lora_A", "lora_B", "lora_dropout"})
      if (this->named_children().contains(name)) this->unregister_module(name);
    lora_A = nullptr;
    lora_B = nullptr;
    dropout_ = nullptr;
  }
  void merge() override {
    require_branch("merge");
    if (merged_) return;
    at::NoGradGuard no_grad;
    this->weight.add_(delta_weight());
    merged_ = true;
  }
  void unmerge() override {
    require_branch("unmerge");
    if (!merged_) return;
    at::NoGradGuard no_grad;
    this->weight.sub_(delta_weight());
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
  [[nodiscard]] at::Tensor delta_weight() const override {
    require_branch("delta_weight");
    // B·A with every axis after the first flattened, shaped as the base weight.
    return (lora_B->weight.flatten(1).mm(lora_A->weight.flatten(1)) * o_.scale())
        .view(this->weight.sizes());
  }

  Branch lora_A{nullptr}, lora_B{nullptr};

 private:
  void require_branch(const char* what) const {
    if (!lora_A) throw ConfigError("has no LoRA branch", std::string(Traits::name) + "::" + what);
  }
  LoraOptions o_{};
  torch::nn::Dropout dropout_{nullptr};
  std::shared_ptr<WeightDelta> delta_;
  bool merged_ = false;
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

}  // namespace difftrain::nn
