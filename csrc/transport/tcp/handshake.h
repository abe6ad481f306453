// Mutual authentication of a new TCP connection with the job's secret, so a
// stranger that reaches our port can neither join the job nor impersonate a
// rank. Protocol (all fields fixed size):
//   connector -> acceptor : "RRH2", job id (8), from rank, to rank, channel,
//                           nonce_c (32)
//   acceptor  -> connector: nonce_a (32), HMAC(secret, "A" nonce_c from to channel)
//   connector -> acceptor : HMAC(secret, "C" nonce_a from to channel)
//   acceptor  -> connector: one byte 1 (accepted)
// Each side proves knowledge of the secret over the other side's fresh nonce,
// so recorded handshakes cannot be replayed. Every step has a deadline.
#pragma once

#include <cstdint>
#include <string>

#include "transport/tcp/socket_util.h"

namespace rr {

// What a connection carries: collective data, or heartbeats (heartbeat.h).
enum class Channel : int32_t { kData = 0, kHeartbeat = 1 };

struct HandshakeParams {
  std::string secret;
  uint64_t job_id = 0;
  int my_rank = 0;
  int size = 0;
};

// Client side. Throws on failure (a peer that fails to prove itself is an error).
void handshake_connect(int fd, const HandshakeParams& p, int to_rank, Channel channel,
                       Deadline deadline, const std::string& who);
// Server side. Returns the authenticated peer rank (and sets *channel), or -1
// when the connection is refused (wrong job, bad proof, garbage); the caller
// logs and drops it.
int handshake_accept(int fd, const HandshakeParams& p, Deadline deadline, Channel* channel,
                     std::string* why);

}  // namespace rr
