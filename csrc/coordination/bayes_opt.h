// Bayesian optimization for the autotuner (autotuner.h): which point of the
// unit cube [0,1]^d to try next, given the scores of the points tried so far.
//
// Model. A Gaussian process with a squared-exponential kernel (unit signal
// variance) over the scores standardized to mean 0 and variance 1, plus
// `noise` on the diagonal (Horovod's HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE:
// a training job's throughput varies from sample to sample, so the model must
// not chase single measurements). The length scale is the one of a small
// fixed set that maximizes the marginal likelihood of the samples.
//
// Choice. The next point maximizes expected improvement over the best score
// so far: the mean predicted above it, weighed with the uncertainty there. It
// is sought among random points of the cube and small moves around the best
// candidates; the random stream is seeded, so a run is reproducible.
//
// Invariants: inputs are clamped to the cube; with no sample yet next()
// returns the cube's centre; every computation is O(n^3) in the samples, which
// stay few (tens), so no numerical library is needed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace rr {

class BayesOpt {
 public:
  BayesOpt(int dims, double noise, uint64_t seed = 0x5eed);

  void add(std::vector<double> x, double score);
  std::vector<double> next();
  size_t samples() const { return xs_.size(); }
  // The sample the model rates best (highest posterior mean): with noisy
  // scores, a better choice than the highest single score. Needs a sample.
  size_t best_sample();
  // Posterior mean and standard deviation of the score at x (in the scores'
  // own units), for tests and logging.
  std::pair<double, double> predict(const std::vector<double>& x);

 private:
  void fit();
  double kernel(const std::vector<double>& a, const std::vector<double>& b, double ell) const;
  bool factor(double ell, std::vector<double>& chol, std::vector<double>& alpha) const;
  std::pair<double, double> posterior(const std::vector<double>& x) const;  // standardized
  double improvement(const std::vector<double>& x, double best) const;
  double uniform();

  int dims_;
  double noise_;
  uint64_t rng_;
  std::vector<std::vector<double>> xs_;
  std::vector<double> ys_;
  bool fitted_ = false;
  double mean_ = 0, scale_ = 1, ell_ = 0.3;
  std::vector<double> ystd_, chol_, alpha_;  // standardized scores, L (row-major), K^-1 y
};

}  // namespace rr
