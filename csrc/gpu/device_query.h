// What the CUDA runtime linked into the extension finds on this machine
// (device_query.cu; only built with CUDA). Never throws and never crashes
// without a driver: a missing or too old driver is an answer, not an error.
#pragma once

#include <string>

namespace rr {
namespace gpu {

// CUDA runtime the build links (statically), e.g. 13000 for 13.0.
int cuda_runtime_version();

// CUDA version the installed driver supports (cudaDriverGetVersion), 0 when
// no driver (libcuda.so.1) can be loaded.
int cuda_driver_version();

struct DeviceCount {
  int count = 0;      // 0 whenever `error` is set
  std::string error;  // empty when CUDA is usable; else why not, in words
};

// cudaGetDeviceCount with the reason spelled out (no driver, driver older
// than the runtime, no device visible). Initializes the driver: a process
// that forks afterwards cannot use CUDA in the child.
DeviceCount cuda_device_count();

// "13.0" for 13000.
std::string cuda_version_string(int version);

}  // namespace gpu
}  // namespace rr
