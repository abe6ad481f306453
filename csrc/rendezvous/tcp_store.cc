#include "rendezvous/tcp_store.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <unordered_map>
#include <vector>

#include "common/logging.h"

namespace rr {

// Wire protocol (all integers big-endian u32):
//
//   client -> server, once per connection:  magic "RRS1"
//   client -> server, SET:  u8 1, u32 key_len, key, u32 value_len, value
//   server -> client:       u8 0   (the SET has been applied)
//   client -> server, GET:  u8 2, u32 key_len, key
//   server -> client:       u8 0, u32 value_len, value
//   client -> server, ADD:  u8 3, u32 key_len, key, u32 value_len, value
//   server -> client:       u8 0, u32 value_len, value (what the key now holds:
//                           the value sent if the key was absent, else the old one)
//
// Invariants:
//  - Requests on a connection are answered in order, one reply per request.
//    The server answers a GET only once the key exists; until then the GET is
//    parked and later requests on that connection wait behind it.
//  - Deadlines belong to the client. A client that gives up on a GET closes
//    its connection, which is how the server learns to forget the parked GET;
//    the connection can then never deliver a stale reply.
//  - key_len <= kMaxKeyBytes and value_len <= kMaxValueBytes. Anything else
//    (bad magic, unknown op, oversized length) is garbage: the server drops
//    that connection and nothing else.
//  - Keys are never deleted; a SET replaces the value and wakes every GET
//    parked on that key.

namespace {

constexpr char kMagic[4] = {'R', 'R', 'S', '1'};
constexpr uint8_t kOpSet = 1;
constexpr uint8_t kOpGet = 2;
constexpr uint8_t kOpAdd = 3;  // set if absent: claims (two jobs on one port)
constexpr uint8_t kReplyOk = 0;
constexpr size_t kMaxKeyBytes = 4096;
constexpr size_t kMaxValueBytes = size_t{64} << 20;
constexpr size_t kMaxFrameBytes = 1 + 4 + kMaxKeyBytes + 4 + kMaxValueBytes;
// Past this much unsent reply data the server stops reading new requests from
// that client, so a client that never reads cannot grow server memory.
constexpr size_t kMaxPendingReplyBytes = size_t{1} << 20;

using Clock = std::chrono::steady_clock;

class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = o.release();
    }
    return *this;
  }
  int get() const { return fd_; }
  int release() {
    int f = fd_;
    fd_ = -1;
    return f;
  }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

void put_u32(std::string* out, uint32_t v) {
  const char b[4] = {static_cast<char>(v >> 24), static_cast<char>(v >> 16),
                     static_cast<char>(v >> 8), static_cast<char>(v)};
  out->append(b, 4);
}

uint32_t get_u32(const char* p) {
  const auto* u = reinterpret_cast<const unsigned char*>(p);
  return (uint32_t{u[0]} << 24) | (uint32_t{u[1]} << 16) | (uint32_t{u[2]} << 8) | uint32_t{u[3]};
}

// Latency matters more than segment count for tiny request/reply messages.
void set_nodelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

std::string sockaddr_string(const sockaddr_in& a) {
  char ip[INET_ADDRSTRLEN] = "?";
  ::inet_ntop(AF_INET, &a.sin_addr, ip, sizeof(ip));
  return cat(ip, ":", ntohs(a.sin_port));
}

// Milliseconds for poll(): rounded up so we never wake just before the
// deadline, and capped so very long deadlines cannot overflow an int.
int poll_ms_until(Clock::time_point deadline) {
  auto left = deadline - Clock::now();
  if (left <= Clock::duration::zero()) return 0;
  auto ms = std::chrono::ceil<std::chrono::milliseconds>(left).count();
  return static_cast<int>(std::min<int64_t>(ms, 60 * 60 * 1000));
}

// ---------------------------------------------------------------------------
// Server

enum class Parse { kNeedMore, kOk, kGarbage };

struct Request {
  uint8_t op = 0;
  std::string key;
  std::string value;
  size_t frame_bytes = 0;
};

