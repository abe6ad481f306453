#include "gpu/completion_watcher.h"

#include <pthread.h>

#include <chrono>
#include <exception>
#include <string>
#include <utility>

namespace rr {
namespace gpu {

CompletionWatcher::CompletionWatcher(std::shared_ptr<GpuOps> ops,
                                     std::shared_ptr<CompletionWaker> waker)
    : ops_(std::move(ops)), waker_(std::move(waker)) {}

CompletionWatcher::~CompletionWatcher() {
  stop(1.0);
}

uint64_t CompletionWatcher::watch(GpuEvent e) {
  try {
    if (!thread_.joinable()) thread_ = std::thread(run, shared_, ops_, waker_);
  } catch (const std::exception&) {
    return 0;  // no thread: the engine's polls complete the work
  }
  {
    std::lock_guard<std::mutex> lock(shared_->mu);
    shared_->queue.push_back(e);
  }
  shared_->cv.notify_one();
  return ++tickets_;
}

bool CompletionWatcher::stop(double bound_s) {
  if (!thread_.joinable()) return true;
  std::unique_lock<std::mutex> lock(shared_->mu);
  shared_->stopping = true;
  shared_->cv.notify_one();
  const bool done = shared_->cv.wait_for(lock, std::chrono::duration<double>(bound_s),
                                         [this] { return shared_->finished; });
  lock.unlock();
  if (done)
    thread_.join();
  else
    thread_.detach();
  return done;
}

// The thread's whole life: wait for the next event, sleep until its work is
// done, ring; errors are the poll's to report (it finds them in the event).
void CompletionWatcher::run(std::shared_ptr<Shared> s, std::shared_ptr<GpuOps> ops,
                            std::shared_ptr<CompletionWaker> waker) {
  pthread_setname_np(pthread_self(), "rr-gpu-watch");
  for (;;) {
    GpuEvent e;
    {
      std::unique_lock<std::mutex> lock(s->mu);
      s->cv.wait(lock, [&] { return s->stopping || !s->queue.empty(); });
      if (s->stopping) break;
      e = s->queue.front();
      s->queue.pop_front();
    }
    try {
      std::string ignored;
      ops->event_synchronize(e, &ignored);
    } catch (const std::exception&) {  // any: one escaping a thread ends the process
    }
    // Before the ring: the poll it prompts may give the event to new work.
    s->passed.fetch_add(1, std::memory_order_release);
    waker->ring();
  }
  std::lock_guard<std::mutex> lock(s->mu);
  s->finished = true;
  s->cv.notify_all();
}

}  // namespace gpu
}  // namespace rr
