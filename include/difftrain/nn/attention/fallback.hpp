#pragma once
// The first backend in the list that can run the inputs, decided per call. Pass
// AttentionArgs::ran to learn which one ran; ask `choose()` without running anything. When none
// can run, the ConfigError lists every backend's reason.

#include <ATen/ATen.h>

#include <string>
#include <string_view>

#include "difftrain/nn/attention/concepts.hpp"

namespace difftrain::nn::attention {

template <AttentionBackend... Backends>
struct Fallback {
  static_assert(sizeof...(Backends) > 0, "difftrain: Fallback needs at least one backend");
  static constexpr std::string_view name = "fallback";

  /// The name of the backend that would run, or the reasons none can.
  static Eligibility choose(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const AttentionArgs& args, std::string* chosen = nullptr) {
    std::string reasons;
    bool found = false;
    (
        [&] {
          if (found) return;
          const Eligibility e = Backends::eligibility(q, k, v, args);
          if (e) {
            found = true;
            if (chosen != nullptr) *chosen = Backends::name;
          } else {
            reasons +=
                (reasons.empty() ? "" : "; ") + std::string(Backends::name) + ": " + e.reason;
          }
        }(),
        ...);
    return found ? Eligibility::yes() : Eligibility::no(reasons);
  }

  static Eligibility eligibility(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const AttentionArgs& args) {
    return choose(q, k, v, args);
  }

  static at::Tensor forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const AttentionArgs& args) {
    at::Tensor out;
    std::string reasons;
    const bool done = (try_one<Backends>(q, k, v, args, out, reasons) || ...);
    if (!done)
      throw ConfigError("no backend in the fallback list can run these inputs: " + reasons,
                        "attention");
    return out;
  }

 private:
  template <class B>
  static bool try_one(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const AttentionArgs& args, at::Tensor& out, std::string& reasons) {
    const Eligibility e = B::eligibility(q, k, v, args);
    if (!e) {
      reasons += (reasons.empty() ? "" : "; ") + std::string(B::name) + ": " + e.reason;
      return false;
    }
    out = B::forward(q, k, v, args);
    return true;
  }
};

}  // namespace difftrain::nn::attention
