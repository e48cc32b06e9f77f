#pragma once
// The Fréchet distance between two Gaussians fitted to feature sets (the measure behind FID):
//   d² = |μa − μb|² + tr(Σa) + tr(Σb) − 2·tr((Σa^½ Σb Σa^½)^½).
// Computed in float64 with symmetric eigendecompositions only: Σa^½ Σb Σa^½ is symmetric positive
// semi-definite, so the trace of its square root is the sum of the square roots of its eigenvalues
// (no general matrix square root, no complex parts to discard). Tiny negative eigenvalues from
// rounding are clamped to zero.

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "difftrain/core/error.hpp"

namespace difftrain::eval {

/// Mean and (unbiased) covariance of a feature set.
struct GaussianStats {
  at::Tensor mean;  ///< (D,) float64
  at::Tensor cov;   ///< (D, D) float64
  std::int64_t count = 0;
};

/// Fits a Gaussian to `features` (N, D), N ≥ 2. Non-finite features are a NumericError.
inline GaussianStats gaussian_stats(const at::Tensor& features,
                                    const std::string& where = "features") {
  if (features.dim() != 2)
    throw ShapeError("expects (N, D) features, got " + c10::str(features.sizes()), where);
  if (features.size(0) < 2)
    throw ShapeError("needs at least 2 samples to estimate a covariance, got " +
                         std::to_string(features.size(0)),
                     where);
  const at::Tensor f = features.detach().to(at::kCPU, at::kDouble);
  if (!at::isfinite(f).all().item<bool>()) throw NumericError("holds non-finite values", where);
  const at::Tensor mean = f.mean(0);
  const at::Tensor centred = f - mean;
  const at::Tensor cov = centred.t().mm(centred) / static_cast<double>(f.size(0) - 1);
  return {mean, cov, f.size(0)};
}

namespace frechet_detail {
/// The symmetric PSD square root of a symmetric matrix (eigenvalues clamped at 0).
inline at::Tensor sqrt_psd(const at::Tensor& m) {
  const at::Tensor sym = (m + m.t()) * 0.5;
  auto [values, vectors] = at::linalg_eigh(sym);
  return vectors.mm(at::diag(values.clamp_min(0).sqrt())).mm(vectors.t());
}
}  // namespace frechet_detail

/// The Fréchet distance d² between the Gaussians `a` and `b`.
inline double frechet_distance(const GaussianStats& a, const GaussianStats& b) {
  if (a.mean.sizes() != b.mean.sizes() || a.cov.dim() != 2 || b.cov.sizes() != a.cov.sizes() ||
      a.cov.size(0) != a.mean.size(0))
    throw ShapeError("statistics of different dimensions: mean " + c10::str(a.mean.sizes()) +
                         " / cov " + c10::str(a.cov.sizes()) + " vs mean " +
                         c10::str(b.mean.sizes()) + " / cov " + c10::str(b.cov.sizes()),
                     "frechet_distance");
  const at::Tensor ma = a.mean.to(at::kDouble), mb = b.mean.to(at::kDouble);
  const at::Tensor ca = a.cov.to(at::kDouble), cb = b.cov.to(at::kDouble);
  const at::Tensor root_a = frechet_detail::sqrt_psd(ca);
  const at::Tensor inner = root_a.mm(cb).mm(root_a);
  const at::Tensor eig = at::linalg_eigvalsh((inner + inner.t()) * 0.5);
  const double tr_sqrt = eig.clamp_min(0).sqrt().sum().item<double>();
  const double d = (ma - mb).pow(2).sum().item<double>() + ca.trace().item<double>() +
                   cb.trace().item<double>() - 2.0 * tr_sqrt;
  if (!std::isfinite(d)) throw NumericError("is not finite", "frechet_distance");
  return std::max(d, 0.0);
}

/// The Fréchet distance between Gaussians fitted to two feature sets.
inline double frechet_distance(const at::Tensor& features_a, const at::Tensor& features_b) {
  return frechet_distance(gaussian_stats(features_a, "frechet_distance features_a"),
                          gaussian_stats(features_b, "frechet_distance features_b"));
}

}  // namespace difftrain::eval
