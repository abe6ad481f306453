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
  AutotuneOptions o = opt_.autotune;
  o.hierarchical_allgather = ctx_->options().hierarchical_allgather;
  Tunables start;
  start.fusion_mb = static_cast<double>(opt_.fusion_threshold) / (1 << 20);
  start.cycle_ms = opt_.cycle_time_s * 1e3;
  start.batch_us = opt_.batch_gap_s * 1e6;
  start.hierarchical = ctx_->options().hierarchical;
  hierarchical_tuned_ = hierarchical_applies(*ctx_) && !o.fixed_hierarchical;
  tuner_ = std::make_unique<Autotuner>(o, start, hierarchical_tuned_, rank_);
  set_tuned(tuner_->current());
}

// Every rank at the same response (autotuner.h): rank 0's choice, applied.
void Engine::retune() {
  Tunables t{};
  if (rank_ == 0) t = tuner_->decide();
  Tensor desc{&t, {kTunables}, DType::kFloat64, "autotune"};
  broadcast(*ctx_, &t, desc, 0);
  // A knob held by hand keeps each rank's own value (ranks agree on which are held).
  const AutotuneOptions& o = opt_.autotune;
  if (rank_ == 0 && !o.fixed_fusion)
    negotiator_->set_fusion_threshold(static_cast<uint64_t>(t.fusion_mb * (1 << 20)));
  if (!o.fixed_cycle) cycle_s_.store(t.cycle_ms * 1e-3);
  if (!o.fixed_batch) batch_.set_gap(t.batch_us * 1e-6);
  if (hierarchical_tuned_) ctx_->set_hierarchical(static_cast<int>(t.hierarchical));
  set_tuned(t);
  tuner_->adopt(t, now());  // after the exchange: the next trial's time starts here
}

void Engine::set_tuned(const Tunables& t) {
  std::lock_guard<std::mutex> lock(tune_mu_);
  tuned_ = t;
}

// What the engine runs with now: the live values where other threads may read
// them (the cycle time, the batching gap), what was applied otherwise.
void Engine::tuned_stats(EngineStats& s) const {
  s.cycle_time_ms = cycle_s_.load() * 1e3;
  s.batch_us = batch_.gap_seconds() * 1e6;
  std::lock_guard<std::mutex> lock(tune_mu_);
  s.autotuning = tuned_.active > 0;
  s.autotune_trials = static_cast<uint64_t>(tuned_.trials);
  s.fusion_threshold = tuner_ && !opt_.autotune.fixed_fusion
                           ? static_cast<uint64_t>(tuned_.fusion_mb * (1 << 20))
                           : opt_.fusion_threshold;
  s.hierarchical =
      hierarchical_tuned_ ? static_cast<int>(tuned_.hierarchical) : ctx_->options().hierarchical;
}

}  // namespace rr
