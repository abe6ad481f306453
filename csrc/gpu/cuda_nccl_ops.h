// The real GpuOps: the CUDA runtime, the kernels of kernels.cu and NCCL's
// entry points from an NcclLibrary. Defined in cuda_nccl_ops.cu, so only in
// a build with CUDA (callers test RR_HAVE_CUDA; this header needs no CUDA).
#pragma once

#include <memory>

#include "gpu/gpu_ops.h"
#include "gpu/nccl_loader.h"

namespace rr {
namespace gpu {

// Every call runs on `device` (made current on the calling thread first).
std::shared_ptr<GpuOps> make_cuda_nccl_ops(std::shared_ptr<NcclLibrary> nccl, int device);

}  // namespace gpu
}  // namespace rr
