// memcpy with non-temporal stores, for destinations that will not be read
// again soon (the tail of a large allreduce). Regular stores first read each
// destination line from DRAM (read-for-ownership); streaming stores skip that
// read, which is worth ~20% of the memory traffic once buffers leave the caches.
#pragma once

#include <cstddef>

namespace rr {

void stream_copy(void* dst, const void* src, size_t n);

}  // namespace rr
