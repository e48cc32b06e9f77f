#pragma once
// PyTorch's fused attention kernels, each *forced*: Sdpa<Flash> calls the flash kernel itself (not
// scaled_dot_product_attention with preference flags, which on an H100 may still pick cuDNN), so
// what runs is what was named. Sdpa<Auto> is torch's own dispatch.
//
// Eligibility is decided in two steps: cheap explicit rules first (device, dtype, head dim, mask,
// dropout) with a sentence each; then, for the fused kernels, torch's own selector
// (`_fused_sdp_choice`) with only that kernel enabled, whose warnings become the reason when it
// refuses (hardware generation, alignment, ...). The second step toggles torch's global SDPA flags
// under a lock and restores them; forward() itself never touches them.

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>

#include "difftrain/nn/attention/concepts.hpp"

namespace difftrain::nn::attention {

/// Kernel tags for Sdpa<Kernel>.
struct Auto {
  static constexpr std::string_view name = "sdpa_auto";
};
struct Flash {
  static constexpr std::string_view name = "sdpa_flash";
  static constexpr std::int64_t torch_index = 1;
};
struct MemEfficient {
  static constexpr std::string_view name = "sdpa_mem_efficient";
  static constexpr std::int64_t torch_index = 2;
};
struct CuDNN {
  static constexpr std::string_view name = "sdpa_cudnn";
  static constexpr std::int64_t torch_index = 3;
};
struct MathKernel {
  static constexpr std::string_view name = "sdpa_math";
  static constexpr std::int64_t torch_index = 0;
};

namespace sdpa_detail {

inline std::string_view kernel_name(std::int64_t torch_index) {
  switch (torch_index) {
    case 0:
      return MathKernel::name;
    case 1:
      return Flash::name;
    case 2:
      return MemEfficient::name;
    case 3:
      return CuDNN::name;
    default:
      return "sdpa_other";
  }
}

// Collects torch's warnings (the selector explains refusals through them).
class WarningCollector : public c10::WarningHandler {
 public:
  void process(const c10::Warning& w) override {
    if (!text.empty()) text += "; ";
    text += w.msg();
  }
  std::string text;
};

// Sets torch's SDPA flags so that only one kernel is enabled, and restores them.
class OnlyKernelGuard {
 public:
  explicit OnlyKernelGuard(std::int64_t index) : lock_(mutex()) {
    auto& ctx = at::globalContext();
    saved_ = {ctx.userEnabledMathSDP(), ctx.userEnabledFlashSDP(), ctx.userEnabledMemEfficientSDP(),
              ctx.userEnabledCuDNNSDP()};
    ctx.setSDPUseMath(index == 0);
    ctx.setSDPUseFlash(index == 1);
    ctx.setSDPUseMemEfficient(index == 2);
    ctx.setSDPUseCuDNN(index == 3);
  }
  ~OnlyKernelGuard() {
    auto& ctx = at::globalContext();
    ctx.setSDPUseMath(std::get<0>(saved_));
    ctx.setSDPUseFlash(std::get<1>(saved_));
    ctx.setSDPUseMemEfficient(std::get<2>(saved_));
    ctx.setSDPUseCuDNN(std::get<3>(saved_));
  }
  OnlyKernelGuard(const OnlyKernelGuard&) = delete;
  OnlyKernelGuard& operator=(const OnlyKernelGuard&) = delete;

