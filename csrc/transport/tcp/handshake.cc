#include "transport/tcp/handshake.h"

#include <array>
#include <cstring>

#include "common/error.h"
#include "common/sha256.h"

namespace rr {

namespace {

struct Hello {
  char magic[4];
  uint64_t job_id;
  int32_t from;
  int32_t to;
  int32_t channel;
  uint8_t nonce[32];
};

std::array<uint8_t, 32> proof(const std::string& secret, char tag, const uint8_t* nonce,
                              const Hello& h) {
  uint8_t msg[1 + 32 + 12];
  msg[0] = static_cast<uint8_t>(tag);
  std::memcpy(msg + 1, nonce, 32);
  std::memcpy(msg + 33, &h.from, 4);
  std::memcpy(msg + 37, &h.to, 4);
  std::memcpy(msg + 41, &h.channel, 4);
  return hmac_sha256(secret, msg, sizeof(msg));
}

}  // namespace

void handshake_connect(int fd, const HandshakeParams& p, int to_rank, Channel channel,
                       Deadline deadline, const std::string& who) {
  Hello h{};
  std::memcpy(h.magic, "RRH2", 4);
  h.job_id = p.job_id;
  h.from = p.my_rank;
  h.to = to_rank;
  h.channel = static_cast<int32_t>(channel);
  std::string nonce = random_bytes(32);
  std::memcpy(h.nonce, nonce.data(), 32);
  write_full(fd, &h, sizeof(h), deadline, who);
  uint8_t reply[64];
  read_full(fd, reply, sizeof(reply), deadline, who);
  auto expect = proof(p.secret, 'A', h.nonce, h);
  if (!constant_time_equal(expect.data(), reply + 32, 32))
    throw_error(ErrorKind::kPeerLost, who, " failed to prove it belongs to this job ",
                "(another job on the same port, or a different RINGREDUCE_SECRET)");
  auto mine = proof(p.secret, 'C', reply, h);
  write_full(fd, mine.data(), mine.size(), deadline, who);
  uint8_t ok = 0;
  read_full(fd, &ok, 1, deadline, who);
  if (ok != 1) throw_error(ErrorKind::kPeerLost, who, " refused our handshake");
}

int handshake_accept(int fd, const HandshakeParams& p, Deadline deadline, Channel* channel,
                     std::string* why) {
  try {
    Hello h{};
    read_full(fd, &h, sizeof(h), deadline, "connecting client");
    if (std::memcmp(h.magic, "RRH2", 4) != 0) {
      *why = "not a ringreduce handshake";
      return -1;
    }
    if (h.job_id != p.job_id || h.to != p.my_rank || h.from < 0 || h.from >= p.size ||
        (h.channel != 0 && h.channel != 1)) {
      *why = cat("wrong job or rank (claims rank ", h.from, " -> ", h.to, ")");
      return -1;
    }
    std::string nonce = random_bytes(32);
    uint8_t reply[64];
    std::memcpy(reply, nonce.data(), 32);
    auto mine = proof(p.secret, 'A', h.nonce, h);
    std::memcpy(reply + 32, mine.data(), 32);
    write_full(fd, reply, sizeof(reply), deadline, "connecting client");
    uint8_t theirs[32];
    read_full(fd, theirs, sizeof(theirs), deadline, "connecting client");
    auto expect = proof(p.secret, 'C', reply, h);
    if (!constant_time_equal(expect.data(), theirs, 32)) {
      *why = cat("bad credentials (claims rank ", h.from, ")");
      return -1;
    }
    uint8_t ok = 1;
    write_full(fd, &ok, 1, deadline, "connecting client");
    *channel = static_cast<Channel>(h.channel);
    return h.from;
  } catch (const Error& e) {
    *why = e.what();
    return -1;
  }
}

}  // namespace rr
