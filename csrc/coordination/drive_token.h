// The driver token: who may run the Engine's state machine right now (the
// engine thread, or a caller thread driving rounds for its own blocking call;
// protocol in engine_drive.cc). Exactly one holder at a time; every field the
// engine header marks "driver only" is touched by the holder alone.
//
// It lives in the WaitSignal that the engine shares with its handles, so a
// handle outliving its engine never touches freed memory: the engine retires
// the token (forever held) before it goes away, and a caller dereferences the
// driver only after taking the token.
#pragma once

#include <sched.h>

#include <atomic>
#include <cstdint>

namespace rr {

class HandleState;

class DriveToken {
 public:
  enum Holder : uint32_t { kFree = 0, kEngine = 1, kCaller = 2, kRetired = 3 };
  // Runs rounds for `h` holding the token as kCaller and gives it back.
  class Driver {
   public:
    virtual void drive(HandleState& h) = 0;

   protected:
    ~Driver() = default;
  };

  bool try_take(Holder who) {
    uint32_t free = kFree;
    return state_.compare_exchange_strong(free, who);
  }
  void give_back() { state_.store(kFree); }
  bool held_by_caller() const { return state_.load() == kCaller; }
  // Takes the token for good (the engine is going away): waits for a caller
  // that holds it to give it back.
  void retire() {
    for (;;) {
      if (try_take(kRetired) || state_.load() == kRetired) return;
      sched_yield();
    }
  }
  // Before the engine thread starts; the token starts held by the engine.
  void set_driver(Driver* d) { driver_ = d; }
  // From a waiting caller: drives when the token is free.
  void offer(HandleState& h) {
    if (driver_ && try_take(kCaller)) driver_->drive(h);
  }

 private:
  std::atomic<uint32_t> state_{kEngine};
  Driver* driver_ = nullptr;
};

}  // namespace rr
