// Ring allgather with blocks of any size (dim 0 may differ per rank).
//
// Rank r starts with block r in place at out + byte_off[r]. At step s = 0 ..
// N-2 it sends block (r - s) mod N to its right neighbour and receives block
// (r - s - 1) mod N from its left neighbour straight into its final place.
// Invariant: after step s, rank r holds blocks r, r-1, ..., r-s-1. Each rank
// sends every block but its left neighbour's once: (N-1)/N of the output.
#include "collectives/collective_util.h"
#include "collectives/collectives.h"

namespace rr {

void allgather_ring(Context& ctx, uint8_t* out, const std::vector<size_t>& byte_off,
                    const std::string& what) {
  const int n = ctx.size(), r = ctx.rank();
  if (n == 1) return;
  const int right = (r + 1) % n, left = (r - 1 + n) % n;
  auto blk = [&](int b) { return ((b % n) + n) % n; };
  for (int s = 0; s < n - 1; ++s) {
    int send_b = blk(r - s), recv_b = blk(r - s - 1);
    CopySink sink(out + byte_off[recv_b]);
    send_recv(ctx, right, out + byte_off[send_b], byte_off[send_b + 1] - byte_off[send_b], left,
              &sink, byte_off[recv_b + 1] - byte_off[recv_b], what);
  }
}

}  // namespace rr
