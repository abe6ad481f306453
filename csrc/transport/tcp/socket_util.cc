#include "transport/tcp/socket_util.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "common/env.h"
#include "common/error.h"

namespace rr {

Deadline deadline_in(double seconds) {
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

static int ms_left(Deadline d) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(d - Clock::now()).count();
  return left < 0 ? 0 : static_cast<int>(std::min<long long>(left, 1 << 30));
}

Fd& Fd::operator=(Fd&& o) noexcept {
  if (this != &o) {
    reset();
    fd_ = o.release();
  }
  return *this;
}

void Fd::reset() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

static sockaddr_in resolve(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int rc = getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (rc != 0 || !res)
    throw_error(ErrorKind::kInvalidArgument, "cannot resolve host '", host,
                "': ", gai_strerror(rc));
  sockaddr_in addr = *reinterpret_cast<sockaddr_in*>(res->ai_addr);
  freeaddrinfo(res);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  return addr;
}

Fd listen_tcp(const std::string& bind_addr, int port, int* bound_port) {
  Fd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (fd.get() < 0) throw_error(ErrorKind::kInternal, "socket(): ", errno_string(errno));
  int one = 1;
  setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr = resolve(bind_addr, port);
  if (bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0)
    throw_error(ErrorKind::kInvalidArgument, "cannot bind ", bind_addr, ":", port,
                " (RINGREDUCE_BIND_ADDR): ", errno_string(errno));
  if (listen(fd.get(), 1024) != 0)
    throw_error(ErrorKind::kInternal, "listen(): ", errno_string(errno));
  set_nonblocking(fd.get());  // accept() after poll() must not block if the client left
  socklen_t len = sizeof(addr);
  getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &len);
  *bound_port = ntohs(addr.sin_port);
  return fd;
}

Fd accept_until(int listen_fd, Deadline deadline, std::string* peer_addr) {
  while (true) {
    pollfd p{listen_fd, POLLIN, 0};
    int rc = poll(&p, 1, ms_left(deadline));
    if (rc == 0) return Fd();
    if (rc < 0 && errno != EINTR)
      throw_error(ErrorKind::kInternal, "poll(): ", errno_string(errno));
    sockaddr_in addr{};
    socklen_t len = sizeof(addr);
    int fd = accept4(listen_fd, reinterpret_cast<sockaddr*>(&addr), &len, SOCK_CLOEXEC);
    if (fd < 0) continue;  // the client went away between poll and accept
    char buf[INET_ADDRSTRLEN] = {0};
    inet_ntop(AF_INET, &addr.sin_addr, buf, sizeof(buf));
    *peer_addr = std::string(buf) + ":" + std::to_string(ntohs(addr.sin_port));
    return Fd(fd);
  }
}

// One attempt, bounded by the deadline: a blocking connect() to an address
// that drops SYNs would wait for the kernel's own timeout (minutes). Returns
// 0 with `fd` connected (and blocking again), or the error.
static int connect_once(int fd, const sockaddr_in& addr, Deadline deadline) {
  const int flags = fcntl(fd, F_GETFL);
  fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  int err = 0;
  if (connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) err = errno;
  if (err == EINPROGRESS) {
    pollfd pf{fd, POLLOUT, 0};
    socklen_t len = sizeof(err);
    if (poll(&pf, 1, ms_left(deadline)) <= 0)
      err = ETIMEDOUT;
    else if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0)
      err = errno;
  }
  fcntl(fd, F_SETFL, flags);
  return err;
}

Fd connect_until(const std::string& host, int port, Deadline deadline) {
  sockaddr_in addr = resolve(host, port);
  while (true) {
    Fd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    const int err = connect_once(fd.get(), addr, deadline);
    if (err == 0) return fd;
    if (Clock::now() > deadline)
      throw_error(ErrorKind::kTimeout, "cannot connect to ", host, ":", port, ": ",
                  errno_string(err));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

void write_full(int fd, const void* data, size_t n, Deadline deadline, const std::string& who) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w > 0) {
      p += w;
      n -= static_cast<size_t>(w);
      continue;
    }
    if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
      throw_error(ErrorKind::kPeerLost, "sending to ", who, " failed: ", errno_string(errno));
    pollfd pf{fd, POLLOUT, 0};
    if (poll(&pf, 1, ms_left(deadline)) == 0)
      throw_error(ErrorKind::kTimeout, "sending to ", who, " timed out");
  }
}

void read_full(int fd, void* data, size_t n, Deadline deadline, const std::string& who) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    ssize_t r = ::recv(fd, p, n, MSG_DONTWAIT);
    if (r > 0) {
      p += r;
      n -= static_cast<size_t>(r);
      continue;
    }
    if (r == 0) throw_error(ErrorKind::kPeerLost, who, " closed the connection");
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
      throw_error(ErrorKind::kPeerLost, "receiving from ", who, " failed: ", errno_string(errno));
    pollfd pf{fd, POLLIN, 0};
    if (poll(&pf, 1, ms_left(deadline)) == 0)
      throw_error(ErrorKind::kTimeout, "receiving from ", who, " timed out");
  }
}

void set_nonblocking(int fd) {
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
}

void tune_data_socket(int fd, double link_timeout_s) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  // A host that vanishes without closing its sockets (power loss, a cut
  // link) sends no FIN or RST. Keepalive alone does not help while data is
  // queued (the kernel retransmits for ~15 minutes instead of probing), so
  // TCP_USER_TIMEOUT bounds how long sent data may stay unacknowledged, and,
  // with keepalive probing an idle connection every second after a short
  // idle time, how long the peer may stay unheard. A slow but live link keeps
  // acknowledging, so only a dead path (or a receiver whose buffer stayed full
  // that long) trips it. Either way the socket fails with ETIMEDOUT.
  if (link_timeout_s > 0) {
    const double ms = std::min(link_timeout_s * 1000.0, 2e9);
    unsigned user_timeout = static_cast<unsigned>(ms);
    int idle = static_cast<int>(std::clamp(link_timeout_s / 3, 1.0, 5.0));
    int interval = 1, count = std::max(1, static_cast<int>(link_timeout_s));
    setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout, sizeof(user_timeout));
    setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval));
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof(count));
  }
  int buf = 4 << 20;
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof(buf));
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof(buf));
}

static std::string iface_address(const std::string& want_iface) {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return "";
  std::string found;
  for (ifaddrs* i = list; i && found.empty(); i = i->ifa_next) {
    if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET) continue;
    bool loopback = std::strcmp(i->ifa_name, "lo") == 0;
    if (want_iface.empty() ? loopback : want_iface != i->ifa_name) continue;
    char buf[INET_ADDRSTRLEN] = {0};
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, buf, sizeof(buf));
    found = buf;
  }
  freeifaddrs(list);
  return found;
}

std::string advertised_address() {
  std::string addr = env_str("RINGREDUCE_ADVERTISE_ADDR", "");
  if (!addr.empty()) return addr;
  std::string iface = env_str("RINGREDUCE_IFACE", "");
  addr = iface_address(iface);
  if (addr.empty() && !iface.empty())
    throw_error(ErrorKind::kInvalidArgument, "RINGREDUCE_IFACE=", iface,
                " has no IPv4 address on this host");
  return addr.empty() ? "127.0.0.1" : addr;
}

}  // namespace rr
