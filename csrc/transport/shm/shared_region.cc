#include "transport/shm/shared_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <new>
#include <thread>

#include "common/error.h"
#include "transport/shm/shm_segment.h"

namespace rr {

namespace {

constexpr uint64_t kRegionMagic = 0x52524d454d4f5259ULL;  // "RRMEMORY"
constexpr size_t kHeaderBytes = 4096;                     // the data starts page-aligned

struct alignas(64) RegionHeader {
  uint64_t magic;
  uint64_t bytes;
  int32_t rank;
  std::atomic<uint32_t> ready;
  std::atomic<uint32_t> mapped;
};
static_assert(sizeof(RegionHeader) <= kHeaderBytes, "the header fits its page");

RegionHeader* header_of(void* base) {
  return static_cast<RegionHeader*>(base);
}

using Clock = std::chrono::steady_clock;

Clock::time_point deadline_after(double s) {
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

void* create_own(const std::string& name, int rank, size_t bytes) {
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0)
    throw_error(ErrorKind::kInternal, "rank ", rank, ": cannot create shared memory ", name, ": ",
                errno_string(errno));
  const int err = reserve_shm(fd, kHeaderBytes + bytes);
  if (err != 0) {
    ::close(fd);
    shm_unlink(name.c_str());
    throw_error(ErrorKind::kInvalidArgument, "rank ", rank, ": cannot reserve ",
                kHeaderBytes + bytes, " bytes of shared memory for ", name, ": ", errno_string(err),
                err == ENOSPC ? " (/dev/shm is too small: every rank on the host allocates this "
                                "much; df -h /dev/shm)"
                              : "");
  }
  void* base = nullptr;
  try {
    base = shm_map(fd, kHeaderBytes + bytes, name);
  } catch (...) {
    shm_unlink(name.c_str());
    throw;
  }
  RegionHeader* h = new (base) RegionHeader();
  h->magic = kRegionMagic;
  h->bytes = bytes;
  h->rank = rank;
  h->mapped.store(0);
  h->ready.store(1);
  return base;
}

// Maps a peer's region once it is ready and counts this rank in its `mapped`.
void* open_peer(const std::string& name, const SharedPeer& p, double timeout_s, size_t* size) {
  const int fd = shm_open_peer(name, p.rank, p.pid, timeout_s, size);
  void* base = shm_map(fd, *size, name);
  RegionHeader* h = header_of(base);
  const auto deadline = deadline_after(timeout_s);
  while (h->ready.load() != 1) {
    if (!process_alive(p.pid)) {
      munmap(base, *size);
      throw_error(ErrorKind::kPeerLost, "rank ", p.rank, " exited while allocating ", name);
    }
    if (Clock::now() > deadline) {
      munmap(base, *size);
      throw_error(ErrorKind::kTimeout, "shared memory ", name, " of rank ", p.rank,
                  " was never initialised");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  if (h->magic != kRegionMagic || h->rank != p.rank || *size < kHeaderBytes + h->bytes) {
    munmap(base, *size);
    throw_error(ErrorKind::kInternal, "shared memory ", name, " does not belong to rank ", p.rank,
                " of this job");
  }
  h->mapped.fetch_add(1);
  return base;
}

void wait_mapped(RegionHeader* h, int rank, const std::vector<SharedPeer>& peers,
                 double timeout_s) {
  const auto deadline = deadline_after(timeout_s);
  while (h->mapped.load() < peers.size()) {
    for (const SharedPeer& p : peers)
      if (!process_alive(p.pid))
        throw_error(ErrorKind::kPeerLost, "rank ", rank, ": rank ", p.rank,
                    " exited while allocating a shared buffer");
    if (Clock::now() > deadline)
      throw_error(ErrorKind::kTimeout, "rank ", rank, ": local peers did not map the shared ",
                  "buffer within ", timeout_s, " s (does every rank allocate it?)");
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

}  // namespace

SharedRegion::~SharedRegion() {
  for (const Mapping& m : maps_)
    if (m.base) munmap(m.base, m.bytes);
}

uint8_t* SharedRegion::data_of(int rank) const {
  return static_cast<uint8_t*>(maps_.at(static_cast<size_t>(rank)).base) + kHeaderBytes;
}

std::shared_ptr<SharedRegion> SharedRegistry::create(const std::string& prefix, int rank, int size,
                                                     const std::vector<SharedPeer>& peers,
                                                     size_t bytes, double timeout_s) {
  uint64_t id;
  {
    std::lock_guard<std::mutex> lock(mu_);
    id = next_id_++;
  }
  auto region = std::make_shared<SharedRegion>(id, rank, bytes);
  region->maps_.resize(static_cast<size_t>(size));
  auto name_of = [&](int r) { return cat(prefix, "m", id, "-", r); };
  const std::string mine = name_of(rank);
  void* base = create_own(mine, rank, bytes);
  region->maps_[rank] = {base, kHeaderBytes + bytes};
  // Unlinked however this ends: once every peer has mapped it, or on failure.
  struct UnlinkAtExit {
    const std::string& name;
    ~UnlinkAtExit() { shm_unlink(name.c_str()); }
  } unlink_mine{mine};
  try {
    for (const SharedPeer& p : peers) {
      size_t n = 0;
      void* q = open_peer(name_of(p.rank), p, timeout_s, &n);
      region->maps_[p.rank] = {q, n};
    }
    wait_mapped(header_of(base), rank, peers, timeout_s);
  } catch (const Error& e) {
    throw Error(e.kind(), cat("rank ", rank, ": allocating shared buffer #", id, " (", bytes,
                              " bytes): ", e.what()));
  }
  std::string sizes;
  bool same = true;
  for (int r = 0; r < size; ++r) {
    if (!region->maps_[r].base) continue;  // on another host
    const uint64_t b = header_of(region->maps_[r].base)->bytes;
    same &= b == bytes;
    sizes += cat(sizes.empty() ? "" : ", ", "rank ", r, " ", b, " bytes");
  }
  if (!same)
    throw_error(ErrorKind::kMismatch, "rank ", rank, ": shared buffer #", id,
                ": the ranks asked for different sizes (", sizes, "); every rank must allocate ",
                "the same shared buffers, in the same order");
  std::lock_guard<std::mutex> lock(mu_);
  regions_.erase(std::remove_if(regions_.begin(), regions_.end(),
                                [](const std::weak_ptr<SharedRegion>& w) { return w.expired(); }),
                 regions_.end());
  regions_.push_back(region);
  return region;
}

std::shared_ptr<SharedRegion> SharedRegistry::find(const void* p, size_t n, size_t* offset) const {
  const auto* q = static_cast<const uint8_t*>(p);
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& w : regions_) {
    std::shared_ptr<SharedRegion> r = w.lock();
    if (!r) continue;
    const uint8_t* d = r->data();
    if (q >= d && q + n <= d + r->bytes()) {
      *offset = static_cast<size_t>(q - d);
      return r;
    }
  }
  return nullptr;
}

}  // namespace rr
