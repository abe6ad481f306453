// Launchers of the GPU kernels (kernels.cu, compiled only when the build has
// CUDA). No CUDA headers here: a stream is passed as void* (cudaStream_t).
// Each launcher enqueues exactly one kernel on `stream` (none for an empty
// input) and returns without waiting; launch failures throw rr::Error
// (kInternal, with CUDA's error name and text), unsupported dtypes kInvalidArgument.
#pragma once

#include <cstdint>

#include "common/dtype.h"
#include "gpu/pack_plan.h"

namespace rr {
namespace gpu {

// Tensor fusion in one launch each. `device_descs` points to plan.descs
// copied to device memory (the plan's addresses are device addresses).
// Pack copies every descriptor's tensor bytes into the fusion buffer, unpack
// copies them back; unpack may use a plan made for other output tensors.
void launch_pack(const CopyDesc* device_descs, uint64_t count, LaunchArgs launch, void* stream);
void launch_unpack(const CopyDesc* device_descs, uint64_t count, LaunchArgs launch, void* stream);

// data[i] *= factor for `count` elements of `dtype` (any dtype but bool), in
// place; same rounding as the CPU's scale_inplace (see gpu/elementwise.h).
void launch_scale(void* data, uint64_t count, DType dtype, double factor, void* stream);

// dst[i] = src[i] converted, for float32/float64 to and from float16/bfloat16
// (round to nearest even). src and dst must not overlap.
void launch_cast(const void* src, DType from, void* dst, DType to, uint64_t count, void* stream);

// Compression in one launch: the batched copy's descriptors, each element
// cast and multiplied by `factor` (gpu/elementwise.h's ScaledCast). Pack
// casts tensor (`tensor` dtype) -> fused (`wire`), unpack fused -> tensor; a
// descriptor's bytes count its fused (wire) side. float32/float64 tensors,
// float16/bfloat16 wire.
void launch_cast_copy(const CopyDesc* device_descs, uint64_t count, bool pack, DType tensor,
                      DType wire, double factor, LaunchArgs launch, void* stream);

// `count` elements of `item_bytes` (1, 2, 4 or 8) set to the low bytes of
// `pattern` (a joined rank's neutral elements).
void launch_fill(void* data, uint64_t count, uint32_t item_bytes, uint64_t pattern, void* stream);

}  // namespace gpu
}  // namespace rr
