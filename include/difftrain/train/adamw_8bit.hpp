#pragma once
// 8-bit AdamW, as bitsandbytes' `AdamW8bit` keeps and steps it (Dettmers et al. 2022, "8-bit
// Optimizers via Block-wise Quantization"; the optimizer kohya's sd-scripts name "AdamW8bit"):
// both moments of a tensor of at least `min_8bit_size` values are stored as one byte per value,
// an index into bitsandbytes' dynamic code (a sign, a decimal exponent from 10⁻⁶ to 1 and a
// fraction; the second moment's code is unsigned), scaled per block of 256 values by the block's
// largest magnitude. A step decodes the block, takes AdamW's step in float32
//   m ← β₁m + (1 − β₁)g;  v ← β₂v + (1 − β₂)g²;  p ← p(1 − lr·wd) − lr/(1 − β₁ᵗ) · m/(√v/√(1 − β₂ᵗ)
//   + ε)
// and encodes the moments again, with bitsandbytes' CPU rounding (its 65,536-entry lookup table).
// Smaller tensors keep float32 moments and bitsandbytes' 32-bit step, whose ε is scaled by
// √(1 − β₂ᵗ). State: 2 B per value plus 8 B per block of 256, against AdamW's 8 B per value.

#include <torch/optim/optimizer.h>
#include <torch/optim/serialize.h>
#include <torch/serialize/archive.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/train/fused_adam.hpp"  // fused_detail::evaluate_closure

namespace difftrain::train {

namespace quantize8 {

inline constexpr std::int64_t kBlock = 256;

/// bitsandbytes' `create_dynamic_map(signed)`: 256 sorted float32 codes in [-1, 1] (signed) or
/// [0, 1], built with the same float32 operations.
inline at::Tensor dynamic_map(bool is_signed) {
  std::vector<double> data;
  constexpr int kExponentBits = 7, kNonSignBits = 7;
  for (int i = 0; i < kExponentBits; ++i) {
    const int items = is_signed ? (1 << (i + kNonSignBits - kExponentBits)) + 1
                                : (1 << (i + kNonSignBits - kExponentBits + 1)) + 1;
    const at::Tensor bounds = at::linspace(0.1, 1, items, at::kFloat);
    const at::Tensor means = (bounds.slice(0, 0, items - 1) + bounds.slice(0, 1)) / 2.0;
    const double scale = std::pow(10.0, -(kExponentBits - 1) + i);
    const at::Tensor pos = (scale * means).contiguous(), neg = (-scale * means).contiguous();
    for (std::int64_t k = 0; k < pos.numel(); ++k) data.push_back(pos.data_ptr<float>()[k]);
    if (is_signed)
      for (std::int64_t k = 0; k < neg.numel(); ++k) data.push_back(neg.data_ptr<float>()[k]);
  }
  data.push_back(0.0);
  data.push_back(1.0);
  while (data.size() < 256) data.push_back(0.0);
  std::sort(data.begin(), data.end());
  std::vector<float> out(data.begin(), data.end());
  return at::tensor(out, at::kFloat);
}

/// The codes as the encoder uses them: the map and bitsandbytes' CPU lookup table (the value's
/// position on a 65,536-step grid over [-1, 1] names the nearest code), as tensors so that the
/// same steps run on any device.
struct Code {
  at::Tensor map;  // float32 [256]
  at::Tensor lut;  // uint8 [65536]