// Parses one request starting at in[pos]; on kGarbage, *why says what was wrong.
Parse parse_request(const std::string& in, size_t pos, Request* req, std::string* why) {
  const size_t avail = in.size() - pos;
  const char* p = in.data() + pos;
  if (avail < 1) return Parse::kNeedMore;
  req->op = static_cast<uint8_t>(p[0]);
  if (req->op != kOpSet && req->op != kOpGet && req->op != kOpAdd) {
    *why = cat("unknown op ", int{req->op});
    return Parse::kGarbage;
  }
  if (avail < 5) return Parse::kNeedMore;
  const size_t key_len = get_u32(p + 1);
  if (key_len > kMaxKeyBytes) {
    *why = cat("key length ", key_len, " exceeds ", kMaxKeyBytes);
    return Parse::kGarbage;
  }
  size_t need = 5 + key_len;
  size_t value_len = 0;
  if (req->op != kOpGet) {
    if (avail < need + 4) return Parse::kNeedMore;
    value_len = get_u32(p + need);
    if (value_len > kMaxValueBytes) {
      *why = cat("value length ", value_len, " exceeds ", kMaxValueBytes);
      return Parse::kGarbage;
    }
    need += 4 + value_len;
  }
  if (avail < need) return Parse::kNeedMore;
  req->key.assign(p + 5, key_len);
  if (req->op != kOpGet) req->value.assign(p + 5 + key_len + 4, value_len);
  req->frame_bytes = need;
  return Parse::kOk;
}

}  // namespace

// Server invariants: a Conn is erased only in sweep(), so ids and references
// taken during one poll iteration stay valid for that iteration; a dead Conn
// is never read from or written to again; a Conn is listed in waiters_ under
// K exactly while it is alive and parked on K (kill() removes it eagerly).
class TcpStoreServer::Loop {
 public:
  Loop(Fd listen, Fd wake) : listen_(std::move(listen)), wake_(std::move(wake)) {}

  // Serves until the wake pipe becomes readable; never throws. On exit every
  // socket is closed so that clients see the server go away.
  void run() {
    try {
      serve();
    } catch (const std::exception& e) {
      log(LogLevel::kError, -1, "TCP store server stopped: ", e.what());
    }
    conns_.clear();
    listen_.reset();
  }

 private:
  struct Conn {
    uint64_t id = 0;
    Fd fd;
    std::string peer;
    std::string in;
    std::string out;
    size_t out_sent = 0;
    bool greeted = false;  // magic received
    bool parked = false;   // waiting for parked_key to be set
    std::string parked_key;
    bool dead = false;
  };

  void serve();
  void accept_all();
  void read_from(Conn& c);
  void process(Conn& c);
  void handle(Conn& c, Request& req);
  void reply(Conn& c, const std::string& bytes);
  void flush(Conn& c);
  void kill(Conn& c, LogLevel level, const std::string& why);
  void sweep();

  Fd listen_;
  Fd wake_;
  uint64_t next_id_ = 1;
  std::map<uint64_t, Conn> conns_;
  std::map<std::string, std::string> data_;
  std::unordered_map<std::string, std::vector<uint64_t>> waiters_;
  std::vector<uint64_t> runnable_;  // conns that may have requests to process
  Clock::time_point accept_paused_until_{};
  std::vector<char> read_buf_ = std::vector<char>(size_t{1} << 16);
};

