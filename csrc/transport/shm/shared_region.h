// Shared buffers: memory that the ranks of one host map, so that an
// allreduce over it reads the peers' data where it lies
// (collectives/allreduce_shared.cc on one host, allreduce_shared_
// hierarchical.cc inside each host of several) instead of passing it through
// the link slots. MPI's MPI_Win_allocate_shared plays the same part.
//
// Allocation is collective: every rank calls create() in the same order with
// the same size. Lifecycle (as for the link segments, shm_segment.h, nothing
// stays in /dev/shm even if a rank dies):
//   1. each rank creates /ringreduce-<job>-m<id>-<rank> (O_EXCL, 0600): a
//      page of header, then the data, zero-filled;
//   2. it opens and maps every peer's, waits for it to be ready and
//      increments that peer's `mapped`;
//   3. it waits until its own `mapped` counts every peer, then unlinks it;
//   4. every rank has read its host's sizes, so the host's ranks reach the
//      same verdict on a size mismatch and raise alike (ranks of other hosts
//      asking another size end up with layouts that do not agree, and their
//      allreduces take the ring).
// The mappings (this rank's and the peers') live as long as the SharedRegion,
// which the arrays over it keep alive; a peer's mapping keeps that peer's
// memory valid even after the peer has let go of it or died.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace rr {

struct SharedPeer {
  int rank = -1;
  int pid = 0;
};

class SharedRegion {
 public:
  SharedRegion(uint64_t id, int rank, size_t bytes) : id_(id), rank_(rank), bytes_(bytes) {}
  ~SharedRegion();
  SharedRegion(const SharedRegion&) = delete;
  SharedRegion& operator=(const SharedRegion&) = delete;

  uint64_t id() const { return id_; }
  size_t bytes() const { return bytes_; }
  uint8_t* data() const { return data_of(rank_); }
  // Rank `rank`'s memory as mapped in this process (a rank of this host).
  uint8_t* data_of(int rank) const;

 private:
  friend class SharedRegistry;
  struct Mapping {
    void* base = nullptr;
    size_t bytes = 0;
  };
  uint64_t id_;
  int rank_;
  size_t bytes_;
  std::vector<Mapping> maps_;  // by rank
};

class SharedRegistry {
 public:
  // Collective over `peers` (this host's other ranks): see above.
  // `prefix` names the job's shm objects.
  std::shared_ptr<SharedRegion> create(const std::string& prefix, int rank, int size,
                                       const std::vector<SharedPeer>& peers, size_t bytes,
                                       double timeout_s);
  // The live region holding [p, p + n), with p's offset in it; nullptr if
  // none does.
  std::shared_ptr<SharedRegion> find(const void* p, size_t n, size_t* offset) const;

 private:
  mutable std::mutex mu_;
  std::vector<std::weak_ptr<SharedRegion>> regions_;
  uint64_t next_id_ = 1;  // 0 means "no region" in a SharedKey
};

}  // namespace rr
