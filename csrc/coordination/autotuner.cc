// The autotuner's samples, trials and search (protocol in autotuner.h).
#include "coordination/autotuner.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "common/env.h"
#include "common/error.h"
#include "common/logging.h"

namespace rr {

namespace {

constexpr int kSamplesPerTrial = 5;  // Horovod's: a trial's score is their median
// Knob ranges; the fusion threshold on a log2 scale of MiB.
constexpr double kFusionLog2Lo = -1, kFusionLog2Hi = 8;
constexpr double kCycleHi = 5;
constexpr size_t kMaxNames = 100000;
constexpr int kDims = 3;  // fusion, cycle, batch

bool env_set(const char* name) {
  const char* v = std::getenv(name);
  return v && *v;
}

double clamp01(double v) {
  return std::min(1.0, std::max(0.0, v));
}

}  // namespace

std::string AutotuneOptions::fixed_mask() const {
  return {fixed_fusion ? 'f' : '-', fixed_cycle ? 'c' : '-', fixed_batch ? 'b' : '-',
          fixed_hierarchical ? 'h' : '-'};
}

AutotuneOptions autotune_options_from_env() {
  AutotuneOptions o;
  o.enabled = env_int("RINGREDUCE_AUTOTUNE", 0) != 0;
  o.log_path = env_str("RINGREDUCE_AUTOTUNE_LOG", "");
  o.warmup_samples = static_cast<int>(env_int("RINGREDUCE_AUTOTUNE_WARMUP_SAMPLES", 3));
  o.steps_per_sample = static_cast<int>(env_int("RINGREDUCE_AUTOTUNE_STEPS_PER_SAMPLE", 10));
  o.bayes_opt_max_samples =
      static_cast<int>(env_int("RINGREDUCE_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", 20));
  o.gp_noise = env_double("RINGREDUCE_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", 0.8);
  if (o.warmup_samples < 0 || o.steps_per_sample < 1 || o.bayes_opt_max_samples < 1 ||
      !(o.gp_noise >= 0))
    throw_error(ErrorKind::kInvalidArgument,
                "RINGREDUCE_AUTOTUNE_WARMUP_SAMPLES must be >= 0, "
                "RINGREDUCE_AUTOTUNE_STEPS_PER_SAMPLE and RINGREDUCE_AUTOTUNE_BAYES_OPT_MAX_"
                "SAMPLES >= 1, RINGREDUCE_AUTOTUNE_GAUSSIAN_PROCESS_NOISE >= 0");
  o.fixed_fusion = env_set("RINGREDUCE_FUSION_THRESHOLD");
  o.fixed_cycle = env_set("RINGREDUCE_CYCLE_TIME_MS");
  o.fixed_batch = env_set("RINGREDUCE_BATCH_US");
  o.fixed_hierarchical = env_set("RINGREDUCE_HIERARCHICAL_ALLREDUCE");
  return o;
}

Autotuner::Autotuner(AutotuneOptions o, Tunables start, bool hierarchical_tunable, int rank)
    : opt_(std::move(o)),
      rank_(rank),
      hierarchical_tunable_(hierarchical_tunable),
      cur_(start),
      best_(start),
      start_(start),
      warmups_left_(opt_.warmup_samples) {
  cur_.active = 1;
  // The start first (so the defaults are always measured), then spread points.
  test_points_ = {cur_, cur_, cur_, cur_};
  const double fusion[] = {64, 8, 256}, cycle[] = {1, 0, 2.5};
  const double batch[] = {opt_.batch_hi_us / 10, 0, opt_.batch_hi_us / 2};
  for (int i = 1; i < 4; ++i) {
    if (!opt_.fixed_fusion) test_points_[i].fusion_mb = fusion[i - 1];
    if (!opt_.fixed_cycle) test_points_[i].cycle_ms = cycle[i - 1];
    if (!opt_.fixed_batch) test_points_[i].batch_us = batch[i - 1];
  }
  const size_t free = free_dims().size();
  if (free > 0)
    bayes_ = std::make_unique<BayesOpt>(static_cast<int>(free), opt_.gp_noise);
  else
    test_points_.resize(1);  // only the hierarchical allreduce (if any) to tune
  if (free == 0 && !hierarchical_tunable_) cur_.active = 0;  // every knob is the user's
  if (rank_ == 0 && !opt_.log_path.empty()) {
    log_.open(opt_.log_path, std::ios::out | std::ios::trunc);
    if (!log_)
      throw_error(ErrorKind::kInvalidArgument, "rank 0: RINGREDUCE_AUTOTUNE_LOG='", opt_.log_path,
                  "' cannot be written");
    log_.precision(9);
    log_ << "hierarchical_allreduce,hierarchical_allgather,torus_allreduce,cache_enabled,"
            "cycle_time_ms,tensor_fusion_threshold,score,batch_us\n";
    log_.flush();
  }
  if (rank_ == 0 && !(cur_.active > 0))
    log(LogLevel::kWarning, rank_,
        "autotune: every knob it tunes was set by hand (RINGREDUCE_FUSION_THRESHOLD, "
        "RINGREDUCE_CYCLE_TIME_MS, RINGREDUCE_BATCH_US, RINGREDUCE_HIERARCHICAL_ALLREDUCE or "
        "their Horovod names): nothing to tune");
  else if (rank_ == 0)
    log(LogLevel::kInfo, rank_, "autotune: tuning ", free, " knob(s)",
        hierarchical_tunable_ ? " and the hierarchical allreduce" : "", "; ", opt_.warmup_samples,
        " warmup trial(s), ", kSamplesPerTrial, " samples of ", opt_.steps_per_sample,
        " steps each");
}

Autotuner::~Autotuner() = default;

std::vector<int> Autotuner::free_dims() const {
  std::vector<int> d;
  if (!opt_.fixed_fusion) d.push_back(0);
  if (!opt_.fixed_cycle) d.push_back(1);
  if (!opt_.fixed_batch) d.push_back(2);
  return d;
}

std::vector<double> Autotuner::to_unit(const Tunables& t) const {
  const double all[kDims] = {clamp01((std::log2(std::max(t.fusion_mb, 1e-9)) - kFusionLog2Lo) /
                                     (kFusionLog2Hi - kFusionLog2Lo)),
                             clamp01(t.cycle_ms / kCycleHi),
                             clamp01(t.batch_us / opt_.batch_hi_us)};
  std::vector<double> u;
  for (int d : free_dims()) u.push_back(all[d]);
  return u;
}

Tunables Autotuner::from_unit(const std::vector<double>& u) const {
  Tunables t = cur_;
  const std::vector<int> dims = free_dims();
  for (size_t i = 0; i < dims.size(); ++i) {
    const double v = clamp01(u[i]);
    if (dims[i] == 0) t.fusion_mb = std::exp2(kFusionLog2Lo + v * (kFusionLog2Hi - kFusionLog2Lo));
    if (dims[i] == 1) t.cycle_ms = v * kCycleHi;
    if (dims[i] == 2) t.batch_us = v * opt_.batch_hi_us;
  }
  return t;
}

bool Autotuner::observe(const std::vector<RequestMeta>& tensors, double now) {
  if (!(cur_.active > 0)) return false;
  if (sample_start_ < 0) sample_start_ = now;
  bool ended = false;
  for (const RequestMeta& m : tensors) ended |= counts_[m.name] + 1 > opt_.steps_per_sample;
  double bytes = 0;
  for (const RequestMeta& m : tensors) bytes += static_cast<double>(m.bytes());
  if (!ended) {
    for (const RequestMeta& m : tensors) ++counts_[m.name];
    bytes_ += bytes;
    if (counts_.size() <= kMaxNames) return false;
    gave_up_ = true;  // on every rank at this response: end tuning as a trial would end
    counts_.clear();
    return true;
  }
  const double dt = now - sample_start_;
  sample_scores_.push_back(dt > 0 ? bytes_ / dt : 0.0);
  counts_.clear();
  for (const RequestMeta& m : tensors) ++counts_[m.name];
  bytes_ = bytes;
  sample_start_ = now;
  if (sample_scores_.size() < kSamplesPerTrial) return false;
  trial_scores_.swap(sample_scores_);
  sample_scores_.clear();
  return true;
}

// Names stopped repeating: tuning ends with the start's settings, or the
// incumbent of the duels (a setting that was compared with the start).
Tunables Autotuner::give_up() {
  Tunables t = phase_ == Phase::kDuel ? best_ : start_;
  phase_ = Phase::kDone;
  t.active = 0;
  t.trials = trials_;
  log(LogLevel::kWarning, rank_, "autotune: ", kMaxNames,
      " tensor names went by without one coming ", opt_.steps_per_sample + 1,
      " times, so there are no steps to time; tuning stopped, keeping fusion ", t.fusion_mb,
      " MiB, cycle ", t.cycle_ms, " ms, batch ", t.batch_us, " us, hierarchical ", t.hierarchical,
      " (name the tensors a step submits: DistributedOptimizer does; unnamed calls get new "
      "names)");
  return cur_ = t;
}

Tunables Autotuner::decide() {
  if (gave_up_) return give_up();
  std::vector<double> s;
  s.swap(trial_scores_);
  std::sort(s.begin(), s.end());
  const double score = s[s.size() / 2];
  if (warmups_left_ > 0) {
    --warmups_left_;
    log(LogLevel::kInfo, rank_, "autotune: warmup trial done (", warmups_left_, " left)");
    return cur_;
  }
  record(score);
  cur_ = choose(score);
  cur_.trials = trials_;
  return cur_;
}

// The setting after the one just scored (`score`).
Tunables Autotuner::choose(double score) {
  if (phase_ == Phase::kDuel) return duel(score);
  tried_.push_back(cur_);
  if (bayes_) bayes_->add(to_unit(cur_), score);
  if (trials_ < static_cast<int>(test_points_.size()) && trials_ < opt_.bayes_opt_max_samples)
    return test_points_[trials_];
  if (bayes_ && trials_ < opt_.bayes_opt_max_samples) return next_bayes();
  phase_ = Phase::kDuel;
  best_ = tried_.front();  // the start is the incumbent
  best_score_ = bayes_ ? bayes_->predict(to_unit(best_)).first : score;
  if (bayes_ && rated_better()) challengers_.push_back({tried_[bayes_->best_sample()], -2});
  if (hierarchical_tunable_) {  // forced off, then on, against the incumbent of the time
    challengers_.push_back({Tunables{}, 0});
    challengers_.push_back({Tunables{}, 1});
  }
  return duel(-1);
}

// Whether the model rates its best trial better than the start by more than
// twice its uncertainty: on a flat landscape a change has only costs, and
// each duel costs four trials. (Simulated on tests/test_autotune.py's clocks,
// 30 seeds each: a flat landscape with 10% noise per step kept the start in
// 30; a setting 40% faster with 5% noise was found in 29; a flat landscape
// whose speed drifted 30% over the search moved in 8, about the one in four
// that duels let an equal challenger through.)
bool Autotuner::rated_better() {
  const auto [mean, sd] = bayes_->predict(to_unit(tried_[bayes_->best_sample()]));
  const auto [start_mean, start_sd] = bayes_->predict(to_unit(tried_.front()));
  return mean - start_mean > 2 * std::max(sd, start_sd);
}

// Duels (protocol in autotuner.h): incumbent, challenger, challenger,
// incumbent; the challenger wins if it beats the incumbent in both adjacent
// pairs. `score`: of the trial just run (< 0: none).
Tunables Autotuner::duel(double score) {
  if (score >= 0) duel_scores_.push_back(score);
  if (duel_scores_.size() == 4) {
    const std::vector<double>& d = duel_scores_;
    const bool won = d[1] > d[0] && d[2] > d[3];
    if (won) best_ = challenger_;
    best_score_ = won ? (d[1] + d[2]) / 2 : (d[0] + d[3]) / 2;
    duel_scores_.clear();
  }
  if (duel_scores_.empty()) {
    if (challengers_.empty()) return finish();
    const Challenger c = challengers_.front();
    challengers_.erase(challengers_.begin());
    challenger_ = c.hierarchical < -1 ? c.t : best_;
    if (c.hierarchical >= -1) challenger_.hierarchical = c.hierarchical;
  }
  const size_t k = duel_scores_.size();
  Tunables t = k == 1 || k == 2 ? challenger_ : best_;
  t.active = 1;
  return t;
}

Tunables Autotuner::next_bayes() {
  Tunables t = from_unit(bayes_->next());
  t.active = 1;
  return t;
}

void Autotuner::record(double score) {
  ++trials_;
  write_row(cur_, score);
  log(LogLevel::kInfo, rank_, "autotune: trial ", trials_, ": fusion ", cur_.fusion_mb,
      " MiB, cycle ", cur_.cycle_ms, " ms, batch ", cur_.batch_us, " us, hierarchical ",
      cur_.hierarchical, ": ", score / 1e6, " MB/s");
}

Tunables Autotuner::finish() {
  phase_ = Phase::kDone;
  Tunables t = best_;
  t.active = 0;
  write_row(t, best_score_);
  log(LogLevel::kInfo, rank_, "autotune: done after ", trials_, " trials; keeping fusion ",
      t.fusion_mb, " MiB, cycle ", t.cycle_ms, " ms, batch ", t.batch_us, " us, hierarchical ",
      t.hierarchical, " (", best_score_ / 1e6, " MB/s)");
  return t;
}

void Autotuner::write_row(const Tunables& t, double score) {
  if (!log_.is_open()) return;
  // Horovod's columns and units (score in bytes per microsecond), then ours;
  // hierarchical_allreduce is the setting: -1 automatic (Horovod: 0 or 1).
  log_ << t.hierarchical << "," << opt_.hierarchical_allgather << ",0,"
       << (opt_.cache_enabled ? 1 : 0) << "," << t.cycle_ms << "," << t.fusion_mb << ","
       << score / 1e6 << "," << t.batch_us << "\n";
  log_.flush();
}

}  // namespace rr
