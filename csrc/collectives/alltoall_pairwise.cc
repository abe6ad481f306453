// Pairwise-exchange alltoall.
//
// In step s = 1 .. N-1, rank r sends its block for rank (r + s) mod N and
// receives the block from rank (r - s) mod N, both at once; its own block is
// copied locally. In every step each rank talks to exactly one sender and one
// receiver, so no link is ever shared and all N links stay busy. Blocks may
// have any size (send_off / recv_off are byte offsets, N + 1 entries each).
#include <cstring>

#include "collectives/collective_util.h"
#include "collectives/collectives.h"

namespace rr {

void alltoall_pairwise(Context& ctx, const uint8_t* in, const std::vector<size_t>& send_off,
                       uint8_t* out, const std::vector<size_t>& recv_off, const std::string& what) {
  const int n = ctx.size(), r = ctx.rank();
  std::memcpy(out + recv_off[r], in + send_off[r], send_off[r + 1] - send_off[r]);
  for (int s = 1; s < n; ++s) {
    int to = (r + s) % n, from = (r - s + n) % n;
    CopySink sink(out + recv_off[from]);
    send_recv(ctx, to, in + send_off[to], send_off[to + 1] - send_off[to], from, &sink,
              recv_off[from + 1] - recv_off[from], what);
  }
}

}  // namespace rr
