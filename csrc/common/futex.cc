#include "common/futex.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <climits>

namespace rr {

void futex_wait(std::atomic<uint32_t>* word, uint32_t seen, int64_t timeout_ns, FutexScope scope) {
  struct timespec ts;
  ts.tv_sec = timeout_ns / 1000000000;
  ts.tv_nsec = timeout_ns % 1000000000;
  const int op = scope == FutexScope::kShared ? FUTEX_WAIT : FUTEX_WAIT_PRIVATE;
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, seen, &ts, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word, FutexScope scope) {
  const int op = scope == FutexScope::kShared ? FUTEX_WAKE : FUTEX_WAKE_PRIVATE;
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, INT_MAX, nullptr, nullptr, 0);
}

}  // namespace rr
