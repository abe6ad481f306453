// Hierarchical allreduce on GPU (RINGREDUCE_HIERARCHICAL_ALLREDUCE=1, Horovod's
// HOROVOD_HIERARCHICAL_ALLREDUCE with NCCL): the fusion buffer of `count`
// elements, on every rank of the job, hosts of L ranks each (the same L on
// every host, as NCCL's and Horovod's hierarchical paths require; otherwise
// the flat NCCL allreduce runs). Local rank l of a host owns shard l of
// ceil(count / L) elements (the buffer is padded with zeros to L shards).
//   1. inside the host: ncclReduceScatter over the host's NCCL communicator
//      (made among the host's ranks at the first such response, gpu_comms.cc):
//      shard l, summed over the host, lands in place;
//   2. across hosts: shard l goes to a host staging buffer (the engine thread
//      waits for the device), the existing CPU allreduce runs over the ranks
//      of local rank l on every host (a group view of the Context), and the
//      result goes back to shard l;
//   3. inside the host: ncclAllGather of the shards, in place.
// Average runs as Sum in every stage; the executor's postscale divides by the
// job size once, afterwards. Every rank derives hosts and shards from the
// Context's topology, so all agree without talking; stage 2's rings are
// disjoint (one per local rank), each runs in the negotiated order.
// Waiting for stage 1 blocks the engine thread (the host needs the data);
// the wait polls the host communicator's NCCL errors, so a dead peer inside
// the host fails the response instead of hanging it.
#include <algorithm>
#include <chrono>
#include <thread>

#include "collectives/collectives.h"
#include "common/error.h"
#include "gpu/gpu_executor.h"

namespace rr {
namespace gpu {

bool GpuExecutor::hierarchical(const Response& r, const std::vector<Entry*>& local) const {
  const RequestMeta& m = r.tensors.front();
  if (!ctx_ || ctx_->options().hierarchical != 1 || ctx_->cross_size() < 2 || !m.members.empty() ||
      (r.contributors > 0 && r.contributors < opt_.size))
    return false;
  for (Entry* e : local)
    if (!e) return false;
  const auto& hosts = ctx_->hosts();
  for (const auto& h : hosts)
    if (h.size() != hosts.front().size()) return false;
  return true;
}

// This rank's host (its global ranks, ascending) and its index there.
const std::vector<int>& GpuExecutor::my_host(int* index) const {
  for (const auto& h : ctx_->hosts()) {
    auto it = std::find(h.begin(), h.end(), ctx_->rank());
    if (it == h.end()) continue;
    *index = static_cast<int>(it - h.begin());
    return h;
  }
  throw_error(ErrorKind::kInternal, "rank ", ctx_->rank(), " is on none of the job's hosts");
}

uint64_t GpuExecutor::hierarchical_bytes(uint64_t bytes, uint64_t item) const {
  int l = 0;
  const uint64_t L = my_host(&l).size();
  const uint64_t count = bytes / item;
  return (count + L - 1) / L * L * item;
}

void GpuExecutor::allreduce_hierarchical(const RequestMeta& m, DType dtype, uint64_t buf,
                                         uint64_t count, DeviceOp op) {
  int l = 0;
  const std::vector<int>& host = my_host(&l);
  const int L = static_cast<int>(host.size());
  const uint64_t item = dtype_size(dtype);
  const uint64_t shard = (count + static_cast<uint64_t>(L) - 1) / static_cast<uint64_t>(L);
  const uint64_t sb = shard * item, mine = buf + static_cast<uint64_t>(l) * sb;
  if (shard * static_cast<uint64_t>(L) > count)
    ops_->memset_async(buf + count * item, (shard * static_cast<uint64_t>(L) - count) * item,
                       stream_);
  RequestMeta local_meta = m;
  local_meta.members.assign(host.begin(), host.end());
  Comm& local = comm_of(local_meta);
  local.ops->nccl_reducescatter(buf, mine, shard, dtype, op, stream_);
  staging_.resize(sb);
  ops_->memcpy_async(addr_of(staging_.data()), mine, sb, stream_);
  wait_here(local);
  std::vector<int> ring;
  for (const auto& h : ctx_->hosts()) ring.push_back(h[static_cast<size_t>(l)]);
  Tensor t;
  t.data = staging_.data();
  t.shape = {static_cast<int64_t>(shard)};
  t.dtype = dtype;
  t.name = cat(m.name, " (across hosts)");
  allreduce(ctx_->group(ring), t, staging_.data(), host_op(op), 1.0, 1.0);
  ops_->memcpy_async(mine, addr_of(staging_.data()), sb, stream_);
  local.ops->nccl_allgather(mine, buf, shard, dtype, stream_);
  ctx_->count_hierarchical_allreduce();
}

// Until the work enqueued so far has finished; throws if it failed.
void GpuExecutor::wait_here(Comm& c) {
  GpuEvent ev = take_event();
  ops_->event_record(ev, stream_);
  for (;;) {
    std::string cuda;
    const EventState st = ops_->event_query(ev, &cuda);
    if (st == EventState::kDone) break;
    const std::string nccl = c.ops->nccl_async_error();
    if (st == EventState::kError || !nccl.empty()) {
      fail_in_flight(st == EventState::kError
                         ? cat("CUDA failed on GPU ", opt_.device, ": ", cuda)
                         : cat("NCCL failed on GPU ", opt_.device, ": ", nccl));
      throw_error(ErrorKind::kInternal, broken_);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  free_events_.push_back(ev);
}

}  // namespace gpu
}  // namespace rr
