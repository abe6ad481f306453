#include "transport/shm/shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <new>
#include <thread>

#include "common/error.h"

namespace rr {

namespace {

constexpr uint64_t kMagic = 0x52494e47524544ULL;  // "RINGRED"
constexpr size_t kPage = 4096;

size_t round_up(size_t x, size_t a) {
  return (x + a - 1) / a * a;
}
size_t rings_offset() {
  return round_up(sizeof(SegmentHeader), kPage);
}
size_t data_offset(uint32_t nrings) {
  return rings_offset() + round_up(nrings * sizeof(RingHeader), kPage);
}

}  // namespace

void* shm_map(int fd, size_t bytes, const std::string& name) {
  // MAP_POPULATE pre-faults the rings: page faults on first touch would
  // otherwise land inside the first collective's timing.
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (p == MAP_FAILED) {
    int err = errno;
    ::close(fd);
    throw_error(ErrorKind::kInternal, "mmap of shared memory ", name, " (", bytes,
                " bytes) failed: ", errno_string(err));
  }
  ::close(fd);
  return p;
}

int shm_open_peer(const std::string& name, int owner_rank, int owner_pid, double timeout_s,
                  size_t* size) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  struct stat st{};
  // The owner may not have created (or sized) the segment yet: retry.
  while (true) {
    int fd = shm_open(name.c_str(), O_RDWR, 0600);
    if (fd >= 0 && fstat(fd, &st) == 0 && st.st_size >= static_cast<off_t>(kPage)) {
      *size = static_cast<size_t>(st.st_size);
      return fd;
    }
    if (fd >= 0) ::close(fd);
    if (fd < 0 && errno != ENOENT)
      throw_error(ErrorKind::kInternal, "cannot open shared memory ", name, " of rank ", owner_rank,
                  ": ", errno_string(errno));
    if (!process_alive(owner_pid))
      throw_error(ErrorKind::kPeerLost, "rank ", owner_rank, " (pid ", owner_pid,
                  ") exited during initialisation");
    if (std::chrono::steady_clock::now() > deadline)
      throw_error(ErrorKind::kTimeout, "rank ", owner_rank, " did not create its shared memory ",
                  name, " within ", timeout_s, " s");
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

size_t ShmSegment::layout_bytes(uint32_t nrings, uint32_t slots, uint64_t slot_bytes) {
  return data_offset(nrings) + static_cast<size_t>(nrings) * slots * slot_bytes;
}

ShmSegment ShmSegment::create(const std::string& name, int rank, uint32_t nrings, uint32_t slots,
                              uint64_t slot_bytes) {
  size_t bytes = layout_bytes(nrings, slots, slot_bytes);
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0)
    throw_error(ErrorKind::kInternal, "rank ", rank, ": cannot create shared memory ", name, ": ",
                errno_string(errno));
  ShmSegment seg;
  seg.name_ = name;
  seg.owner_ = true;
  if (const int err = reserve_shm(fd, bytes); err != 0) {
    ::close(fd);
    shm_unlink(name.c_str());
    throw_error(ErrorKind::kInternal, "rank ", rank, ": cannot reserve ", bytes,
                " bytes of shared memory for ", name,
                " (the links to this rank): ", errno_string(err),
                err == ENOSPC ? " (/dev/shm is too small: every rank on the host needs this "
                                "much; df -h /dev/shm, or RINGREDUCE_SHM_SLOTS / "
                                "RINGREDUCE_SHM_SLOT_BYTES to need less)"
                              : "");
  }
  seg.base_ = shm_map(fd, bytes, name);
  seg.bytes_ = bytes;
  auto* h = new (seg.base_) SegmentHeader();
  h->magic = kMagic;
  h->owner_rank = rank;
  h->owner_pid = static_cast<int32_t>(getpid());
  h->nrings = nrings;
  h->slots = slots;
  h->slot_bytes = slot_bytes;
  h->mapped.store(0);
  h->closed.store(0);
  h->closed_reason[0] = '\0';
  h->doorbell.init();
  for (uint32_t i = 0; i < nrings; ++i) {
    RingHeader* r = new (seg.ring(i)) RingHeader();
    r->tail.store(0);
    r->head.store(0);
  }
  h->ready.store(1);
  return seg;
}

ShmSegment ShmSegment::open(const std::string& name, int owner_rank, int owner_pid,
                            double timeout_s) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  size_t size = 0;
  const int fd = shm_open_peer(name, owner_rank, owner_pid, timeout_s, &size);
  ShmSegment seg;
  seg.name_ = name;
  seg.base_ = shm_map(fd, size, name);
  seg.bytes_ = size;
  SegmentHeader* h = seg.header();
  while (h->ready.load() != 1) {
    if (std::chrono::steady_clock::now() > deadline)
      throw_error(ErrorKind::kTimeout, "shared memory ", name, " of rank ", owner_rank,
                  " was never initialised");
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  if (h->magic != kMagic || h->owner_rank != owner_rank ||
      seg.bytes_ < layout_bytes(h->nrings, h->slots, h->slot_bytes))
    throw_error(ErrorKind::kInternal, "shared memory ", name, " does not belong to rank ",
                owner_rank, " of this job");
  h->mapped.fetch_add(1);
  return seg;
}

ShmSegment& ShmSegment::operator=(ShmSegment&& o) noexcept {
  if (this != &o) {
    this->~ShmSegment();
    base_ = o.base_;
    bytes_ = o.bytes_;
    name_ = std::move(o.name_);
    owner_ = o.owner_;
    unlinked_ = o.unlinked_;
    o.base_ = nullptr;
    o.owner_ = false;
  }
  return *this;
}

ShmSegment::~ShmSegment() {
  if (owner_) unlink();
  if (base_) munmap(base_, bytes_);
  base_ = nullptr;
}

RingHeader* ShmSegment::ring(uint32_t i) const {
  return reinterpret_cast<RingHeader*>(static_cast<uint8_t*>(base_) + rings_offset()) + i;
}

uint8_t* ShmSegment::slot(uint32_t ring, uint32_t index) const {
  const SegmentHeader* h = header();
  size_t off =
      data_offset(h->nrings) + (static_cast<size_t>(ring) * h->slots + index) * h->slot_bytes;
  return static_cast<uint8_t*>(base_) + off;
}

void ShmSegment::unlink() {
  if (owner_ && !unlinked_) {
    shm_unlink(name_.c_str());
    unlinked_ = true;
  }
}

void ShmSegment::mark_closed(const std::string& reason) {
  SegmentHeader* h = header();
  if (!owner_ || !h || h->closed.load()) return;
  size_t n = std::min(reason.size(), sizeof(h->closed_reason) - 1);
  std::memcpy(h->closed_reason, reason.data(), n);
  h->closed_reason[n] = '\0';
  h->closed.store(1);
}

std::string ShmSegment::closed_reason() const {
  const SegmentHeader* h = header();
  if (!h || !h->closed.load()) return "";
  return std::string(h->closed_reason, strnlen(h->closed_reason, sizeof(h->closed_reason)));
}

int reserve_shm(int fd, size_t bytes) {
  int err;
  do {
    err = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  } while (err == EINTR);
  return err;
}

bool process_alive(int pid) {
  // kill(pid, 0) succeeds for zombies, so read the state letter instead.
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  if (!f) return false;
  std::string line;
  std::getline(f, line);
  size_t close_paren = line.rfind(')');
  if (close_paren == std::string::npos || close_paren + 2 >= line.size()) return false;
  char state = line[close_paren + 2];
  return state != 'Z' && state != 'X' && state != 'x';
}

}  // namespace rr
