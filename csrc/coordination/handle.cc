#include "coordination/handle.h"

#include <chrono>
#include <cstdlib>

#include "common/futex.h"

namespace rr {

OwnedBuffer allocate_owned(const std::vector<int64_t>& shape, DType dtype) {
  OwnedBuffer b;
  b.shape = shape;
  b.bytes = static_cast<size_t>(num_elements(shape)) * dtype_size(dtype);
  // 64-byte alignment suits every dtype and vector load; never zero-sized.
  const size_t rounded = (b.bytes + 63) / 64 * 64 + 64;
  void* p = std::aligned_alloc(64, rounded);
  if (!p)
    throw_error(ErrorKind::kInternal, "out of memory allocating ", b.bytes,
                " bytes for a collective's result");
  b.data = std::shared_ptr<uint8_t>(static_cast<uint8_t*>(p), [](uint8_t* q) { std::free(q); });
  return b;
}

void WaitSignal::begin_wait() {
  waiting_.fetch_add(1);
  seq_.fetch_add(1);
  if (sleeping_.load()) futex_wake_all(&seq_, FutexScope::kProcess);
}

void WaitSignal::close() {
  closed_.store(1);
  seq_.fetch_add(1);
  futex_wake_all(&seq_, FutexScope::kProcess);
}

void WaitSignal::poke() {
  seq_.fetch_add(1);
  if (sleeping_.load()) futex_wake_all(&seq_, FutexScope::kProcess);
}

void WaitSignal::sleep(int64_t timeout_ns, const std::atomic<bool>* unless) {
  const uint32_t seen = seq_.load();
  sleeping_.store(1);
  if (!waiting() && !closed() && !(unless && unless->load()))
    futex_wait(&seq_, seen, timeout_ns, FutexScope::kProcess);
  sleeping_.store(0);
}

bool HandleState::finish_locked() {
  if (--remaining_ > 0) return false;
  done_.store(true, std::memory_order_release);
  return true;
}

// Waiters check done_ under mu_, which finish_locked() sets under mu_, so a
// notify after unlocking loses no wake-up; a waiter woken while mu_ is still
// held would only block on it again.
void HandleState::resolve_one() {
  std::unique_lock<std::mutex> lock(mu_);
  finish_and_notify(lock);
}

void HandleState::finish_and_notify(std::unique_lock<std::mutex>& lock) {
  if (!finish_locked()) return;
  lock.unlock();
  cv_.notify_all();
}

void HandleState::resolve_all(const std::vector<std::shared_ptr<HandleState>>& hs) {
  std::vector<HandleState*> completed;  // kept alive by `hs` while notified
  for (const auto& h : hs) {
    std::lock_guard<std::mutex> lock(h->mu_);
    if (h->finish_locked()) completed.push_back(h.get());
  }
  for (HandleState* h : completed) h->cv_.notify_all();
}

void HandleState::fail_one(ErrorKind kind, const std::string& message) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!failed_) {
    failed_ = true;
    kind_ = kind;
    message_ = message;
  }
  finish_and_notify(lock);
}

namespace {

// Tells the engine, for as long as a caller waits, that it waits (see
// batch_window.h: a waiting caller ends a hold at once).
class Waiting {
 public:
  explicit Waiting(WaitSignal* signal) : s_(signal) {
    if (s_) s_->begin_wait();
  }
  ~Waiting() {
    if (s_) s_->end_wait();
  }
  Waiting(const Waiting&) = delete;
  Waiting& operator=(const Waiting&) = delete;

 private:
  WaitSignal* s_;
};

}  // namespace

void HandleState::wait() {
  if (!done() && signal_) signal_->token().offer(*this);
  if (!done()) {
    Waiting waiting(signal_.get());
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return done_.load(std::memory_order_acquire); });
  }
  rethrow();
}

bool HandleState::wait_for(int64_t timeout_ns) {
  if (!done() && signal_) signal_->token().offer(*this);
  if (done()) return true;
  Waiting waiting(signal_.get());
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_for(lock, std::chrono::nanoseconds(timeout_ns),
                      [this] { return done_.load(std::memory_order_acquire); });
}

void HandleState::mark_enqueued(StreamWaiter waiter, void* executor_stream) {
  std::unique_lock<std::mutex> lock(mu_);
  waiter_ = std::move(waiter);
  executor_stream_ = executor_stream;
  if (unqueued_ == 0 || --unqueued_ > 0) return;
  lock.unlock();
  cv_.notify_all();
}

bool HandleState::wait_enqueued_for(int64_t timeout_ns) {
  auto ready = [this] { return done_.load(std::memory_order_acquire) || unqueued_ == 0; };
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (ready()) return true;
  }
  Waiting waiting(signal_.get());
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_for(lock, std::chrono::nanoseconds(timeout_ns), ready);
}

HandleState::StreamWaiter HandleState::stream_waiter() const {
  std::lock_guard<std::mutex> lock(mu_);
  return unqueued_ == 0 ? waiter_ : StreamWaiter();
}

void* HandleState::executor_stream() const {
  std::lock_guard<std::mutex> lock(mu_);
  return unqueued_ == 0 ? executor_stream_ : nullptr;
}

void HandleState::rethrow() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_) throw Error(kind_, message_);
}

}  // namespace rr
