// expect: an attention backend needs `static Eligibility eligibility
// An attention backend that can compute but cannot say whether it may run.
#include <difftrain/nn/blocks/cross_attention.hpp>

struct Broken {
  static constexpr std::string_view name = "broken";
  static at::Tensor forward(const at::Tensor& q, const at::Tensor&, const at::Tensor&,
                            const difftrain::nn::attention::AttentionArgs&) {
    return q;
  }
};

int main() {
  difftrain::nn::blocks::CrossAttention<Broken> m(
      difftrain::nn::blocks::CrossAttentionOptions{8, std::nullopt, 2, 4, 0.0});
  return m.is_empty() ? 1 : 0;
}
