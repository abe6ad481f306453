// Chooses, for each large ring, whether this rank writes its shm slots with
// ordinary or with streaming (non-temporal) stores. Neither wins everywhere:
// on the VMs we measure on, cache-to-cache hand-over of a slot is fastest
// most of the time, but for stretches of seconds to minutes it becomes ~4x
// slower, and then streaming stores (the peer reads the slot from memory)
// are far better, while costing ~20% otherwise. So each rank keeps a moving
// estimate of the throughput it got with each kind, uses the better one and
// tries the other every kExploreEvery rings. A sender's choice is its own:
// the receiver reads a slot the same way however it was written.
#pragma once

#include <cstdint>

namespace rr {

enum class StreamMode { kAuto, kAlways, kNever };

class StreamChoice {
 public:
  explicit StreamChoice(StreamMode mode = StreamMode::kAuto) : mode_(mode) {}

  bool pick() {
    if (mode_ != StreamMode::kAuto) return mode_ == StreamMode::kAlways;
    ++picks_;
    if (rate_[0] == 0) return false;
    if (rate_[1] == 0) return true;
    const bool best = rate_[1] > rate_[0];
    return picks_ % kExploreEvery == 0 ? !best : best;
  }

  void report(bool streamed, double bytes, double seconds) {
    if (seconds <= 0) return;
    double& r = rate_[streamed ? 1 : 0];
    const double now = bytes / seconds;
    r = r == 0 ? now : (1 - kWeight) * r + kWeight * now;
  }

 private:
  static constexpr uint64_t kExploreEvery = 8;
  static constexpr double kWeight = 0.3;
  StreamMode mode_;
  uint64_t picks_ = 0;
  double rate_[2] = {0, 0};  // bytes/s without / with streaming; 0 = not tried
};

}  // namespace rr
