// Control messages between the coordinator (rank 0) and the workers, carried
// on the same links as data. A message is a fixed 256-byte header, whose
// payload rides inline when it fits and otherwise follows as a second
// message of the announced length.
//
// Round protocol (round k; each link direction stays a well-ordered stream):
//   worker -> 0 : REQUESTS(k)   exactly one per round: new tensors since its
//                               last REQUESTS (full metadata or cache bits)
//   0 -> worker : POLL(k)       exactly one per round, always before RESPONSES
//   0 -> worker : RESPONSES(k)  exactly one per round, then everyone executes
// A round starts when any rank has new work: a worker sends REQUESTS(k)
// unprompted, or rank 0 (local work, a worker's REQUESTS arriving, a stall
// deadline) sends POLL(k) to all. Every worker reads POLL(k); one that already
// sent REQUESTS(k) has nothing more to do for it, an idle one answers it at
// once (possibly with nothing). Always polling keeps each stream's order
// fixed: the worker never has to guess whether a POLL is still coming.
// No rank sends anything when nobody has work, so an idle job sleeps.
// Data of round k's responses follows RESPONSES(k) and precedes anything of
// round k + 1 on every link, because every rank executes the same list.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "transport/context.h"
#include "transport/link.h"
#include "transport/progress.h"

namespace rr {

enum class CtrlType : uint32_t { kPoll = 1, kRequests = 2, kResponses = 3 };

constexpr size_t kCtrlInline = 232;

struct CtrlHeader {
  uint32_t magic;
  uint32_t type;
  uint64_t round;
  uint64_t payload_bytes;
  uint8_t inline_payload[kCtrlInline];
};
static_assert(sizeof(CtrlHeader) == 256, "control headers are 256 bytes");

struct CtrlMessage {
  int from = -1;
  CtrlType type = CtrlType::kPoll;
  uint64_t round = 0;
  std::vector<uint8_t> payload;
};

class ControlChannel {
 public:
  explicit ControlChannel(Context& ctx);

  // Queues a message; it goes out during the next receive() or flush().
  void post(int peer, CtrlType type, uint64_t round, const std::vector<uint8_t>& payload);
  // Completes every queued send.
  void flush(const Describe& what);
  // Receives one whole message from each of `peers` (continuing any header
  // already begun by try_header), pushing queued sends meanwhile.
  std::vector<CtrlMessage> receive(const std::vector<int>& peers, const Describe& what);
  // Moves bytes of the next header from `peer` without blocking. Returns true
  // once some bytes of it have arrived.
  bool try_header(int peer);

 private:
  struct Outgoing {
    CtrlHeader header;
    std::vector<uint8_t> payload;
    int peer;
    size_t header_done = 0;
    size_t payload_done = 0;
  };
  struct Inbox {
    CtrlHeader header;
    size_t done = 0;
  };
  void transfer(std::vector<RecvOp>& recvs, const Describe& what, bool wait_sends);
  CtrlMessage finish(int peer, std::vector<uint8_t>&& extra);

  Context& ctx_;
  std::vector<std::unique_ptr<Outgoing>> out_;
  std::vector<Inbox> in_;
};

}  // namespace rr
