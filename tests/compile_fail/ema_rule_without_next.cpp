// expect: an EMA decay rule needs `ema::Action next\(\)`
#include <difftrain/ema/moving_average.hpp>

struct NoNext {
  static constexpr std::string_view name = "no_next";
  struct Options {};
  explicit NoNext(const Options&) {}
  nlohmann::json state() const { return {}; }
  void load_state(const nlohmann::json&) {}
};

int main() {
  torch::nn::Module m;
  difftrain::ema::Ema<NoNext> e(m);
  return 0;
}
