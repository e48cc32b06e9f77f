// Everything: difftrain's umbrella header.
#include <difftrain/difftrain.hpp>

int main() { return at::ones({2, 2}).sum().item<float>() == 4.0F ? 0 : 1; }
