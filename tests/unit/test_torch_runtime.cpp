// The LibTorch the build found works on every device the machine has. CUDA cases skip (and
// say so) where no GPU is present; they run on the GPU machine through scripts/gpu-check.sh.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

TEST(TorchRuntime, CpuTensorMath) {
  const at::Tensor a = at::arange(6, at::kFloat).reshape({2, 3});
  EXPECT_EQ(a.sum().item<float>(), 15.0F);
  EXPECT_TRUE(
      at::allclose(a.matmul(a.t()), at::tensor({5.0F, 14.0F, 14.0F, 50.0F}).reshape({2, 2})));
}

TEST(TorchRuntime, CudaTensorMath) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device on this machine";
  const at::Tensor a = at::arange(6, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA));
  EXPECT_EQ(a.sum().item<float>(), 15.0F);
  const at::Tensor b =
      at::randn({64, 64}, at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16));
  EXPECT_TRUE(at::allclose(b.matmul(b).to(at::kFloat).cpu(),
                           b.cpu().to(at::kFloat).matmul(b.cpu().to(at::kFloat)), 5e-2, 5e-1));
}
