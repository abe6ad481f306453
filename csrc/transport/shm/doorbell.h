// A doorbell is a futex word in shared memory that one rank sleeps on and
// any peer rings. Protocol (no lost wake-ups):
//   waiter:   v = seq; sleeping += 1; re-check its condition; futex_wait(seq, v);
//             sleeping -= 1
//   notifier: publish its data; seq += 1; if (sleeping) futex_wake(seq)
// All accesses are sequentially consistent, so either the waiter's re-check
// sees the published data, or the notifier sees sleeping == 1 and wakes it, or
// seq has changed before futex_wait and the kernel returns at once.
// Waiters are the owning rank's communication thread (the engine thread, or
// a caller driving a round, coordination/engine_drive.cc) and, in a
// multi-host job, rank 0's DoorbellWatcher helper (doorbell_watcher.h), so a
// wake-up wakes every waiter. `sleeping` counts them: one waiter waking up
// must not hide the others from the notifier.
#pragma once

#include <atomic>
#include <cstdint>

namespace rr {

class Doorbell {
 public:
  void init() {
    seq_.store(0);
    sleeping_.store(0);
  }
  uint32_t snapshot() const { return seq_.load(); }
  void ring() {
    seq_.fetch_add(1);
    if (sleeping_.load()) wake();
  }
  // Rings and wakes every waiter whether or not one announced itself.
  void ring_and_wake() {
    seq_.fetch_add(1);
    wake();
  }
  // Sleeps until rung or `timeout_ns` passes, unless seq already differs from
  // `seen`. The caller announces itself (set_sleeping(true)) and re-checks
  // first, and withdraws (set_sleeping(false)) after; calls pair up.
  void set_sleeping(bool s) {
    if (s)
      sleeping_.fetch_add(1);
    else
      sleeping_.fetch_sub(1);
  }
  void wait(uint32_t seen, int64_t timeout_ns);

 private:
  void wake();
  alignas(64) std::atomic<uint32_t> seq_;
  alignas(64) std::atomic<uint32_t> sleeping_;
};

}  // namespace rr
