// Heartbeats: is every rank's process still running? The data links cannot
// tell (their byte streams have no room for anything between the bytes of a
// collective, and a stopped process's kernel still acknowledges TCP), so a
// rank that is frozen (SIGSTOP, a debugger, a swapping host) would make the
// others wait silently, each blaming the ring neighbour it waits on.
//
// Protocol: a star of one extra authenticated TCP connection (Channel::
// kHeartbeat) from every worker to rank 0, served by one thread per rank.
//   every period, each side writes one 16-byte beat:
//     worker -> 0 : "alive"
//     0 -> worker : "alive", plus the worker that has been silent longest
//                   (if any is past warn_s) and for how long
//   silence of a peer for warn_s: a warning naming the silent rank, repeated
//     every warn_s (RINGREDUCE_STALL_CHECK_SECONDS);
//   silence for fail_s: check() throws kTimeout naming it
//     (RINGREDUCE_PEER_TIMEOUT_SECONDS).
// Workers relay rank 0's verdict, so every rank names the frozen one, not
// the neighbour that relays the wait. A peer whose connection ends (EOF,
// reset) is no longer watched: it left, and the data links report why.
// Invariants: the thread starts after connect() and stops before the sockets
// close; check() costs one atomic load while all is well.
#pragma once

#include <atomic>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "transport/tcp/socket_util.h"

namespace rr {

struct HeartbeatOptions {
  int rank = 0;
  double warn_s = 60;              // 0: never warn
  double fail_s = 120;             // 0: never fail
  std::vector<std::string> hosts;  // host id of every rank, for messages
};

class Heartbeat {
 public:
  explicit Heartbeat(HeartbeatOptions o);
  ~Heartbeat();
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

  bool enabled() const { return opt_.warn_s > 0 || opt_.fail_s > 0; }
  // Before start(): rank 0 adds every worker, a worker adds rank 0.
  void add(int peer, Fd fd);
  void start();
  void stop();  // idempotent
  // Throws kTimeout naming the silent rank once one was silent for fail_s.
  void check() const;

 private:
  struct Peer {
    int rank;
    Fd fd;
    double heard = 0;                    // when a beat last arrived
    bool gone = false;                   // its connection ended
    std::vector<uint8_t> inbox, outbox;  // partial beats
  };
  struct Verdict {  // the longest silence this rank knows of
    int rank = -1;
    double seconds = 0;
    bool relayed = false;
  };
  void loop();
  void send_beats(double now);
  void read_beats(Peer& p, double now);
  Verdict verdict(double now) const;
  void judge(const Verdict& v, double now);
  double now() const;

  HeartbeatOptions opt_;
  double period_s_;
  std::vector<Peer> peers_;
  int relayed_rank_ = -1;  // worker: rank 0's latest verdict
  double relayed_s_ = 0;
  double last_warning_ = 0;
  int wake_[2] = {-1, -1};
  std::thread thread_;
  std::atomic<bool> failed_{false};
  mutable std::mutex mu_;
  std::string failure_;
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace rr
