// The autotuner (Horovod's HOROVOD_AUTOTUNE; here RINGREDUCE_AUTOTUNE): while
// a job trains, it tries settings of the engine's knobs and keeps the ones
// under which the job moved the most bytes per second.
//
// Knobs. The fusion threshold (0.5-256 MiB, on a log scale), the cycle time
// (0-5 ms), the submit batching gap (0-2000 us; batch_window.h) and, where it
// applies (several hosts, one with several ranks), the hierarchical
// allreduce. A knob the user set (its RINGREDUCE_* or HOROVOD_* variable, a
// ringrun flag) is held at that value, as in Horovod.
//
// Protocol. Every rank feeds observe() the responses it executes, in the
// order all ranks execute them (the response cache's invariant), before it
// executes each. A *sample* ends when some tensor name comes for the
// (steps_per_sample + 1)-th time since the sample began; that response opens
// the next sample. Because this depends only on the names, every rank ends
// every sample at the same response. Five samples make one *trial* of a
// setting; its score is their median in bytes per second of wall time (rank
// 0's clock; time the job spends computing counts, so the score is the
// training throughput of a job whose steps move the same bytes). When a trial
// ends, observe() returns true on every rank; the engine then broadcasts rank
// 0's choice (decide()) and every rank adopts it before that response runs.
//
// A job whose names never repeat (unnamed calls are numbered) never ends a
// sample: after kMaxNames distinct names in one sample every rank ends tuning
// there alike, as at the end of a trial, with a warning on rank 0; the start's
// settings are restored (or the duels' incumbent, a setting compared with it).
//
// Log columns: current Horovod's (hierarchical_allreduce, hierarchical_allgather,
// torus_allreduce, cache_enabled, cycle_time_ms, tensor_fusion_threshold in
// MiB, score in bytes per microsecond), then batch_us; the hierarchical
// allgather and the cache are not tuned (their settings are shown), and there
// is no torus allreduce (0).
//
// Search (rank 0). The first `warmup_samples` trials are discarded (caches,
// first touches). Then the continuous knobs: the starting setting, three
// spread test points, then Bayesian optimization (bayes_opt.h) until
// `bayes_opt_max_samples` trials were scored. The model's favourite (the
// highest posterior mean, which pools neighbouring trials: one trial's median
// is noisy, and on a flat landscape the highest one is mostly luck) becomes a
// challenger only if it is rated above the start by more than twice the
// model's uncertainty. Then duels settle it: the start is the incumbent; each
// challenger (the favourite, then, where the hierarchical allreduce is
// tunable, the incumbent with it forced off, then forced on; the start's
// automatic choice differs by backend, the GPU path running it only when
// forced) runs four trials against it, incumbent-challenger-challenger-
// incumbent, and takes its place if it wins both adjacent pairs. The order
// cancels a steady drift of the machine's speed (trials run minutes apart,
// the Bayesian ones far from the start's), and two wins out of two let an
// equal challenger through one time in four. The last incumbent stays for the
// rest of the job and tuning stops (active = false). Each scored trial and the
// choice (with its duel score) are written to RINGREDUCE_AUTOTUNE_LOG (CSV,
// Horovod's columns plus batch_us) and logged at info level on rank 0.
#pragma once

#include <cstdint>
#include <fstream>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "coordination/bayes_opt.h"
#include "coordination/request.h"

namespace rr {

struct AutotuneOptions {
  bool enabled = false;            // RINGREDUCE_AUTOTUNE
  std::string log_path;            // RINGREDUCE_AUTOTUNE_LOG
  int warmup_samples = 3;          // RINGREDUCE_AUTOTUNE_WARMUP_SAMPLES (trials)
  int steps_per_sample = 10;       // RINGREDUCE_AUTOTUNE_STEPS_PER_SAMPLE
  int bayes_opt_max_samples = 20;  // RINGREDUCE_AUTOTUNE_BAYES_OPT_MAX_SAMPLES (trials)
  double gp_noise = 0.8;           // RINGREDUCE_AUTOTUNE_GAUSSIAN_PROCESS_NOISE
  // Knobs the user set, held at their values.
  bool fixed_fusion = false, fixed_cycle = false, fixed_batch = false, fixed_hierarchical = false;
  double batch_hi_us = 2000;       // the batching gap's range ends here (RINGREDUCE_BATCH_MAX_US)
  bool cache_enabled = true;       // for the log's cache_enabled column (RINGREDUCE_CACHE_CAPACITY)
  int hierarchical_allgather = 0;  // for the log (RINGREDUCE_HIERARCHICAL_ALLGATHER, not tuned)
  // "fcbh" with "-" for each knob the tuner may move: ranks must agree on it.
  std::string fixed_mask() const;
};

AutotuneOptions autotune_options_from_env();

// The engine's tunable settings, as every rank applies them.
struct Tunables {
  double fusion_mb = 256;  // fusion threshold, MiB
  double cycle_ms = 0;
  double batch_us = 50;
  double hierarchical = -1;  // RINGREDUCE_HIERARCHICAL_ALLREDUCE: -1 automatic, 0, 1
  double active = 0;         // 1 while tuning goes on
  double trials = 0;         // scored so far
};

class Autotuner {
 public:
  // `start`: the settings the engine runs with; `hierarchical_tunable`: the
  // hierarchical allreduce applies to this job and the user did not fix it.
  Autotuner(AutotuneOptions o, Tunables start, bool hierarchical_tunable, int rank);
  ~Autotuner();

  // Every rank, before executing each exec response. True: a trial ended here
  // (on every rank alike); call decide() on rank 0, broadcast, adopt().
  bool observe(const std::vector<RequestMeta>& tensors, double now);
  // Rank 0: scores the trial that ended and returns the settings to run next.
  Tunables decide();
  // Every rank: the settings rank 0 decided; the next sample starts at `now`.
  void adopt(const Tunables& t, double now) {
    cur_ = t;
    sample_start_ = now;
  }
  const Tunables& current() const { return cur_; }

 private:
  enum class Phase { kBayes, kDuel, kDone };
  // A setting to duel the incumbent: `t`, or (hierarchical >= -1) the
  // incumbent of the time with that hierarchical setting.
  struct Challenger {
    Tunables t;
    double hierarchical;
  };
  std::vector<int> free_dims() const;
  std::vector<double> to_unit(const Tunables& t) const;
  Tunables from_unit(const std::vector<double>& u) const;
  Tunables next_bayes();
  void record(double score);
  Tunables choose(double score);
  bool rated_better();
  Tunables duel(double score);
  Tunables give_up();
  Tunables finish();
  void write_row(const Tunables& t, double score);

  AutotuneOptions opt_;
  int rank_;
  bool hierarchical_tunable_;
  Phase phase_ = Phase::kBayes;
  Tunables cur_, best_, start_;
  bool gave_up_ = false;
  double best_score_ = -1;
  int warmups_left_;
  int trials_ = 0;  // scored trials
  std::vector<Tunables> test_points_;
  std::vector<Tunables> tried_;  // scored in the Bayesian phase, in bayes_'s order
  std::vector<Challenger> challengers_;
  Tunables challenger_;
  std::vector<double> duel_scores_;
  std::unique_ptr<BayesOpt> bayes_;
  // The sample in progress.
  std::unordered_map<std::string, int> counts_;
  double bytes_ = 0, sample_start_ = -1;
  std::vector<double> sample_scores_;
  std::vector<double> trial_scores_;  // of the trial that ended, for decide()
  std::ofstream log_;
};

}  // namespace rr
