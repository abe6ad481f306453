// memcpy with non-temporal stores, for destinations that will not be read
// again soon (the tail of a large allreduce). Regular stores first read each
// destination line from DRAM (read-for-ownership); streaming stores skip that
// read, which is worth ~20% of the memory traffic once buffers leave the caches.
#pragma once

#include <cstddef>

namespace rr {

void stream_copy(void* dst, const void* src, size_t n);

// memcpy, or stream_copy if `stream`.
void copy_to(void* dst, const void* src, size_t n, bool stream);

// Blocks small enough that data just written or read is still in L1 when it
// is touched again (forwarding a ring chunk: reduce or copy, then copy out).
constexpr size_t kL1Block = 16 << 10;

// Copies src to both `a` and `b` block by block, so src is read from memory
// (or another core's cache) once.
void copy_twice(void* a, bool stream_a, void* b, bool stream_b, const void* src, size_t n);

}  // namespace rr
