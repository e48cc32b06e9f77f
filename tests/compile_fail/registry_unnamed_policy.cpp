// expect: this policy has no name; add `static constexpr std::string_view name
// A policy without a `name` cannot enter a registry; the error says what to add.
#include <difftrain/core/registry.hpp>

struct Relu {
  static constexpr std::string_view name = "relu";
};
struct Anonymous {};

int main() {
  constexpr difftrain::Registry<difftrain::type_list<Relu, Anonymous>> r{"activation"};
  return static_cast<int>(r.names.size());
}
