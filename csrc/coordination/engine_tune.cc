// The autotuner in the engine (protocol in autotuner.h): every rank feeds it
// the exec responses it is about to run; when a trial ends (on every rank at
// the same response), rank 0's choice is broadcast over the Context and
// every rank applies it before that response runs.
#include <cmath>
#include <cstring>

#include "collectives/collectives.h"
#include "common/logging.h"
#include "coordination/engine.h"

namespace rr {

constexpr int64_t kTunables = sizeof(Tunables) / sizeof(double);
static_assert(sizeof(Tunables) == kTunables * sizeof(double), "Tunables travel as float64s");

void Engine::make_tuner() {
  if (!opt_.autotune.enabled) return;
  if (size_ == 1) {
    if (rank_ == 0) log(LogLevel::kInfo, rank_, "autotune: a job of one rank has nothing to tune");
    return;
  }
  Tunables start;
  start.fusion_mb = static_cast<double>(opt_.fusion_threshold) / (1 << 20);
  start.cycle_ms = opt_.cycle_time_s * 1e3;
  start.batch_us = opt_.batch_gap_s * 1e6;
  start.hierarchical = static_cast<double>(wants_hierarchical(*ctx_));
  const bool hier = hierarchical_applies(*ctx_) && !opt_.autotune.fixed_hierarchical;
  tuner_ = std::make_unique<Autotuner>(opt_.autotune, start, hier, rank_);
  hierarchical_tuned_ = hier;
  set_tuned(tuner_->current());
}

void Engine::retune() {
  Tunables t{};
  if (rank_ == 0) t = tuner_->decide();
  Tensor desc{&t, {kTunables}, DType::kFloat64, "autotune"};
  broadcast(*ctx_, &t, desc, 0);
  tuner_->adopt(t);
  if (rank_ == 0) negotiator_->set_fusion_threshold(static_cast<uint64_t>(t.fusion_mb * (1 << 20)));
  cycle_s_.store(t.cycle_ms * 1e-3);
  batch_.set_gap(t.batch_us * 1e-6);
  if (hierarchical_tuned_) ctx_->set_hierarchical(t.hierarchical > 0 ? 1 : 0);
  set_tuned(t);
}

void Engine::set_tuned(const Tunables& t) {
  std::lock_guard<std::mutex> lock(tune_mu_);
  tuned_ = t;
}

void Engine::tuned_stats(EngineStats& s) const {
  std::lock_guard<std::mutex> lock(tune_mu_);
  s.autotuning = tuned_.active > 0;
  s.autotune_trials = static_cast<uint64_t>(tuned_.trials);
  s.fusion_threshold =
      tuner_ ? static_cast<uint64_t>(tuned_.fusion_mb * (1 << 20)) : opt_.fusion_threshold;
  s.cycle_time_ms = tuner_ ? tuned_.cycle_ms : opt_.cycle_time_s * 1e3;
  s.batch_us = tuner_ ? tuned_.batch_us : opt_.batch_gap_s * 1e6;
  s.hierarchical = tuner_ ? static_cast<int>(tuned_.hierarchical) : -1;
}

}  // namespace rr
