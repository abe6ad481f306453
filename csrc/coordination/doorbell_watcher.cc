#include "coordination/doorbell_watcher.h"

#include <unistd.h>

namespace rr {

namespace {
// A helper waiting on a doorbell that nobody rings re-checks this often.
constexpr int64_t kWaitNs = 100 * 1000 * 1000;
}  // namespace

DoorbellWatcher::DoorbellWatcher(Doorbell* bell, int wake_fd)
    : bell_(bell), wake_fd_(wake_fd), thread_([this] { run(); }) {}

DoorbellWatcher::~DoorbellWatcher() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    quit_ = true;
  }
  cv_.notify_one();
  bell_->ring_and_wake();  // the helper may be in the futex wait
  thread_.join();
}

void DoorbellWatcher::arm(uint32_t seen) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    armed_ = true;
    seen_ = seen;
    ++generation_;
  }
  cv_.notify_one();
}

void DoorbellWatcher::disarm() {
  std::lock_guard<std::mutex> lock(mu_);
  armed_ = false;
}

void DoorbellWatcher::run() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] { return armed_ || quit_; });
    if (quit_) return;
    const uint64_t generation = generation_;
    const uint32_t seen = seen_;
    lock.unlock();
    bell_->wait(seen, kWaitNs);  // returns at once if it rang since `seen`
    lock.lock();
    if (armed_ && generation_ == generation && bell_->snapshot() != seen) {
      const uint64_t one = 1;
      ssize_t ignored = ::write(wake_fd_, &one, sizeof one);
      (void)ignored;
      armed_ = false;  // one wake per arming
    }
  }
}

}  // namespace rr