 private:
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  std::unique_lock<std::mutex> lock_;
  std::tuple<bool, bool, bool, bool> saved_;
};

// torch's own verdict on one kernel for these inputs.
inline Eligibility torch_selector_allows(std::int64_t index, const at::Tensor& q,
                                         const at::Tensor& k, const at::Tensor& v,
                                         const AttentionArgs& args) {
  WarningCollector warnings;
  std::int64_t chosen = -1;
  std::string error;
  {
    OnlyKernelGuard only(index);
    c10::WarningUtils::WarningHandlerGuard guard(&warnings);
    try {
      chosen =
          at::_fused_sdp_choice(q, k, v, args.mask, args.dropout_p, args.is_causal, args.scale);
    } catch (const c10::Error& e) {
      error = e.what_without_backtrace();
    }
  }
  if (chosen == index) return Eligibility::yes();
  std::string why = "torch's selector refuses it";
  if (!warnings.text.empty())
    why += ": " + warnings.text;
  else if (!error.empty())
    why += ": " + error;
  return Eligibility::no(why);
}

inline bool is_low_precision(const at::Tensor& t) {
  return t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16;
}

// torch's private kernels take masks as additive float biases of q's dtype (the public
// scaled_dot_product_attention converts boolean masks before dispatching to them).
inline std::optional<at::Tensor> as_additive(const std::optional<at::Tensor>& mask,
                                             const at::Tensor& q) {
  if (!mask || mask->scalar_type() != at::kBool) return mask;
  return at::zeros(mask->sizes(), q.options())
      .masked_fill(mask->logical_not(), -std::numeric_limits<double>::infinity());
}

// A boolean mask as the additive bias the memory-efficient and cuDNN kernels take, expanded to
// (B, H, Lq, Lk) with its last dimension padded to a multiple of 16 elements and sliced back, so
// rows start on the alignment those kernels need (as torch's own preprocessing does).
inline at::Tensor as_aligned_bias(const at::Tensor& mask, const at::Tensor& q,
                                  const at::Tensor& k) {
  at::Tensor bias = mask;
  if (mask.scalar_type() == at::kBool)
    bias = at::zeros(mask.sizes(), q.options())
               .masked_fill(mask.logical_not(), -std::numeric_limits<double>::infinity());
  bias = bias.expand({q.size(0), q.size(1), q.size(2), k.size(2)});
  const std::int64_t lk = k.size(2);
  const std::int64_t padded = (lk + 15) / 16 * 16;
  at::Tensor storage = at::empty({q.size(0), q.size(1), q.size(2), padded}, q.options());
  storage.narrow(-1, 0, lk).copy_(bias);
  return storage.narrow(-1, 0, lk);
}

}  // namespace sdpa_detail

/// One of PyTorch's SDPA kernels, forced.
template <class Kernel>
struct Sdpa {
  static constexpr std::string_view name = Kernel::name;

  static Eligibility eligibility(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const AttentionArgs& args) {
    check_qkv(q, k, v, args, name);
    if (Eligibility e = explicit_rules(q, k, v, args); !e) return e;
    if constexpr (requires { Kernel::torch_index; }) {
      if (Kernel::torch_index != 0)
        return sdpa_detail::torch_selector_allows(Kernel::torch_index, q, k, v, args);
    }
    return Eligibility::yes();
  }

  static at::Tensor forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const AttentionArgs& args) {
    check_qkv(q, k, v, args, name);
    require(explicit_rules(q, k, v, args), name);
    try {
      return run(q, k, v, args);
    } catch (const c10::Error& e) {
      // A rule torch checks that the explicit ones do not (hardware generation, alignment).
      throw ConfigError("the " + std::string(name) +
                            " backend cannot run these inputs: " + e.what_without_backtrace(),
                        "attention");
    }
  }

