// A name looked up at run time (config files, checkpoints) should cost next to nothing compared
// with calling the policy directly.
#include <benchmark/benchmark.h>
#include <difftrain/core/registry.hpp>

#include <string>

namespace {
struct A {
  static constexpr std::string_view name = "linear";
  static double f(double x) { return x; }
};
struct B {
  static constexpr std::string_view name = "relu";
  static double f(double x) { return x > 0 ? x : 0; }
};
struct C {
  static constexpr std::string_view name = "leakyrelu";
  static double f(double x) { return x > 0 ? x : 0.01 * x; }
};
struct D {
  static constexpr std::string_view name = "swish";
  static double f(double x) { return x * 0.5; }
};
constexpr difftrain::Registry<difftrain::type_list<A, B, C, D>> registry{"activation"};

void registry_lookup_baseline(benchmark::State& state) {
  double x = 1.0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(x = D::f(x) + 1.0);
  }
}
void registry_lookup_difftrain(benchmark::State& state) {
  std::string name = "swish";  // the last entry: the worst case for a linear scan
  benchmark::DoNotOptimize(name);
  double x = 1.0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(
        x = registry.visit(name, [x](auto tag) { return decltype(tag)::type::f(x); }) + 1.0);
  }
}
}  // namespace

BENCHMARK(registry_lookup_baseline)->Name("registry_lookup/baseline");
BENCHMARK(registry_lookup_difftrain)->Name("registry_lookup/difftrain");
