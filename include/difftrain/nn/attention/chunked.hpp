#pragma once
// Query-chunked attention: runs the inner backend on slices of at most QueryChunk queries and
// concatenates, so the score matrix held at once is QueryChunk × Lk instead of Lq × Lk (the way
// xformers' memory-efficient path bounds memory on any device). Exact: each query's softmax only
// involves its own row of scores.

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "difftrain/nn/attention/concepts.hpp"
#include "difftrain/nn/attention/math.hpp"

namespace difftrain::nn::attention {

template <AttentionBackend Inner = Math, std::int64_t QueryChunk = 1024>
struct Chunked {
  static_assert(QueryChunk > 0, "difftrain: Chunked needs a positive query chunk size");
  static constexpr std::string_view name = "chunked";

  static Eligibility eligibility(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const AttentionArgs& args) {
    return Inner::eligibility(q, k, v, args);
  }

  static at::Tensor forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const AttentionArgs& args) {
    check_qkv(q, k, v, args, name);
    const std::int64_t lq = q.size(2);
    std::string inner_ran;
    if (lq <= QueryChunk) {
      AttentionArgs one = args;
      one.ran = &inner_ran;
      at::Tensor out = Inner::forward(q, k, v, one);
      if (args.ran != nullptr) *args.ran = "chunked(" + inner_ran + ")";
      return out;
    }
    // The causal mask depends on each query's absolute position: make it explicit so slices keep
    // it.
    std::optional<at::Tensor> mask = args.mask;
    if (args.is_causal) {
      at::Tensor causal = at::ones({lq, k.size(2)}, q.options().dtype(at::kBool)).tril();
      mask = mask ? (mask->scalar_type() == at::kBool
                         ? at::logical_and(*mask, causal)
                         : mask->masked_fill(causal.logical_not(),
                                             -std::numeric_limits<double>::infinity()))
                  : causal;
    }
    std::vector<at::Tensor> parts;
    for (std::int64_t start = 0; start < lq; start += QueryChunk) {
      const std::int64_t len = std::min(QueryChunk, lq - start);
      AttentionArgs part = args;
      part.is_causal = false;
      part.ran = &inner_ran;
      if (mask) {
        // Slice the query dimension only where the mask has one (size 1 broadcasts).
        part.mask =
            (mask->dim() >= 2 && mask->size(-2) == lq) ? mask->narrow(-2, start, len) : *mask;
      }
      parts.push_back(Inner::forward(q.narrow(2, start, len), k, v, part));
    }
    if (args.ran != nullptr) *args.ran = "chunked(" + inner_ran + ")";
    return at::cat(parts, 2);
  }
};

}  // namespace difftrain::nn::attention