  explicit Code(bool is_signed) : map(dynamic_map(is_signed)) {
    const float* values = map.data_ptr<float>();
    std::array<float, 255> mid{};
    for (int i = 0; i < 255; ++i) mid[i] = 0.5f * (values[i] + values[i + 1]);
    lut = at::empty({65536}, at::kByte);
    std::uint8_t* out = lut.data_ptr<std::uint8_t>();
    int index = 0;
    for (int i = 0; i < 65536; ++i) {
      const float v = -1.0f + (2.0f * static_cast<float>(i)) / 65535.0f;
      while (index < 255 && mid[index] < v) ++index;
      out[i] = static_cast<std::uint8_t>(index);
    }
  }
};

inline const Code& signed_code() {
  static const Code c(true);
  return c;
}
inline const Code& unsigned_code() {
  static const Code c(false);
  return c;
}

/// Encodes float32 `values` into `codes` (uint8, same numel) and `absmax` (one per block of 256),
/// in place. A block of zeros is all code 0 with scale 0, as bitsandbytes writes it.
inline void encode(const at::Tensor& values, const Code& code, at::Tensor& codes,
                   at::Tensor& absmax) {
  const std::int64_t n = values.numel(), blocks = absmax.numel();
  at::Tensor flat = values.reshape({-1});
  if (blocks * kBlock != n) flat = at::constant_pad_nd(flat, {0, blocks * kBlock - n});
  const at::Tensor grid = flat.view({blocks, kBlock});
  const at::Tensor largest = grid.abs().amax(1);
  const at::Tensor zero = largest.eq(0);  // such a block is all code 0 (no 0·∞ below)
  const at::Tensor inverse = at::reciprocal(largest.masked_fill(zero, 1.0)).unsqueeze(1);
  const at::Tensor scaled = (grid * inverse).clamp_(-1.0, 1.0);
  const at::Tensor position = scaled.add_(1.0).mul_(0.5).mul_(65535.0).add_(0.5).to(at::kInt);
  at::Tensor q = code.lut.to(values.device()).index({position.reshape({-1}).to(at::kLong)});
  q = q.view({blocks, kBlock}).masked_fill_(zero.unsqueeze(1), 0).reshape({-1});
  codes.view({-1}).copy_(q.slice(0, 0, n));
  absmax.copy_(largest);
}

/// The float32 values `codes` and `absmax` stand for.
inline at::Tensor decode(const at::Tensor& codes, const at::Tensor& absmax, const Code& code) {
  const std::int64_t n = codes.numel();
  const at::Tensor values = code.map.to(codes.device()).index({codes.reshape({-1}).to(at::kLong)});
  const at::Tensor scales =
      absmax.repeat_interleave(kBlock).slice(0, 0, n);  // the block's scale for each value
  return (values * scales).view(codes.sizes());
}

}  // namespace quantize8

struct AdamW8bitOptions : public torch::optim::OptimizerCloneableOptions<AdamW8bitOptions> {
  AdamW8bitOptions(double lr = 1e-3) : lr_(lr) {}  // NOLINT: implicit as LibTorch's options are
  using Betas = std::tuple<double, double>;
  TORCH_ARG(double, lr);
  TORCH_ARG(Betas, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 1e-2;
  TORCH_ARG(std::int64_t, min_8bit_size) = 4096;

 public:  // (TORCH_ARG leaves its members private)
  void serialize(torch::serialize::InputArchive& archive) override {
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(Betas, betas);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(int64_t, min_8bit_size);
  }
  void serialize(torch::serialize::OutputArchive& archive) const override {
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(betas);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(min_8bit_size);
  }
  [[nodiscard]] double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

/// bitsandbytes' names: state1/state2 (uint8 codes, or float32 moments for a small tensor) and
/// absmax1/absmax2 (one scale per block; undefined for a small tensor).
struct AdamW8bitParamState
    : public torch::optim::OptimizerCloneableParamState<AdamW8bitParamState> {
  TORCH_ARG(std::int64_t, step) = 0;
  TORCH_ARG(at::Tensor, state1);
  TORCH_ARG(at::Tensor, state2);
  TORCH_ARG(at::Tensor, absmax1);
  TORCH_ARG(at::Tensor, absmax2);

 public:
  void serialize(torch::serialize::InputArchive& archive) override {
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(int64_t, step);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, state1);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, state2);
    if (c10::IValue saved; archive.try_read("absmax1", saved)) absmax1(saved.toTensor());
    if (c10::IValue saved; archive.try_read("absmax2", saved)) absmax2(saved.toTensor());
  }
  void serialize(torch::serialize::OutputArchive& archive) const override {
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(step);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(state1);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(state2);
    if (absmax1().defined()) _TORCH_OPTIM_SERIALIZE_TORCH_ARG(absmax1);
    if (absmax2().defined()) _TORCH_OPTIM_SERIALIZE_TORCH_ARG(absmax2);
  }
  [[nodiscard]] bool quantized() const { return absmax1().defined(); }
  [[nodiscard]] std::int64_t nbytes() const {
    std::int64_t n = 0;
    for (const at::Tensor* t : {&state1_, &state2_, &absmax1_, &absmax2_})
      if (t->defined()) n += t->numel() * static_cast<std::int64_t>(t->element_size());
    return n;
  }
};

class AdamW8bitOptimizer : public torch::optim::Optimizer {
 public:
  AdamW8bitOptimizer(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                     const AdamW8bitOptions& defaults)
      : torch::optim::Optimizer(groups, std::make_unique<AdamW8bitOptions>(defaults)) {}

