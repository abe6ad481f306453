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
// The segment sent at step s is the one received at step s - 1, so steps are
// chunk-pipelined (ring_pipeline.h). The order in which contributions meet is
// fixed by N and the segment, so the bits are repeatable run to run.
#include <cstring>

#include "collectives/collective_util.h"
#include "collectives/collectives.h"
#include "collectives/ring_pipeline.h"

namespace rr {

void reduce_scatter_steps(Context& ctx, uint8_t* buf, const std::vector<size_t>& seg_off,
                          DType dtype, ReduceOp op, double postscale,
                          std::vector<ReduceSink>* sinks, std::vector<RingStep>* steps,
                          const uint8_t* own) {
  const int n = ctx.size(), r = ctx.rank();
  auto seg = [&](int s) { return ((s % n) + n) % n; };
  if (!own) own = buf;
  for (int s = 0; s < n - 1; ++s) {
    int out = seg(r - s - 1), in = seg(r - s - 2);
    // Step 0 sends this rank's own segment as it is (from `own`); later steps
    // forward what the step before reduced into buf. The last step completes
    // segment r: finalize it chunk by chunk.
    sinks->emplace_back(buf + seg_off[in], dtype, op, s == n - 2 ? n : 0, postscale,
                        own + seg_off[in]);
    steps->push_back(RingStep{(s == 0 ? own : buf) + seg_off[out], seg_off[out + 1] - seg_off[out],
                              &sinks->back(), seg_off[in + 1] - seg_off[in]});
  }
}

void reduce_scatter_ring(Context& ctx, uint8_t* buf, const std::vector<size_t>& seg_off,
                         DType dtype, ReduceOp op, double postscale, const std::string& what,
                         const uint8_t* own) {
  if (ctx.size() == 1) {
    if (own && own != buf) std::memcpy(buf, own, seg_off.back());
    return;
  }
  std::vector<ReduceSink> sinks;
  sinks.reserve(ctx.size());
  std::vector<RingStep> steps;
  reduce_scatter_steps(ctx, buf, seg_off, dtype, op, postscale, &sinks, &steps, own);
  run_ring(ctx, steps, /*chained=*/true, what);
}

}  // namespace rr
