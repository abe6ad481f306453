// Alltoall of one GPU tensor (GpuExecutor::alltoall_one): rank r sends
// splits[q] rows of dim 0 (consecutive, in rank order) to each rank q and
// receives peer_rows[q] rows from each, placed in rank order in the
// output. Both lists are known before the submit (ringreduce/_gpu_calls.py
// exchanged them over a small host allgather so the framework could allocate
// the output): the entry's splits and peer_rows.
//
// Protocol: this rank's own block is a device copy; every other pair
// exchanges with ncclSend / ncclRecv inside one ncclGroupStart / ncclGroupEnd,
// so NCCL schedules all of them as one operation and no rank waits on a peer
// that is itself waiting to send (the deadlock a plain sequence of blocking
// sends would have). Every rank opens and closes the group, even with
// nothing to exchange (an empty group costs nothing; the emulated backend
// runs it as a collective). A send or receive of 0 rows is left out on both
// sides alike (the sender's splits[q] is the receiver's peer_rows[r]).
#include <numeric>

#include "common/error.h"
#include "gpu/gpu_executor.h"

namespace rr {
namespace gpu {

void GpuExecutor::alltoall_one(Entry* e) {
  const RequestMeta& m = e->meta;  // this rank's shape: dim 0 differs per rank
  const std::vector<int64_t>& send = e->splits;
  const std::vector<int64_t>& recv = e->peer_rows;
  const size_t n = static_cast<size_t>(cur_->size);
  if (m.shape.empty() || send.size() != n || recv.size() != n ||
      std::accumulate(send.begin(), send.end(), int64_t{0}) != m.shape[0] ||
      send[static_cast<size_t>(cur_->rank)] != recv[static_cast<size_t>(cur_->rank)])
    throw_error(ErrorKind::kInvalidArgument, "alltoall '", m.name, "' on GPU ", opt_.device,
                ": needs the rows sent to and received from each of the ", n, " ranks");
  const uint64_t item = dtype_size(m.dtype);
  const uint64_t row_bytes = row_elements(m.shape) * item;
  const uint64_t in = addr_of(e->in), out = addr_of(e->out);
  const size_t me = static_cast<size_t>(cur_->rank);
  uint64_t send_off = 0, recv_off = 0, my_send = 0, my_recv = 0;
  if (n > 1) nccl().nccl_group_start();
  for (size_t q = 0; q < n; ++q) {
    const uint64_t s = static_cast<uint64_t>(send[q]) * row_bytes;
    const uint64_t v = static_cast<uint64_t>(recv[q]) * row_bytes;
    if (q == me) {
      my_send = send_off;
      my_recv = recv_off;
    } else {
      if (s) nccl().nccl_send(in + send_off, s / item, m.dtype, static_cast<int>(q), stream_);
      if (v) nccl().nccl_recv(out + recv_off, v / item, m.dtype, static_cast<int>(q), stream_);
    }
    send_off += s;
    recv_off += v;
  }
  if (n > 1) nccl().nccl_group_end();
  const uint64_t own = static_cast<uint64_t>(send[me]) * row_bytes;
  if (own) ops_->memcpy_async(out + my_recv, in + my_send, own, stream_);
}

}  // namespace gpu
}  // namespace rr
