// GpuOps for machines without a GPU, so that whole GPU collectives run end
// to end in tests (selected by RINGREDUCE_GPU_EMULATE=1 at init(), a testing
// aid; never chosen by itself):
//   - "device memory" is host memory (256-byte aligned);
//   - every stream runs its work at once, in call order, so an event is done
//     as soon as it is recorded and stream waits have nothing to wait for;
//   - the kernels run their CPU reference (kernels_reference.h), the same
//     per-element code and work split as kernels.cu;
//   - the NCCL calls are ringreduce's CPU collectives over the Context, which
//     the engine thread issues in the negotiated order on every rank, as the
//     CPU executor does (so they stay in step with the control traffic).
// What it cannot show: streams overlapping, the kernels' device code, NCCL
// itself (its algorithms, its errors, ncclCommAbort on a real hang).
#pragma once

#include <memory>

#include "gpu/gpu_ops.h"
#include "transport/context.h"

namespace rr {
namespace gpu {

// `nccl_version` is what nccl_version() reports (22703: ncclAvg is planned).
std::shared_ptr<GpuOps> make_emulated_gpu_ops(Context& ctx, int nccl_version = 22703);

}  // namespace gpu
}  // namespace rr
