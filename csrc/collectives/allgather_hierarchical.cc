// Hierarchical allgather (Horovod's HOROVOD_HIERARCHICAL_ALLGATHER; here
// RINGREDUCE_HIERARCHICAL_ALLGATHER): gather inside each host over shared
// memory, exchange whole hosts' data between one leader per host, share it
// inside the host.
//
// Protocol. Hosts h = 0 .. H-1 in order of their lowest rank; host h's ranks
// in rank order, its leader the first. A staging buffer holds the output in
// host-major order (host 0's blocks in its local order, then host 1's, ...).
//   1. Inside each host: this rank's block goes to its place in the staging
//      buffer, and a ring allgather over the host's group view fills the
//      host's range.
//   2. Across hosts: the leaders run a ring allgather of the host ranges.
//   3. Inside each host: the leader broadcasts (chain) the other hosts' ranges.
//   Finally, with a separate staging buffer, every rank copies each block to
//   its place in the output (rank order).
// Across the network each host's leader sends (H-1)/H of the output, against
// (N-1)/N per host boundary for the flat ring with ranks placed host by host
// (2 hosts x 2 ranks: 1/2 against 3/4), at the price of phase 3's traffic
// inside the host (and, ranks interleaving hosts, two copies of the output).
//
// Invariants. Every rank derives the same hosts, leaders and offsets from the
// Context's topology and the agreed block sizes, so groups agree without
// talking; phases 1 and 3 use same-host links only, phase 2 other-host links
// only. Ranks agree on the setting at start-up (Engine::agree_on_settings),
// so all run this or all run the flat ring. Bytes are copied, never combined:
// the output is identical to the flat ring's.
#include <cstring>
#include <vector>

#include "collectives/collective_util.h"
#include "collectives/collectives.h"

namespace rr {

bool hierarchical_allgather_applies(const Context& ctx) {
  return ctx.options().hierarchical_allgather && hierarchical_applies(ctx);
}

void allgather_hierarchical(Context& ctx, uint8_t* out, const std::vector<size_t>& off,
                            const std::string& what) {
  const std::vector<std::vector<int>>& hosts = ctx.hosts();
  const int me = ctx.rank();
  std::vector<size_t> pos(ctx.size());  // each block's place, host-major
  std::vector<size_t> host_off{0};      // each host's range, host-major
  std::vector<int> leaders;
  const std::vector<int>* mine = nullptr;
  for (const std::vector<int>& host : hosts) {
    size_t at = host_off.back();
    for (int r : host) {
      pos[r] = at;
      at += off[r + 1] - off[r];
    }
    host_off.push_back(at);
    leaders.push_back(host.front());
    for (int r : host)
      if (r == me) mine = &host;
  }
  const int h = static_cast<int>(mine - hosts.data());
  // Ranks placed host by host (as mpirun fills slots): host-major order is rank
  // order, and the output itself is the staging buffer (no copies).
  bool in_order = true;
  for (int r = 0; r < ctx.size(); ++r) in_order &= pos[r] == off[r];
  // Otherwise a staging buffer kept between calls (slot 6: no other user).
  uint8_t* staged = in_order ? out : ctx.scratch(6, host_off.back());
  const size_t own = off[me + 1] - off[me];
  if (!in_order && own) std::memcpy(staged + pos[me], out + off[me], own);
  std::vector<size_t> local_off;
  for (int r : *mine) local_off.push_back(pos[r]);
  local_off.push_back(host_off[h + 1]);
  Context& local = ctx.group(*mine);
  ctx.phase("HIER_LOCAL_ALLGATHER");
  allgather_ring(local, staged, local_off, what);
  if (mine->front() == me) {
    ctx.phase("HIER_CROSS_ALLGATHER");
    allgather_ring(ctx.group(leaders), staged, host_off, what);
  }
  // The host's own range is in place on every local rank already.
  ctx.phase("HIER_LOCAL_BROADCAST");
  broadcast_chain(local, staged, host_off[h], 0, what);
  broadcast_chain(local, staged + host_off[h + 1], host_off.back() - host_off[h + 1], 0, what);
  for (int r = 0; !in_order && r < ctx.size(); ++r)
    if (r != me && off[r + 1] > off[r])
      std::memcpy(out + off[r], staged + pos[r], off[r + 1] - off[r]);
  ctx.count_hierarchical_allgather();
}

}  // namespace rr
