// make_device_executor (coordination/executor.h): the one place that decides
// whether this build and machine can run tensors on a GPU, and if not, says
// what is missing. Each reason becomes the InvalidInputError of the entries.
#include "common/error.h"
#include "coordination/executor.h"
#include "gpu/nccl_loader.h"

#if !defined(RR_HAVE_CUDA)
#error "RR_HAVE_CUDA must be defined to 0 or 1 (setup.py does)"
#endif

#if RR_HAVE_CUDA
#include "gpu/device_query.h"
#endif

namespace rr {

std::unique_ptr<Executor> make_device_executor(Context& ctx, int32_t device) {
  (void)ctx;
#if RR_HAVE_CUDA
  const gpu::DeviceCount dc = gpu::cuda_device_count();
  if (!dc.error.empty()) throw_error(ErrorKind::kInvalidArgument, "CUDA is not usable: ", dc.error);
  if (device >= dc.count)
    throw_error(ErrorKind::kInvalidArgument, "GPU ", device, " does not exist (", dc.count,
                " visible)");
  std::shared_ptr<gpu::NcclLibrary> nccl;
  try {
    nccl = gpu::NcclLibrary::open({});  // finds a libnccl.so.2 Python already loaded
  } catch (const Error& e) {
    throw Error(ErrorKind::kInvalidArgument, e.what());
  }
  // The executor (gpu_executor.h) and its CUDA / NCCL calls (cuda_nccl_ops.cu)
  // exist; what does not yet is the NCCL communicator's bootstrap.
  throw_error(ErrorKind::kInvalidArgument, "NCCL ", gpu::nccl_version_string(nccl->version()),
              " loaded from ", nccl->path(),
              ", but ringreduce cannot yet set up an NCCL communicator through its rendezvous "
              "(a later part of the GPU backend)");
#else
  (void)device;
  throw_error(ErrorKind::kInvalidArgument,
              "ringreduce was built without CUDA (no nvcc at build time, or "
              "RINGREDUCE_WITH_CUDA=0); rebuild it with nvcc on PATH");
#endif
}

}  // namespace rr
