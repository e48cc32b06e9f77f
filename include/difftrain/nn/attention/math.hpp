#pragma once
// The reference backend: softmax(Q Kᵀ · scale + mask) V written out, computed in float32 for half
// and bfloat16 inputs. Every other backend is tested against it. Memory is O(Lq · Lk) per head.

#include <ATen/ATen.h>

#include <limits>
#include <string_view>

#include "difftrain/nn/attention/concepts.hpp"

namespace difftrain::nn::attention {

struct Math {
  static constexpr std::string_view name = "math";

  static Eligibility eligibility(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const AttentionArgs& args) {
    check_qkv(q, k, v, args, name);
    return Eligibility::yes();
  }

  static at::Tensor forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const AttentionArgs& args) {
    check_qkv(q, k, v, args, name);
    if (args.ran != nullptr) *args.ran = name;
    const bool low = q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16;
    const at::ScalarType compute = low ? at::kFloat : q.scalar_type();
    at::Tensor scores =
        at::matmul(q.to(compute), k.to(compute).transpose(-2, -1)) * args.scale_for(q);
    const double neg_inf = -std::numeric_limits<double>::infinity();
    if (args.is_causal) {
      const at::Tensor keep = at::ones({q.size(2), k.size(2)}, q.options().dtype(at::kBool)).tril();
      scores = scores.masked_fill(keep.logical_not(), neg_inf);
    }
    if (args.mask) {
      const at::Tensor& m = *args.mask;
      scores = m.scalar_type() == at::kBool ? scores.masked_fill(m.logical_not(), neg_inf)
                                            : scores + m.to(compute);
    }
    at::Tensor weights = at::softmax(scores, -1);
    if (args.dropout_p > 0.0) weights = at::dropout(weights, args.dropout_p, /*train=*/true);
    return at::matmul(weights, v.to(compute)).to(q.scalar_type());
  }
};

}  // namespace difftrain::nn::attention
