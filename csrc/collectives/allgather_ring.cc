// Ring allgather with blocks of any size (dim 0 may differ per rank).
//
// Rank r starts with block r in place at out + byte_off[r]. At step s = 0 ..
// N-2 it sends block (r - s) mod N to its right neighbour and receives block
// (r - s - 1) mod N from its left neighbour straight into its final place.
// Invariant: after step s, rank r holds blocks r, r-1, ..., r-s-1. Each rank
// sends every block but its left neighbour's once: (N-1)/N of the output.
// Block r - s is the one received at step s - 1: steps are chunk-pipelined.
#include "collectives/collective_util.h"
#include "collectives/collectives.h"
#include "collectives/ring_pipeline.h"

namespace rr {

void allgather_steps(Context& ctx, uint8_t* out, const std::vector<size_t>& byte_off,
                     std::vector<CopySink>* sinks, std::vector<RingStep>* steps) {
  const int n = ctx.size(), r = ctx.rank();
  auto blk = [&](int b) { return ((b % n) + n) % n; };
  // Past the caches, the gathered blocks are not read again soon: stream them.
  const bool streaming = byte_off.back() >= ctx.options().streaming_bytes;
  for (int s = 0; s < n - 1; ++s) {
    int send_b = blk(r - s), recv_b = blk(r - s - 1);
    sinks->emplace_back(out + byte_off[recv_b], streaming);
    steps->push_back(RingStep{out + byte_off[send_b], byte_off[send_b + 1] - byte_off[send_b],
                              &sinks->back(), byte_off[recv_b + 1] - byte_off[recv_b]});
  }
}

void allgather_ring(Context& ctx, uint8_t* out, const std::vector<size_t>& byte_off,
                    const std::string& what) {
  if (ctx.size() == 1) return;
  std::vector<CopySink> sinks;
  sinks.reserve(ctx.size());
  std::vector<RingStep> steps;
  allgather_steps(ctx, out, byte_off, &sinks, &steps);
  run_ring(ctx, steps, /*chained=*/true, what);
}

}  // namespace rr
