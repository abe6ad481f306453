#include <cuda_runtime.h>

#include <cstdlib>

#include "common/error.h"
#include "gpu/device_query.h"

namespace rr {
namespace gpu {

// The oldest driver branch that runs this runtime (CUDA minor version
// compatibility: every 13.x runtime runs on a 580 or newer driver).
constexpr int kMinDriverBranch = CUDART_VERSION >= 13000 ? 580 : 525;

int cuda_runtime_version() {
  int v = 0;
  if (cudaRuntimeGetVersion(&v) != cudaSuccess) return CUDART_VERSION;
  return v;
}

int cuda_driver_version() {
  int v = 0;
  if (cudaDriverGetVersion(&v) != cudaSuccess) return 0;
  return v;
}

std::string cuda_version_string(int version) {
  return cat(version / 1000, ".", (version % 1000) / 10);
}

DeviceCount cuda_device_count() {
  DeviceCount out;
  const int runtime = cuda_runtime_version();
  const int driver = cuda_driver_version();
  const std::string need =
      cat("this build's CUDA ", cuda_version_string(runtime),
          " runtime needs an NVIDIA driver of branch ", kMinDriverBranch, " or newer");
  if (driver == 0) {
    out.error = cat("no NVIDIA driver found (libcuda.so.1 could not be loaded); ", need);
    return out;
  }
  if (driver / 1000 < runtime / 1000) {
    out.error = cat("the NVIDIA driver supports CUDA ", cuda_version_string(driver), ", but ", need,
                    " (CUDA ", runtime / 1000, ".x)");
    return out;
  }
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear it for later calls
    out.error =
        cat("cudaGetDeviceCount failed: ", cudaGetErrorName(err), ": ", cudaGetErrorString(err));
    if (err == cudaErrorNoDevice) {
      const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
      if (visible) out.error += cat(" (CUDA_VISIBLE_DEVICES='", visible, "')");
    }
    return out;
  }
  if (n == 0) {
    out.error = "no CUDA device is visible";
    return out;
  }
  out.count = n;
  return out;
}

}  // namespace gpu
}  // namespace rr
