#include "transport/shm/doorbell.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <climits>

namespace rr {

// Shared (not FUTEX_PRIVATE) operations: the word lives in memory mapped by
// several processes.
void Doorbell::wait(uint32_t seen, int64_t timeout_ns) {
  struct timespec ts;
  ts.tv_sec = timeout_ns / 1000000000;
  ts.tv_nsec = timeout_ns % 1000000000;
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&seq_), FUTEX_WAIT, seen, &ts, nullptr, 0);
}

void Doorbell::wake() {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&seq_), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

}  // namespace rr
