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
// A rank that joined has no entry and gives 0 rows: every rank first agrees
// on the counts (agree_rows), and it takes part in the padded allgather.
// Why padded allgather rather than one ncclBroadcast per rank in a group:
// the allgather is one bandwidth-optimal ring (each byte crosses each link
// once); N grouped broadcasts run N rings whose pipelines start and drain
// separately. Padding costs size x (max - rows) extra rows, small when
// counts differ a little (a last, short batch), which is the common ragged case.
#include <algorithm>

#include "collectives/collectives.h"
#include "common/error.h"
#include "gpu/gpu_executor.h"

namespace rr {
namespace gpu {

// While a rank has joined (it has no entry, and knows no row counts), every
// rank learns every count here, in the response's turn, with a small host
// allgather over the communicator's ranks (the job's links or the process
// set's view of them): a joined rank gives 0 rows. The others check it
// against what the Python call exchanged before submitting.
std::vector<int64_t> GpuExecutor::agree_rows(const RequestMeta& m, Entry* e) {
  if (!ctx_)
    throw_error(ErrorKind::kInvalidArgument, "allgather '", m.name, "' on GPU ", opt_.device,
                ": a rank has joined, and this executor has no host links to agree on the "
                "row counts");
  Context& g = m.members.empty() ? *ctx_ : ctx_->group(m.members);
  int64_t mine = e ? m.shape[0] : 0;
  std::vector<int64_t> rows(static_cast<size_t>(g.size()));
  Tensor t;
  t.data = &mine;
  t.shape = {1};
  t.dtype = DType::kInt64;
  t.name = cat(m.name, " (row counts, a rank joined)");
  allgather(g, t, [&rows](const std::vector<int64_t>&) { return static_cast<void*>(rows.data()); });
  if (e && rows != e->peer_rows)
    throw_error(ErrorKind::kInvalidArgument, "allgather '", m.name, "' on GPU ", opt_.device,
                ": the row counts given (", e->peer_rows.size(),
                " ranks) differ from the ranks' "
                "own while a rank has joined");
  return rows;
}

void GpuExecutor::allgather_one(const Response& r, Entry* e, bool joined) {
  const RequestMeta& m = e ? e->meta : r.tensors.front();  // dim 0 differs per rank
  const std::vector<int64_t> rows = joined ? agree_rows(m, e) : e->peer_rows;
  const int64_t own = e ? m.shape[0] : 0;
  if (m.shape.empty() || rows.size() != static_cast<size_t>(cur_->size) ||
      rows[static_cast<size_t>(cur_->rank)] != own ||
      std::any_of(rows.begin(), rows.end(), [](int64_t n) { return n < 0; }))
    throw_error(ErrorKind::kInvalidArgument, "allgather '", m.name, "' on GPU ", opt_.device,
                ": needs every rank's row count (", cur_->size,
                " non-negative counts, this rank's its own)");
  const uint64_t item = dtype_size(m.dtype);
  const uint64_t row_bytes = row_elements(m.shape) * item;
  const uint64_t max_rows = static_cast<uint64_t>(*std::max_element(rows.begin(), rows.end()));
  const uint64_t block = max_rows * row_bytes;
  if (block == 0) return;  // nothing to move anywhere
  const uint64_t in = e ? addr_of(e->in) : 0, out = e ? addr_of(e->out) : 0;
  if (std::all_of(rows.begin(), rows.end(), [&](int64_t n) { return uint64_t(n) == max_rows; })) {
    nccl().nccl_allgather(in, out, block / item, m.dtype, stream_);
    return;
  }
  const uint64_t buf = fusion(block * static_cast<uint64_t>(cur_->size));
  const uint64_t mine = buf + static_cast<uint64_t>(cur_->rank) * block;
  const uint64_t bytes = static_cast<uint64_t>(own) * row_bytes;
  if (bytes) ops_->memcpy_async(mine, in, bytes, stream_);
  nccl().nccl_allgather(mine, buf, block / item, m.dtype, stream_);
  if (!e) return;  // a joined rank keeps nothing
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
