#include "transport/progress.h"

#include <poll.h>
#include <sched.h>

#include <chrono>
#include <cstring>

#include "common/error.h"
#include "common/stream_copy.h"
#include "transport/heartbeat.h"
#include "transport/shm/doorbell.h"

namespace rr {

void CopySink::consume(const uint8_t* data, size_t offset, size_t n) {
  copy_to(dst_ + offset, data, n, streaming_);
}

bool CopySink::consume_forward(const uint8_t* data, size_t offset, size_t n, uint8_t* out,
                               bool stream) {
  copy_twice(dst_ + offset, streaming_, out, stream, data, n);
  return true;
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

class TransferTask : public ProgressTask {
 public:
  TransferTask(std::vector<SendOp>& sends, std::vector<RecvOp>& recvs, bool wait_sends)
      : sends_(sends), recvs_(recvs), wait_sends_(wait_sends) {}

  bool advance(size_t* pending) override {
    bool moved = false;
    size_t left = 0;
    for (size_t i = 0; i < sends_.size(); ++i) {
      SendOp& s = sends_[i];
      if (s.done < s.n && !blocked_behind(sends_, i)) {
        size_t k = s.link->send_some(s.data, s.n, s.done);
        s.done += k;
        moved |= k > 0;
      }
      left += wait_sends_ && s.done < s.n;
    }
    for (size_t i = 0; i < recvs_.size(); ++i) {
      RecvOp& r = recvs_[i];
      if (r.done < r.n && !blocked_behind(recvs_, i)) {
        size_t k = r.link->recv_some(*r.sink, r.n, r.done);
        r.done += k;
        moved |= k > 0;
      }
      left += r.done < r.n;
    }
    *pending = left;
    return moved;
  }

  void pending_io(std::vector<PendingIo>* out) const override {
    out->clear();
    for (const auto& s : sends_)
      if (s.done < s.n) out->push_back(PendingIo{s.link, true});
    for (const auto& r : recvs_)
      if (r.done < r.n) out->push_back(PendingIo{r.link, false});
  }

 private:
  std::vector<SendOp>& sends_;
  std::vector<RecvOp>& recvs_;
  bool wait_sends_;
};

std::string describe_pending(const std::vector<PendingIo>& io) {
  std::string out;
  for (const auto& p : io)
    out += cat(out.empty() ? "" : ", ", p.sending ? "send to rank " : "receive from rank ",
               p.link->peer(), " (", p.link->kind(), ", host ", p.link->peer_host(), ")");
  return out;
}

// Blocks for at most `slice_ns` or until something may have changed, the
// way the pending links' table entries say (transports.h).
void block_once(const ProgressSettings& st, ProgressTask& task, const std::vector<PendingIo>& io,
                std::vector<pollfd>* fds, int64_t slice_ns) {
  bool any_bell = false;
  fds->clear();
  for (const auto& p : io) {
    const unsigned wait = p.link->transport().wait;
    const short events = p.sending ? POLLOUT : POLLIN;
    if (wait & kWaitFd) fds->push_back(pollfd{p.link->poll_fd(), events, 0});
    any_bell |= (wait & kWaitDoorbell) != 0;
  }
  Doorbell* bell = st.doorbell;
  if (any_bell && fds->empty() && bell) {
    uint32_t seen = bell->snapshot();
    bell->set_sleeping(true);
    size_t pending = 0;
    if (!task.advance(&pending) && pending > 0) bell->wait(seen, slice_ns);
    bell->set_sleeping(false);
    return;
  }
  // Sockets only: poll for the whole slice. Mixed: short slices, since a
  // doorbell cannot wake poll().
  if (any_bell) {
    struct timespec ts{0, 200000};
    ppoll(fds->data(), fds->size(), &ts, nullptr);
  } else {
    poll(fds->data(), fds->size(), static_cast<int>(slice_ns / 1000000));
  }
}

}  // namespace

void drive(const ProgressSettings& st, ProgressTask& task, const Describe& what) {
  size_t pending = 1;
  const auto spin = std::chrono::duration<double>(st.spin_seconds);
  auto last_progress = Clock::now();
  auto last_check = last_progress;
  std::vector<pollfd> fds;
  std::vector<PendingIo> io;
  constexpr int64_t kSliceNs = 100 * 1000 * 1000;  // liveness checks every 100 ms
  try {
    if (!task.advance(&pending) && pending == 0) return;
    while (pending > 0) {
      if (task.advance(&pending)) {
        last_progress = Clock::now();
        continue;
      }
      if (pending == 0) break;
      auto now = Clock::now();
      if (now - last_progress < spin) {
        // Yield on every turn rather than spin with pause: the thread we wait
        // for (the peer's, or this rank's engine or caller) may need this very
        // core, and a spin would keep it off for the rest of the spin time.
        // That was the ms-level latency of small TCP allreduces on a busy
        // 2-core machine (README, "Hosts, links and faults"); on an idle core
        // sched_yield() returns at once.
        sched_yield();
        continue;
      }
      task.pending_io(&io);
      if (now - last_check > std::chrono::milliseconds(100)) {
        for (const auto& p : io) p.link->check_alive();
        if (st.heartbeat) st.heartbeat->check();
        // A slow but moving transfer (a large message on a busy link) is let finish:
        // only a wait that has moved nothing for a second is given up.
        if (st.leaving && st.leaving->load(std::memory_order_relaxed) &&
            now - last_progress > std::chrono::seconds(1))
          throw_error(ErrorKind::kInternal, "this rank is shutting down; stopped waiting to ",
                      describe_pending(io));
        last_check = now;
      }
      if (now - last_progress > std::chrono::duration<double>(st.timeout_seconds))
        throw_error(ErrorKind::kTimeout, "no progress for ", st.timeout_seconds,
                    " s (RINGREDUCE_TIMEOUT_SECONDS) waiting to ", describe_pending(io));
      block_once(st, task, io, &fds, kSliceNs);
    }
  } catch (const Error& e) {
    throw Error(e.kind(), cat("rank ", st.rank, ": ", what(), ": ", e.what()));
  }
}

void run_transfers(const ProgressSettings& st, std::vector<SendOp>& sends,
                   std::vector<RecvOp>& recvs, const Describe& what, bool wait_sends) {
  TransferTask task(sends, recvs, wait_sends);
  drive(st, task, what);
}

}  // namespace rr
