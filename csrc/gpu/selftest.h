// Runs each GPU kernel once on a device and compares its output with the CPU
// reference (gpu/kernels_reference.h) bit for bit; for tests on machines with
// a GPU (selftest.cu, only built with CUDA).
#pragma once

#include <string>

namespace rr {
namespace gpu {

// "" when every kernel matched, else the first mismatch in words. CUDA
// errors (no device, out of memory) throw rr::Error.
std::string kernel_selftest(int device);

}  // namespace gpu
}  // namespace rr