void TcpStoreServer::Loop::serve() {
  std::vector<pollfd> fds;
  std::vector<uint64_t> ids;  // ids[i] owns fds[i + first_conn]
  for (;;) {
    fds.clear();
    ids.clear();
    fds.push_back({wake_.get(), POLLIN, 0});
    const bool accepting = Clock::now() >= accept_paused_until_;
    if (accepting) fds.push_back({listen_.get(), POLLIN, 0});
    const size_t first_conn = fds.size();
    for (auto& [id, c] : conns_) {
      short events = POLLIN;
      if (c.out_sent < c.out.size()) events |= POLLOUT;
      fds.push_back({c.fd.get(), events, 0});
      ids.push_back(id);
    }
    const int timeout_ms = accepting ? -1 : poll_ms_until(accept_paused_until_);
    if (::poll(fds.data(), fds.size(), timeout_ms) < 0) {
      if (errno == EINTR) continue;
      throw_error(ErrorKind::kInternal, "poll: ", errno_string(errno));
    }
    if (fds[0].revents != 0) return;  // close() wrote to the wake pipe
    if (accepting && fds[1].revents != 0) accept_all();
    for (size_t i = 0; i < ids.size(); ++i) {
      const short rev = fds[first_conn + i].revents;
      Conn& c = conns_.at(ids[i]);
      if (c.dead || rev == 0) continue;
      if (rev & POLLOUT) flush(c);
      if (!c.dead && (rev & (POLLIN | POLLHUP | POLLERR))) read_from(c);
      runnable_.push_back(ids[i]);
    }
    // A SET can unpark other clients, whose buffered requests then become
    // processable; runnable_ grows until no client can make progress.
    while (!runnable_.empty()) {
      const uint64_t id = runnable_.back();
      runnable_.pop_back();
      auto it = conns_.find(id);
      if (it != conns_.end() && !it->second.dead) process(it->second);
    }
    sweep();
  }
}

void TcpStoreServer::Loop::accept_all() {
  for (;;) {
    sockaddr_in addr{};
    socklen_t len = sizeof(addr);
    int fd = ::accept4(listen_.get(), reinterpret_cast<sockaddr*>(&addr), &len,
                       SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      if (errno == EINTR || errno == ECONNABORTED || errno == EPROTO) continue;
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        // The pending connection stays in the backlog; pausing keeps poll()
        // from spinning on it while descriptors are exhausted.
        log(LogLevel::kWarning, -1, "TCP store server cannot accept: ", errno_string(errno));
        accept_paused_until_ = Clock::now() + std::chrono::milliseconds(100);
        return;
      }
      throw_error(ErrorKind::kInternal, "accept: ", errno_string(errno));
    }
    set_nodelay(fd);
    const uint64_t id = next_id_++;
    Conn& c = conns_[id];
    c.id = id;
    c.fd = Fd(fd);
    c.peer = sockaddr_string(addr);
    log(LogLevel::kDebug, -1, "TCP store server: client ", c.peer, " connected");
  }
}

void TcpStoreServer::Loop::read_from(Conn& c) {
  ssize_t r = ::recv(c.fd.get(), read_buf_.data(), read_buf_.size(), 0);
  if (r < 0) {
    if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) return;
    kill(c, LogLevel::kWarning, cat("connection failed: ", errno_string(errno)));
    return;
  }
  if (r == 0) {
    // A clean close between requests is how clients leave (or abandon a
    // timed-out GET); a close mid-request means the client crashed.
    const bool mid_request = !c.in.empty();
    kill(c, mid_request ? LogLevel::kWarning : LogLevel::kDebug,
         mid_request ? "disconnected in the middle of a request" : "disconnected");
    return;
  }
  c.in.append(read_buf_.data(), static_cast<size_t>(r));
}

void TcpStoreServer::Loop::process(Conn& c) {
  size_t pos = 0;
  if (!c.greeted) {
    if (c.in.size() < sizeof(kMagic)) return;
    if (std::memcmp(c.in.data(), kMagic, sizeof(kMagic)) != 0) {
      kill(c, LogLevel::kWarning, "sent a bad handshake (not a ringreduce store client?)");
      return;
    }
    c.greeted = true;
    pos = sizeof(kMagic);
  }
  while (!c.dead && !c.parked && c.out.size() - c.out_sent < kMaxPendingReplyBytes) {
    Request req;
    std::string why;
    Parse p = parse_request(c.in, pos, &req, &why);
    if (p == Parse::kNeedMore) break;
    if (p == Parse::kGarbage) {
      kill(c, LogLevel::kWarning, cat("sent a malformed request: ", why));
      return;
    }
    pos += req.frame_bytes;
    handle(c, req);
  }
  c.in.erase(0, pos);
  // Whatever is still buffered is either an incomplete frame (< kMaxFrameBytes)
  // or requests queued behind a parked GET, which a well-behaved client never
  // sends; more than a frame's worth means the client ignores the protocol.
  if (!c.dead && c.in.size() > kMaxFrameBytes) {
    kill(c, LogLevel::kWarning, "sent too much data without reading replies");
  }
}

