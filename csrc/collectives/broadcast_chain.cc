// Pipelined chain broadcast for large buffers.
//
// Ranks are ordered by distance from the root: root, root+1, ..., root-1.
// The root streams the whole buffer to its successor as one message. Each
// middle rank receives block k from its predecessor while forwarding block
// k-1 to its successor, so after the pipeline fills every link is busy at
// once and the time approaches bytes / link bandwidth, independent of N.
// The last rank only receives. Blocks are a multiple of the transport chunk,
// so one message on the sending side equals the concatenation of the block
// messages on the receiving side (shm slot framing and TCP streams alike).
// (Small buffers travel with the header instead: see collectives.cc.)
#include <algorithm>

#include "collectives/collective_util.h"
#include "collectives/collectives.h"

namespace rr {

void broadcast_chain(Context& ctx, uint8_t* buf, size_t bytes, int root, const std::string& what) {
  const int n = ctx.size(), r = ctx.rank();
  if (n == 1 || bytes == 0) return;
  const int pos = (r - root + n) % n;
  const int next = pos == n - 1 ? -1 : (r + 1) % n;
  const int prev = pos == 0 ? -1 : (r - 1 + n) % n;
  if (prev < 0) return send_recv(ctx, next, buf, bytes, -1, nullptr, 0, what);
  CopySink sink_all(buf);
  if (next < 0) return send_recv(ctx, -1, nullptr, 0, prev, &sink_all, bytes, what);
  const size_t block = 4 * ctx.options().shm_slot_bytes;
  const size_t nblocks = (bytes + block - 1) / block;
  for (size_t k = 0; k <= nblocks; ++k) {
    size_t recv_at = k * block, send_at = k > 0 ? (k - 1) * block : 0;
    CopySink sink(buf + std::min(recv_at, bytes));
    send_recv(ctx, k > 0 ? next : -1, buf + send_at, k > 0 ? std::min(block, bytes - send_at) : 0,
              k < nblocks ? prev : -1, &sink, k < nblocks ? std::min(block, bytes - recv_at) : 0,
              what);
  }
}

}  // namespace rr
