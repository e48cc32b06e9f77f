// LibTorch alone: the floor every LibTorch program pays.
#include <torch/torch.h>

int main() { return torch::ones({2, 2}).sum().item<float>() == 4.0F ? 0 : 1; }
