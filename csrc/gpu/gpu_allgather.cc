// Allgather of one GPU tensor with a ragged first dimension
// (GpuExecutor::allgather_one). The caller (ringreduce/_gpu_calls.py) learnt
// every rank's row count before submitting (a small host allgather, the
// count the framework needs to allocate the output) and passes them as the
// entry's peer_rows; the output holds their sum, in rank order.
//
// NCCL's ncclAllGather gives every rank the same count, so:
//   - equal counts (the usual case): one ncclAllGather from the input
//     straight into the output;
//   - otherwise, padded blocks of the largest count: this rank's rows are
//     copied to its block of a scratch buffer (size x block), one
//     ncclAllGather in place there (NCCL allows send == recv + rank * count),
//     and ONE batched unpack launch copies each rank's rows from its block to
//     their place in the output. The padding rows travel but are never read.
// Why padded allgather rather than one ncclBroadcast per rank in a group:
// the allgather is one bandwidth-optimal ring (each byte crosses each link
// once); N grouped broadcasts run N rings whose pipelines start and drain
// separately. Padding costs size x (max - rows) extra rows, small when
// counts differ a little (a last, short batch), which is the common ragged case.
#include <algorithm>

#include "common/error.h"
#include "gpu/gpu_executor.h"

namespace rr {
namespace gpu {

void GpuExecutor::allgather_one(Entry* e) {
  const RequestMeta& m = e->meta;  // this rank's shape: dim 0 differs per rank
  const std::vector<int64_t>& rows = e->peer_rows;
  if (m.shape.empty() || rows.size() != static_cast<size_t>(cur_->size) ||
      rows[static_cast<size_t>(cur_->rank)] != m.shape[0] ||
      std::any_of(rows.begin(), rows.end(), [](int64_t n) { return n < 0; }))
    throw_error(ErrorKind::kInvalidArgument, "allgather '", m.name, "' on GPU ", opt_.device,
                ": needs every rank's row count (", cur_->size,
                " non-negative counts, this rank's its own)");
  const uint64_t item = dtype_size(m.dtype);
  const uint64_t row_bytes =
      m.shape[0] ? m.bytes() / static_cast<uint64_t>(m.shape[0]) : row_elements(m.shape) * item;
  const uint64_t in = addr_of(e->in), out = addr_of(e->out);
  const uint64_t max_rows = static_cast<uint64_t>(*std::max_element(rows.begin(), rows.end()));
  const uint64_t block = max_rows * row_bytes;
  if (block == 0) return;  // nothing to move anywhere
  if (std::all_of(rows.begin(), rows.end(), [&](int64_t n) { return uint64_t(n) == max_rows; })) {
    nccl().nccl_allgather(in, out, block / item, m.dtype, stream_);
    return;
  }
  const uint64_t buf = fusion(block * static_cast<uint64_t>(cur_->size));
  const uint64_t mine = buf + static_cast<uint64_t>(cur_->rank) * block;
  if (m.bytes()) ops_->memcpy_async(mine, in, m.bytes(), stream_);
  nccl().nccl_allgather(mine, buf, block / item, m.dtype, stream_);
  std::vector<CopyDesc> copies;
  uint64_t offset = 0;
  for (size_t q = 0; q < rows.size(); ++q) {
    const uint64_t n = static_cast<uint64_t>(rows[q]) * row_bytes;
    if (n) copies.push_back(CopyDesc{out + offset, buf + q * block, n});
    offset += n;
  }
  const PackPlan plan = plan_copies(copies, opt_.pack);
  ops_->launch_unpack(plan.descs, plan.launch, stream_);
}

}  // namespace gpu
}  // namespace rr
