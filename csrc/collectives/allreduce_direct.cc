// Latency-optimal allreduce for small buffers: every rank's contribution
// travels with its header to every peer (one hop, see op_header.h), then each
// rank reduces all N contributions itself, always in rank order 0, 1, ...,
// N-1. The same inputs in the same order give the same bits on every rank.
#include <cstring>

#include "collectives/collective_util.h"
#include "collectives/collectives.h"
#include "collectives/reduce_kernels.h"

namespace rr {

void allreduce_direct(Context& ctx, uint8_t* buf, size_t count, DType dtype, ReduceOp op,
                      double postscale, const std::vector<std::vector<uint8_t>>& contributions) {
  const int n = ctx.size();
  const size_t bytes = count * dtype_size(dtype);
  std::memcpy(buf, contributions[0].data(), bytes);
  for (int r = 1; r < n; ++r) reduce_into(buf, contributions[r].data(), count, dtype, op);
  finalize_reduction(buf, count, dtype, op, postscale, n);
}

}  // namespace rr
