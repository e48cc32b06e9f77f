#pragma once
// An optimizer whose step divides the gradients by the loss scale itself (torch's fused Adam and
// AdamW kernels take `grad_scale`): GradScaler then only checks the still-scaled gradients for
// inf/NaN and hands it the scale, instead of rewriting every gradient in an unscale pass first.

#include <ATen/core/Tensor.h>

namespace difftrain::train {

class ScaledStepOptimizer {
 public:
  virtual ~ScaledStepOptimizer() = default;
  /// One step with every gradient divided by `grad_scale` (a one-element float32 tensor).
  virtual void step_scaled(const at::Tensor& grad_scale) = 0;

 protected:
  ScaledStepOptimizer() = default;
  ScaledStepOptimizer(const ScaledStepOptimizer&) = default;
  ScaledStepOptimizer& operator=(const ScaledStepOptimizer&) = default;
};

}  // namespace difftrain::train
