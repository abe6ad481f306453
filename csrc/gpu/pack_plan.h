// Planning of the GPU fusion kernels: where each tensor goes in the fusion
// buffer, which copies the batched pack / unpack kernels run and with how
// many blocks. Pure C++ (no CUDA headers), so it is unit-tested on machines
// without a GPU; kernels.cu only executes what this decides.
//
// Layout: tensor i starts at offsets[i], a multiple of `alignment` (256 bytes
// by default, what NCCL and cudaMalloc align to), so every tensor keeps the
// vector alignment it has in its own buffer. The gaps between tensors are
// never written; a fused collective runs over plan.bytes bytes, gaps included.
//
// Work split: a tensor larger than the chunk size becomes several descriptors,
// so no warp copies much more than any other. Every warp of the grid takes
// descriptors i, i + warps, i + 2 * warps, ... (one launch whatever the
// number of tensors). The chunk size grows with the total so that the number
// of descriptors stays below tensors + 2 * warps even for huge buffers.
#pragma once

#include <cstdint>
#include <vector>

namespace rr {
namespace gpu {

// One contiguous copy. Pack copies tensor -> fused, unpack fused -> tensor;
// both kernels read the same descriptor array. Addresses are device
// addresses as integers: 24 bytes, the same layout on host and device.
struct CopyDesc {
  uint64_t tensor;
  uint64_t fused;
  uint64_t bytes;
};
static_assert(sizeof(CopyDesc) == 24, "CopyDesc is copied to the device as is");

struct PackEntry {
  uint64_t addr;   // device address of the tensor's first byte
  uint64_t bytes;  // 0 is allowed: the tensor gets an offset and no descriptor
};

// blocks == 0: there is nothing to launch.
struct LaunchArgs {
  uint32_t blocks = 0;
  uint32_t threads = 0;
};

constexpr uint32_t kWarpSize = 32;
constexpr uint32_t kMaxThreadsPerBlock = 1024;
constexpr uint32_t kMaxGridX = 0x7fffffffu;  // gridDim.x limit (compute capability >= 3.0)

struct PackOptions {
  uint64_t alignment = 256;    // power of two
  uint64_t chunk_bytes = 0;    // largest descriptor, a multiple of 16; 0: from the total
  uint32_t threads = 256;      // per block: a multiple of 32, at most 1024
  uint32_t max_blocks = 1024;  // 1024 x 8 warps fills an H100 (132 SMs x 64 warps)
};

struct PackPlan {
  std::vector<uint64_t> offsets;  // per entry, from the fusion buffer's start
  uint64_t bytes = 0;             // end of the last entry: the fused collective's length
  uint64_t chunk_bytes = 0;       // the chunk size used
  std::vector<CopyDesc> descs;    // in entry order, each entry's chunks in address order
  LaunchArgs launch;
};

// Smallest automatic chunk: 32 lanes x 16 bytes x 32 iterations.
constexpr uint64_t kMinChunkBytes = 16 * 1024;

// Lays `entries` out in the buffer at `fusion_addr` (aligned to
// opt.alignment) of `fusion_capacity` bytes. Throws kInvalidArgument when the
// tensors do not fit, an address range wraps around, or an option is out of range.
PackPlan plan_pack(const std::vector<PackEntry>& entries, uint64_t fusion_addr,
                   uint64_t fusion_capacity, const PackOptions& opt = {});

// The pack (tensor -> fused) and unpack (fused -> result) copies of a fused
// response laid out by `layout` over `entries` (the bytes in the fusion
// buffer): tensor i is read at ins[i] and written at outs[i] (0: this rank
// has no tensor i), with `item`-byte elements there and `wire`-byte elements
// in the buffer at buf + layout.offsets[i] (equal unless a cast compresses
// it), in chunks of layout.chunk_bytes of the buffer's side.
struct FusedCopies {
  std::vector<CopyDesc> pack, unpack;
};
FusedCopies fused_copies(const PackPlan& layout, const std::vector<PackEntry>& entries,
                         const std::vector<uint64_t>& ins, const std::vector<uint64_t>& outs,
                         uint64_t buf, uint64_t item, uint64_t wire);

// The same split and launch for copies whose places the caller chose
// (allgather's compaction, reducescatter's padded blocks): each copy becomes
// descriptors of at most the chunk size, in order. plan.bytes is their total;
// plan.offsets stays empty.
PackPlan plan_copies(const std::vector<CopyDesc>& copies, const PackOptions& opt = {});

// Grid for an element-wise kernel (scale, cast) over `count` elements with a
// grid-stride loop: one thread per element up to max_blocks blocks.
LaunchArgs elementwise_launch(uint64_t count, uint32_t threads = 256, uint32_t max_blocks = 4096);

}  // namespace gpu
}  // namespace rr