void TcpStoreServer::Loop::handle(Conn& c, Request& req) {
  if (req.op == kOpGet) {
    auto it = data_.find(req.key);
    if (it == data_.end()) {
      c.parked = true;
      c.parked_key = req.key;
      waiters_[req.key].push_back(c.id);
      return;
    }
    std::string out(1, static_cast<char>(kReplyOk));
    put_u32(&out, static_cast<uint32_t>(it->second.size()));
    out += it->second;
    reply(c, out);
    return;
  }
  const bool existed = data_.count(req.key) != 0;
  std::string& stored = data_[req.key];
  if (req.op == kOpSet || !existed) stored = std::move(req.value);
  if (req.op == kOpSet) {
    reply(c, std::string(1, static_cast<char>(kReplyOk)));
  } else {
    std::string out(1, static_cast<char>(kReplyOk));
    put_u32(&out, static_cast<uint32_t>(stored.size()));
    reply(c, out + stored);
  }
  auto w = waiters_.find(req.key);
  if (w == waiters_.end()) return;
  std::string out(1, static_cast<char>(kReplyOk));
  put_u32(&out, static_cast<uint32_t>(stored.size()));
  out += stored;
  // Unpark before reply(): if the send fails, kill() must not edit the
  // waiter list this loop is iterating over.
  for (uint64_t wid : w->second) {
    auto it = conns_.find(wid);
    if (it == conns_.end()) continue;
    Conn& waiter = it->second;
    if (waiter.dead || !waiter.parked || waiter.parked_key != req.key) continue;
    waiter.parked = false;
    waiter.parked_key.clear();
    reply(waiter, out);
    runnable_.push_back(wid);
  }
  waiters_.erase(w);
}

void TcpStoreServer::Loop::reply(Conn& c, const std::string& bytes) {
  if (c.out_sent > 0) {
    c.out.erase(0, c.out_sent);
    c.out_sent = 0;
  }
  c.out += bytes;
  flush(c);  // most replies fit in the socket buffer: no extra poll round
}

void TcpStoreServer::Loop::flush(Conn& c) {
  while (c.out_sent < c.out.size()) {
    ssize_t r =
        ::send(c.fd.get(), c.out.data() + c.out_sent, c.out.size() - c.out_sent, MSG_NOSIGNAL);
    if (r < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      kill(c, LogLevel::kWarning, cat("connection failed while replying: ", errno_string(errno)));
      return;
    }
    c.out_sent += static_cast<size_t>(r);
  }
  c.out.clear();
  c.out_sent = 0;
}

void TcpStoreServer::Loop::kill(Conn& c, LogLevel level, const std::string& why) {
  if (c.dead) return;
  c.dead = true;
  log(level, -1, "TCP store server: dropping client ", c.peer, ": ", why,
      c.parked ? cat(" (was waiting for key '", c.parked_key, "')") : std::string());
  if (c.parked) {
    // Erase this conn's entry now, so a key that is never set does not
    // accumulate entries from clients that gave up on it.
    auto w = waiters_.find(c.parked_key);
    if (w != waiters_.end()) {
      auto& v = w->second;
      v.erase(std::remove(v.begin(), v.end(), c.id), v.end());
      if (v.empty()) waiters_.erase(w);
    }
  }
}

void TcpStoreServer::Loop::sweep() {
  for (auto it = conns_.begin(); it != conns_.end();) {
    it = it->second.dead ? conns_.erase(it) : std::next(it);
  }
}