 private:
  static Eligibility explicit_rules(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const AttentionArgs& args) {
    (void)k;
    const bool cuda = q.is_cuda();
    const std::int64_t d = q.size(-1);
    if constexpr (std::is_same_v<Kernel, Flash>) {
      if (!cuda) {
        if (args.dropout_p > 0.0) return Eligibility::no("the CPU flash kernel has no dropout");
        return Eligibility::yes();
      }
      if (!sdpa_detail::is_low_precision(q))
        return Eligibility::no("flash attention on CUDA needs float16 or bfloat16 inputs, got " +
                               std::string(c10::toString(q.scalar_type())));
      if (args.mask) return Eligibility::no("flash attention takes no attention mask");
      if (d > 256 || d % 8 != 0)
        return Eligibility::no(
            "flash attention needs a head dim that is a multiple of 8 and at "
            "most 256, got " +
            std::to_string(d));
      if (v.size(-1) != d)
        return Eligibility::no("flash attention needs equal q/k and v head dims");
    } else if constexpr (std::is_same_v<Kernel, MemEfficient>) {
      if (!cuda) return Eligibility::no("memory-efficient attention runs on CUDA only");
      if (!sdpa_detail::is_low_precision(q) && q.scalar_type() != at::kFloat)
        return Eligibility::no("memory-efficient attention needs float32, float16 or bfloat16");
      const std::int64_t align = q.scalar_type() == at::kFloat ? 4 : 8;
      if (d % align != 0 || v.size(-1) % align != 0)
        return Eligibility::no("memory-efficient attention needs head dims that are multiples of " +
                               std::to_string(align) + " for this dtype, got " + std::to_string(d));
    } else if constexpr (std::is_same_v<Kernel, CuDNN>) {
      if (!cuda) return Eligibility::no("cuDNN attention runs on CUDA only");
      if (!sdpa_detail::is_low_precision(q))
        return Eligibility::no("cuDNN attention needs float16 or bfloat16 inputs, got " +
                               std::string(c10::toString(q.scalar_type())));
      if (d > 256 || d % 8 != 0)
        return Eligibility::no(
            "cuDNN attention needs a head dim that is a multiple of 8 and at "
            "most 256, got " +
            std::to_string(d));
    }
    return Eligibility::yes();
  }

  static at::Tensor run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const AttentionArgs& args) {
    const bool grad =
        at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad());
    if constexpr (std::is_same_v<Kernel, Auto>) {
      if (args.ran != nullptr)
        *args.ran = sdpa_detail::kernel_name(
            at::_fused_sdp_choice(q, k, v, args.mask, args.dropout_p, args.is_causal, args.scale));
      return at::scaled_dot_product_attention(q, k, v, args.mask, args.dropout_p, args.is_causal,
                                              args.scale);
    } else {
      if (args.ran != nullptr) *args.ran = name;
      if constexpr (std::is_same_v<Kernel, MathKernel>) {
        return std::get<0>(at::_scaled_dot_product_attention_math(
            q, k, v, sdpa_detail::as_additive(args.mask, q), args.dropout_p, args.is_causal,
            std::nullopt, args.scale));
      } else if constexpr (std::is_same_v<Kernel, Flash>) {
        if (!q.is_cuda())
          return std::get<0>(at::_scaled_dot_product_flash_attention_for_cpu(
              q, k, v, args.dropout_p, args.is_causal, sdpa_detail::as_additive(args.mask, q),
              args.scale));
        return std::get<0>(at::_scaled_dot_product_flash_attention(
            q, k, v, args.dropout_p, args.is_causal, false, args.scale));
      } else if constexpr (std::is_same_v<Kernel, MemEfficient>) {
        std::optional<at::Tensor> bias;
        if (args.mask) bias = sdpa_detail::as_aligned_bias(*args.mask, q, k);
        return std::get<0>(at::_scaled_dot_product_efficient_attention(
            q, k, v, bias, grad, args.dropout_p, args.is_causal, args.scale));
      } else if constexpr (std::is_same_v<Kernel, CuDNN>) {
        std::optional<at::Tensor> bias;
        if (args.mask) bias = sdpa_detail::as_aligned_bias(*args.mask, q, k);
        return std::get<0>(at::_scaled_dot_product_cudnn_attention(
            q, k, v, bias, grad, args.dropout_p, args.is_causal, false, args.scale));
      } else {
        static_assert(sizeof(Kernel) == 0, "difftrain: unknown Sdpa kernel tag");
      }
    }
  }
};

}  // namespace difftrain::nn::attention
