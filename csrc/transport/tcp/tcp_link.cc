#include "transport/tcp/tcp_link.h"

#include <sys/socket.h>

#include <algorithm>
#include <cerrno>

#include "common/error.h"

namespace rr {

TcpLink::TcpLink(int peer, std::string host, Fd fd, size_t chunk_bytes)
    : peer_(peer), host_(std::move(host)), fd_(std::move(fd)), staging_(chunk_bytes) {
  set_nonblocking(fd_.get());
  tune_data_socket(fd_.get());
}

void TcpLink::fail(const char* what, int err) {
  if (err == 0)
    throw_error(ErrorKind::kPeerLost, "rank ", peer_, " on host ", host_,
                " closed its connection (it exited, crashed, shut down or failed)");
  throw_error(ErrorKind::kPeerLost, what, " rank ", peer_, " on host ", host_, " failed: ",
              errno_string(err));
}

void TcpLink::abort() {
  if (fd_.get() >= 0) ::shutdown(fd_.get(), SHUT_RDWR);  // the peer reads EOF at once
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
    uint8_t* dst = sink.direct(done);
    size_t want = dst ? n - done : std::min(chunk, n - done) - staged_;
    uint8_t* into = dst ? dst : staging_.data() + staged_;
    ssize_t r = ::recv(fd_.get(), into, want, MSG_DONTWAIT);
    if (r == 0) fail("receiving from", 0);
    if (r < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      if (errno == EINTR) continue;
      fail("receiving from", errno);
    }
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
