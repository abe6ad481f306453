// CUDA kernels: batched pack / unpack for tensor fusion, scaling and the
// float16 / bfloat16 casts of compression. The arithmetic lives in
// gpu/elementwise.h (shared with the CPU reference); the work split in
// gpu/pack_plan.cc. Every loop is grid-stride, so any grid covers any size.
#include <cuda_runtime.h>

#include "common/error.h"
#include "gpu/elementwise.h"
#include "gpu/kernels.h"

namespace rr {
namespace gpu {
namespace {

void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw_error(ErrorKind::kInternal, "GPU ", what,
                " kernel launch failed: ", cudaGetErrorName(err), ": ", cudaGetErrorString(err));
  }
}

// Each warp takes descriptors warp, warp + warps, ...; its 32 lanes share a
// descriptor's bytes (16-byte units where both sides are 16-byte aligned).
template <bool kPack>
__device__ __forceinline__ void batched_copy(const CopyDesc* descs, uint64_t count) {
  const uint64_t thread = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint64_t warps = static_cast<uint64_t>(gridDim.x) * blockDim.x / kWarpSize;
  const unsigned lane = threadIdx.x % kWarpSize;
  for (uint64_t i = thread / kWarpSize; i < count; i += warps) {
    const CopyDesc d = descs[i];
    auto* tensor = reinterpret_cast<unsigned char*>(d.tensor);
    auto* fused = reinterpret_cast<unsigned char*>(d.fused);
    if (kPack) {
      copy_lane(fused, tensor, d.bytes, lane, kWarpSize);
    } else {
      copy_lane(tensor, fused, d.bytes, lane, kWarpSize);
    }
  }
}

__global__ void __launch_bounds__(kMaxThreadsPerBlock)
    rr_pack_kernel(const CopyDesc* descs, uint64_t count) {
  batched_copy<true>(descs, count);
}

__global__ void __launch_bounds__(kMaxThreadsPerBlock)
    rr_unpack_kernel(const CopyDesc* descs, uint64_t count) {
  batched_copy<false>(descs, count);
}

template <class Op>
__global__ void rr_scale_kernel(typename Op::Storage* data, uint64_t count,
                                typename Op::Factor factor) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    data[i] = Op::apply(data[i], factor);
  }
}

template <class Op>
__global__ void rr_cast_kernel(const typename Op::Src* __restrict__ src,
                               typename Op::Dst* __restrict__ dst, uint64_t count) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    dst[i] = Op::apply(src[i]);
  }
}

// batched_copy's warps and descriptors, each element cast (Op: tensor ->
// wire for pack, wire -> tensor for unpack); d.bytes counts the wire side.
template <class Op, bool kPack>
__global__ void __launch_bounds__(kMaxThreadsPerBlock)
    rr_cast_copy_kernel(const CopyDesc* descs, uint64_t count, typename Op::Factor f) {
  using Src = typename Op::Src;
  using Dst = typename Op::Dst;
  const uint64_t thread = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint64_t warps = static_cast<uint64_t>(gridDim.x) * blockDim.x / kWarpSize;
  const unsigned lane = threadIdx.x % kWarpSize;
  for (uint64_t i = thread / kWarpSize; i < count; i += warps) {
    const CopyDesc d = descs[i];
    const uint64_t n = d.bytes / (kPack ? sizeof(Dst) : sizeof(Src));
    const auto* src = reinterpret_cast<const Src*>(kPack ? d.tensor : d.fused);
    auto* dst = reinterpret_cast<Dst*>(kPack ? d.fused : d.tensor);
    cast_lane<Op>(src, dst, n, f, lane, kWarpSize);
  }
}

template <class T>
__global__ void rr_fill_kernel(T* data, uint64_t count, T value) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  fill_lane<T>(data, count, value, static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x,
               stride);
}

template <class T>
void fill_as(void* data, uint64_t count, uint64_t pattern, void* stream) {
  const LaunchArgs a = elementwise_launch(count);
  if (a.blocks == 0) return;
  rr_fill_kernel<T><<<a.blocks, a.threads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<T*>(data), count, static_cast<T>(pattern));
  check_launch("fill");
}

void check_copy_launch(uint64_t count, LaunchArgs launch) {
  if (count != 0 && (launch.blocks == 0 || launch.threads == 0)) {
    throw_error(ErrorKind::kInvalidArgument, "GPU pack: ", count,
                " descriptors but an empty launch (use the plan's launch arguments)");
  }
}

}  // namespace

void launch_pack(const CopyDesc* device_descs, uint64_t count, LaunchArgs launch, void* stream) {
  check_copy_launch(count, launch);
  if (count == 0) return;
  rr_pack_kernel<<<launch.blocks, launch.threads, 0, static_cast<cudaStream_t>(stream)>>>(
      device_descs, count);
  check_launch("pack");
}

void launch_unpack(const CopyDesc* device_descs, uint64_t count, LaunchArgs launch, void* stream) {
  check_copy_launch(count, launch);
  if (count == 0) return;
  rr_unpack_kernel<<<launch.blocks, launch.threads, 0, static_cast<cudaStream_t>(stream)>>>(
      device_descs, count);
  check_launch("unpack");
}

void launch_scale(void* data, uint64_t count, DType dtype, double factor, void* stream) {
  with_scale_op(dtype, [&](auto op) {
    using Op = decltype(op);
    const LaunchArgs a = elementwise_launch(count);
    if (a.blocks == 0) return;
    rr_scale_kernel<Op><<<a.blocks, a.threads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<typename Op::Storage*>(data), count, static_cast<typename Op::Factor>(factor));
    check_launch("scale");
  });
}

void launch_cast(const void* src, DType from, void* dst, DType to, uint64_t count, void* stream) {
  with_cast_op(from, to, [&](auto op) {
    using Op = decltype(op);
    const LaunchArgs a = elementwise_launch(count);
    if (a.blocks == 0) return;
    rr_cast_kernel<Op><<<a.blocks, a.threads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const typename Op::Src*>(src), static_cast<typename Op::Dst*>(dst), count);
    check_launch("cast");
  });
}

void launch_cast_copy(const CopyDesc* device_descs, uint64_t count, bool pack, DType tensor,
                      DType wire, double factor, LaunchArgs launch, void* stream) {
  check_copy_launch(count, launch);
  with_scaled_cast_op(pack ? tensor : wire, pack ? wire : tensor, [&](auto op) {
    using Op = decltype(op);
    if (count == 0) return;
    const auto f = static_cast<typename Op::Factor>(factor);
    auto s = static_cast<cudaStream_t>(stream);
    if (pack)
      rr_cast_copy_kernel<Op, true>
          <<<launch.blocks, launch.threads, 0, s>>>(device_descs, count, f);
    else
      rr_cast_copy_kernel<Op, false>
          <<<launch.blocks, launch.threads, 0, s>>>(device_descs, count, f);
    check_launch(pack ? "pack (cast)" : "unpack (cast)");
  });
}

void launch_fill(void* data, uint64_t count, uint32_t item_bytes, uint64_t pattern, void* stream) {
  switch (item_bytes) {
    case 1: return fill_as<uint8_t>(data, count, pattern, stream);
    case 2: return fill_as<uint16_t>(data, count, pattern, stream);
    case 4: return fill_as<uint32_t>(data, count, pattern, stream);
    case 8: return fill_as<uint64_t>(data, count, pattern, stream);
    default: break;
  }
  throw_error(ErrorKind::kInvalidArgument, "GPU fill: elements of ", item_bytes,
              " bytes (1, 2, 4 or 8 are supported)");
}

}  // namespace gpu
}  // namespace rr
