// The smallest difftrain program: looks a policy up by name and runs LibTorch on the best device.
#include <difftrain/difftrain.hpp>

#include <ATen/ATen.h>
#include <torch/cuda.h>

#include <iostream>

int main() {
  std::cout << "difftrain " << difftrain::version_string << '\n';
  const bool cuda = torch::cuda::is_available();
  const at::Device device = cuda ? at::Device(at::kCUDA) : at::Device(at::kCPU);
  const at::Tensor x = at::randn({256, 256}, at::TensorOptions().device(device));
  std::cout << "device: " << device << ", |x x^T| = " << x.matmul(x.t()).norm().item<double>()
            << '\n';
  return 0;
}
