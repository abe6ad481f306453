// Ring reduce-scatter.
//
// The buffer is cut into N segments (byte offsets seg_off, element-aligned).
// Ranks form a ring r -> r+1. At step s = 0 .. N-2, rank r sends segment
// (r - s - 1) mod N to its right neighbour and receives segment (r - s - 2)
// mod N from its left neighbour, reducing it into its own copy as it streams
// in (straight out of shared memory on the shm transport).
// Invariant: after step s, rank r's segment (r - s - 2) mod N holds the
// reduction of s + 2 ranks' contributions, so after N - 1 steps rank r holds
// segment r fully reduced. Each rank sends and receives (N-1)/N of the buffer.
// The order in which contributions meet is fixed by N and the segment, so the
// bits are repeatable run to run.
#include "collectives/collective_util.h"
#include "collectives/collectives.h"

namespace rr {

void reduce_scatter_ring(Context& ctx, uint8_t* buf, const std::vector<size_t>& seg_off,
                         DType dtype, ReduceOp op, const std::string& what) {
  const int n = ctx.size(), r = ctx.rank();
  if (n == 1) return;
  const int right = (r + 1) % n, left = (r - 1 + n) % n;
  auto seg = [&](int s) { return ((s % n) + n) % n; };
  for (int s = 0; s < n - 1; ++s) {
    int out = seg(r - s - 1), in = seg(r - s - 2);
    ReduceSink sink(buf + seg_off[in], dtype, op);
    send_recv(ctx, right, buf + seg_off[out], seg_off[out + 1] - seg_off[out], left, &sink,
              seg_off[in + 1] - seg_off[in], what);
  }
}

}  // namespace rr
