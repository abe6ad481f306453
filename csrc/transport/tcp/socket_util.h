// Thin, deadline-aware wrappers over BSD sockets (IPv4). Every call that can
// wait takes an absolute deadline, so no socket operation can hang forever.
#pragma once

#include <chrono>
#include <cstddef>
#include <string>

namespace rr {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

Deadline deadline_in(double seconds);

// Owns a file descriptor.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }
  int get() const { return fd_; }
  int release() {
    int f = fd_;
    fd_ = -1;
    return f;
  }
  void reset();

 private:
  int fd_ = -1;
};

// Listening socket on bind_addr (e.g. "0.0.0.0"), port 0 = any. Returns the port.
Fd listen_tcp(const std::string& bind_addr, int port, int* bound_port);
// Accepts one connection or returns an empty Fd at the deadline.
Fd accept_until(int listen_fd, Deadline deadline, std::string* peer_addr);
// Connects, retrying refused connections until the deadline.
Fd connect_until(const std::string& host, int port, Deadline deadline);
// Blocking-style full read/write on a (possibly non-blocking) socket, bounded
// by the deadline. Throw kPeerLost on EOF/reset, kTimeout at the deadline;
// `who` names the other side for the message.
void write_full(int fd, const void* data, size_t n, Deadline deadline, const std::string& who);
void read_full(int fd, void* data, size_t n, Deadline deadline, const std::string& who);

void set_nonblocking(int fd);
// TCP_NODELAY, large buffers, and (link_timeout_s > 0) TCP_USER_TIMEOUT plus
// keepalive: unacknowledged data or an unheard peer fails the socket with
// ETIMEDOUT after about link_timeout_s (RINGREDUCE_LINK_TIMEOUT_SECONDS).
void tune_data_socket(int fd, double link_timeout_s);

// The address other hosts should use to reach this one: RINGREDUCE_ADVERTISE_ADDR,
// else the IPv4 address of interface RINGREDUCE_IFACE, else the first
// non-loopback IPv4 address, else 127.0.0.1.
std::string advertised_address();

}  // namespace rr
