// Hierarchical allreduce over shared buffers: on a job of several hosts whose
// ranks hold their data in buffers shared within each host (rr.shared_zeros,
// the gradient buckets), reduce inside the host by reading the host peers'
// buffers where they lie (as allreduce_shared.cc does on one host), ring
// across hosts, and write the result into every host peer's buffer: the host
// part moves no byte through the link slots.
//
// Protocol (shards and owners as host_plan.h: every shard has one owner per
// host; AGREE saw the same region id and layout, and the hierarchical wish,
// on every rank, so every rank's input is in place and all run this):
//   HOST_REDUCE  for each shard it owns, local rank l reduces it block by
//                block from every host peer's buffer (in local-rank order,
//                Sum for Average) and writes the partial result into its own
//                buffer;
//   CROSS        for each owned shard j in increasing j, the owners of j (one
//                per host) run a ring allreduce of it in their own buffers,
//                then each finalizes it (Average / postscale, world size);
//   HOST_SHARE   the owner copies the finished shard into every host peer's
//                buffer;
//   barrier      (the host's ranks) nobody returns, letting its caller touch
//                its buffer, while a host peer may still read or write it.
// Invariants: shard j of every buffer on a host is read and written by its
// owner on that host alone, each block is read from all host buffers before
// the owner writes it, so no rank reads a result in place of an input. Ring j
// waits only on owners that finished every shard below j (allreduce_
// hierarchical.cc's argument), so no cycle of waits forms. Every host reduces
// its ranks in local order and the cross rings run in host order, so every
// rank ends with the same bits.
#include <algorithm>
#include <cstring>

#include "collectives/collective_util.h"
#include "collectives/collectives.h"
#include "collectives/host_plan.h"
#include "collectives/reduce_kernels.h"
#include "collectives/segments.h"

namespace rr {

namespace {

constexpr size_t kBlock = 16 << 10;  // stays in L1 between the host peers' reads

// Rank q's address of `p`, a pointer into this rank's part of `region`.
uint8_t* at_rank(const SharedRegion& region, int q, const uint8_t* p) {
  return region.data_of(q) + (p - region.data());
}

// [off, off + n) of the concatenation as its own Segments (one shard).
Segments slice(const Segments& segs, size_t off, size_t n) {
  Segments out;
  segs.for_each(off, n, [&](uint8_t* p, size_t, size_t len) { out.add(p, len); });
  return out;
}

void host_reduce(Context& ctx, const SharedRegion& region, const std::vector<int>& host,
                 const Segments& shard, DType dtype, ReduceOp op) {
  if (host.size() < 2) return;  // alone on the host: the input is the host's sum
  const size_t es = dtype_size(dtype);
  uint8_t* tmp = ctx.scratch(3, kBlock);
  shard.for_each(0, shard.bytes(), [&](uint8_t* p, size_t, size_t len) {
    for (size_t b = 0; b < len; b += kBlock) {
      const size_t m = std::min(kBlock, len - b), count = m / es;
      reduce_to(tmp, at_rank(region, host[0], p + b), at_rank(region, host[1], p + b), count, dtype,
                op);
      for (size_t q = 2; q < host.size(); ++q)
        reduce_into(tmp, at_rank(region, host[q], p + b), count, dtype, op);
      std::memcpy(p + b, tmp, m);
    }
  });
}

void host_share(const SharedRegion& region, const std::vector<int>& host, int me,
                const Segments& shard) {
  shard.for_each(0, shard.bytes(), [&](uint8_t* p, size_t, size_t len) {
    for (int q : host)
      if (q != me) std::memcpy(at_rank(region, q, p), p, len);
  });
}

}  // namespace

void allreduce_shared_hierarchical(Context& ctx, const Segments& segs, DType dtype, ReduceOp op,
                                   double postscale, const std::string& what) {
  const size_t es = dtype_size(dtype);
  size_t unused = 0;
  uint8_t* first = segs.contiguous(0, es);
  std::shared_ptr<SharedRegion> region = ctx.find_shared(first, es, &unused);
  RR_CHECK(region, "rank ", ctx.rank(), ": ", what, ": shared buffer released while in use");
  const HostPlan p = plan_hosts(ctx, segs.bytes() / es, es);
  const std::vector<int>& host = p.my_ranks();
  for (size_t j = p.my_first(); j < p.my_last(); ++j) {
    const Segments shard = slice(segs, p.shard_off[j], p.shard_off[j + 1] - p.shard_off[j]);
    const size_t n = shard.bytes() / es;
    if (n == 0) continue;  // every owner of j skips it alike
    ctx.phase("HIER_SHARED_HOST_REDUCE");
    host_reduce(ctx, *region, host, shard, dtype, partial_op(op));
    ctx.phase("HIER_SHARED_CROSS_ALLREDUCE");
    allreduce_ring_segments(ctx.group(p.ring(j)), shard, n, dtype, partial_op(op), 1.0, what);
    shard.for_each(0, shard.bytes(), [&](uint8_t* q, size_t, size_t len) {
      finalize_reduction(q, len / es, dtype, op, postscale, ctx.size());
    });
    ctx.phase("HIER_SHARED_HOST_SHARE");
    host_share(*region, host, ctx.rank(), shard);
  }
  barrier(ctx.group(host), what + " shared in the host");
  ctx.count_shared_allreduce();
  ctx.count_hierarchical_allreduce();
}

}  // namespace rr
