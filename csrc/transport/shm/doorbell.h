// A doorbell is a futex word in shared memory that one rank sleeps on and
// any peer rings. Protocol (no lost wake-ups):
//   waiter:   v = seq; sleeping = 1; re-check its condition; futex_wait(seq, v)
//   notifier: publish its data; seq += 1; if (sleeping) futex_wake(seq)
// All accesses are sequentially consistent, so either the waiter's re-check
// sees the published data, or the notifier sees sleeping == 1 and wakes it, or
// seq has changed before futex_wait and the kernel returns at once.
// Waiters are the owning rank's communication thread and, in a multi-host job,
// rank 0's DoorbellWatcher helper (coordination/doorbell_watcher.h), so a
// wake-up wakes every waiter.
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
  // `seen`. The caller sets the sleeping flag and re-checks first.
  void set_sleeping(bool s) { sleeping_.store(s ? 1 : 0); }
  void wait(uint32_t seen, int64_t timeout_ns);

 private:
  void wake();
  alignas(64) std::atomic<uint32_t> seq_;
  alignas(64) std::atomic<uint32_t> sleeping_;
};

}  // namespace rr
