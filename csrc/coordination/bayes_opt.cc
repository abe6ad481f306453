// Gaussian process and expected improvement (protocol in bayes_opt.h).
#include "coordination/bayes_opt.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace rr {

namespace {

// Length scales tried when fitting (the cube's units).
constexpr double kScales[] = {0.08, 0.15, 0.3, 0.5, 0.8};
constexpr int kRandomCandidates = 2000;
constexpr int kRefineRounds = 60;
constexpr double kExploration = 0.01;  // EI's xi, in standard deviations of the scores

double normal_pdf(double z) {
  return std::exp(-0.5 * z * z) / std::sqrt(2 * M_PI);
}

double normal_cdf(double z) {
  return 0.5 * std::erfc(-z / std::sqrt(2.0));
}

// Solves L y = b in place (L lower-triangular, row-major n x n).
void forward(const std::vector<double>& L, std::vector<double>& b) {
  const size_t n = b.size();
  for (size_t i = 0; i < n; ++i) {
    double s = b[i];
    for (size_t j = 0; j < i; ++j) s -= L[i * n + j] * b[j];
    b[i] = s / L[i * n + i];
  }
}

// Solves L^T y = b in place.
void backward(const std::vector<double>& L, std::vector<double>& b) {
  const size_t n = b.size();
  for (size_t i = n; i-- > 0;) {
    double s = b[i];
    for (size_t j = i + 1; j < n; ++j) s -= L[j * n + i] * b[j];
    b[i] = s / L[i * n + i];
  }
}

}  // namespace

BayesOpt::BayesOpt(int dims, double noise, uint64_t seed)
    : dims_(dims), noise_(std::max(noise, 1e-6)), rng_(seed ? seed : 1) {}

void BayesOpt::add(std::vector<double> x, double score) {
  x.resize(dims_, 0.5);
  for (double& v : x) v = std::min(1.0, std::max(0.0, v));
  xs_.push_back(std::move(x));
  ys_.push_back(score);
  fitted_ = false;
}

double BayesOpt::kernel(const std::vector<double>& a, const std::vector<double>& b,
                        double ell) const {
  double d2 = 0;
  for (int i = 0; i < dims_; ++i) d2 += (a[i] - b[i]) * (a[i] - b[i]);
  return std::exp(-0.5 * d2 / (ell * ell));
}

// Cholesky of K + noise I and alpha = K^-1 y for length scale ell; false if
// the matrix is not positive definite (it always is with noise > 0, up to rounding).
bool BayesOpt::factor(double ell, std::vector<double>& L, std::vector<double>& alpha) const {
  const size_t n = xs_.size();
  L.assign(n * n, 0.0);
  for (size_t i = 0; i < n; ++i) {
    for (size_t j = 0; j <= i; ++j) {
      double s = kernel(xs_[i], xs_[j], ell) + (i == j ? noise_ : 0.0);
      for (size_t k = 0; k < j; ++k) s -= L[i * n + k] * L[j * n + k];
      if (i == j) {
        if (s <= 0) return false;
        L[i * n + i] = std::sqrt(s);
      } else {
        L[i * n + j] = s / L[j * n + j];
      }
    }
  }
  alpha = ystd_;
  forward(L, alpha);
  backward(L, alpha);
  return true;
}

void BayesOpt::fit() {
  const size_t n = ys_.size();
  mean_ = 0;
  for (double y : ys_) mean_ += y;
  mean_ /= static_cast<double>(n);
  double var = 0;
  for (double y : ys_) var += (y - mean_) * (y - mean_);
  scale_ = n > 1 ? std::sqrt(var / static_cast<double>(n)) : 0.0;
  if (!(scale_ > 0)) scale_ = std::max(std::fabs(mean_), 1.0);
  ystd_.resize(n);
  for (size_t i = 0; i < n; ++i) ystd_[i] = (ys_[i] - mean_) / scale_;
  double best_ll = -std::numeric_limits<double>::infinity();
  for (double ell : kScales) {
    std::vector<double> L, a;
    if (!factor(ell, L, a)) continue;
    // log marginal likelihood, up to a constant: -y^T K^-1 y / 2 - log det L
    double ll = 0;
    for (size_t i = 0; i < n; ++i) ll -= 0.5 * ystd_[i] * a[i] + std::log(L[i * n + i]);
    if (ll > best_ll) {
      best_ll = ll;
      ell_ = ell;
      chol_ = std::move(L);
      alpha_ = std::move(a);
    }
  }
  fitted_ = true;
}

std::pair<double, double> BayesOpt::posterior(const std::vector<double>& x) const {
  const size_t n = xs_.size();
  std::vector<double> k(n);
  double mu = 0;
  for (size_t i = 0; i < n; ++i) {
    k[i] = kernel(x, xs_[i], ell_);
    mu += k[i] * alpha_[i];
  }
  forward(chol_, k);
  double var = 1.0;
  for (double v : k) var -= v * v;
  return {mu, std::sqrt(std::max(var, 1e-12))};
}

std::pair<double, double> BayesOpt::predict(const std::vector<double>& x) {
  if (xs_.empty()) return {0.0, 0.0};
  if (!fitted_) fit();
  auto [mu, sd] = posterior(x);
  return {mean_ + mu * scale_, sd * scale_};
}

size_t BayesOpt::best_sample() {
  if (!fitted_) fit();
  size_t best = 0;
  double top = -std::numeric_limits<double>::infinity();
  for (size_t i = 0; i < xs_.size(); ++i) {
    const double mu = posterior(xs_[i]).first;
    if (mu > top) {
      top = mu;
      best = i;
    }
  }
  return best;
}

double BayesOpt::improvement(const std::vector<double>& x, double best) const {
  auto [mu, sd] = posterior(x);
  const double gain = mu - best - kExploration;
  const double z = gain / sd;
  return gain * normal_cdf(z) + sd * normal_pdf(z);
}

double BayesOpt::uniform() {
  rng_ ^= rng_ << 13;  // xorshift64
  rng_ ^= rng_ >> 7;
  rng_ ^= rng_ << 17;
  return static_cast<double>(rng_ >> 11) * 0x1.0p-53;
}

std::vector<double> BayesOpt::next() {
  if (xs_.empty()) return std::vector<double>(dims_, 0.5);
  if (!fitted_) fit();
  const double best = *std::max_element(ystd_.begin(), ystd_.end());
  std::vector<double> top(dims_), x(dims_);
  double top_ei = -1;
  auto consider = [&](const std::vector<double>& c) {
    const double ei = improvement(c, best);
    if (ei > top_ei) {
      top_ei = ei;
      top = c;
    }
  };
  for (const auto& s : xs_) consider(s);
  for (int i = 0; i < kRandomCandidates; ++i) {
    for (double& v : x) v = uniform();
    consider(x);
  }
  // Moves around the best candidate, shrinking: expected improvement peaks
  // between samples, narrower than random points resolve.
  double step = 0.1;
  for (int r = 0; r < kRefineRounds; ++r, step *= 0.95) {
    for (int d = 0; d < dims_; ++d)
      x[d] = std::min(1.0, std::max(0.0, top[d] + step * (2 * uniform() - 1)));
    consider(x);
  }
  return top;
}

}  // namespace rr
