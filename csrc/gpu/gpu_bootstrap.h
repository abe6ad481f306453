// An NCCL communicator's bootstrap through ringreduce's own links, run the
// first time a response needs it (the job's communicator on GPU `device`, or
// a process set's: then over the set's view of the Context, among its
// members). Every rank concerned reaches that response in the same negotiated
// round and the engine thread runs it in order with the CPU executor's
// collectives, so plain CPU collectives on the Context carry the exchange:
//
//   1. allgather of one fixed-size status record per rank: empty, or why this
//      rank cannot run GPU work (no CUDA build, no driver or device, no NCCL).
//      If any rank has a reason, every rank throws kInvalidArgument naming
//      those ranks and reasons: all ranks fail the same tensors and go on in
//      step, and none waits in NCCL for a rank that will never join.
//   2. rank 0 makes the id (GpuOps::nccl_unique_id, i.e. ncclGetUniqueId) and
//      broadcasts a fixed-size record holding the 128 bytes or, if that
//      failed, rank 0's message (every rank then throws it).
//   3. every rank joins with ncclCommInitRank(id, size, rank): one
//      communicator per (device, ranks), kept by the executor (gpu_comms.cc).
//
// Invariant: steps 1 and 2 run exactly once per device on every rank whatever
// its local state, so the Context's streams stay in step. Step 3 is NCCL's
// own collective: a rank failing inside it (after 1 and 2 agreed) can leave
// the others waiting in ncclCommInitRank (NCCL has no timeout there).
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "coordination/executor.h"
#include "gpu/gpu_ops.h"
#include "gpu/pack_plan.h"
#include "transport/context.h"

namespace rr {
namespace gpu {

// Steps 1 and 2 over `ctx` (the job's Context or a process set's view of
// it): the 128-byte id on every rank, or kInvalidArgument on every rank.
// `ops` is this rank's GPU (nullptr when it has none, `why_not` saying why).
std::string agree_on_unique_id(Context& ctx, GpuOps* ops, const std::string& why_not);

// The executor for GPU `device`, whose communicators (the job's, each process
// set's, made with `make_ops`) go through steps 1 to 3 at the first response
// that needs them (GpuExecutor::bootstrap_over): nothing is exchanged here.
std::unique_ptr<Executor> bootstrap_gpu_executor(
    Context& ctx, int32_t device, std::shared_ptr<GpuOps> ops, const std::string& why_not,
    std::function<std::shared_ptr<GpuOps>(Context&)> make_ops, PackOptions pack = {});

}  // namespace gpu
}  // namespace rr
