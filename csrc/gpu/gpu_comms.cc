// The NCCL communicators of one GPU executor (GpuExecutor::comm_for): the
// job's, for responses of every rank, and one per process set, for a set's
// responses. Each is made at the first response that needs it, by the
// bootstrap of gpu_bootstrap.h over the Context (the job's) or the set's view
// of it (Context::group): only the set's members run a set's response, so
// only they take part, in the same negotiated order. A set's communicator
// has its own GpuOps (CommOpsMaker); streams, events and memory stay the
// executor's.
//
// Invariant: every member makes or fails a communicator at the same response,
// and a failure (a rank without a GPU, rank 0 without an id, NCCL refusing)
// is kept: every later response of that set of ranks fails with it, on every
// member alike, without another exchange, so members stay in step.
#include "common/error.h"
#include "gpu/gpu_bootstrap.h"
#include "gpu/gpu_executor.h"

namespace rr {
namespace gpu {

void GpuExecutor::bootstrap_over(Context& ctx, CommOpsMaker make_ops, std::string why_not) {
  ctx_ = &ctx;
  make_ops_ = std::move(make_ops);
  why_not_ = std::move(why_not);
}

GpuExecutor::Comm& GpuExecutor::comm_of(const RequestMeta& m) {
  auto it = comms_.find(m.members);
  if (it == comms_.end()) {
    if (!ctx_)
      throw_error(ErrorKind::kInvalidArgument, coll_name(m.kind), " '", m.name, "': GPU ",
                  opt_.device, " has no NCCL communicator",
                  m.members.empty() ? "" : cat(" for process set ", ranks_text(m.members)));
    it = comms_.emplace(m.members, Comm{}).first;
    Comm& c = it->second;
    try {
      Context& g = m.members.empty() ? *ctx_ : ctx_->group(m.members);
      const std::string id = agree_on_unique_id(g, ops_.get(), why_not_);
      if (!m.members.empty() && !make_ops_)
        throw_error(ErrorKind::kInvalidArgument, "no NCCL communicators for process sets here");
      c.ops = m.members.empty() ? ops_ : make_ops_(g);
      start();
      c.ops->nccl_comm_init(id, g.size(), g.rank());
      c.rank = g.rank();
      c.size = g.size();
      c.alive = true;
    } catch (const Error& e) {
      c.failed = e.what();
    }
  }
  if (!it->second.failed.empty())
    throw_error(ErrorKind::kInvalidArgument, "rank ", opt_.rank, ": ", coll_name(m.kind), " '",
                m.name, "': the tensor is on GPU ", opt_.device,
                ", which this process cannot use: ", it->second.failed);
  return it->second;
}

}  // namespace gpu
}  // namespace rr
