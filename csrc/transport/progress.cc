#include "transport/progress.h"

#include <poll.h>
#include <sched.h>

#include <chrono>
#include <cstring>

#include "common/error.h"
#include "transport/shm/doorbell.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define RR_CPU_RELAX() _mm_pause()
#else
#define RR_CPU_RELAX() ((void)0)
#endif

namespace rr {

void CopySink::consume(const uint8_t* data, size_t offset, size_t n) {
  std::memcpy(dst_ + offset, data, n);
}

namespace {

using Clock = std::chrono::steady_clock;

// True if an earlier op in `ops` on the same link is still incomplete: a link
// carries one message per direction at a time, in the order ops were listed.
template <typename Op>
bool blocked_behind(const std::vector<Op>& ops, size_t i) {
  for (size_t j = 0; j < i; ++j)
    if (ops[j].link == ops[i].link && ops[j].done < ops[j].n) return true;
  return false;
}

// One pass over every pending op. Returns true if any bytes moved.
bool progress_once(std::vector<SendOp>& sends, std::vector<RecvOp>& recvs, size_t* pending,
                   bool wait_sends) {
  bool moved = false;
  size_t left = 0;
  for (size_t i = 0; i < sends.size(); ++i) {
    SendOp& s = sends[i];
    if (s.done < s.n && !blocked_behind(sends, i)) {
      size_t k = s.link->send_some(s.data, s.n, s.done);
      s.done += k;
      moved |= k > 0;
    }
    left += wait_sends && s.done < s.n;
  }
  for (size_t i = 0; i < recvs.size(); ++i) {
    RecvOp& r = recvs[i];
    if (r.done < r.n && !blocked_behind(recvs, i)) {
      size_t k = r.link->recv_some(*r.sink, r.n, r.done);
      r.done += k;
      moved |= k > 0;
    }
    left += r.done < r.n;
  }
  *pending = left;
  return moved;
}

// Which pending links are sockets; whether any pending link is shm.
bool collect_fds(const std::vector<SendOp>& sends, const std::vector<RecvOp>& recvs,
                 std::vector<pollfd>* fds) {
  bool any_shm = false;
  fds->clear();
  for (const auto& s : sends) {
    if (s.done >= s.n) continue;
    WaitHandle w = s.link->wait_handle();
    if (w.fd >= 0) fds->push_back(pollfd{w.fd, POLLOUT, 0});
    any_shm |= w.doorbell;
  }
  for (const auto& r : recvs) {
    if (r.done >= r.n) continue;
    WaitHandle w = r.link->wait_handle();
    if (w.fd >= 0) fds->push_back(pollfd{w.fd, POLLIN, 0});
    any_shm |= w.doorbell;
  }
  return any_shm;
}

void check_pending_alive(std::vector<SendOp>& sends, std::vector<RecvOp>& recvs) {
  for (auto& s : sends)
    if (s.done < s.n) s.link->check_alive();
  for (auto& r : recvs)
    if (r.done < r.n) r.link->check_alive();
}

std::string pending_peers(const std::vector<SendOp>& sends, const std::vector<RecvOp>& recvs) {
  std::string out;
  for (const auto& s : sends)
    if (s.done < s.n) out += cat(out.empty() ? "" : ", ", "send to rank ", s.link->peer());
  for (const auto& r : recvs)
    if (r.done < r.n) out += cat(out.empty() ? "" : ", ", "receive from rank ", r.link->peer());
  return out;
}

// Blocks for at most `slice_ns` or until something may have changed.
void block_once(const ProgressSettings& st, std::vector<SendOp>& sends, std::vector<RecvOp>& recvs,
                std::vector<pollfd>* fds, int64_t slice_ns) {
  Doorbell* bell = st.doorbell;
  bool any_shm = collect_fds(sends, recvs, fds);
  if (any_shm && fds->empty() && bell) {
    uint32_t seen = bell->snapshot();
    bell->set_sleeping(true);
    size_t pending = 0;
    if (!progress_once(sends, recvs, &pending, true) && pending > 0) bell->wait(seen, slice_ns);
    bell->set_sleeping(false);
    return;
  }
  // Sockets only: poll for the whole slice. Mixed: short slices, since shm
  // peers cannot wake poll().
  int ms = any_shm ? 0 : static_cast<int>(slice_ns / 1000000);
  if (any_shm) {
    struct timespec ts {0, 200000};
    ppoll(fds->data(), fds->size(), &ts, nullptr);
  } else {
    poll(fds->data(), fds->size(), ms);
  }
}

}  // namespace

void run_transfers(const ProgressSettings& st, std::vector<SendOp>& sends,
                   std::vector<RecvOp>& recvs, const std::string& what, bool wait_sends) {
  size_t pending = 0;
  if (!progress_once(sends, recvs, &pending, wait_sends) && pending == 0) return;
  const auto spin = std::chrono::duration<double>(st.spin_seconds);
  const auto start = Clock::now();
  auto last_progress = start;
  auto last_check = start;
  std::vector<pollfd> fds;
  constexpr int64_t kSliceNs = 100 * 1000 * 1000;  // liveness checks every 100 ms
  try {
    while (pending > 0) {
      if (progress_once(sends, recvs, &pending, wait_sends)) {
        last_progress = Clock::now();
        continue;
      }
      if (pending == 0) break;
      auto now = Clock::now();
      if (now - last_progress < spin) {
        if (st.yield_while_spinning)
          sched_yield();
        else
          RR_CPU_RELAX();
        continue;
      }
      if (st.abort && st.abort->load())
        throw_error(ErrorKind::kPeerLost, "aborted while waiting");
      if (now - last_check > std::chrono::milliseconds(100)) {
        check_pending_alive(sends, recvs);
        last_check = now;
      }
      if (now - last_progress > std::chrono::duration<double>(st.timeout_seconds))
        throw_error(ErrorKind::kTimeout, "no progress for ", st.timeout_seconds,
                    " s (RINGREDUCE_TIMEOUT_SECONDS) waiting to ", pending_peers(sends, recvs));
      block_once(st, sends, recvs, &fds, kSliceNs);
      if (st.spin_seconds <= 0) sched_yield();
    }
  } catch (const Error& e) {
    throw Error(e.kind(), cat("rank ", st.rank, ": ", what, ": ", e.what()));
  }
}

}  // namespace rr
