// Hierarchical allreduce: reduce inside each host over shared memory, ring
// across hosts, share the result inside the host (Horovod's
// HOROVOD_HIERARCHICAL_ALLREDUCE; here RINGREDUCE_HIERARCHICAL_ALLREDUCE).
//
// Protocol. Hosts h = 0 .. H-1 (in order of their lowest rank) hold L_h ranks;
// S = max L_h. The buffer is cut into S shards (split_offsets: sizes differ by
// at most one element). On host h, local rank l owns the contiguous shard
// range [a_h(l), a_h(l+1)) with a_h = split_offsets(S, L_h), so every shard
// has exactly one owner per host.
//   1. Inside each host: ring reduce-scatter over the host's group view; each
//      rank ends with its own shards summed over the host.
//   2. Across hosts: for each shard j, in increasing j, the owners of j on
//      every host (one per host, hosts in order) run a ring allreduce of that
//      shard over their group view, then the owner finalizes it (Average /
//      postscale with the world size).
//   3. Inside each host: ring allgather of the shards over the host's view.
// Rather than one leader per host carrying the whole buffer across, every
// local rank carries its own 1/L of it (NCCL's split rings): with equal L
// each host sends 2(H-1)/H of the buffer across the network in total, spread
// over L TCP connections, against 2(N-1)/N per host boundary for the flat
// ring (1.5x less at 2 hosts x 2 ranks; more when ranks interleave hosts).
//
// Invariants. Every rank derives the same hosts, shards and owners from the
// Context's topology, so every group agrees on its members and sizes without
// talking. Phases 1 and 3 use same-host links only, phase 2 other-host links
// only, and a rank runs its shard rings in increasing j: ring j waits only on
// ranks that finished every ring below j, so no cycle of waits can form, and
// two rings sharing a link (uneven hosts: a rank alone on its host owns every
// shard) use it in the same order on both ends. Intermediate phases reduce
// with Sum for Average (the world size divides once, at the end), so the
// result equals the flat ring's up to the order of floating-point additions;
// integer and integer-valued results are identical. Out of place (`own`),
// phase 1 reads this rank's input where it lies: only the rank's own shards
// of buf are written before phase 3 fills the rest.
#include <algorithm>
#include <cstring>

#include "collectives/collective_util.h"
#include "collectives/collectives.h"
#include "collectives/host_plan.h"
#include "collectives/op_header.h"
#include "collectives/reduce_kernels.h"
#include "collectives/segments.h"
#include "common/dtype.h"

namespace rr {

size_t HostPlan::first_shard(int h, int l) const {
  return split_offsets(static_cast<size_t>(shards()), static_cast<int>(hosts[h].size()))[l];
}

int HostPlan::owner(int h, size_t shard) const {
  const int L = static_cast<int>(hosts[h].size());
  int l = 0;
  while (l + 1 < L && first_shard(h, l + 1) <= shard) ++l;
  return hosts[h][l];
}

std::vector<int> HostPlan::ring(size_t shard) const {
  std::vector<int> ring;
  for (size_t h = 0; h < hosts.size(); ++h) ring.push_back(owner(static_cast<int>(h), shard));
  return ring;
}

HostPlan plan_hosts(const Context& ctx, size_t count, size_t es) {
  HostPlan p;
  p.hosts = ctx.hosts();
  size_t S = 0;
  for (size_t h = 0; h < p.hosts.size(); ++h) {
    S = std::max(S, p.hosts[h].size());
    auto it = std::find(p.hosts[h].begin(), p.hosts[h].end(), ctx.rank());
    if (it != p.hosts[h].end()) {
      p.my_host = static_cast<int>(h);
      p.my_local = static_cast<int>(it - p.hosts[h].begin());
    }
  }
  p.shard_off = split_offsets(count, static_cast<int>(S));
  for (auto& o : p.shard_off) o *= es;
  return p;
}

bool hierarchical_applies(const Context& ctx) {
  if (ctx.cross_size() < 2) return false;
  for (const auto& h : ctx.hosts())
    if (h.size() > 1) return true;
  return false;
}

// Automatic: wherever it applies and the ranks of a host share memory (above
// the direct path's size, where callers ask); see README "Hierarchical allreduce".
uint64_t wants_hierarchical(const Context& ctx) {
  const int setting = ctx.options().hierarchical;
  if (setting == 0 || !hierarchical_applies(ctx)) return 0;
  return setting == 1 || ctx.hosts_may_share_memory();
}

bool hierarchical_agreed(const HeaderExchange& x) {
  for (const auto& e : x.extras) {
    SharedKey k;
    if (e.size() != sizeof k) return false;
    std::memcpy(&k, e.data(), sizeof k);
    if (k.hierarchical != 1) return false;
  }
  return !x.extras.empty();
}

void allreduce_hierarchical(Context& ctx, uint8_t* buf, size_t count, DType dtype, ReduceOp op,
                            double postscale, const std::string& what, const uint8_t* own) {
  const size_t es = dtype_size(dtype);
  const HostPlan p = plan_hosts(ctx, count, es);
  const std::vector<int>& host = p.hosts[p.my_host];
  const int L = static_cast<int>(host.size());
  std::vector<size_t> local_off(L + 1);
  for (int l = 0; l <= L; ++l) local_off[l] = p.shard_off[p.first_shard(p.my_host, l)];
  Context& local = ctx.group(host);
  ctx.phase("HIER_LOCAL_REDUCE_SCATTER");
  reduce_scatter_ring(local, buf, local_off, dtype, partial_op(op), 1.0, what, own);
  ctx.phase("HIER_CROSS_ALLREDUCE");
  for (size_t j = p.my_first(); j < p.my_last(); ++j) {
    const size_t n = (p.shard_off[j + 1] - p.shard_off[j]) / es;
    if (n == 0) continue;  // every owner of j skips it alike
    uint8_t* shard = buf + p.shard_off[j];
    allreduce_ring(ctx.group(p.ring(j)), shard, n, dtype, partial_op(op), 1.0, what);
    finalize_reduction(shard, n, dtype, op, postscale, ctx.size());
  }
  ctx.phase("HIER_LOCAL_ALLGATHER");
  allgather_ring(local, buf, local_off, what);
  ctx.count_hierarchical_allreduce();
}

void allreduce_hierarchical_segments(Context& ctx, const Segments& segs, DType dtype, ReduceOp op,
                                     double postscale, const std::string& what) {
  // Shards cut across tensors; one packed copy costs little next to the
  // network phase this algorithm is chosen for.
  uint8_t* buf = ctx.scratch(4, segs.bytes());
  segs.for_each(0, segs.bytes(),
                [&](uint8_t* q, size_t rel, size_t len) { std::memcpy(buf + rel, q, len); });
  allreduce_hierarchical(ctx, buf, segs.bytes() / dtype_size(dtype), dtype, op, postscale, what);
  segs.for_each(0, segs.bytes(),
                [&](uint8_t* q, size_t rel, size_t len) { std::memcpy(q, buf + rel, len); });
}

}  // namespace rr