  at::Tensor step(LossClosure closure = nullptr) override {
    at::Tensor loss = fused_detail::evaluate_closure(closure);
    const at::NoGradGuard no_grad;
    for (auto& group : param_groups()) {
      const auto& o = static_cast<const AdamW8bitOptions&>(group.options());
      const auto [beta1, beta2] = o.betas();
      const double lr = o.lr(), eps = o.eps(), wd = o.weight_decay();
      for (auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        auto& slot = state()[p.unsafeGetTensorImpl()];
        if (!slot) {
          auto fresh = std::make_unique<AdamW8bitParamState>();
          const auto f32 = p.options().dtype(at::kFloat);
          if (p.numel() < o.min_8bit_size()) {
            fresh->state1(at::zeros(p.sizes(), f32)).state2(at::zeros(p.sizes(), f32));
          } else {
            const auto u8 = p.options().dtype(at::kByte);
            const std::int64_t blocks = (p.numel() + quantize8::kBlock - 1) / quantize8::kBlock;
            fresh->state1(at::zeros(p.sizes(), u8)).state2(at::zeros(p.sizes(), u8));
            fresh->absmax1(at::zeros({blocks}, f32)).absmax2(at::zeros({blocks}, f32));
          }
          slot = std::move(fresh);
        }
        auto& st = static_cast<AdamW8bitParamState&>(*slot);
        st.step(st.step() + 1);
        const auto t = static_cast<double>(st.step());
        const double correction1 = 1.0 - std::pow(beta1, t);
        const double correction2 = std::sqrt(1.0 - std::pow(beta2, t));
        const at::Tensor grad = p.grad().to(at::kFloat) * 1.0;  // bitsandbytes' g·gnorm_scale
        at::Tensor p32 = p.scalar_type() == at::kFloat ? p : p.to(at::kFloat);
        if (!st.quantized()) {  // bitsandbytes' 32-bit step
          st.state1().mul_(beta1).add_(grad, 1.0 - beta1);
          st.state2().mul_(beta2).addcmul_(grad, grad, 1.0 - beta2);
          const double step_size = -lr * correction2 / correction1;
          if (wd > 0.0) p32.mul_(1.0 - lr * wd);
          const at::Tensor update = st.state1() / (st.state2().sqrt() + eps * correction2);
          p32.add_(update, step_size);
        } else {
          const auto& c1 = quantize8::signed_code();
          const auto& c2 = quantize8::unsigned_code();
          at::Tensor m = quantize8::decode(st.state1(), st.absmax1(), c1);
          at::Tensor v = quantize8::decode(st.state2(), st.absmax2(), c2);
          m.mul_(beta1).add_(grad, 1.0 - beta1);
          v.mul_(beta2).addcmul_(grad, grad, 1.0 - beta2);
          const at::Tensor denom = (v.sqrt() / correction2).add_(eps);
          if (wd > 0.0) p32.mul_(1.0 - lr * wd);
          p32.addcdiv_(m, denom, -lr / correction1);
          at::Tensor codes1 = st.state1(), codes2 = st.state2();
          at::Tensor absmax1 = st.absmax1(), absmax2 = st.absmax2();
          quantize8::encode(m, c1, codes1, absmax1);
          quantize8::encode(v, c2, codes2, absmax2);
        }
        if (!p32.is_same(p)) p.copy_(p32);
      }
    }
    return loss;
  }

  void save(torch::serialize::OutputArchive& archive) const override {
    torch::optim::serialize<AdamW8bitParamState, AdamW8bitOptions>(archive, *this);
  }
  void load(torch::serialize::InputArchive& archive) override {
    torch::optim::serialize<AdamW8bitParamState, AdamW8bitOptions>(archive, *this);
  }
};

}  // namespace difftrain::train
