// Lets a thread that sleeps in poll() (on sockets and an eventfd) also wake
// when its shared-memory doorbell rings, which poll() cannot watch. Only the
// engine of a rank whose control peers are reached both ways (rank 0 of a
// multi-host job with several ranks per host) needs it; without it, that
// engine slept in 1 ms poll() slices while idle, about 1000 wake-ups a second.
//
// Protocol: the sleeper snapshots the doorbell, sets its sleeping flag (so
// ringers issue the futex wake), calls arm(snapshot), re-checks its condition
// and enters poll(); once poll() returns it calls disarm(). While armed, a
// helper thread waits on the doorbell's futex; when the doorbell's value
// differs from the snapshot it writes the eventfd, once per arming. Each
// arming has a generation, so a wait left over from an earlier arming never
// fires for a later one. Invariant: a ring after the snapshot either is seen
// by the re-check or makes the helper write the eventfd.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>

#include "transport/shm/doorbell.h"

namespace rr {

class DoorbellWatcher {
 public:
  DoorbellWatcher(Doorbell* bell, int wake_fd);
  ~DoorbellWatcher();  // stops and joins the helper; the doorbell must still be mapped
  DoorbellWatcher(const DoorbellWatcher&) = delete;
  DoorbellWatcher& operator=(const DoorbellWatcher&) = delete;

  void arm(uint32_t seen);
  void disarm();

 private:
  void run();

  Doorbell* bell_;
  int wake_fd_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool armed_ = false;
  bool quit_ = false;
  uint64_t generation_ = 0;
  uint32_t seen_ = 0;
  std::thread thread_;
};

}  // namespace rr