TcpStoreServer::TcpStoreServer(const std::string& bind_host, int port) {
  if (port < 0 || port > 65535) {
    throw_error(ErrorKind::kInvalidArgument, "TCP store port must be in [0, 65535], got ", port);
  }
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  const bool any = bind_host.empty() || bind_host == "0.0.0.0";
  int gai =
      ::getaddrinfo(any ? nullptr : bind_host.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (gai != 0) {
    throw_error(ErrorKind::kInvalidArgument, "TCP store server cannot resolve bind host '",
                bind_host, "': ", ::gai_strerror(gai));
  }
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> res_guard(res, ::freeaddrinfo);
  Fd listen(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (listen.get() < 0) throw_error(ErrorKind::kInternal, "socket: ", errno_string(errno));
  // A restarted job must be able to rebind the port while old connections
  // from the previous run sit in TIME_WAIT.
  int one = 1;
  ::setsockopt(listen.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  set_nodelay(listen.get());
  if (::bind(listen.get(), res->ai_addr, res->ai_addrlen) != 0 ||
      ::listen(listen.get(), SOMAXCONN) != 0) {
    throw_error(ErrorKind::kInternal, "TCP store server cannot listen on ", bind_host, ":", port,
                ": ", errno_string(errno));
  }
  sockaddr_in bound{};
  socklen_t len = sizeof(bound);
  if (::getsockname(listen.get(), reinterpret_cast<sockaddr*>(&bound), &len) != 0) {
    throw_error(ErrorKind::kInternal, "getsockname: ", errno_string(errno));
  }
  port_ = ntohs(bound.sin_port);
  int pipe_fds[2];
  if (::pipe2(pipe_fds, O_NONBLOCK | O_CLOEXEC) != 0) {
    throw_error(ErrorKind::kInternal, "pipe2: ", errno_string(errno));
  }
  wake_fd_ = pipe_fds[1];
  loop_ = std::make_unique<Loop>(std::move(listen), Fd(pipe_fds[0]));
  thread_ = std::thread([this] { loop_->run(); });
}

TcpStoreServer::~TcpStoreServer() {
  close();
}

void TcpStoreServer::close() {
  std::lock_guard<std::mutex> lock(close_mu_);
  if (!thread_.joinable()) return;
  const char b = 0;
  // The pipe is empty (this is the only write), so the write cannot block.
  while (::write(wake_fd_, &b, 1) < 0 && errno == EINTR) {
  }
  thread_.join();
  ::close(wake_fd_);
  wake_fd_ = -1;
  loop_.reset();
}

// ---------------------------------------------------------------------------
// Client

namespace {

// Waits until fd is ready for `events`; false when the deadline passes first.
bool wait_ready(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    int r = ::poll(&p, 1, poll_ms_until(deadline));
    if (r > 0) return true;  // errors and hangups surface in the following recv/send
    if (r == 0 && Clock::now() >= deadline) return false;
    if (r < 0 && errno != EINTR) throw_error(ErrorKind::kInternal, "poll: ", errno_string(errno));
  }
}

// `what` names the operation in progress ("setting key 'k' in the store at
// host:port") and completes the error messages.
void send_all(int fd, const std::string& buf, Clock::time_point deadline, const std::string& what) {
  size_t sent = 0;
  while (sent < buf.size()) {
    ssize_t r = ::send(fd, buf.data() + sent, buf.size() - sent, MSG_NOSIGNAL);
    if (r >= 0) {
      sent += static_cast<size_t>(r);
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (!wait_ready(fd, POLLOUT, deadline)) {
        throw_error(ErrorKind::kTimeout, "timed out ", what);
      }
    } else if (errno != EINTR) {
      throw_error(ErrorKind::kPeerLost, "connection failed while ", what, ": ",
                  errno_string(errno));
    }
  }
}

void recv_all(int fd, char* p, size_t n, Clock::time_point deadline, const std::string& what) {
  size_t got = 0;
  while (got < n) {
    ssize_t r = ::recv(fd, p + got, n - got, 0);
    if (r > 0) {
      got += static_cast<size_t>(r);
    } else if (r == 0) {
      throw_error(ErrorKind::kPeerLost, "server closed the connection while ", what);
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (!wait_ready(fd, POLLIN, deadline)) {
        throw_error(ErrorKind::kTimeout, "timed out ", what);
      }
    } else if (errno != EINTR) {
      throw_error(ErrorKind::kPeerLost, "connection failed while ", what, ": ",
                  errno_string(errno));
    }
  }
}

// With no listener on a loopback port inside the ephemeral range, a connect
// can succeed by connecting the socket to itself (TCP simultaneous open).
bool is_self_connected(int fd) {
  sockaddr_in a{}, b{};
  socklen_t la = sizeof(a), lb = sizeof(b);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &la) != 0) return false;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&b), &lb) != 0) return false;
  return a.sin_port == b.sin_port && a.sin_addr.s_addr == b.sin_addr.s_addr;
}

