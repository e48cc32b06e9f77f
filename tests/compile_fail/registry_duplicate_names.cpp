// expect: two policies in the list share a name
#include <difftrain/core/registry.hpp>

struct Relu {
  static constexpr std::string_view name = "relu";
};
struct AlsoRelu {
  static constexpr std::string_view name = "relu";
};

int main() {
  constexpr difftrain::Registry<difftrain::type_list<Relu, AlsoRelu>> r{"activation"};
  return static_cast<int>(r.names.size());
}
