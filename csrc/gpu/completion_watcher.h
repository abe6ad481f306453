// Wakes the engine as soon as a GPU executor's work finishes, with no device
// work of its own: a thread per executor sleeps in GpuOps::event_synchronize
// on each response's completion event, in the order they were enqueued, and
// rings the engine's CompletionWaker when one returns.
//
// Why a host thread rather than a host function behind the event
// (cudaLaunchHostFunc on a stream that waits for it): that wait is a command
// on the device, and where streams share a hardware queue
// (CUDA_DEVICE_MAX_CONNECTIONS=1, or more streams than connections) a
// command waiting for a collective holds up the compute queued behind it,
// which would cost the overlap of communication with backward. The events
// are made with blocking sync, so the thread sleeps in the driver instead of
// spinning a core.
//
// Invariants: the thread only waits and rings; the engine's poll() remains
// the only judge of completion and errors (a wait that fails only makes a
// ring early or spurious). An event must not be recorded again until the
// thread has passed it (passed()): the thread may lag behind the engine's
// polls, and a queued event recorded for later work would hold it, in order,
// past the responses queued behind that event, whose completions would then
// wake no one until the later work finished (or the next 10 ms poll).
// stop() ends the thread once its current wait returns; a wait
// that never returns (a device that hangs, a test double that is never
// completed) leaves the thread detached, and the caller must then not
// destroy the events it may still be waiting on.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>

#include "coordination/completion_waker.h"
#include "gpu/gpu_ops.h"

namespace rr {
namespace gpu {

class CompletionWatcher {
 public:
  CompletionWatcher(std::shared_ptr<GpuOps> ops, std::shared_ptr<CompletionWaker> waker);
  ~CompletionWatcher();  // stop(1 s)
  CompletionWatcher(const CompletionWatcher&) = delete;
  CompletionWatcher& operator=(const CompletionWatcher&) = delete;

  // Rings the waker once the work recorded before `e` has finished (the
  // thread starts at the first call). Returns the watch's ticket (1, 2, ...),
  // or 0 where there is no thread (nothing waits on `e`). Never throws for the
  // device's sake.
  uint64_t watch(GpuEvent e);
  // Whether the thread is done with the watch of `ticket`: its event may be
  // recorded again.
  bool passed(uint64_t ticket) const {
    return ticket <= shared_->passed.load(std::memory_order_acquire);
  }
  // Ends the thread: true once it has, false if it is still waiting after
  // `bound_s` (it is then detached and keeps what it uses alive).
  bool stop(double bound_s);

 private:
  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<GpuEvent> queue;
    bool stopping = false;
    bool finished = false;
    std::atomic<uint64_t> passed{0};  // watches whose wait has returned, in order
  };
  static void run(std::shared_ptr<Shared> s, std::shared_ptr<GpuOps> ops,
                  std::shared_ptr<CompletionWaker> waker);

  std::shared_ptr<GpuOps> ops_;
  std::shared_ptr<CompletionWaker> waker_;
  std::shared_ptr<Shared> shared_ = std::make_shared<Shared>();
  std::thread thread_;
  uint64_t tickets_ = 0;  // watches queued
};

}  // namespace gpu
}  // namespace rr
