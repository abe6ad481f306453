// Ring allreduce = ring reduce-scatter + ring allgather (bandwidth-optimal:
// each rank sends and receives 2(N-1)/N of the buffer), run as one chain of
// 2(N-1) chunk-pipelined steps (ring_pipeline.h): the allgather's first step
// sends the segment the reduce-scatter's last step completed, chunk by chunk,
// so the two phases overlap too. The owner of each segment applies Average /
// postscale to each chunk as it completes, so the scaling work is split N ways
// and every rank receives identical, already-final bits. Out of place (`own`,
// the input, apart from `buf`, the output), the reduce-scatter reads this rank's
// contribution from the input and the allgather fills the rest of the output,
// so every byte of the output is written once and the input is never copied.
#include "collectives/collective_util.h"
#include "collectives/collectives.h"
#include "collectives/ring_pipeline.h"
#include "common/dtype.h"

namespace rr {

void allreduce_ring(Context& ctx, uint8_t* buf, size_t count, DType dtype, ReduceOp op,
                    double postscale, const std::string& what, const uint8_t* own) {
  const int n = ctx.size();
  std::vector<size_t> off = split_offsets(count, n);
  for (auto& o : off) o *= dtype_size(dtype);
  std::vector<ReduceSink> reduce_sinks;
  std::vector<CopySink> copy_sinks;
  reduce_sinks.reserve(n);
  copy_sinks.reserve(n);
  std::vector<RingStep> steps;
  reduce_scatter_steps(ctx, buf, off, dtype, op, postscale, &reduce_sinks, &steps, own);
  allgather_steps(ctx, buf, off, &copy_sinks, &steps);
  ctx.phase("RING_REDUCE_SCATTER");
  run_ring(ctx, steps, /*chained=*/true, what,
           RingPhase{static_cast<size_t>(n - 1), "RING_ALLGATHER"});
}

}  // namespace rr
