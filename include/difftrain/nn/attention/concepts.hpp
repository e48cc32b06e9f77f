#pragma once
// The attention-backend family. A backend computes softmax(Q Kᵀ · scale + mask) V on tensors laid
// out (batch, heads, length, head_dim), as torch's scaled_dot_product_attention does:
//   static constexpr std::string_view name;
//   static Eligibility eligibility(q, k, v, const AttentionArgs&);   why it can or cannot run
//   static at::Tensor forward(q, k, v, const AttentionArgs&);        throws ConfigError if it
//   cannot
// Backends are stateless types; blocks take one as a template parameter.

#include <ATen/ATen.h>

#include <cmath>
#include <concepts>
#include <optional>
#include <string>
#include <string_view>

#include "difftrain/core/concepts.hpp"
#include "difftrain/core/error.hpp"

namespace difftrain::nn::attention {

/// What a call asks for besides Q, K, V.
struct AttentionArgs {
  /// Boolean (true = attend) or additive float mask, broadcastable to (B, H, Lq, Lk).
  std::optional<at::Tensor> mask;
  double dropout_p = 0.0;
  /// Causal masking aligned at the top left, as torch's is_causal.
  bool is_causal = false;
  /// Defaults to 1 / sqrt(head_dim).
  std::optional<double> scale;
  /// When set, receives the name of the kernel that actually ran (for Fallback and Sdpa<Auto>).
  std::string* ran = nullptr;

  [[nodiscard]] double scale_for(const at::Tensor& q) const {
    return scale.value_or(1.0 / std::sqrt(static_cast<double>(q.size(-1))));
  }
};

/// Whether a backend can run these inputs, and if not, why.
struct Eligibility {
  bool ok = true;
  std::string reason;

  static Eligibility yes() { return {}; }
  static Eligibility no(std::string why) { return {false, std::move(why)}; }
  explicit operator bool() const { return ok; }
};

template <class B>
concept AttentionBackend = NamedPolicy<B> && requires(const at::Tensor& t, const AttentionArgs& a) {
  { B::eligibility(t, t, t, a) } -> std::same_as<Eligibility>;
  { B::forward(t, t, t, a) } -> std::same_as<at::Tensor>;
};

template <class B>
consteval bool diagnose_attention_backend() {
  static_assert(diagnose_named_policy<B>());
  static_assert(
      requires(const at::Tensor& t, const AttentionArgs& a) {
        { B::eligibility(t, t, t, a) } -> std::same_as<Eligibility>;
      },
      "difftrain: an attention backend needs `static Eligibility eligibility(const at::Tensor& q, "
      "const at::Tensor& k, const at::Tensor& v, const AttentionArgs&)`");
  static_assert(
      requires(const at::Tensor& t, const AttentionArgs& a) {
        { B::forward(t, t, t, a) } -> std::same_as<at::Tensor>;
      },
      "difftrain: an attention backend needs `static at::Tensor forward(const at::Tensor& q, "
      "const at::Tensor& k, const at::Tensor& v, const AttentionArgs&)`");
  return AttentionBackend<B>;
}

/// Checks the shapes every backend needs; a mismatch is a ShapeError naming both shapes.
inline void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const AttentionArgs& args, std::string_view backend) {
  const std::string where = "attention (" + std::string(backend) + ")";
  auto shape = [](const at::Tensor& t) { return c10::str(t.sizes()); };
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4)
    throw ShapeError("q, k and v must be (batch, heads, length, head_dim); got q " + shape(q) +
                         ", k " + shape(k) + ", v " + shape(v),
                     where);
  if (k.size(0) != q.size(0) || v.size(0) != q.size(0) || k.size(1) != q.size(1) ||
      v.size(1) != q.size(1))
    throw ShapeError(
        "batch and heads differ: q " + shape(q) + ", k " + shape(k) + ", v " + shape(v), where);
  if (k.size(3) != q.size(3))
    throw ShapeError("q and k head dims differ: q " + shape(q) + ", k " + shape(k), where);
  if (v.size(2) != k.size(2))
    throw ShapeError("k and v lengths differ: k " + shape(k) + ", v " + shape(v), where);
  if (q.scalar_type() != k.scalar_type() || q.scalar_type() != v.scalar_type())
    throw ShapeError("q, k and v dtypes differ", where);
  if (args.mask) {
    const at::Tensor& m = *args.mask;
    const std::vector<std::int64_t> full = {q.size(0), q.size(1), q.size(2), k.size(2)};
    bool fits = m.dim() <= 4;
    for (std::int64_t i = 1; fits && i <= m.dim(); ++i) {
      const auto s = m.size(-i);
      fits = s == 1 || s == full[static_cast<std::size_t>(4 - i)];
    }
    if (!fits)
      throw ShapeError("mask " + shape(m) + " does not broadcast to (B, H, Lq, Lk) = " +
                           c10::str(at::IntArrayRef(full)),
                       where);
    if (m.scalar_type() != at::kBool && m.scalar_type() != q.scalar_type())
      throw ShapeError("a float mask must have the dtype of q", where);
  }
  if (args.dropout_p < 0.0 || args.dropout_p >= 1.0)
    throw ConfigError("dropout_p must be in [0, 1), got " + std::to_string(args.dropout_p), where);
}

/// Throws ConfigError with the reason when `e` says no.
inline void require(const Eligibility& e, std::string_view backend) {
  if (!e.ok)
    throw ConfigError(
        "the " + std::string(backend) + " backend cannot run these inputs: " + e.reason,
        "attention");
}

}  // namespace difftrain::nn::attention
