#include "transport/tcp/tcp_link.h"

#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/error.h"

namespace rr {

TcpLink::TcpLink(int peer, std::string host, Fd fd, size_t chunk_bytes, double link_timeout_s)
    : peer_(peer),
      host_(std::move(host)),
      fd_(std::move(fd)),
      staging_(chunk_bytes),
      link_timeout_s_(link_timeout_s) {
  set_nonblocking(fd_.get());
  tune_data_socket(fd_.get(), link_timeout_s);
}

namespace {
constexpr char kLastWordsMagic[8] = {'R', 'R', 'A', 'B', 'O', 'R', 'T', '!'};
constexpr size_t kMaxReason = 400;
constexpr size_t kTailBytes = kMaxReason + 4 + sizeof(kLastWordsMagic);
}  // namespace

void TcpLink::remember(const uint8_t* data, size_t n) {
  if (n >= kTailBytes) {
    tail_.assign(data + n - kTailBytes, data + n);
    return;
  }
  tail_.insert(tail_.end(), data, data + n);
  if (tail_.size() > kTailBytes) tail_.erase(tail_.begin(), tail_.end() - kTailBytes);
}

std::string TcpLink::last_words() const {
  const size_t m = sizeof(kLastWordsMagic);
  if (tail_.size() < m + 4 || std::memcmp(tail_.data() + tail_.size() - m, kLastWordsMagic, m))
    return "";
  uint32_t len = 0;
  std::memcpy(&len, tail_.data() + tail_.size() - m - 4, 4);
  if (len > kMaxReason || len + m + 4 > tail_.size()) return "";
  const uint8_t* start = tail_.data() + tail_.size() - m - 4 - len;
  return std::string(reinterpret_cast<const char*>(start), len);
}

void TcpLink::abort(const std::string& reason) {
  if (aborted_ || fd_.get() < 0) return;
  aborted_ = true;
  std::string rec = reason.substr(0, kMaxReason);
  uint32_t len = static_cast<uint32_t>(rec.size());
  rec.append(reinterpret_cast<const char*>(&len), 4);
  rec.append(kLastWordsMagic, sizeof(kLastWordsMagic));
  // The socket may be full of ring data the peer is still draining: give it a
  // moment, then give up (the EOF alone still tells the peer we are gone).
  try {
    write_full(fd_.get(), rec.data(), rec.size(), deadline_in(0.25), "last words");
  } catch (const Error&) {
  }
  ::shutdown(fd_.get(), SHUT_WR);  // half-close: the peer reads the record, then EOF
}

// Peeks at what is waiting on the socket without consuming it: EOF with
// nothing before it, or a short backlog that ends with a last-words record
// (the peer wrote it, then half-closed), means the peer has left.
void TcpLink::check_alive() {
  if (fd_.get() < 0) return;
  std::vector<uint8_t> peek(8192);
  ssize_t r = ::recv(fd_.get(), peek.data(), peek.size(), MSG_PEEK | MSG_DONTWAIT);
  if (r == 0) fail("receiving from", 0);
  if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
    fail("receiving from", errno);
  if (r <= 0 || static_cast<size_t>(r) == peek.size()) return;
  // The record may have begun in bytes already consumed: look at both.
  std::vector<uint8_t> saved = tail_;
  remember(peek.data(), static_cast<size_t>(r));
  std::string why = last_words();
  tail_ = std::move(saved);
  if (!why.empty())
    throw_error(ErrorKind::kPeerLost, "rank ", peer_, " on host ", host_, " left the job: ", why);
}

void TcpLink::fail(const char* what, int err) {
  if (err == 0) {
    std::string why = last_words();
    if (!why.empty())
      throw_error(ErrorKind::kPeerLost, "rank ", peer_, " on host ", host_, " left the job: ", why);
    throw_error(ErrorKind::kPeerLost, "rank ", peer_, " on host ", host_,
                " closed its connection (it exited, crashed, shut down or failed)");
  }
  if (err == ETIMEDOUT)
    throw_error(ErrorKind::kPeerLost, what, " rank ", peer_, " on host ", host_,
                " failed: the link is dead (nothing acknowledged or heard for ", link_timeout_s_,
                " s, RINGREDUCE_LINK_TIMEOUT_SECONDS): its host is ",
                "unreachable, or it stopped reading");
  throw_error(ErrorKind::kPeerLost, what, " rank ", peer_, " on host ", host_,
              " failed: ", errno_string(err));
}

size_t TcpLink::send_some(const uint8_t* data, size_t n, size_t done) {
  size_t start = done;
  while (done < n) {
    ssize_t w = ::send(fd_.get(), data + done, n - done, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w > 0) {
      done += static_cast<size_t>(w);
      continue;
    }
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    if (w < 0 && errno == EINTR) continue;
    fail("sending to", errno);
  }
  return done - start;
}

size_t TcpLink::recv_some(RecvSink& sink, size_t n, size_t done) {
  size_t start = done;
  const size_t chunk = staging_.size();
  while (done < n) {
    uint8_t* dst = sink.direct(done, n - done);
    size_t want = dst ? n - done : std::min(chunk, n - done) - staged_;
    uint8_t* into = dst ? dst : staging_.data() + staged_;
    ssize_t r = ::recv(fd_.get(), into, want, MSG_DONTWAIT);
    if (r == 0) fail("receiving from", 0);
    if (r < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      if (errno == EINTR) continue;
      fail("receiving from", errno);
    }
    remember(into, static_cast<size_t>(r));
    if (dst) {
      done += static_cast<size_t>(r);
      continue;
    }
    staged_ += static_cast<size_t>(r);
    size_t chunk_len = std::min(chunk, n - done);
    if (staged_ == chunk_len) {
      sink.consume(staging_.data(), done, chunk_len);
      done += chunk_len;
      staged_ = 0;
    }
  }
  return done - start;
}

}  // namespace rr
