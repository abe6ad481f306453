#include "coordination/batch_window.h"

#include <algorithm>
#include <chrono>
#include <cmath>

namespace rr {

namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// A blocking call (submit, then wait at once) reaches wait() within
// microseconds: the engine watches for that long before it sleeps, so the
// call does not pay for a futex wake-up across cores.
constexpr int64_t kWatchNs = 20000;

}  // namespace

BatchWindow::BatchWindow(double gap_s, double max_s)
    : gap_ns_(std::llround(gap_s * 1e9)), max_ns_(std::llround(max_s * 1e9)) {}

void BatchWindow::set_gap(double gap_s) {
  gap_ns_.store(std::llround(gap_s * 1e9), std::memory_order_relaxed);
}

void BatchWindow::submitted(bool first) {
  if (gap_ns_.load(std::memory_order_relaxed) <= 0) return;
  const int64_t t = now_ns();
  if (first) first_ns_.store(t, std::memory_order_relaxed);
  last_ns_.store(t, std::memory_order_relaxed);
}

bool BatchWindow::hold(int64_t max_sleep_ns) {
  const int64_t gap_ns = gap_ns_.load(std::memory_order_relaxed);
  if (gap_ns <= 0 || signal_->waiting() || signal_->closed()) return false;
  const int64_t last = last_ns_.load(std::memory_order_relaxed);
  const int64_t first = first_ns_.load(std::memory_order_relaxed);
  const int64_t until = std::min(last + gap_ns, first + max_ns_);
  int64_t t = now_ns();
  if (t >= until) return false;
  if (last == first) {  // one submit so far: perhaps a blocking call
    const int64_t watch_end = std::min(until, t + kWatchNs);
    while (t < watch_end && !signal_->waiting() && last_ns_.load(std::memory_order_relaxed) == last)
      t = now_ns();
    if (signal_->waiting()) return false;
    if (t >= until) return true;
  }
  signal_->sleep(std::min(until - t, max_sleep_ns));
  return true;
}

}  // namespace rr
