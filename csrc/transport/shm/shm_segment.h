// One POSIX shared-memory segment per rank holds the rings that carry data
// *to* that rank from each peer on its host, plus the rank's doorbell.
//
// Lifecycle (nothing is left in /dev/shm after init, even if a rank dies):
//   1. the owner creates /ringreduce-<job>-<rank> (O_EXCL, mode 0600), sizes
//      and maps it, initialises it, then publishes `ready`;
//   2. each local peer opens it (retrying until it exists), maps it, waits for
//      `ready` and increments `mapped`;
//   3. the owner waits until `mapped` == local peers, then unlinks the name.
// The mapping lives on in every process until the Context is destroyed.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "transport/shm/doorbell.h"

namespace rr {

// A single-producer single-consumer ring of `slots` slots of `slot_bytes`.
// tail counts slots published by the producer, head slots released by the
// consumer; both only grow (mod 2^32) and tail - head <= slots always.
struct alignas(64) RingHeader {
  alignas(64) std::atomic<uint32_t> tail;
  alignas(64) std::atomic<uint32_t> head;
};

struct alignas(64) SegmentHeader {
  uint64_t magic;
  int32_t owner_rank;
  int32_t owner_pid;
  uint32_t nrings;
  uint32_t slots;
  uint64_t slot_bytes;
  std::atomic<uint32_t> ready;
  std::atomic<uint32_t> mapped;
  // Set by the owner when it stops taking part (shutdown, or a failure it
  // cannot recover from); peers then fail fast instead of waiting for it.
  std::atomic<uint32_t> closed;
  char closed_reason[512];
  Doorbell doorbell;
};

class ShmSegment {
 public:
  // Creates and initialises this rank's segment with `nrings` rings.
  static ShmSegment create(const std::string& name, int rank, uint32_t nrings, uint32_t slots,
                           uint64_t slot_bytes);
  // Maps a peer's segment, waiting up to `timeout_s` for it to appear and
  // failing early if the owner process (`owner_pid`) dies meanwhile.
  static ShmSegment open(const std::string& name, int owner_rank, int owner_pid, double timeout_s);

  ShmSegment() = default;
  ShmSegment(ShmSegment&& o) noexcept { *this = std::move(o); }
  ShmSegment& operator=(ShmSegment&& o) noexcept;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  ~ShmSegment();

  SegmentHeader* header() const { return static_cast<SegmentHeader*>(base_); }
  RingHeader* ring(uint32_t i) const;
  uint8_t* slot(uint32_t ring, uint32_t index) const;
  // Removes the name from /dev/shm (idempotent); the mapping stays valid.
  void unlink();
  // Owner only: tells every peer that this rank is gone, and why.
  void mark_closed(const std::string& reason);
  // Peers: the owner's reason if it has closed, else empty.
  std::string closed_reason() const;
  const std::string& name() const { return name_; }

 private:
  static size_t layout_bytes(uint32_t nrings, uint32_t slots, uint64_t slot_bytes);
  void* base_ = nullptr;
  size_t bytes_ = 0;
  std::string name_;
  bool owner_ = false;
  bool unlinked_ = false;
};

// True if process `pid` exists and is not a zombie.
bool process_alive(int pid);

// posix_fallocate of a shm file's first `bytes`, retried when a signal
// interrupts it (tmpfs checks for them): 0 or the error number. Reserving up
// front turns a /dev/shm too small into this error instead of a SIGBUS at the
// first touch of a page that cannot be backed.
int reserve_shm(int fd, size_t bytes);

// Maps `bytes` of the shm object open on `fd` (pre-faulted) and closes `fd`.
void* shm_map(int fd, size_t bytes, const std::string& name);
// Opens a peer's shm object `name`, retrying until it exists and is sized
// (its owner may not have got that far yet); fails early if the owner
// process dies, and after `timeout_s`. Returns the fd; `*size` its size.
int shm_open_peer(const std::string& name, int owner_rank, int owner_pid, double timeout_s,
                  size_t* size);

}  // namespace rr
