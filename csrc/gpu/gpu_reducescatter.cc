// Reducescatter of one GPU tensor (GpuExecutor::reducescatter_one). Rank r
// keeps rows [off_r, off_r + rows_r) of dim 0, split as the CPU collective
// splits them (lower ranks get the extra rows), so results match it.
//
// NCCL's ncclReduceScatter gives every rank the same count, so:
//   - rows divisible by the ranks: one ncclReduceScatter from the input (or,
//     with a prescale, from a scaled copy in the fusion buffer: the input
//     stays as the caller gave it) straight into the output;
//   - otherwise, padded blocks: one pack launch copies each rank's rows to
//     block q of the fusion buffer (blocks of the largest share, rows_0),
//     the prescale runs on it, ncclReduceScatter leaves block r reduced in
//     the buffer's tail, and its first rows_r rows are copied to the output.
//     The padding rows are reduced too and thrown away (never read).
// The postscale (with 1 / contributors folded in when Average runs as Sum)
// runs on the output.
#include <algorithm>

#include "common/error.h"
#include "gpu/gpu_executor.h"

namespace rr {
namespace gpu {

void GpuExecutor::reducescatter_one(const Response& r, Entry* e) {
  const RequestMeta& m = r.tensors.front();
  if (!e || !e->out || m.shape.empty())
    throw_error(ErrorKind::kInvalidArgument, "reducescatter '", m.name, "' on GPU ", opt_.device,
                ": needs a tensor with at least one dimension and an output");
  const uint64_t rows = static_cast<uint64_t>(m.shape[0]);
  const uint64_t size = static_cast<uint64_t>(cur_->size);
  const uint64_t row_bytes = rows ? m.bytes() / rows : 0;
  const uint64_t item = dtype_size(m.dtype);
  const uint64_t base = rows / size, extra = rows % size;
  const uint64_t me = static_cast<uint64_t>(cur_->rank);
  const uint64_t my_rows = base + (me < extra ? 1 : 0);
  const ReducePlan p = plan_reduce(r);
  const uint64_t in = addr_of(e->in);
  const uint64_t out = addr_of(e->out);
  if (extra == 0) {
    uint64_t src = in;
    if (m.prescale != 1.0) {
      src = fusion(m.bytes());
      ops_->memcpy_async(src, in, m.bytes(), stream_);
      ops_->launch_scale(src, m.bytes() / item, m.dtype, m.prescale, stream_);
    }
    nccl().nccl_reducescatter(src, out, base * row_bytes / item, m.dtype, p.op, stream_);
  } else {
    const uint64_t block = (base + 1) * row_bytes;  // the largest share, rank 0's
    const uint64_t buf = fusion(block * (size + 1));
    std::vector<CopyDesc> copies;
    uint64_t offset = 0;
    for (uint64_t q = 0; q < size; ++q) {
      const uint64_t n = (base + (q < extra ? 1 : 0)) * row_bytes;
      if (n) copies.push_back(CopyDesc{in + offset, buf + q * block, n});
      offset += n;
    }
    const PackPlan plan = plan_copies(copies, opt_.pack);
    ops_->launch_pack(plan.descs, plan.launch, stream_);
    if (m.prescale != 1.0)
      ops_->launch_scale(buf, block * size / item, m.dtype, m.prescale, stream_);
    const uint64_t tail = buf + block * size;
    nccl().nccl_reducescatter(buf, tail, block / item, m.dtype, p.op, stream_);
    if (my_rows) ops_->memcpy_async(out, tail, my_rows * row_bytes, stream_);
  }
  if (p.postscale != 1.0 && my_rows)
    ops_->launch_scale(out, my_rows * row_bytes / item, m.dtype, p.postscale, stream_);
}

}  // namespace gpu
}  // namespace rr
