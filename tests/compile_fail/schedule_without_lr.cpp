// expect: an LR schedule needs `double lr\(std::int64_t step, double base_lr\) const`
#include <difftrain/schedule/warmup.hpp>

struct NoLr {
  static constexpr std::string_view name = "no_lr";
  struct Options {};
  explicit NoLr(const Options&) {}
  double value(std::int64_t) const { return 1.0; }
};

int main() {
  difftrain::schedule::WithWarmup<difftrain::schedule::LinearWarmup, NoLr> s({});
  return s.lr(0, 1.0) > 0 ? 0 : 1;
}
