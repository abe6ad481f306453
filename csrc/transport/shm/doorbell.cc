#include "transport/shm/doorbell.h"

#include "common/futex.h"

namespace rr {

// Shared (not private) futex operations: the word lives in memory mapped by
// several processes.
void Doorbell::wait(uint32_t seen, int64_t timeout_ns) {
  futex_wait(&seq_, seen, timeout_ns, FutexScope::kShared);
}

void Doorbell::wake() {
  futex_wake_all(&seq_, FutexScope::kShared);
}

}  // namespace rr
