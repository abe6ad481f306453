#include "transport/heartbeat.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>

#include "common/error.h"
#include "common/logging.h"

namespace rr {

namespace {

constexpr uint32_t kBeatMagic = 0x52524842;  // "RRHB"
constexpr size_t kMaxBacklog = 4096;         // a peer that reads nothing gets no more

struct Beat {
  uint32_t magic;
  int32_t silent_rank;  // rank 0's verdict: longest-silent worker past warn_s, or -1
  uint32_t silent_ms;
  uint32_t reserved;
};
static_assert(sizeof(Beat) == 16, "beats are 16 bytes");

std::string round1(double s) {
  return cat(std::floor(s * 10) / 10);
}

}  // namespace

Heartbeat::Heartbeat(HeartbeatOptions o) : opt_(std::move(o)), t0_(Clock::now()) {
  double shortest = 1.0;
  if (opt_.warn_s > 0) shortest = std::min(shortest, opt_.warn_s / 4);
  if (opt_.fail_s > 0) shortest = std::min(shortest, opt_.fail_s / 4);
  period_s_ = std::max(shortest, 0.02);
}

Heartbeat::~Heartbeat() {
  stop();
}

double Heartbeat::now() const {
  return std::chrono::duration<double>(Clock::now() - t0_).count();
}

void Heartbeat::add(int peer, Fd fd) {
  set_nonblocking(fd.get());
  Peer p;
  p.rank = peer;
  p.fd = std::move(fd);
  peers_.push_back(std::move(p));
}

void Heartbeat::start() {
  if (!enabled() || peers_.empty() || thread_.joinable()) return;
  if (pipe2(wake_, O_CLOEXEC | O_NONBLOCK) != 0)
    throw_error(ErrorKind::kInternal, "rank ", opt_.rank, ": pipe(): ", errno_string(errno));
  const double t = now();
  for (Peer& p : peers_) p.heard = t;
  thread_ = std::thread([this] { loop(); });
}

void Heartbeat::stop() {
  if (thread_.joinable()) {
    const char x = 1;
    ssize_t ignored = ::write(wake_[1], &x, 1);
    (void)ignored;
    thread_.join();
  }
  for (int& fd : wake_) {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
  peers_.clear();
}

void Heartbeat::check() const {
  if (!failed_.load(std::memory_order_relaxed)) return;
  std::lock_guard<std::mutex> lock(mu_);
  throw Error(ErrorKind::kTimeout, failure_);
}

void Heartbeat::loop() {
  double next_beat = 0;
  std::vector<pollfd> fds;
  std::vector<Peer*> polled;
  for (;;) {
    fds.assign(1, pollfd{wake_[0], POLLIN, 0});
    polled.clear();
    for (Peer& p : peers_) {
      if (p.gone) continue;
      fds.push_back(pollfd{p.fd.get(), POLLIN, 0});
      polled.push_back(&p);
    }
    const int ms = static_cast<int>(std::ceil(std::max(0.0, next_beat - now()) * 1000));
    if (::poll(fds.data(), fds.size(), ms) < 0 && errno != EINTR) return;
    if (fds[0].revents) return;  // stop()
    const double t = now();
    for (size_t i = 0; i < polled.size(); ++i)
      if (fds[i + 1].revents) read_beats(*polled[i], t);
    if (t >= next_beat) {
      send_beats(t);
      next_beat = t + period_s_;
    }
    judge(verdict(t), t);
  }
}

void Heartbeat::send_beats(double t) {
  Beat b{kBeatMagic, -1, 0, 0};
  const Verdict v = opt_.rank == 0 ? verdict(t) : Verdict{};
  if (v.rank >= 0 && v.seconds >= 2 * period_s_) {  // a beat or two late is no news
    b.silent_rank = v.rank;
    b.silent_ms = static_cast<uint32_t>(std::min(v.seconds * 1000, 4e9));
  }
  const auto* bytes = reinterpret_cast<const uint8_t*>(&b);
  for (Peer& p : peers_) {
    if (p.gone) continue;
    // A backlog per peer keeps beats whole on the stream when a send is
    // partial; a peer that reads nothing (frozen) stops getting new ones.
    if (p.outbox.size() < kMaxBacklog) p.outbox.insert(p.outbox.end(), bytes, bytes + sizeof b);
    ssize_t w = ::send(p.fd.get(), p.outbox.data(), p.outbox.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
    if (w > 0) p.outbox.erase(p.outbox.begin(), p.outbox.begin() + w);
    if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) p.gone = true;
  }
}

void Heartbeat::read_beats(Peer& p, double t) {
  uint8_t buf[1024];
  for (;;) {
    ssize_t r = ::recv(p.fd.get(), buf, sizeof buf, MSG_DONTWAIT);
    if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
      p.gone = true;  // it left (or its link died): the data links say which
      return;
    }
    if (r < 0) break;
    p.heard = t;
    p.inbox.insert(p.inbox.end(), buf, buf + r);
  }
  // Only rank 0's beats carry news; a worker keeps the latest whole one.
  const size_t whole = p.inbox.size() / sizeof(Beat) * sizeof(Beat);
  if (opt_.rank != 0 && whole > 0) {
    Beat b;
    std::memcpy(&b, p.inbox.data() + whole - sizeof(Beat), sizeof(Beat));
    // A rank that was frozen itself reads rank 0's beats about it on waking.
    if (b.magic == kBeatMagic) {
      relayed_rank_ = b.silent_rank == opt_.rank ? -1 : b.silent_rank;
      relayed_s_ = b.silent_ms / 1000.0;
    }
  }
  p.inbox.erase(p.inbox.begin(), p.inbox.begin() + static_cast<std::ptrdiff_t>(whole));
}

// The longest silence this rank knows of: its own peers', or (a worker)
// the one rank 0 reports, whichever is longer.
Heartbeat::Verdict Heartbeat::verdict(double t) const {
  Verdict v;
  for (const Peer& p : peers_) {
    if (p.gone || t - p.heard <= v.seconds) continue;
    v.rank = p.rank;
    v.seconds = t - p.heard;
  }
  if (relayed_rank_ >= 0 && relayed_s_ > v.seconds) v = Verdict{relayed_rank_, relayed_s_, true};
  return v;
}

void Heartbeat::judge(const Verdict& v, double t) {
  if (v.rank < 0 || failed_.load()) return;
  const std::string host =
      v.rank < static_cast<int>(opt_.hosts.size()) ? opt_.hosts[v.rank] : std::string("?");
  const std::string who =
      cat("rank ", v.rank, " (host ", host, ") has sent no heartbeat for ", round1(v.seconds), " s",
          v.relayed ? " (seen by rank 0)" : "",
          ": it is stopped (SIGSTOP, a debugger), frozen or swapping, or its host is unreachable");
  if (opt_.fail_s > 0 && v.seconds >= opt_.fail_s) {
    std::lock_guard<std::mutex> lock(mu_);
    failure_ = cat(who, " (RINGREDUCE_PEER_TIMEOUT_SECONDS=", opt_.fail_s, ")");
    failed_.store(true);
    log(LogLevel::kError, opt_.rank, who,
        "; giving up (RINGREDUCE_PEER_TIMEOUT_SECONDS=", opt_.fail_s, ")");
    return;
  }
  if (opt_.warn_s <= 0 || v.seconds < opt_.warn_s) return;
  if (t - last_warning_ < opt_.warn_s) return;
  last_warning_ = t;
  log(LogLevel::kWarning, opt_.rank, who, "; collectives that need it wait",
      opt_.fail_s > 0 ? cat(" (they fail after RINGREDUCE_PEER_TIMEOUT_SECONDS=", opt_.fail_s, ")")
                      : std::string());
}

}  // namespace rr