// One attempt over every resolved address; returns a connected non-blocking
// socket, or -1 with *error describing the last failure and *refused set if
// some address actively refused the connection.
int connect_once(const std::string& host, int port, Clock::time_point deadline, std::string* error,
                 bool* refused) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int gai = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (gai != 0) {
    *error = cat("cannot resolve '", host, "': ", ::gai_strerror(gai));
    return -1;
  }
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> res_guard(res, ::freeaddrinfo);
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (fd.get() < 0) throw_error(ErrorKind::kInternal, "socket: ", errno_string(errno));
    int err = 0;
    if (::connect(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0) {
      err = errno;
      if (err == EINPROGRESS) {
        if (!wait_ready(fd.get(), POLLOUT, deadline)) {
          *error = "connect timed out";
          continue;
        }
        socklen_t len = sizeof(err);
        ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
      }
    }
    if (err == 0 && is_self_connected(fd.get())) err = ECONNREFUSED;
    if (err != 0) {
      *error = errno_string(err);
      *refused = *refused || err == ECONNREFUSED;
      continue;
    }
    set_nodelay(fd.get());
    return fd.release();
  }
  return -1;
}

}  // namespace

TcpStoreClient::TcpStoreClient(const std::string& host, int port, double connect_timeout_s)
    : host_(host), port_(port), connect_timeout_s_(connect_timeout_s) {
  if (port <= 0 || port > 65535) {
    throw_error(ErrorKind::kInvalidArgument, "TCP store port must be in [1, 65535], got ", port);
  }
  connect_until(deadline_after(connect_timeout_s), nullptr);
}

TcpStoreClient::~TcpStoreClient() {
  disconnect();
}

std::string TcpStoreClient::endpoint() const {
  return cat(host_, ":", port_);
}

void TcpStoreClient::disconnect() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void TcpStoreClient::connect_until(Clock::time_point deadline, const std::string* reconnect_for) {
  std::string last_error = "no attempt made";
  auto backoff = std::chrono::milliseconds(10);
  for (;;) {
    bool refused = false;
    int fd = connect_once(host_, port_, deadline, &last_error, &refused);
    if (fd >= 0) {
      fd_ = fd;
      send_all(fd_, std::string(kMagic, sizeof(kMagic)), deadline,
               cat("greeting the store server at ", endpoint()));
      return;
    }
    // Before the first connection a refusal means "not up yet"; once we have
    // been connected it means the server is gone, and waiting would only
    // delay the job's failure.
    if (reconnect_for != nullptr && refused) {
      throw_error(ErrorKind::kPeerLost, "the store server at ", endpoint(),
                  " is gone (reconnecting refused: ", last_error, ") while ", *reconnect_for);
    }
    const auto left = deadline - Clock::now();
    if (left <= Clock::duration::zero()) {
      throw_error(reconnect_for != nullptr ? ErrorKind::kPeerLost : ErrorKind::kTimeout,
                  "could not connect to the store server at ", endpoint(), " within ",
                  connect_timeout_s_, "s: ", last_error,
                  reconnect_for != nullptr ? cat(" (reconnecting while ", *reconnect_for, ")")
                                           : std::string());
    }
    // The server is usually just not up yet; back off so that hundreds of
    // ranks do not hammer it (or the resolver) in lockstep.
    std::this_thread::sleep_for(std::min<Clock::duration>(backoff, left));
    backoff = std::min(backoff * 2, std::chrono::milliseconds(500));
  }
}

