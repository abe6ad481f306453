// Allreduce over shared buffers (transport/shm/shared_region.h): when every
// rank's data lies at the same place of the same shared region, each rank
// reads its peers' data where it lies and writes the result where they will
// read it, and no byte passes through the links. Per rank that is one read
// of its share from every buffer and one write of the result into every
// buffer: the least memory traffic an in-place allreduce can have, against
// the ring's copies into and out of link slots handed over between cores.
//
// Protocol (P ranks, all on one host; shares split as the ring splits):
//   AGREE   every allreduce header above the small-message size carries a
//           SharedKey (region id, digest of the layout); every rank sees all
//           of them, so all run this or all run the ring; a rank sends its
//           header once its own input is in place, so past AGREE every
//           rank's input is ready;
//   REDUCE  rank r computes share r, block by block in an L1 scratch block,
//           as x_0 (op) x_1 (op) ... (op) x_{P-1} read from each rank's
//           buffer, finalizes it (Average, postscale) and writes the block
//           into share r of every rank's buffer, its own included;
//   barrier nobody returns (letting its caller read or change its buffer)
//           while a peer may still be reading or writing it.
// Invariants: share r of every buffer is read and written by rank r alone,
// and each of its blocks is read in full (from all P buffers) before any of
// it is written, so no rank reads a result in place of an input. Each element
// is reduced once, by its owner, in rank order, so every rank ends with the
// same bits. A peer lost mid-way fails the barrier (a transport error); a
// peer's memory stays mapped here, so touching it never faults.
//
// (An earlier form wrote share r into its own buffer only, and after a
// barrier every rank copied the other shares out of their owners' buffers:
// the same reads plus a second pass over (P-1)/P of the data: for 97.5 MiB on
// two ranks, benchmarks/shared_ceiling.c measured a mean of 15.0-16.4 ms for
// that form against 8.6-10.6 ms for this one, three alternating runs.)
#include <algorithm>
#include <cstring>

#include "collectives/collective_util.h"
#include "collectives/collectives.h"
#include "collectives/reduce_kernels.h"
#include "collectives/segments.h"

namespace rr {

namespace {

constexpr size_t kBlock = 16 << 10;  // stays in L1 between the peers' reads

uint64_t fnv1a(uint64_t h, uint64_t v) {
  for (int i = 0; i < 8; ++i) {
    h ^= (v >> (8 * i)) & 0xff;
    h *= 1099511628211ULL;
  }
  return h;
}

// Rank q's address of `p`, a pointer into this rank's part of `region`.
uint8_t* at_rank(const SharedRegion& region, int q, const uint8_t* p) {
  return region.data_of(q) + (p - region.data());
}

void reduce_share(Context& ctx, const SharedRegion& region, const Segments& segs, size_t off,
                  size_t n, DType dtype, ReduceOp op, double postscale) {
  const int P = ctx.size();
  const size_t es = dtype_size(dtype);
  uint8_t* tmp = ctx.scratch(3, kBlock);
  segs.for_each(off, n, [&](uint8_t* p, size_t, size_t len) {
    for (size_t b = 0; b < len; b += kBlock) {
      const size_t m = std::min(kBlock, len - b), count = m / es;
      reduce_to(tmp, at_rank(region, 0, p + b), at_rank(region, 1, p + b), count, dtype, op);
      for (int q = 2; q < P; ++q) reduce_into(tmp, at_rank(region, q, p + b), count, dtype, op);
      finalize_reduction(tmp, count, dtype, op, postscale, P);
      for (int q = 0; q < P; ++q) std::memcpy(at_rank(region, q, p + b), tmp, m);
    }
  });
}

}  // namespace

SharedKey shared_key(const Context& ctx, const Segments& segs) {
  SharedKey key;
  std::shared_ptr<SharedRegion> region;
  uint64_t digest = 14695981039346656037ULL;
  key.hierarchical = wants_hierarchical(ctx);
  bool ok = segs.bytes() > 0 && segs.bytes() >= ctx.options().shared_min_bytes;
  if (!ok) return key;
  segs.for_each(0, segs.bytes(), [&](uint8_t* p, size_t, size_t len) {
    size_t off = 0;
    std::shared_ptr<SharedRegion> r = ok ? ctx.find_shared(p, len, &off) : nullptr;
    ok = r && (!region || r == region);
    region = r;
    digest = fnv1a(fnv1a(digest, off), len);
  });
  if (ok) key = SharedKey{region->id(), digest, key.hierarchical};
  return key;
}

bool shared_agreed(const HeaderExchange& x) {
  SharedKey first;
  for (size_t r = 0; r < x.extras.size(); ++r) {
    SharedKey k;
    if (x.extras[r].size() != sizeof k) return false;
    std::memcpy(&k, x.extras[r].data(), sizeof k);
    if (k.region == 0) return false;
    if (r == 0) first = k;
    if (k.region != first.region || k.layout != first.layout) return false;
  }
  return !x.extras.empty();
}

// Shared buffers span one host: on several hosts they serve the hierarchical
// algorithm only (allreduce_shared_hierarchical.cc).
LargeAllreduce agreed_large_allreduce(const Context& ctx, const HeaderExchange& x) {
  const bool shared = shared_agreed(x), hierarchical = hierarchical_agreed(x);
  if (shared && ctx.cross_size() == 1) return LargeAllreduce::kShared;
  if (shared && hierarchical) return LargeAllreduce::kSharedHierarchical;
  return hierarchical ? LargeAllreduce::kHierarchical : LargeAllreduce::kRing;
}

void allreduce_shared(Context& ctx, const Segments& segs, DType dtype, ReduceOp op,
                      double postscale, const std::string& what) {
  const int P = ctx.size(), r = ctx.rank();
  size_t unused = 0;
  uint8_t* first = segs.contiguous(0, dtype_size(dtype));
  std::shared_ptr<SharedRegion> region = ctx.find_shared(first, dtype_size(dtype), &unused);
  RR_CHECK(region, "rank ", r, ": ", what, ": shared buffer released while in use");
  const size_t es = dtype_size(dtype);
  std::vector<size_t> off = split_offsets(segs.bytes() / es, P);
  for (auto& o : off) o *= es;
  ctx.phase("SHARED_REDUCE");
  reduce_share(ctx, *region, segs, off[r], off[r + 1] - off[r], dtype, op, postscale);
  barrier(ctx, what + " reduced");
  ctx.count_shared_allreduce();
}

}  // namespace rr
