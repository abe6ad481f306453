// Caller-driven rounds: a blocking call on an idle engine runs the
// negotiation round and its execution on the caller's own thread.
//
// Why this design (measured, README "Small messages pay for the engine"): on
// a small machine a blocking 4-byte call spent most of its time in hand-offs
// between threads, not on the wire: the submit woke the engine thread, the
// engine thread woke the caller once the handle resolved, and with two ranks
// that is four threads competing for two cores, each cross-core futex wake-up
// costing tens of microseconds. A caller that waits anyway can run the
// round itself; the control messages and the data exchange are unchanged, so
// every guarantee of the round protocol (control.h: any submission order,
// named and unnamed matching, mismatch and rejection errors, join, stall
// reports, fusion of whatever is queued, process sets, the timeline) holds
// whichever thread drives, and ranks need not agree on who drives.
//
// Protocol. The driver token (drive_token.h) has one holder at a time, and
// only the holder touches the driver-only state (pending table, rounds,
// caches, executors, the links' control streams).
//   engine thread: holds the token while it works; gives it back around
//     every yield, batch hold and sleep of its idle loop (untokened) and
//     takes it back after (reclaim_token); while a caller holds it, the
//     thread parks (park) instead.
//   caller: HandleState::wait/wait_for offers to drive (DriveToken::offer);
//     with the token free it takes it and runs rounds while any is ready and
//     its handle is not done, spinning up to RINGREDUCE_SPIN_US for the next
//     one, then gives the token back (hand_back).
// Wake-ups. The doorbell counts its sleepers (doorbell.h). A caller that
// takes the token withdraws the engine thread's announcement (engine_bell_,
// made in block()), so its own traffic does not wake the sleeping thread;
// hand_back() announces it again and then, still holding the token, checks
// for anything ready (a message published before the announcement is seen
// there and the thread woken; a later one rings the announced sleeper). A
// thread that woke while a caller drove parks unannounced for at most
// kParkNs (200 us) at a time and then checks for itself: in a loop of
// blocking calls the next caller has usually taken the token by then, so the
// engine thread wakes a few times per millisecond rather than per message.
// Work that arrives meanwhile without a waiting caller (an asynchronous
// submit, a round another rank starts) waits at most kParkNs for it.
// What stays on the engine thread: GPU executors (they bind a CUDA device to
// their thread; once a GPU tensor is submitted no caller drives), a rank that
// joined, and everything while no caller waits (asynchronous calls, rounds
// other ranks start, liveness checks while idle). A failure in a caller's
// round fails the engine as it would on the engine thread (fail_engine).
// RINGREDUCE_FAST_PATH=0 turns the caller-driven path off.
#include <poll.h>
#include <sched.h>
#include <unistd.h>

#include "coordination/engine.h"
#include "transport/shm/doorbell.h"
#include "transport/transports.h"

namespace rr {

// Whether block() sleeps on the doorbell alone (shm links only): the same
// choice of links block() makes.
bool Engine::bell_only() const {
  if (!ctx_->progress().doorbell) return false;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_ || (rank_ != 0 && p != 0)) continue;
    if (ctx_->link(p).transport().wait & kWaitFd) return false;
  }
  return true;
}

void Engine::withdraw_bell() {
  if (!engine_bell_) return;
  ctx_->progress().doorbell->set_sleeping(false);
  engine_bell_ = false;
}

void Engine::reclaim_token() {
  while (!token_.try_take(DriveToken::kEngine)) park();
  withdraw_bell();
}

// Sleeps while a caller holds the token, unannounced: the caller's traffic
// and submits do not wake it (a caller in a loop of blocking calls would
// otherwise wake it once per message). It wakes after kParkNs, or when
// hand_back() finds work for it, and then checks everything itself.
void Engine::park() {
  constexpr int64_t kParkNs = 200'000;
  if (bell_only_) {
    Doorbell* bell = ctx_->progress().doorbell;
    const uint32_t seen = bell->snapshot();
    if (token_.held_by_caller() && !stop_.load()) bell->wait(seen, kParkNs);
    return;
  }
  pollfd fd{wake_fd_, POLLIN, 0};
  const timespec ts{0, kParkNs};
  if (token_.held_by_caller() && !stop_.load() && ::ppoll(&fd, 1, &ts, nullptr) > 0) {
    uint64_t v;
    ssize_t ignored = ::read(wake_fd_, &v, sizeof v);
    (void)ignored;
  }
}

void Engine::wake_engine() {
  if (Doorbell* bell = ctx_->progress().doorbell) bell->ring_and_wake();
  const uint64_t one = 1;
  ssize_t ignored = ::write(wake_fd_, &one, sizeof one);
  (void)ignored;
}

void Engine::drive(HandleState& h) {
  bell_withdrawn_ = engine_bell_;
  withdraw_bell();
  if (opt_.fast_path && !stop_.load() && !dead_.load() && !joined_ && !async_ &&
      !gpu_seen_.load()) {
    try {
      drive_rounds(h);
    } catch (const Error& e) {
      fail_engine(e);
    } catch (const std::exception& e) {
      fail_engine(Error(ErrorKind::kInternal, cat("rank ", rank_, ": caller's round: ", e.what())));
    }
  }
  hand_back(!h.done());
}

void Engine::drive_rounds(HandleState& h) {
  const double spin = ctx_->progress().spin_seconds;
  double until = now() + spin;
  double last_check = now();
  while (!h.done() && !stop_.load() && !dead_.load() && !gpu_seen_.load()) {
    bool ready;
    try {
      ready = ready_to_start();
    } catch (const Error& e) {
      throw Error(e.kind(), cat("rank ", rank_, ": ", idle_state(), ": ", e.what()));
    }
    if (ready) {
      caller_rounds_.fetch_add(1, std::memory_order_relaxed);
      run_round();
      until = now() + spin;
      continue;
    }
    if (now() >= until) return;
    check_peers(last_check);
    sched_yield();
  }
}

// An engine thread that was asleep announced on the doorbell (block()) is
// announced again, then anything ready is checked for with the token still
// held: a message published before the announcement is seen here, a later
// one rings the announced sleeper. A parked thread (park()) is left alone:
// it looks for itself within kParkNs, and by then the caller of the next
// blocking call has usually taken the token again; unless this caller goes
// on to wait for the engine thread (`caller_waits`): that is woken at once.
void Engine::hand_back(bool caller_waits) {
  bool wake = caller_waits || stop_.load() || dead_.load() || async_busy();
  if (bell_withdrawn_) {
    ctx_->progress().doorbell->set_sleeping(true);
    engine_bell_ = true;
    bell_withdrawn_ = false;
    try {
      wake = wake || has_work_.load() || ready_to_start();
    } catch (const Error&) {
      wake = true;  // the engine thread finds the error itself and reports it
    }
    wake = wake || holding_;  // a hold began: the sleeper's timeout must become its deadline
  }
  token_.give_back();
  if (wake) wake_engine();
}

}  // namespace rr
