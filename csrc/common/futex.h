// The futex system call behind the project's sleep/wake protocols: Doorbell
// (a word in shared memory, several processes) and WaitSignal (one process,
// where private futexes are cheaper). Each caller's header states its
// protocol; these only sleep and wake.
#pragma once

#include <atomic>
#include <cstdint>

namespace rr {

enum class FutexScope { kProcess, kShared };

// Sleeps while *word == seen, for at most timeout_ns (returns at once if the
// value already differs; spurious returns are possible).
void futex_wait(std::atomic<uint32_t>* word, uint32_t seen, int64_t timeout_ns, FutexScope scope);
// Wakes every thread sleeping on *word.
void futex_wake_all(std::atomic<uint32_t>* word, FutexScope scope);

static_assert(sizeof(std::atomic<uint32_t>) == 4, "futex words are 32-bit");

}  // namespace rr
