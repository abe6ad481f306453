// Hierarchical allreduce on GPU (RINGREDUCE_HIERARCHICAL_ALLREDUCE=1, Horovod's
// HOROVOD_HIERARCHICAL_ALLREDUCE with NCCL): the fusion buffer of `count`
// elements over H >= 2 hosts, host h holding L_h of the response's ranks (the
// job's, or a process set's members on that host). Hosts may hold different
// rank counts, which NCCL's and Horovod's hierarchical paths do not allow.
//
// Layout. M = lcm(L_0 .. L_{H-1}) units of u = ceil(count / M) elements (the
// buffer is padded with zeros to M x u; the padding is < M elements). On host
// h, local rank l owns units [l M / L_h, (l + 1) M / L_h): one contiguous
// shard of M / L_h units, the same size for every rank of the host, which is
// what NCCL's reduce-scatter and allgather need. Every unit has one owner per host.
//   1. inside the host: ncclReduceScatter over the host's NCCL communicator
//      (made among the host's ranks at the first such response, gpu_comms.cc):
//      this rank's shard, summed over the host, lands in place;
//   2. across hosts: the shard goes to a host staging buffer (the engine
//      thread waits for the device) and is cut at every host's shard
//      boundaries into at most sum(L_h) pieces; for each piece, in increasing
//      order, its owners (one per host, hosts in order) run the CPU allreduce
//      over a group view of the Context (TCP between hosts); then the shard
//      goes back;
//   3. inside the host: ncclAllGather of the shards, in place.
// With equal hosts (M = L) this is one piece per rank: ring l of local rank l.
// Average runs as Sum in every stage; the executor's postscale divides by the
// ranks' count once, afterwards.
//
// Invariants (those of the CPU version, collectives/allreduce_hierarchical.cc).
// Every rank derives hosts, units and owners from the Context's topology and
// the response's members, so all agree without talking. The owner of a unit
// on each host never decreases with the unit, so consecutive pieces differ in
// some owner and no two pieces have the same ring; each rank runs its pieces'
// rings in increasing order, so a ring waits only on ranks that finished every
// ring below it (no cycle of waits), and two rings sharing a link use it in
// the same order on both ends. Waiting for stage 1 blocks the engine thread
// (the host needs the data); the wait polls the host communicator's NCCL
// errors, so a dead peer inside the host fails the response instead of hanging it.
#include <algorithm>
#include <chrono>
#include <numeric>
#include <thread>

#include "collectives/collectives.h"
#include "common/error.h"
#include "gpu/gpu_executor.h"

namespace rr {
namespace gpu {

GpuExecutor::HostSplit GpuExecutor::split_hosts(const RequestMeta& m) const {
  HostSplit s;
  for (const auto& h : ctx_->hosts()) {
    std::vector<int> in;
    for (int r : h)
      if (m.has_rank(r)) in.push_back(r);
    if (in.empty()) continue;
    auto it = std::find(in.begin(), in.end(), ctx_->rank());
    if (it != in.end()) {
      s.host = static_cast<int>(s.hosts.size());
      s.local = static_cast<int>(it - in.begin());
    }
    s.units = std::lcm(s.units, static_cast<uint64_t>(in.size()));
    s.hosts.push_back(std::move(in));
  }
  if (s.host < 0)
    throw_error(ErrorKind::kInternal, "rank ", ctx_->rank(), " is on none of the hosts of ",
                coll_name(m.kind), " '", m.name, "'");
  return s;
}

bool GpuExecutor::hierarchical(const Response& r, const std::vector<Entry*>& local) const {
  const RequestMeta& m = r.tensors.front();
  if (!ctx_ || ctx_->options().hierarchical != 1 || ctx_->cross_size() < 2 ||
      (r.contributors > 0 && r.contributors < m.set_size(opt_.size)))
    return false;
  for (Entry* e : local)
    if (!e) return false;
  return split_hosts(m).hosts.size() >= 2;  // a process set may sit on one host
}

uint64_t GpuExecutor::hierarchical_bytes(const RequestMeta& m, uint64_t bytes,
                                         uint64_t item) const {
  const uint64_t M = split_hosts(m).units, count = bytes / item;
  return (count + M - 1) / M * M * item;
}

void GpuExecutor::allreduce_hierarchical(const RequestMeta& m, DType dtype, uint64_t buf,
                                         uint64_t count, DeviceOp op) {
  const HostSplit s = split_hosts(m);
  const std::vector<int>& host = s.hosts[static_cast<size_t>(s.host)];
  const uint64_t item = dtype_size(dtype), M = s.units, u = (count + M - 1) / M;
  const uint64_t per = M / host.size();  // units per rank of this host
  const uint64_t shard = per * u, sb = shard * item;
  const uint64_t mine = buf + static_cast<uint64_t>(s.local) * sb;
  if (M * u > count) ops_->memset_async(buf + count * item, (M * u - count) * item, stream_);
  RequestMeta local_meta = m;
  local_meta.members.assign(host.begin(), host.end());
  Comm& local = comm_of(local_meta);
  local.ops->nccl_reducescatter(buf, mine, shard, dtype, op, stream_);
  staging_.resize(sb);
  ops_->memcpy_async(addr_of(staging_.data()), mine, sb, stream_);
  wait_here(local);
  cross_host_rings(s, m, dtype, u, op);
  ops_->memcpy_async(mine, addr_of(staging_.data()), sb, stream_);
  local.ops->nccl_allgather(mine, buf, shard, dtype, stream_);
  ctx_->count_hierarchical_allreduce();
}

// Stage 2 on the staging buffer (this rank's shard, `unit` elements a unit).
void GpuExecutor::cross_host_rings(const HostSplit& s, const RequestMeta& m, DType dtype,
                                   uint64_t unit, DeviceOp op) {
  const uint64_t M = s.units;
  const uint64_t per = M / s.hosts[static_cast<size_t>(s.host)].size();
  const uint64_t first = static_cast<uint64_t>(s.local) * per, last = first + per;
  std::vector<uint64_t> cuts;  // every host's shard boundaries inside this rank's shard
  for (const auto& h : s.hosts)
    for (uint64_t k = 0, step = M / h.size(); k <= h.size(); ++k)
      if (k * step >= first && k * step <= last) cuts.push_back(k * step);
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  if (unit == 0) return;  // nothing to reduce, on every rank alike
  for (size_t i = 0; i + 1 < cuts.size(); ++i) {
    std::vector<int> ring;  // the piece's owner on every host, hosts in order
    for (const auto& h : s.hosts) ring.push_back(h[cuts[i] / (M / h.size())]);
    uint8_t* piece = staging_.data() + (cuts[i] - first) * unit * dtype_size(dtype);
    Tensor t;
    t.data = piece;
    t.shape = {static_cast<int64_t>((cuts[i + 1] - cuts[i]) * unit)};
    t.dtype = dtype;
    t.name = cat(m.name, " (across hosts, units ", cuts[i], "..", cuts[i + 1], " of ", M, ")");
    allreduce(ctx_->group(ring), t, piece, host_op(op), 1.0, 1.0);
  }
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
