// How an asynchronous executor's finished work wakes the engine thread at
// once instead of at its next poll. The executor calls ring() from a thread
// of its own (gpu/completion_watcher.h), possibly after the engine has shut
// down: the engine disarms the waker first (Engine::shutdown),
// and a ring after that does nothing. Thread-safe; ring() never blocks beyond
// the short critical section of a concurrent disarm().
#pragma once

#include <functional>
#include <mutex>
#include <utility>

namespace rr {

class CompletionWaker {
 public:
  explicit CompletionWaker(std::function<void()> wake) : wake_(std::move(wake)) {}
  CompletionWaker(const CompletionWaker&) = delete;
  CompletionWaker& operator=(const CompletionWaker&) = delete;

  void ring() noexcept {
    std::lock_guard<std::mutex> lock(mu_);
    if (wake_) wake_();
  }
  void disarm() noexcept {
    std::lock_guard<std::mutex> lock(mu_);
    wake_ = nullptr;
  }

 private:
  std::mutex mu_;
  std::function<void()> wake_;
};

}  // namespace rr
