// The GPU kernels' code run on the CPU over host memory: the same
// per-element and per-lane functions (gpu/elementwise.h) and the same work
// split, lane by lane. Tests compare it with numpy and with the CPU
// collectives' kernels on machines without a GPU; on a GPU the kernels must
// give the same bits.
#pragma once

#include <cstdint>
#include <vector>

#include "common/dtype.h"
#include "gpu/pack_plan.h"

namespace rr {
namespace gpu {

// Runs every descriptor as one warp of kWarpSize lanes would (addresses are
// host addresses here). pack: tensor -> fused; else fused -> tensor.
void reference_copy(const std::vector<CopyDesc>& descs, bool pack);

void reference_scale(void* data, uint64_t count, DType dtype, double factor);

void reference_cast(const void* src, DType from, void* dst, DType to, uint64_t count);

// launch_cast_copy's work, descriptor by descriptor and lane by lane.
void reference_cast_copy(const std::vector<CopyDesc>& descs, bool pack, DType tensor, DType wire,
                         double factor);

void reference_fill(void* data, uint64_t count, uint32_t item_bytes, uint64_t pattern);

}  // namespace gpu
}  // namespace rr
