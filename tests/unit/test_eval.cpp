// The Fréchet distance against closed forms and an independent route, and the image grid's layout.
#include <difftrain/eval/frechet_distance.hpp>
#include <difftrain/io/image_grid.hpp>

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <cmath>

namespace dt = difftrain;
namespace ev = difftrain::eval;

namespace {

ev::GaussianStats stats(const at::Tensor& mean, const at::Tensor& cov) {
  return {mean.to(at::kDouble), cov.to(at::kDouble), 100};
}

TEST(FrechetDistance, IsotropicGaussiansHaveTheClosedForm) {
  const std::int64_t d = 7;
  const at::Tensor mu = at::arange(d, at::kDouble) * 0.3;
  const double s = 1.7;
  // |μ|² + d·(1 − s)² for N(0, I) against N(μ, s²I).
  const double want = mu.pow(2).sum().item<double>() + static_cast<double>(d) * (1 - s) * (1 - s);
  const double got =
      ev::frechet_distance(stats(at::zeros({d}, at::kDouble), at::eye(d, at::kDouble)),
                           stats(mu, s * s * at::eye(d, at::kDouble)));
  EXPECT_NEAR(got, want, 1e-10);
}

TEST(FrechetDistance, DiagonalCovariancesAddSquaredRootDifferences) {
  const at::Tensor a = at::tensor({1.0, 4.0, 9.0, 0.25}, at::kDouble);
  const at::Tensor b = at::tensor({4.0, 1.0, 9.0, 1.0}, at::kDouble);
  const double want = (a.sqrt() - b.sqrt()).pow(2).sum().item<double>();  // 1 + 1 + 0 + 0.25
  const at::Tensor zero = at::zeros({4}, at::kDouble);
  EXPECT_NEAR(ev::frechet_distance(stats(zero, at::diag(a)), stats(zero, at::diag(b))), want,
              1e-10);
}

TEST(FrechetDistance, GeneralCovariancesMatchTheEigenvaluesOfTheirProduct) {
  // tr((ΣaΣb)^½) is the sum of the square roots of ΣaΣb's (real, non-negative) eigenvalues: a
  // route through a non-symmetric eigensolver, independent of the symmetric one the library uses.
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(3);
  const std::int64_t d = 16;
  const at::Tensor xa = at::randn({d, d}, gen, at::kDouble),
                   xb = at::randn({d, d}, gen, at::kDouble);
  const at::Tensor ca = xa.mm(xa.t()) / d, cb = xb.mm(xb.t()) / d + 0.1 * at::eye(d, at::kDouble);
  const at::Tensor ma = at::randn({d}, gen, at::kDouble), mb = at::randn({d}, gen, at::kDouble);
  const double tr_sqrt =
      at::real(at::linalg_eigvals(ca.mm(cb))).clamp_min(0).sqrt().sum().item<double>();
  const double want = (ma - mb).pow(2).sum().item<double>() + ca.trace().item<double>() +
                      cb.trace().item<double>() - 2 * tr_sqrt;
  EXPECT_NEAR(ev::frechet_distance(stats(ma, ca), stats(mb, cb)), want, 1e-8 * want);
  EXPECT_NEAR(ev::frechet_distance(stats(ma, ca), stats(ma, ca)), 0.0, 1e-8);
}

TEST(FrechetDistance, FeatureSetsGiveTheirMeanAndUnbiasedCovariance) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(5);
  const at::Tensor f = at::randn({300, 5}, gen, at::kFloat) * 2 + 1;
  const auto s = ev::gaussian_stats(f);
  EXPECT_EQ(s.count, 300);
  EXPECT_TRUE(at::allclose(s.mean, f.to(at::kDouble).mean(0)));
  EXPECT_TRUE(at::allclose(s.cov, at::cov(f.to(at::kDouble).t())));
  // Two large samples of the same distribution are close; a shifted one is not.
  const at::Tensor g = at::randn({20000, 5}, gen, at::kFloat),
                   h = at::randn({20000, 5}, gen, at::kFloat);
  EXPECT_LT(ev::frechet_distance(g, h), 0.01);
  EXPECT_NEAR(ev::frechet_distance(g, h + 1), 5.0, 0.1);
}

TEST(FrechetDistance, BadInputIsATypedErrorThatSaysWhat) {
  EXPECT_THROW((void)ev::gaussian_stats(at::ones({1, 4})), dt::ShapeError);
  EXPECT_THROW((void)ev::gaussian_stats(at::ones({4})), dt::ShapeError);
  at::Tensor nan = at::zeros({3, 2});
  nan[1][1] = std::nan("");
  try {
    (void)ev::frechet_distance(at::ones({3, 2}), nan);
    FAIL() << "expected NumericError";
  } catch (const dt::NumericError& e) {
    EXPECT_NE(std::string(e.what()).find("features_b"), std::string::npos) << e.what();
  }
  EXPECT_THROW((void)ev::frechet_distance(at::randn({5, 3}), at::randn({5, 4})), dt::ShapeError);
}

TEST(ImageGrid, LaysImagesOutInRowsWithPadding) {
  // Three 2×2 grey images at -1, 0 and 1, two per row, one pixel of padding.
  const at::Tensor images = at::tensor({-1.0F, 0.0F, 1.0F}).view({3, 1, 1, 1}).expand({3, 1, 2, 2});
  const auto img = dt::io::image_grid(images, {.columns = 2, .padding = 1, .background = 7});
  ASSERT_EQ(img.width, 7u);
  ASSERT_EQ(img.height, 7u);
  auto px = [&](std::uint32_t x, std::uint32_t y) { return static_cast<int>(img.at(x, y)[0]); };
  EXPECT_EQ(px(0, 0), 7);
  EXPECT_EQ(px(1, 1), 0);
  EXPECT_EQ(px(2, 2), 0);
  EXPECT_EQ(px(3, 1), 7);  // padding between columns
  EXPECT_EQ(px(4, 1), 128);
  EXPECT_EQ(px(5, 2), 128);
  EXPECT_EQ(px(1, 4), 255);
  EXPECT_EQ(px(4, 4), 7);           // no fourth image
  EXPECT_EQ(img.at(4, 1)[1], 128);  // grey to all three channels
}

TEST(ImageGrid, RgbChannelsAndClampingAndErrors) {
  at::Tensor rgb = at::zeros({1, 3, 1, 1});
  rgb[0][0][0][0] = 5.0F;   // clamps to 255
  rgb[0][1][0][0] = -5.0F;  // clamps to 0
  const auto img = dt::io::image_grid(rgb, {.padding = 0});
  EXPECT_EQ(img.at(0, 0)[0], 255);
  EXPECT_EQ(img.at(0, 0)[1], 0);
  EXPECT_EQ(img.at(0, 0)[2], 128);
  EXPECT_THROW((void)dt::io::image_grid(at::zeros({2, 2, 4, 4})), dt::ShapeError);
  EXPECT_THROW((void)dt::io::image_grid(at::zeros({4, 4})), dt::ShapeError);
  EXPECT_THROW((void)dt::io::image_grid(at::zeros({1, 1, 4, 4}), {.columns = 0}), dt::ConfigError);
}

}  // namespace
