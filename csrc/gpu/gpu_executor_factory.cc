// make_device_executor (coordination/executor.h): the one place that decides
// whether this build and machine can run tensors on a GPU. Every rank then
// takes part in the communicator's bootstrap (gpu_bootstrap.h), also a rank
// that has no usable GPU: it brings its reason, and every rank fails the
// same tensors with it, in step.
#include "common/error.h"
#include "coordination/executor.h"
#include "gpu/gpu_bootstrap.h"
#include "gpu/nccl_loader.h"

#if !defined(RR_HAVE_CUDA)
#error "RR_HAVE_CUDA must be defined to 0 or 1 (setup.py does)"
#endif

#if RR_HAVE_CUDA
#include "gpu/cuda_nccl_ops.h"
#include "gpu/device_query.h"
#endif

namespace rr {

const char* const kBuiltWithoutCuda =
    "ringreduce was built without CUDA (no nvcc at build time, or RINGREDUCE_WITH_CUDA=0); "
    "rebuild it with nvcc on PATH (RINGREDUCE_WITH_CUDA=1 makes a missing nvcc a build error)";

namespace {

// This rank's CUDA + NCCL operations for `device`, or nullptr with `*why`.
std::shared_ptr<gpu::GpuOps> cuda_ops(int32_t device, std::string* why) {
#if RR_HAVE_CUDA
  const gpu::DeviceCount dc = gpu::cuda_device_count();
  if (!dc.error.empty()) {
    *why = cat("CUDA is not usable: ", dc.error);
    return nullptr;
  }
  if (device >= dc.count) {
    *why = cat("GPU ", device, " does not exist (", dc.count, " visible)");
    return nullptr;
  }
  try {
    // Finds a libnccl.so.2 Python already loaded (ringreduce._gpu loads the wheel's).
    return gpu::make_cuda_nccl_ops(gpu::NcclLibrary::open({}), device);
  } catch (const Error& e) {
    *why = e.what();
    return nullptr;
  }
#else
  (void)device;
  *why = kBuiltWithoutCuda;
  return nullptr;
#endif
}

}  // namespace

std::unique_ptr<Executor> make_device_executor(Context& ctx, int32_t device) {
  std::string why;
  std::shared_ptr<gpu::GpuOps> ops = cuda_ops(device, &why);
  // A process set's communicator: more CUDA + NCCL operations on the same GPU.
  auto make_ops = [device](Context&) -> std::shared_ptr<gpu::GpuOps> {
    std::string no;
    std::shared_ptr<gpu::GpuOps> more = cuda_ops(device, &no);
    if (!more) throw_error(ErrorKind::kInvalidArgument, no);
    return more;
  };
  return gpu::bootstrap_gpu_executor(ctx, device, std::move(ops), why, make_ops);
}

}  // namespace rr
