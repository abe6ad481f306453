// The table of transports (NCCL's ncclTransports[]): every way a rank can
// reach a peer, in order of preference. Nothing outside this table and the
// entries' own files names a transport: the Context chooses each peer's link
// here, and the progress loop and the engine's idle wait ask a link's entry
// how to sleep on it.
//
// Protocol of the table:
// - Choice. For each peer the Context walks the entries RINGREDUCE_TRANSPORT
//   allows ("auto": all of them), in table order; the first whose
//   can_connect(self, peer, options) holds carries every link to that peer.
//   Both ends see the same endpoint records and options, so both choose the
//   same entry without talking. No allowed entry reaching a peer is an error
//   naming the peer, its host and the setting.
// - Connection. Context::connect calls connect(ctx, peers) of every entry of
//   the whole table, in table order, on every rank, each with the peers it
//   was chosen for (possibly none: an entry may also set up job-wide services,
//   as TCP does the heartbeat connections every rank has to rank 0). An entry
//   may wait only for peers chosen for it (or for those services), so ranks
//   that reach each other through different entries never wait on each other.
// - Waiting. A link that cannot move wakes a sleeper through what its entry's
//   `wait` says: kWaitDoorbell, this rank's shared-memory doorbell (the peer
//   rings it); kWaitFd, poll() on the link's poll_fd(); both, either. A
//   waiter with links of only doorbell entries sleeps on the doorbell, with
//   only fd entries in poll(), and with both in short slices (progress.cc) or
//   through a watcher that turns a ring into an eventfd write (engine.cc).
// - Memory. shares_memory: the two ranks map each other's memory, so the
//   shared buffers of a host and the hierarchical allreduce's in-host phases
//   may read a peer's memory in place.
#pragma once

#include <string>
#include <vector>

namespace rr {

class Context;
struct ContextOptions;
struct PeerInfo;

enum TransportWait : unsigned { kWaitDoorbell = 1u, kWaitFd = 2u };

struct Transport {
  const char* name;
  bool (*can_connect)(const PeerInfo& self, const PeerInfo& peer, const ContextOptions& opt);
  void (*connect)(Context& ctx, const std::vector<int>& peers);
  unsigned wait;  // TransportWait bits
  bool shares_memory;
};

// Every transport, in order of preference.
const std::vector<Transport>& transport_table();
// The entries `setting` (RINGREDUCE_TRANSPORT: "auto" or one entry's name)
// allows, in table order; throws kInvalidArgument for any other value.
std::vector<const Transport*> allowed_transports(const std::string& setting);

}  // namespace rr