void TcpStoreClient::ensure_connected(const std::string& what) {
  if (fd_ < 0) connect_until(deadline_after(connect_timeout_s_), &what);
}

// A SET or ADD request; throws if the key or value is over the limits.
static std::string key_value_frame(uint8_t op, const std::string& key, const std::string& value) {
  if (key.size() > kMaxKeyBytes || value.size() > kMaxValueBytes) {
    throw_error(ErrorKind::kInvalidArgument, "store key '", key.substr(0, 64), "' (", key.size(),
                " bytes) or its value (", value.size(), " bytes) exceeds the limit of ",
                kMaxKeyBytes, " / ", kMaxValueBytes, " bytes");
  }
  std::string frame(1, static_cast<char>(op));
  put_u32(&frame, static_cast<uint32_t>(key.size()));
  frame += key;
  put_u32(&frame, static_cast<uint32_t>(value.size()));
  frame += value;
  return frame;
}

void TcpStoreClient::set(const std::string& key, const std::string& value) {
  const std::string frame = key_value_frame(kOpSet, key, value);
  const std::string what = cat("setting key '", key, "' in the store at ", endpoint());
  std::lock_guard<std::mutex> lock(mu_);
  ensure_connected(what);
  const auto deadline = deadline_after(connect_timeout_s_);
  try {
    send_all(fd_, frame, deadline, what);
    char ack = 0;
    recv_all(fd_, &ack, 1, deadline, what);
    RR_CHECK(static_cast<uint8_t>(ack) == kReplyOk, "store protocol error: bad reply ",
             int{static_cast<uint8_t>(ack)}, " while ", what);
  } catch (...) {
    disconnect();  // the connection is mid-exchange and cannot be reused
    throw;
  }
}

std::string TcpStoreClient::add(const std::string& key, const std::string& value) {
  const std::string frame = key_value_frame(kOpAdd, key, value);
  const std::string what = cat("claiming key '", key, "' in the store at ", endpoint());
  std::lock_guard<std::mutex> lock(mu_);
  ensure_connected(what);
  try {
    send_all(fd_, frame, deadline_after(connect_timeout_s_), what);
    return read_value(deadline_after(connect_timeout_s_), what);
  } catch (...) {
    disconnect();
    throw;
  }
}

std::string TcpStoreClient::read_value(Clock::time_point deadline, const std::string& what) {
  char header[5];
  recv_all(fd_, header, sizeof(header), deadline, what);
  const uint32_t len = get_u32(header + 1);
  RR_CHECK(static_cast<uint8_t>(header[0]) == kReplyOk && len <= kMaxValueBytes,
           "store protocol error: bad reply header while ", what);
  std::string value(len, '\0');
  recv_all(fd_, value.data(), len, deadline, what);
  return value;
}

std::string TcpStoreClient::get(const std::string& key, double timeout_s) {
  if (key.size() > kMaxKeyBytes) {
    throw_error(ErrorKind::kInvalidArgument, "store key '", key.substr(0, 64), "' (", key.size(),
                " bytes) exceeds the limit of ", kMaxKeyBytes, " bytes");
  }
  const auto deadline = deadline_after(timeout_s);
  const std::string what =
      cat("waiting up to ", timeout_s, "s for key '", key, "' from the store at ", endpoint());
  std::lock_guard<std::mutex> lock(mu_);
  ensure_connected(what);
  try {
    std::string frame(1, static_cast<char>(kOpGet));
    put_u32(&frame, static_cast<uint32_t>(key.size()));
    frame += key;
    send_all(fd_, frame, deadline, what);
    return read_value(deadline, what);
  } catch (...) {
    disconnect();  // also tells the server to forget the parked GET
    throw;
  }
}

}  // namespace rr
