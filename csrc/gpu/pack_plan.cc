#include "gpu/pack_plan.h"

#include <algorithm>
#include <limits>

#include "common/error.h"

namespace rr {
namespace gpu {
namespace {

constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();

bool is_pow2(uint64_t x) {
  return x != 0 && (x & (x - 1)) == 0;
}

uint64_t ceil_div(uint64_t a, uint64_t b) {
  return a / b + (a % b != 0);
}

void check_threads(uint32_t threads, uint32_t max_blocks) {
  if (threads == 0 || threads % kWarpSize != 0 || threads > kMaxThreadsPerBlock) {
    throw_error(ErrorKind::kInvalidArgument, "GPU launch: threads per block must be a multiple of ",
                kWarpSize, " between ", kWarpSize, " and ", kMaxThreadsPerBlock, ", got ", threads);
  }
  if (max_blocks == 0 || max_blocks > kMaxGridX) {
    throw_error(ErrorKind::kInvalidArgument, "GPU launch: max_blocks must be between 1 and ",
                kMaxGridX, ", got ", max_blocks);
  }
}

// Chunk size for `total` bytes over `warps` warps: about two chunks per warp,
// rounded up to 4 KiB, never below kMinChunkBytes.
uint64_t auto_chunk(uint64_t total, uint64_t warps) {
  const uint64_t per_warp = ceil_div(total, 2 * warps);
  const uint64_t rounded = ceil_div(per_warp, 4096) * 4096;
  return std::max(kMinChunkBytes, rounded);
}

void check_chunk(uint64_t chunk_bytes) {
  if (chunk_bytes % 16 != 0) {
    throw_error(ErrorKind::kInvalidArgument,
                "GPU pack plan: chunk_bytes must be a multiple of 16 (0: automatic), got ",
                chunk_bytes);
  }
}

// Every copy as descriptors of at most the chunk size (`total` bytes in all),
// in order, and the grid that runs them.
void split_copies(const std::vector<CopyDesc>& copies, uint64_t total, const PackOptions& opt,
                  PackPlan& plan) {
  const uint64_t warps_per_block = opt.threads / kWarpSize;
  const uint64_t max_warps = warps_per_block * opt.max_blocks;
  plan.chunk_bytes = opt.chunk_bytes != 0 ? opt.chunk_bytes : auto_chunk(total, max_warps);
  // Counted first so that a huge plan allocates once.
  uint64_t ndescs = 0;
  for (const CopyDesc& c : copies) ndescs += ceil_div(c.bytes, plan.chunk_bytes);
  plan.descs.reserve(ndescs);
  for (const CopyDesc& c : copies) {
    for (uint64_t done = 0; done < c.bytes; done += plan.chunk_bytes) {
      const uint64_t n = std::min(plan.chunk_bytes, c.bytes - done);
      plan.descs.push_back(CopyDesc{c.tensor + done, c.fused + done, n});
    }
  }
  const uint64_t blocks = ceil_div(plan.descs.size(), warps_per_block);
  plan.launch.threads = plan.descs.empty() ? 0 : opt.threads;
  plan.launch.blocks = static_cast<uint32_t>(std::min<uint64_t>(blocks, opt.max_blocks));
}

}  // namespace

PackPlan plan_pack(const std::vector<PackEntry>& entries, uint64_t fusion_addr,
                   uint64_t fusion_capacity, const PackOptions& opt) {
  check_threads(opt.threads, opt.max_blocks);
  if (!is_pow2(opt.alignment)) {
    throw_error(ErrorKind::kInvalidArgument,
                "GPU pack plan: alignment must be a power of two, got ", opt.alignment);
  }
  check_chunk(opt.chunk_bytes);
  if (fusion_addr % opt.alignment != 0) {
    throw_error(ErrorKind::kInvalidArgument, "GPU pack plan: the fusion buffer at 0x", std::hex,
                fusion_addr, std::dec, " is not aligned to ", opt.alignment, " bytes");
  }
  if (fusion_capacity > kMax - fusion_addr) {
    throw_error(ErrorKind::kInvalidArgument, "GPU pack plan: the fusion buffer's ", fusion_capacity,
                " bytes wrap around the address space");
  }

  PackPlan plan;
  plan.offsets.reserve(entries.size());
  uint64_t cursor = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    const PackEntry& e = entries[i];
    if (e.bytes > kMax - e.addr) {
      throw_error(ErrorKind::kInvalidArgument, "GPU pack plan: tensor ", i, " (", e.bytes,
                  " bytes) wraps around the address space");
    }
    const uint64_t pad = (opt.alignment - cursor % opt.alignment) % opt.alignment;
    if (pad > kMax - cursor || e.bytes > kMax - cursor - pad) {
      throw_error(ErrorKind::kInvalidArgument, "GPU pack plan: the tensors' total size overflows");
    }
    const uint64_t offset = cursor + pad;
    plan.offsets.push_back(offset);
    cursor = offset + e.bytes;
  }
  plan.bytes = cursor;
  if (plan.bytes > fusion_capacity) {
    throw_error(ErrorKind::kInvalidArgument, "GPU pack plan: ", entries.size(), " tensors need ",
                plan.bytes, " bytes of fusion buffer (with ", opt.alignment,
                "-byte alignment), it holds ", fusion_capacity);
  }

  std::vector<CopyDesc> copies;
  copies.reserve(entries.size());
  for (size_t i = 0; i < entries.size(); ++i)
    copies.push_back(CopyDesc{entries[i].addr, fusion_addr + plan.offsets[i], entries[i].bytes});
  split_copies(copies, plan.bytes, opt, plan);
  return plan;
}

FusedCopies fused_copies(const PackPlan& layout, const std::vector<PackEntry>& entries,
                         const std::vector<uint64_t>& ins, const std::vector<uint64_t>& outs,
                         uint64_t buf, uint64_t item, uint64_t wire) {
  FusedCopies c;
  for (size_t i = 0; i < entries.size(); ++i) {
    if (ins[i] == 0) continue;
    const uint64_t fused = buf + layout.offsets[i];
    for (uint64_t done = 0; done < entries[i].bytes; done += layout.chunk_bytes) {
      const uint64_t n = std::min(layout.chunk_bytes, entries[i].bytes - done);
      const uint64_t at = done / wire * item;  // the chunk's first element, tensor side
      c.pack.push_back(CopyDesc{ins[i] + at, fused + done, n});
      c.unpack.push_back(CopyDesc{outs[i] + at, fused + done, n});
    }
  }
  return c;
}

PackPlan plan_copies(const std::vector<CopyDesc>& copies, const PackOptions& opt) {
  check_threads(opt.threads, opt.max_blocks);
  check_chunk(opt.chunk_bytes);
  PackPlan plan;
  for (const CopyDesc& c : copies) {
    if (c.bytes > kMax - c.tensor || c.bytes > kMax - c.fused || c.bytes > kMax - plan.bytes)
      throw_error(ErrorKind::kInvalidArgument, "GPU copy plan: a copy of ", c.bytes,
                  " bytes wraps around the address space");
    plan.bytes += c.bytes;
  }
  split_copies(copies, plan.bytes, opt, plan);
  return plan;
}

LaunchArgs elementwise_launch(uint64_t count, uint32_t threads, uint32_t max_blocks) {
  check_threads(threads, max_blocks);
  LaunchArgs a;
  if (count == 0) return a;
  a.threads = threads;
  a.blocks = static_cast<uint32_t>(std::min<uint64_t>(ceil_div(count, threads), max_blocks));
  return a;
}

}  // namespace gpu
}  // namespace rr
