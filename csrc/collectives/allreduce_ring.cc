// Ring allreduce = ring reduce-scatter + ring allgather (bandwidth-optimal:
// each rank sends and receives 2(N-1)/N of the buffer). Between the phases the
// owner of each segment applies Average / postscale to it, so the scaling work
// is split N ways and every rank receives identical, already-final bits.
// Each step streams in chunks (shm slots / socket writes) so send, receive and
// reduce overlap within a step.
#include "collectives/collective_util.h"
#include "collectives/collectives.h"
#include "common/dtype.h"

namespace rr {

void allreduce_ring(Context& ctx, uint8_t* buf, size_t count, DType dtype, ReduceOp op,
                    double postscale, const std::string& what) {
  const int n = ctx.size(), r = ctx.rank();
  const size_t es = dtype_size(dtype);
  std::vector<size_t> off = split_offsets(count, n);
  for (auto& o : off) o *= es;
  reduce_scatter_ring(ctx, buf, off, dtype, op, what);
  finalize_reduction(buf + off[r], (off[r + 1] - off[r]) / es, dtype, op, postscale, n);
  allgather_ring(ctx, buf, off, what);
}

}  // namespace rr
