#pragma once
// Stateless activations: each is the direct ATen call, so a policy costs what the torch call
// costs. Names and defaults follow torch.nn's classes (lowercased), which is how the web UI's
// hypernetwork files name them.

#include <ATen/ATen.h>

#include <cstdint>
#include <limits>
#include <string>
#include <string_view>

#include "difftrain/core/error.hpp"
#include "difftrain/nn/activation/concepts.hpp"

namespace difftrain::nn::activation {

/// Marks a softmax-family `dim` left to torch's legacy implicit choice (torch's `dim=None`).
inline constexpr std::int64_t kImplicitDim = std::numeric_limits<std::int64_t>::min();

/// "linear": the identity (torch.nn.Identity).
struct Linear {
  static constexpr std::string_view name = "linear";
  struct Options {};
  static at::Tensor forward(const at::Tensor& x, const Options& /*unused*/) { return x; }
};

struct ReLU {
  static constexpr std::string_view name = "relu";
  struct Options {};
  static at::Tensor forward(const at::Tensor& x, const Options& /*unused*/) { return at::relu(x); }
};

struct ReLU6 {
  static constexpr std::string_view name = "relu6";
  struct Options {};
  static at::Tensor forward(const at::Tensor& x, const Options& /*unused*/) {
    return at::hardtanh(x, 0.0, 6.0);
  }
};

struct LeakyReLU {
  static constexpr std::string_view name = "leakyrelu";
  struct Options {
    double negative_slope = 0.01;
  };
  static at::Tensor forward(const at::Tensor& x, const Options& o) {
    return at::leaky_relu(x, o.negative_slope);
  }
};

struct ELU {
  static constexpr std::string_view name = "elu";
  struct Options {
    double alpha = 1.0;
  };
  static at::Tensor forward(const at::Tensor& x, const Options& o) { return at::elu(x, o.alpha); }
};

struct CELU {
  static constexpr std::string_view name = "celu";
  struct Options {
    double alpha = 1.0;
  };
  static at::Tensor forward(const at::Tensor& x, const Options& o) { return at::celu(x, o.alpha); }
};

struct SELU {
  static constexpr std::string_view name = "selu";
  struct Options {};
  static at::Tensor forward(const at::Tensor& x, const Options& /*unused*/) { return at::selu(x); }
};

/// "gelu"; `approximate` is "none" (exact erf form) or "tanh".
struct GELU {
  static constexpr std::string_view name = "gelu";
  struct Options {
    std::string_view approximate = "none";
  };
  static at::Tensor forward(const at::Tensor& x, const Options& o) {
    return at::gelu(x, o.approximate);
  }
};

/// "gelu_tanh": GELU with the tanh approximation, reachable by name.
struct GELUTanh {
  static constexpr std::string_view name = "gelu_tanh";
  struct Options {};
  static at::Tensor forward(const at::Tensor& x, const Options& /*unused*/) {
    return at::gelu(x, "tanh");
  }
};

/// "quick_gelu": x·σ(1.702·x), GELU's sigmoid approximation (CLIP's quick_gelu; diffusers'
/// feed-forward calls it "geglu-approximate", ApproximateGELU, though nothing is gated).
struct QuickGELU {
  static constexpr std::string_view name = "quick_gelu";
  struct Options {};
  static at::Tensor forward(const at::Tensor& x, const Options& /*unused*/) {
    return x * at::sigmoid(1.702 * x);
  }
};

/// "swish" maps to Hardswish, as in the web UI's hypernetworks: files that say "swish" mean it.
/// The smooth x·sigmoid(x) is "silu".
struct Swish {
  static constexpr std::string_view name = "swish";
  struct Options {};
  static at::Tensor forward(const at::Tensor& x, const Options& /*unused*/) {
    return at::hardswish(x);
  }
};

struct Hardswish {
  static constexpr std::string_view name = "hardswish";
  struct Options {};
  static at::Tensor forward(const at::Tensor& x, const Options& /*unused*/) {
    return at::hardswish(x);
  }
};

struct SiLU {
  static constexpr std::string_view name = "silu";
  struct Options {};
  static at::Tensor forward(const at::Tensor& x, const Options& /*unused*/) { return at::silu(x); }
};

struct Mish {
  static constexpr std::string_view name = "mish";
  struct Options {};
  static at::Tensor forward(const at::Tensor& x, const Options& /*unused*/) { return at::mish(x); }
};

struct Tanh {
  static constexpr std::string_view name = "tanh";
  struct Options {};
  static at::Tensor forward(const at::Tensor& x, const Options& /*unused*/) { return at::tanh(x); }
};

struct Sigmoid {
  static constexpr std::string_view name = "sigmoid";
  struct Options {};
  static at::Tensor forward(const at::Tensor& x, const Options& /*unused*/) {
    return at::sigmoid(x);
  }
};

struct Hardsigmoid {
  static constexpr std::string_view name = "hardsigmoid";
  struct Options {};
  static at::Tensor forward(const at::Tensor& x, const Options& /*unused*/) {
    return at::hardsigmoid(x);
  }
};

struct Hardtanh {
  static constexpr std::string_view name = "hardtanh";
  struct Options {
    double min_val = -1.0;
    double max_val = 1.0;
  };
  static at::Tensor forward(const at::Tensor& x, const Options& o) {
    return at::hardtanh(x, o.min_val, o.max_val);
  }
};

struct Hardshrink {
  static constexpr std::string_view name = "hardshrink";
  struct Options {
    double lambd = 0.5;
  };
  static at::Tensor forward(const at::Tensor& x, const Options& o) {
    return at::hardshrink(x, o.lambd);
  }
};

struct Softshrink {
  static constexpr std::string_view name = "softshrink";
  struct Options {
    double lambd = 0.5;
  };
  static at::Tensor forward(const at::Tensor& x, const Options& o) {
    return at::softshrink(x, o.lambd);
  }
};

struct LogSigmoid {
  static constexpr std::string_view name = "logsigmoid";
  struct Options {};
  static at::Tensor forward(const at::Tensor& x, const Options& /*unused*/) {
    return at::log_sigmoid(x);
  }
};

struct Softplus {
  static constexpr std::string_view name = "softplus";
  struct Options {
    double beta = 1.0;
    double threshold = 20.0;
  };
  static at::Tensor forward(const at::Tensor& x, const Options& o) {
    return at::softplus(x, o.beta, o.threshold);
  }
};

struct Softsign {
  static constexpr std::string_view name = "softsign";
  struct Options {};
  static at::Tensor forward(const at::Tensor& x, const Options& /*unused*/) {
    return x / (x.abs() + 1);
  }
};

struct Tanhshrink {
  static constexpr std::string_view name = "tanhshrink";
  struct Options {};
  static at::Tensor forward(const at::Tensor& x, const Options& /*unused*/) {
    return x - at::tanh(x);
  }
};

/// torch.nn.Threshold has no defaults (the web UI cannot build it by name alone); here both
/// default to 0, which makes it a ReLU until set.
struct Threshold {
  static constexpr std::string_view name = "threshold";
  struct Options {
    double threshold = 0.0;
    double value = 0.0;
  };
  static at::Tensor forward(const at::Tensor& x, const Options& o) {
    return at::threshold(x, o.threshold, o.value);
  }
};

/// Gated linear unit: halves `dim`, a * sigmoid(b).
struct GLU {
  static constexpr std::string_view name = "glu";
  struct Options {
    std::int64_t dim = -1;
  };
  static at::Tensor forward(const at::Tensor& x, const Options& o) { return at::glu(x, o.dim); }
};

namespace detail {
/// torch.nn.Softmax(dim=None)'s legacy choice of dimension: 0 for 0-, 1- and 3-d input, else 1.
inline std::int64_t implicit_softmax_dim(const at::Tensor& x, std::int64_t dim) {
  if (dim != kImplicitDim) return dim;
  const auto d = x.dim();
  return (d == 0 || d == 1 || d == 3) ? 0 : 1;
}
}  // namespace detail

struct Softmax {
  static constexpr std::string_view name = "softmax";
  struct Options {
    std::int64_t dim = kImplicitDim;  ///< kImplicitDim: torch's legacy implicit choice
  };
  static at::Tensor forward(const at::Tensor& x, const Options& o) {
    return at::softmax(x, detail::implicit_softmax_dim(x, o.dim));
  }
};

struct Softmin {
  static constexpr std::string_view name = "softmin";
  struct Options {
    std::int64_t dim = kImplicitDim;
  };
  static at::Tensor forward(const at::Tensor& x, const Options& o) {
    return at::softmax(-x, detail::implicit_softmax_dim(x, o.dim));
  }
};

struct LogSoftmax {
  static constexpr std::string_view name = "logsoftmax";
  struct Options {
    std::int64_t dim = kImplicitDim;
  };
  static at::Tensor forward(const at::Tensor& x, const Options& o) {
    return at::log_softmax(x, detail::implicit_softmax_dim(x, o.dim));
  }
};

/// Softmax over channels of a (C, H, W) or (N, C, H, W) tensor.
struct Softmax2d {
  static constexpr std::string_view name = "softmax2d";
  struct Options {};
  static at::Tensor forward(const at::Tensor& x, const Options& /*unused*/) {
    if (x.dim() != 3 && x.dim() != 4)
      throw ShapeError("expects a (C, H, W) or (N, C, H, W) tensor, got " +
                           std::to_string(x.dim()) + " dimensions",
                       "activation softmax2d");
    return at::softmax(x, -3);
  }
};

/// GEGLU's gating as an activation: splits the last dimension in halves (x, gate) and returns
/// x * gelu(gate). The feed-forward block's `GEGLU` puts a projection in front of it.
struct GEGLU {
  static constexpr std::string_view name = "geglu";
  struct Options {
    std::string_view approximate = "none";
  };
  static at::Tensor forward(const at::Tensor& x, const Options& o) {
    if (x.dim() == 0 || x.size(-1) % 2 != 0)
      throw ShapeError(
          "needs an even last dimension to split into (x, gate), got shape " + c10::str(x.sizes()),
          "activation geglu");
    const auto halves = x.chunk(2, -1);
    return halves[0] * at::gelu(halves[1], o.approximate);
  }
};

}  // namespace difftrain::nn::activation
