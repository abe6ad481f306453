// Chooses, for each large ring, whether this rank writes its shm slots with
// ordinary or with streaming (non-temporal) stores. Neither wins everywhere:
// on the VMs we measure on, cache-to-cache hand-over of a slot is fastest
// most of the time, but for stretches of seconds to minutes it becomes ~4x
// slower, and then streaming stores (the peer reads the slot from memory)
// are far better, while costing ~20% otherwise. So each rank remembers the
// throughput of its last kKeep rings of each kind, uses the kind whose best
// recent ring was faster, and tries the other every kExploreEvery rings.
// The best of the recent rings, not an average: a ring also includes waiting
// for a late peer, which only ever makes a sample look slower. A mode change
// shows at once: every ring of the kind in use is a fresh sample. A sender's
// choice is its own: the receiver reads a slot the same way however it was
// written.
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
    if (count_[0] == 0) return false;
    if (count_[1] == 0) return true;
    const bool best = best_rate(1) > best_rate(0);
    return picks_ % kExploreEvery == 0 ? !best : best;
  }

  void report(bool streamed, double bytes, double seconds) {
    if (seconds <= 0) return;
    const int k = streamed ? 1 : 0;
    rates_[k][count_[k]++ % kKeep] = bytes / seconds;
  }

 private:
  static constexpr uint64_t kExploreEvery = 8;
  static constexpr uint64_t kKeep = 4;
  double best_rate(int k) const {
    double best = 0;
    for (uint64_t i = 0; i < kKeep && i < count_[k]; ++i)
      best = rates_[k][i] > best ? rates_[k][i] : best;
    return best;
  }
  StreamMode mode_;
  uint64_t picks_ = 0;
  uint64_t count_[2] = {0, 0};   // rings measured without / with streaming
  double rates_[2][kKeep] = {};  // bytes/s of the most recent ones
};

}  // namespace rr
