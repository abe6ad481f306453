// Submit batching: the engine holds its own new work back while the caller
// is still submitting, so that a burst (a backward pass handing over its
// gradients, a loop of async calls) goes out as one response, not as a first
// part and a straggling rest that costs a second ring.
//
// Protocol. Submitting threads record the time of every submit (`last`) and
// of the first one the engine has not taken yet (`first`) before they publish
// the work. Before starting a round for its own work, the engine thread asks
// hold(): while no caller is blocked in wait() and the window is open
// (now < min(last + gap, first + max)), it sleeps on the WaitSignal until the
// window closes or a caller begins to wait, then asks again. A caller that
// blocks in wait() has stopped submitting, so waiting ends the hold at once;
// a caller that pauses for `gap` ends it too, and `max` bounds it for a
// caller that never pauses. Rounds other ranks start are answered after the
// hold (their work waits for this rank's anyway).
//
// Invariants: a hold never exceeds `max` past the oldest untaken submit; a
// waiting caller is never held (the WaitSignal protocol loses no wake-up);
// the engine thread sleeps, rather than spins, through a long burst, so it
// does not take turns on a core with the thread that is submitting.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

#include "coordination/handle.h"

namespace rr {

class BatchWindow {
 public:
  // gap_s <= 0 turns batching off.
  BatchWindow(double gap_s, double max_s);

  const std::shared_ptr<WaitSignal>& signal() const { return signal_; }
  // Any thread (the autotuner's choice); submits and holds see it from then on.
  void set_gap(double gap_s);
  double gap_seconds() const { return static_cast<double>(gap_ns_.load()) * 1e-9; }
  // Any submitting thread, before the work becomes visible to the engine;
  // `first`: the engine's queue was empty.
  void submitted(bool first);
  // Engine thread, when it has local work and no round is running: returns
  // true after waiting in an open window (ask again), false to go ahead.
  // One call sleeps at most `max_sleep_ns` (kMaxSleepNs by default), so the
  // engine still checks its peers' liveness (and polls executors with work
  // in flight, with a shorter bound) while it holds work back.
  bool hold(int64_t max_sleep_ns = kMaxSleepNs);
  static constexpr int64_t kMaxSleepNs = 100'000'000;

 private:
  std::atomic<int64_t> gap_ns_;
  int64_t max_ns_;
  std::atomic<int64_t> first_ns_{0};
  std::atomic<int64_t> last_ns_{0};
  std::shared_ptr<WaitSignal> signal_ = std::make_shared<WaitSignal>();
};

}  // namespace rr
